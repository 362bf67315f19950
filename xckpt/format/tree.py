"""Trees of containers and leaves, flattened to key paths and rebuilt.

A key is a tuple of components, each a ``str`` (dict key, namedtuple field) or
an ``int`` (list or tuple index, or an int dict key). The structure is recorded
as JSON nodes so dict, list, tuple and namedtuple are told apart on reload::

    {"kind": "dict", "items": [[key, node], ...]}
    {"kind": "list" | "tuple", "items": [node, ...]}
    {"kind": "namedtuple", "name": "Name", "fields": ["a", ...], "items": [node, ...]}
    {"kind": "leaf", "index": i}
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from xckpt.errors import TreeError

Key = tuple[Any, ...]
Node = dict[str, Any]
#: Deepest container nesting a tree may have (keys have at most this many components).
MAX_DEPTH = 64


@dataclass(frozen=True)
class Value:
    """Wrap an object to store it whole as one msgpack value leaf, not as a subtree."""

    value: Any


@dataclass(frozen=True)
class Default:
    """In a load target: load this subtree where the checkpoint has it, else keep ``value`` as it is.

    E.g. a PyTorch optimizer's ``param_groups`` when loading optimizer state written by optax,
    which keeps its hyper-parameters outside the checkpoint.
    """

    value: Any


def key_str(key: Key) -> str:
    """A readable rendering of a key, for messages: ``model/layers.0.weight``."""
    return "/".join(str(k) for k in key) if key else "<root>"


def is_namedtuple(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a ``collections.namedtuple``/``typing.NamedTuple``."""
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _check_key_component(k: Any, parent: Key) -> None:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise TreeError(f"dict key {k!r} of type {type(k).__name__} is not a str or int",
                        leaf=key_str(parent))
    if isinstance(k, int) and not -(1 << 63) <= k < (1 << 63):
        raise TreeError(f"dict key {k} lies outside the signed 64-bit range of integer keys", leaf=key_str(parent))


def flatten(tree: Any, view: Callable[[Any], Any] | None = None,
            on_view: Callable[[Key, Any], None] | None = None) -> tuple[Node, list[tuple[Key, Any]]]:
    """Flatten ``tree`` into its structure and a list of ``(key, leaf)`` in order.

    ``view`` may turn a custom object into a plain container (returning None for
    anything it does not handle); the adapters use it for modules and pytrees.
    ``on_view(key, obj)`` is called for each object ``view`` turned into a container.
    """
    leaves: list[tuple[Key, Any]] = []

    def walk(obj: Any, key: Key, depth: int) -> Node:
        if depth > 256 or len(key) > MAX_DEPTH:
            raise TreeError(f"tree deeper than {MAX_DEPTH} levels (a cycle?)", code="tree.too_deep",
                            leaf=key_str(key[:8]) + "/...")
        if isinstance(obj, Value):
            leaves.append((key, obj))
            return {"kind": "leaf", "index": len(leaves) - 1}
        plain = None if view is None or isinstance(obj, (dict, list, tuple)) else view(obj)
        if plain is not None:
            if on_view is not None:
                on_view(key, obj)
            return walk(plain, key, depth + 1)
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                _check_key_component(k, key)
                items.append([k, walk(v, key + (k,), depth + 1)])
            return {"kind": "dict", "items": items}
        if is_namedtuple(obj):
            fields = list(type(obj)._fields)
            return {"kind": "namedtuple", "name": type(obj).__name__, "fields": fields,
                    "items": [walk(v, key + (f,), depth + 1) for f, v in zip(fields, obj)]}
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {"kind": kind, "items": [walk(v, key + (i,), depth + 1) for i, v in enumerate(obj)]}
        leaves.append((key, obj))
        return {"kind": "leaf", "index": len(leaves) - 1}

    return walk(tree, (), 0), leaves


def iter_nodes(node: Node, key: Key = ()) -> Iterator[tuple[Key, Node]]:
    """Every node of a structure with its key, depth first."""
    yield key, node
    kind = node["kind"]
    if kind == "dict":
        for k, child in node["items"]:
            yield from iter_nodes(child, key + (k,))
    elif kind == "namedtuple":
        for f, child in zip(node["fields"], node["items"]):
            yield from iter_nodes(child, key + (f,))
    elif kind in ("list", "tuple"):
        for i, child in enumerate(node["items"]):
            yield from iter_nodes(child, key + (i,))


def unflatten(node: Node, leaves: list[Any]) -> Any:
    """Rebuild a tree of plain containers from a structure and its leaves."""
    kind = node["kind"]
    if kind == "leaf":
        return leaves[node["index"]]
    if kind == "dict":
        return {k: unflatten(child, leaves) for k, child in node["items"]}
    items = [unflatten(child, leaves) for child in node["items"]]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    if kind == "namedtuple":
        # rename: fields named '_<index>', as a namedtuple made with rename=True has them, are kept
        cls = collections.namedtuple(node["name"], node["fields"], rename=True)  # type: ignore[misc]
        return cls(*items)
    raise TreeError(f"unknown node kind {kind!r}")
