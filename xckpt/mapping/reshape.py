"""Reshape as a lazy view, read region by region.

Inserting or removing size-1 dimensions is an index transform. Merging or
splitting other dimensions (``(heads * dim, in)`` <-> ``(heads, dim, in)``) is
not, so it is a ``virtual_chunked`` view (see :mod:`.virtual`) whose chunks are boxes that map to
boxes of the stored array: in each group of dimensions that a reshape merges or
splits, a chunk spans whole trailing dimensions and a slab of the first one, so
reading a region reads the stored rows under the chunks it touches, not more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

from xckpt.mapping.transforms import Layout, Transform, TransformError
from xckpt.mapping.virtual import context, event_loop

Group = tuple[tuple[int, ...], tuple[int, ...]]


def groups(src: Sequence[int], dst: Sequence[int]) -> list[Group] | None:
    """Pair runs of source and target dimensions with equal products (None: not a reshape)."""
    if math.prod(src) != math.prod(dst) or 0 in src or 0 in dst:
        return None
    out: list[Group] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        si, dj = [], []
        ps = pd = 1
        if i < len(src):
            si.append(i)
            ps, i = src[i], i + 1
        if j < len(dst):
            dj.append(j)
            pd, j = dst[j], j + 1
        while ps != pd:
            if ps < pd and i < len(src):
                si.append(i)
                ps, i = ps * src[i], i + 1
            elif pd < ps and j < len(dst):
                dj.append(j)
                pd, j = pd * dst[j], j + 1
            else:
                return None
        out.append((tuple(si), tuple(dj)))
    return out


@dataclass(frozen=True)
class Reshape(Transform):
    """Change the shape (C order), lazily; see the module docstring."""

    shape: tuple[int, ...]

    def _unit_only(self, shape: Sequence[int]) -> bool:
        return [d for d in shape if d != 1] == [d for d in self.shape if d != 1]

    def apply(self, layout: Layout) -> Layout:
        """The new shape; chunk notes follow the dimensions kept and the virtual chunks."""
        if self._unit_only(layout.shape):
            kept = iter([i for i, d in enumerate(layout.shape) if d != 1])
            picks = [None if d == 1 else next(kept) for d in self.shape]
            return Layout(tuple(self.shape), layout.dtype,
                          tuple(1 if p is None else layout.chunk_shape[p] for p in picks),
                          tuple(1 if p is None else layout.inner_chunk_shape[p] for p in picks), None)
        if groups(layout.shape, self.shape) is None:
            raise TransformError(f"reshape {list(layout.shape)} -> {list(self.shape)} changes the number of "
                                 f"elements (or has an empty dimension)")
        chunks = _chunks(layout.shape, self.shape, layout.inner_chunk_shape)
        outer = list(chunks)
        for si, dj in groups(layout.shape, self.shape) or []:
            if len(si) == 1 and len(dj) == 1:
                outer[dj[0]] = layout.chunk_shape[si[0]]
        return Layout(tuple(self.shape), layout.dtype, tuple(outer), chunks, None)

    def view(self, store: ts.TensorStore) -> ts.TensorStore:
        """An index transform for size-1 changes, else a chunk-wise virtual view."""
        shape = tuple(store.shape)
        if self._unit_only(shape):
            if any(d == 1 for d in shape):
                store = store[tuple(0 if d == 1 else slice(None) for d in shape)]
            if any(d == 1 for d in self.shape):
                store = store[tuple(ts.newaxis if d == 1 else slice(None) for d in self.shape)]
            return store[ts.d[:].translate_to[0]] if store.rank else store
        return _virtual(store, shape, tuple(self.shape))

    def __str__(self) -> str:
        return f"reshape{tuple(self.shape)}"


def _chunks(src: Sequence[int], dst: Sequence[int], src_chunks: Sequence[int]) -> tuple[int, ...]:
    """Virtual chunk shape: whole trailing dims and a slab of the first, in each merged or split group.

    The slab is whole rows on both sides and, where it can be, the rows of one stored chunk.
    """
    out = [1] * len(dst)
    for si, dj in groups(src, dst) or []:
        if not si or not dj:  # size-1 dimensions on one side only
            continue
        if len(si) == 1 and len(dj) == 1:
            out[dj[0]] = max(1, min(src_chunks[si[0]], dst[dj[0]]))
            continue
        pt = math.prod(dst[d] for d in dj[1:])
        ps = math.prod(src[s] for s in si[1:])
        unit = math.lcm(pt, ps)  # the smallest flat run that is whole rows on both sides
        want = max(1, min(src_chunks[si[0]], src[si[0]])) * ps  # a stored chunk's rows, flat
        flat = math.lcm(unit, want) if math.lcm(unit, want) <= 4 * max(unit, want) else unit * max(1, want // unit)
        out[dj[0]] = min(dst[dj[0]], flat // pt)
        for d in dj[1:]:
            out[d] = dst[d]
    return tuple(out)


def _virtual(store: ts.TensorStore, src: tuple[int, ...], dst: tuple[int, ...]) -> ts.TensorStore:
    grouping = groups(src, dst)
    assert grouping is not None
    try:
        read_chunks = tuple(store.chunk_layout.read_chunk.shape)
    except Exception:  # noqa: BLE001 - a view without chunk information: one row at a time
        read_chunks = (1,) * len(src)
    chunk = _chunks(src, dst, [c or 1 for c in read_chunks])

    async def read(domain: ts.IndexDomain, array: np.ndarray, params: Any) -> None:
        lo, hi = domain.inclusive_min, domain.exclusive_max
        index: list[slice] = [slice(0, 1)] * len(src)
        for si, dj in grouping:
            if not si or not dj:
                continue
            if len(si) == 1 and len(dj) == 1:
                index[si[0]] = slice(lo[dj[0]], hi[dj[0]])
                continue
            pt = math.prod(dst[d] for d in dj[1:])
            ps = math.prod(src[s] for s in si[1:])
            index[si[0]] = slice(lo[dj[0]] * pt // ps, hi[dj[0]] * pt // ps)
            for s in si[1:]:
                index[s] = slice(0, src[s])
        array[...] = (await store[tuple(index)].read()).reshape(array.shape)

    return ts.virtual_chunked(read, loop=event_loop(), dtype=store.dtype, shape=dst,
                              chunk_layout=ts.ChunkLayout(read_chunk_shape=chunk), context=context())


def reshape(*shape: int) -> Reshape:
    """Reshape (C order) lazily: size-1 changes as index transforms, merges and splits chunk by chunk."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return Reshape(tuple(int(s) for s in shape))
