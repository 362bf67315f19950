"""Per-leaf layout transforms, applied lazily as TensorStore views.

Each transform knows what it does to a shape and dtype (checked before any data
is read), to the chunk grid and sharding notes of a manifest entry, and how to
express itself as a TensorStore view: an index transform (transpose, slice, unit
dimensions) or a cast (checked where the new dtype cannot hold every stored value, as
a load's own casts are); reshapes live in :mod:`.reshape`. Reading a region of the view reads only the stored
chunks that region needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import tensorstore as ts

from xckpt.format import dtypes
from xckpt.format.casts import cast_refusal, narrows
from xckpt.mapping.virtual import checked_cast


class TransformError(ValueError):
    """A transform does not fit the shape or dtype it is applied to (reported as a MappingError)."""


@dataclass(frozen=True)
class Layout:
    """Shape, dtype, chunking and sharding notes of an array, before or after a transform."""

    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    sharding: dict[str, Any] | None = None


class Transform:
    """Base class: a lazy, shape-checked change of an array's layout."""

    def apply(self, layout: Layout) -> Layout:
        """The layout after this transform; raises :class:`TransformError` when it does not fit."""
        raise NotImplementedError

    def view(self, store: ts.TensorStore) -> ts.TensorStore:
        """The TensorStore view of ``store`` after this transform (origin stays at zero)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Transpose(Transform):
    """Permute axes: output axis ``i`` is input axis ``perm[i]`` (as ``numpy.transpose``)."""

    perm: tuple[int, ...]

    def apply(self, layout: Layout) -> Layout:
        """Permuted shape, chunks and per-dimension sharding notes."""
        if sorted(self.perm) != list(range(len(layout.shape))):
            raise TransformError(f"transpose{self.perm} does not fit an array of rank {len(layout.shape)} "
                                 f"(shape {list(layout.shape)})")
        sharding = layout.sharding
        if sharding and isinstance(sharding.get("dim_axes"), list) and len(sharding["dim_axes"]) == len(self.perm):
            sharding = dict(sharding, dim_axes=[sharding["dim_axes"][p] for p in self.perm])
        else:
            sharding = None
        return Layout(_perm(layout.shape, self.perm), layout.dtype, _perm(layout.chunk_shape, self.perm),
                      _perm(layout.inner_chunk_shape, self.perm), sharding)

    def view(self, store: ts.TensorStore) -> ts.TensorStore:
        """``store`` with its dimensions reordered."""
        if not self.perm:
            return store
        return store[ts.d[tuple(self.perm)].transpose[:]]

    def __str__(self) -> str:
        return f"transpose{self.perm}"


@dataclass(frozen=True)
class Slice(Transform):
    """Keep ``[start, stop)`` of ``axis`` (how a fused tensor is split into its parts)."""

    axis: int
    start: int
    stop: int

    def apply(self, layout: Layout) -> Layout:
        """Shape with ``axis`` cut to the slice."""
        axis = _axis(self, self.axis, len(layout.shape))
        n = layout.shape[axis]
        if not 0 <= self.start <= self.stop <= n:
            raise TransformError(f"{self} does not fit axis {axis} of size {n} (shape {list(layout.shape)})")
        size = self.stop - self.start
        chunk = list(layout.chunk_shape)
        inner = list(layout.inner_chunk_shape)
        chunk[axis] = max(1, min(chunk[axis], size))
        inner[axis] = max(1, math.gcd(inner[axis], chunk[axis]))
        shape = list(layout.shape)
        shape[axis] = size
        return Layout(tuple(shape), layout.dtype, tuple(chunk), tuple(inner), None)

    def view(self, store: ts.TensorStore) -> ts.TensorStore:
        """The slice, translated back to origin zero."""
        axis = self.axis % store.rank
        return store[ts.d[axis][self.start:self.stop].translate_to[0]]

    def __str__(self) -> str:
        return f"slice(axis={self.axis}, {self.start}:{self.stop})"


@dataclass(frozen=True)
class Cast(Transform):
    """Convert the elements to another logical dtype (done by TensorStore while reading)."""

    dtype: str

    def apply(self, layout: Layout) -> Layout:
        """Same shape, new dtype; a cast that cannot be made (from a dtype stored as raw bytes, to one
        TensorStore lacks, dropping an imaginary part) is refused here, before anything is read."""
        dtypes.numpy_dtype(self.dtype)
        if layout.dtype == self.dtype:
            return layout
        if dtypes.is_raw(layout.dtype):
            raise TransformError(f"cannot cast from {layout.dtype} (stored as raw bytes) in a mapping; "
                                 f"load it with the target dtype instead")
        try:
            ts.dtype(self.dtype)
        except (ValueError, TypeError):
            raise TransformError(f"cannot cast to {self.dtype} in a mapping (TensorStore has no such type); "
                                 f"load it with the target dtype instead") from None
        why = cast_refusal(layout.dtype, self.dtype)
        if why is not None:
            raise TransformError(f"cannot cast {layout.dtype} to {self.dtype}: {why}")
        return Layout(layout.shape, self.dtype, layout.chunk_shape, layout.inner_chunk_shape, layout.sharding)

    def view(self, store: ts.TensorStore) -> ts.TensorStore:
        """A casting view: TensorStore's cast where the new dtype holds every stored value, else one that
        checks the values it casts (:func:`~xckpt.mapping.virtual.checked_cast`: no value wraps or
        overflows unseen, as no load's own cast lets one)."""
        if store.dtype == ts.dtype(self.dtype):
            return store
        if narrows(store.dtype.name, self.dtype):
            return checked_cast(store, self.dtype)
        return ts.cast(store, ts.dtype(self.dtype))

    def __str__(self) -> str:
        return f"cast({self.dtype})"


def _axis(transform: Transform, axis: int, rank: int) -> int:
    """``axis`` of an array of ``rank`` as a non-negative index; :class:`TransformError` when it has none."""
    if not -rank <= axis < rank:
        raise TransformError(f"{transform} does not fit an array of rank {rank}")
    return axis % rank


def _perm(values: Sequence[int], perm: Sequence[int]) -> tuple[int, ...]:
    return tuple(values[p] for p in perm)


def transpose(*perm: int) -> Transpose:
    """Permute axes like ``numpy.transpose(x, perm)``; ``transpose()`` reverses them (``.T``)."""
    if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
        perm = tuple(perm[0])
    return Transpose(tuple(int(p) for p in perm)) if perm else _Reverse()


class _Reverse(Transpose):
    """Reverse all axes, whatever the rank (``numpy``'s ``.T``)."""

    def __init__(self) -> None:
        object.__setattr__(self, "perm", ())

    def apply(self, layout: Layout) -> Layout:
        """Like transpose with the reversed axis order."""
        return Transpose(tuple(reversed(range(len(layout.shape))))).apply(layout)

    def view(self, store: ts.TensorStore) -> ts.TensorStore:
        """Reversed dimensions."""
        return Transpose(tuple(reversed(range(store.rank)))).view(store)

    def __str__(self) -> str:
        return "transpose()"


def cast(dtype: Any) -> Cast:
    """Convert to ``dtype`` (a logical dtype name or anything numpy accepts)."""
    return Cast(dtype if isinstance(dtype, str) else dtypes.logical_name(dtype))




@dataclass(frozen=True)
class Index(Transform):
    """Keep entry ``index`` of ``axis`` and drop that axis (one layer of a scanned array)."""

    axis: int
    index: int

    def apply(self, layout: Layout) -> Layout:
        """The shape without ``axis``."""
        axis = _axis(self, self.axis, len(layout.shape))
        if not 0 <= self.index < layout.shape[axis]:
            raise TransformError(f"{self} does not fit axis {axis} of size {layout.shape[axis]} "
                                 f"(shape {list(layout.shape)})")

        def cut(values: tuple[int, ...]) -> tuple[int, ...]:
            return values[:axis] + values[axis + 1:]

        return Layout(cut(layout.shape), layout.dtype, cut(layout.chunk_shape), cut(layout.inner_chunk_shape), None)

    def view(self, store: ts.TensorStore) -> ts.TensorStore:
        """The entry, its axis dropped."""
        return store[ts.d[self.axis % store.rank][self.index]]

    def __str__(self) -> str:
        return f"index(axis={self.axis}, {self.index})"
