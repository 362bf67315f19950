"""Trees from DCP's flat names: keys from DCP's flattening paths, nested dicts, lists, values."""

from __future__ import annotations

from typing import Any

from xckpt.errors import TreeError, XckptError
from xckpt.format.tree import Key, Value, flatten, key_str


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


def insert(tree: dict[Any, Any], key: Key, leaf: Any) -> None:
    """Put ``leaf`` at ``key`` in a tree of nested dicts; a key taken already (two names of one flattening
    path, or a leaf where a subtree is) is a ``tree.invalid`` error, never an overwrite."""
    node = tree
    for part in key[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise TreeError(f"key {list(key)} lies below a leaf", leaf=key_str(key))
    if key[-1] in node:
        raise TreeError(f"two entries have the key {list(key)}", leaf=key_str(key))
    node[key[-1]] = leaf


def listify(node: Any) -> Any:
    """Dicts built from DCP paths whose keys are exactly 0..n-1 (list indices) become lists."""
    if not isinstance(node, dict):
        return node
    out = {k: listify(v) for k, v in node.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out
