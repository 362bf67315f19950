"""What a load target looks like, for mappings that resolve against it (the torch <-> flax presets).

``xckpt.load(path, like, mapping=m)`` describes ``like`` before anything is read: every
leaf's key and shape (None for a Python value), the empty containers (optax's
``EmptyState``, ``MaskedNode``) and what the adapters say about custom containers
(a torch module's layer classes and tied parameters, see :func:`xckpt.registry.notes_for`).
The description names no framework type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xckpt.format.tree import Key


@dataclass(frozen=True)
class TargetLeaf:
    """One leaf of a load target."""

    key: Key
    shape: tuple[int, ...] | None  # None: a Python value, or a leaf without a shape
    empty: bool = False  # an empty container (a stored None or empty node matches it)
    optional: bool = False  # wrapped in Default: kept when the checkpoint lacks it


@dataclass
class Target:
    """A load target: its leaves in order, and the adapters' notes on its containers by key."""

    leaves: list[TargetLeaf]
    notes: dict[Key, dict[str, Any]] = field(default_factory=dict)

    def by_key(self) -> dict[Key, TargetLeaf]:
        """Leaves by key."""
        return {leaf.key: leaf for leaf in self.leaves}


def shape_of(like: Any) -> tuple[int, ...] | None:
    """The shape of a target leaf (anything with a ``shape``), else None."""
    shape = getattr(like, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        return None
