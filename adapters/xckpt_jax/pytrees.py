"""Custom pytree nodes as plain containers: flax (linen FrozenDict, struct dataclasses such as
TrainState, nnx State and Variables), optax states and any ``register_pytree_node`` class.

A node is flattened one level with jax's own key paths, so the saved keys are the
ones Orbax uses for the same tree (``DictKey`` -> its key, ``GetAttrKey`` -> the
attribute name, ``SequenceKey``/``FlattenedIndexKey`` -> the index); an nnx
``Param`` is saved as ``{"value": array}``, a ``TrainState`` as
``{"step": ..., "params": ..., "opt_state": ...}``. Loading into a target node
rebuilds the target's own type with its static fields (``apply_fn``, ``tx``,
variable metadata) through its treedef. dicts, lists, tuples and namedtuples
(optax states) are plain containers of the core already.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax import tree_util

from xckpt.errors import TreeError
from xckpt.format.tree import Value

_PLAIN = (dict, list, tuple, str, bytes, bool, int, float, complex, type(None), np.ndarray, np.generic, Value)


def is_custom_node(obj: Any) -> bool:
    """Whether ``obj`` is a registered pytree node other than dict, list, tuple and None."""
    if isinstance(obj, _PLAIN) or isinstance(obj, (jax.Array, jax.ShapeDtypeStruct)):
        return False
    return not tree_util.all_leaves([obj])


def _component(entry: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    raise TreeError(f"unsupported pytree key entry {entry!r}")


def _one_level(obj: Any) -> tuple[list[Any], list[Any], Any]:
    """Keys, children and treedef of ``obj`` flattened by exactly one level."""
    pairs, treedef = tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    keys = [_component(path[0]) for path, _ in pairs]
    if len(set(map(repr, keys))) != len(keys):
        raise TreeError(f"pytree node {type(obj).__qualname__} has repeated child keys {keys}")
    return keys, [child for _, child in pairs], treedef


def save_view(obj: Any) -> dict[Any, Any]:
    """The children of a pytree node, as a dict keyed by their key-path component."""
    keys, children, _ = _one_level(obj)
    return dict(zip(keys, children))


def load_view(like: Any) -> tuple[dict[Any, Any], Callable[[Any], Any]]:
    """The plain target of a pytree node and how to rebuild a node of the same type from the result."""
    keys, children, treedef = _one_level(like)

    def rebuild(loaded: dict[Any, Any]) -> Any:
        return treedef.unflatten([loaded[k] for k in keys])

    return dict(zip(keys, children)), rebuild
