"""Trees from DCP's flat names: keys from DCP's flattening paths, nested dicts, lists, values."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from xckpt.errors import TreeError, XckptError
from xckpt.format.tree import Key, Node, Value, flatten, key_str


def key_of(fqn: str, mappings: dict[str, Any] | None) -> Key:
    """The tree key of a DCP fully qualified name (its flattening path when DCP recorded one)."""
    path = (mappings or {}).get(fqn)
    return tuple(path) if path else (fqn,)


def fqn_of(key: Key) -> str:
    """The DCP name of a tree key: components joined with '.' (as DCP flattens nested state)."""
    return ".".join(str(k) for k in key)


def as_leaf(value: Any) -> Any:
    """A DCP value as tree material: plain containers are spread like ``xckpt.save`` does."""
    if isinstance(value, (dict, list, tuple)):
        try:
            flatten(value)
        except XckptError:
            return Value(value)
    return value


def insert(tree: dict[Any, Any], key: Key, leaf: Any, *, file: str | None = None) -> None:
    """Put ``leaf`` at ``key`` in a tree of nested dicts; a key taken already (two names of one flattening
    path, or a leaf where a subtree is) is a ``tree.invalid`` error naming ``file`` (the DCP metadata the
    names come from, where there is one), never an overwrite."""
    node = tree
    for part in key[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise TreeError(f"key {list(key)} lies below a leaf", leaf=key_str(key), file=file)
    if key[-1] in node:
        raise TreeError(f"two entries have the key {list(key)}", leaf=key_str(key), file=file)
    node[key[-1]] = leaf


def _children(node: Node) -> list[tuple[Any, Node]]:
    """A structure node's children with their key components (none for a leaf)."""
    if node["kind"] == "dict":
        return [(k, child) for k, child in node["items"]]
    items = node.get("items", [])
    return list(zip(node.get("fields") or range(len(items)), items))


def dcp_names(root: Node, is_tensor: Callable[[int], bool]) -> Iterator[tuple[Key, Node]]:
    """The nodes that DCP's flattening of a state dict shaped like ``root`` names, with their keys, as
    torch's ``traverse_state_dict`` draws them (``is_tensor``: whether the leaf of an index is a tensor).

    A dict is walked into, never named. A list is named whole unless one of its items is a tensor, a dict,
    or a list walked into itself; then it is walked into. Anything else is named whole: a leaf, and a tuple
    or namedtuple whatever it holds (tensors included). The root is always walked into.
    """
    def whole(node: Node) -> bool:
        if node["kind"] != "list":
            return node["kind"] != "dict"
        return all(whole(c) and not (c["kind"] == "leaf" and is_tensor(c["index"])) for c in node["items"])

    def walk(node: Node, key: Key) -> Iterator[tuple[Key, Node]]:
        if key and whole(node):
            yield key, node
            return
        for k, child in _children(node):
            yield from walk(child, key + (k,))

    return walk(root, ())


def listify(node: Any) -> Any:
    """Dicts built from DCP paths whose keys are exactly 0..n-1 (list indices) become lists."""
    if not isinstance(node, dict):
        return node
    out = {k: listify(v) for k, v in node.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out
