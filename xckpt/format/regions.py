"""Pure region maths: boxes in an N-d index space, chunk grids, tilings.

A region is ``(offsets, sizes)``, both tuples of ints of the array's rank.
Nothing here does I/O; everything is a pure function, tested directly.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from operator import add, le
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Sequence

import numpy as np

from xckpt.errors import ShapeError


@dataclass(frozen=True, order=True)
class Region:
    """A box ``[offsets, offsets + sizes)`` in an array's index space."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ShapeError(f"region rank mismatch: offsets {self.offsets}, sizes {self.sizes}")
        if self.sizes and (min(self.sizes) < 0 or min(self.offsets) < 0):
            raise ShapeError(f"negative region {self.offsets}+{self.sizes}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Region":
        """The region covering a whole array of ``shape``."""
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ends(self) -> tuple[int, ...]:
        """Exclusive end of each dimension."""
        return tuple(map(add, self.offsets, self.sizes))

    @property
    def numel(self) -> int:
        """Number of elements in the region."""
        return math.prod(self.sizes)

    def is_empty(self) -> bool:
        """Whether the region holds no element."""
        return 0 in self.sizes

    def slices(self) -> tuple[slice, ...]:
        """Slices selecting this region from the full array."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def relative_to(self, outer: "Region") -> "Region":
        """This region in the coordinates of ``outer`` (which must contain it)."""
        return Region(tuple(o - b for o, b in zip(self.offsets, outer.offsets)), self.sizes)

    def placed_in(self, outer: "Region") -> "Region":
        """This region, given in the coordinates of ``outer``, in the array's (undoes :meth:`relative_to`)."""
        return Region(tuple(map(add, self.offsets, outer.offsets)), self.sizes)

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the region lies inside an array of ``shape``."""
        return len(shape) == len(self.sizes) and all(map(le, self.ends, shape))

    def to_json(self) -> list[list[int]]:
        """``[offsets, sizes]`` as lists."""
        return [list(self.offsets), list(self.sizes)]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[int]]) -> "Region":
        """Inverse of :meth:`to_json`."""
        return cls(tuple(int(x) for x in data[0]), tuple(int(x) for x in data[1]))


def intersect(a: Region, b: Region) -> Region | None:
    """The overlap of two regions, or None where they do not overlap (or either is empty)."""
    offs, sizes = [], []
    for ao, ae, bo, be in zip(a.offsets, a.ends, b.offsets, b.ends):
        lo, hi = max(ao, bo), min(ae, be)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return Region(tuple(offs), tuple(sizes))


#: Most inner chunks a chunk object may hold (the format's limit, spec section 2.4).
MAX_INNER = 2**20


@lru_cache(maxsize=4096)
def inner_chunk_shape_for(chunk: tuple[int, ...], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """An inner chunk shape dividing ``chunk`` evenly, of at most ``target_bytes`` where possible, and
    never more than :data:`MAX_INNER` of them per chunk.

    Repeatedly divides one dimension by its smallest prime factor, choosing the dimension
    that stays largest after the division (so a prime-sized dimension is not cut to 1 while
    another can still be halved), so a reader on another mesh reads only part of a chunk.
    """
    inner = [int(c) for c in chunk]
    while math.prod(inner) * itemsize > target_bytes:
        best = None
        for d, n in enumerate(inner):
            p = _smallest_prime_factor(n)
            if p and (best is None or n // p > inner[best[0]] // best[1]):
                best = (d, p)
        if best is None or math.prod(chunk) // (math.prod(inner) // best[1]) > MAX_INNER:
            break
        inner[best[0]] //= best[1]
    return tuple(inner)


def _smallest_prime_factor(n: int) -> int:
    if n < 2:
        return 0
    for p in range(2, int(math.isqrt(n)) + 1):
        if n % p == 0:
            return p
    return n


def grid_shape(shape: Sequence[int], chunk: Sequence[int]) -> tuple[int, ...]:
    """Number of chunks along each dimension."""
    return tuple(-(-int(s) // int(c)) for s, c in zip(shape, chunk))


def walk(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    """Every index of the grid that ``ranges`` (each of step 1) span, in C order, made one at a time:
    ``itertools.product`` would first copy each range into a tuple (a dimension of 2**24 chunks, which a
    grid may declare: about 600 MB before the first index)."""
    if any(len(r) == 0 for r in ranges):
        return
    if not ranges:
        yield ()
        return
    *outer, last = ranges
    head = [r.start for r in outer]
    while True:
        prefix = tuple(head)
        for i in last:
            yield prefix + (i,)
        d = len(outer) - 1
        while d >= 0:  # the next row: an odometer over the outer dimensions
            head[d] += 1
            if head[d] < outer[d].stop:
                break
            head[d] = outer[d].start
            d -= 1
        if d < 0:
            return


def chunk_indices(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every chunk grid index of an array, in C order (:func:`walk`)."""
    return walk([range(n) for n in grid_shape(shape, chunk)])


def chunk_box(index: Sequence[int], chunk: Sequence[int], shape: Sequence[int]) -> Region:
    """The region of chunk ``index`` of a grid of ``chunk``-shaped chunks over an array of ``shape``, clipped to
    the array (the last chunk along a dimension may be partial)."""
    start = tuple(i * c for i, c in zip(index, chunk))
    return Region(start, tuple(min(c, n - s) for c, n, s in zip(chunk, shape, start)))


def _chunk_ranges(region: Region, chunk: Sequence[int]) -> list[range]:
    """Along each dimension, the grid indices of the chunks that intersect ``region`` (none when it is empty)."""
    if region.is_empty():
        return [range(0)]
    return [range(o // c, -(-e // c)) for o, e, c in zip(region.offsets, region.ends, chunk)]


def chunks_of(region: Region, chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Grid indices of every chunk that intersects ``region``."""
    return walk(_chunk_ranges(region, chunk))


def count_chunks(region: Region, chunk: Sequence[int]) -> int:
    """How many chunks intersect ``region`` (what :func:`chunks_of` yields, counted without visiting them)."""
    return math.prod(len(r) for r in _chunk_ranges(region, chunk))


#: Most grid cells :func:`check_tiling` counts; beyond, it compares regions pairwise.
_MAX_CELLS = 1 << 22


def check_tiling(shape: Sequence[int], regions: Sequence[Region]) -> str | None:
    """None when ``regions`` tile ``shape`` exactly (no gap, no overlap), else why not.

    Counts how often each cell of the grid the region boundaries draw is covered: linear in the
    regions and cells, where comparing regions pairwise would be quadratic.
    """
    shape = tuple(int(s) for s in shape)
    nonempty = sorted(r for r in regions if not r.is_empty())
    total = 0
    for r in nonempty:
        if not r.within(shape):
            return f"region {r.offsets}+{r.sizes} exceeds shape {shape}"
        total += r.numel
    cuts = [sorted({0, n, *(r.offsets[d] for r in nonempty), *(r.ends[d] for r in nonempty)})
            for d, n in enumerate(shape)]
    cells = math.prod(max(1, len(c) - 1) for c in cuts)
    if cells <= _MAX_CELLS:
        count = np.zeros(tuple(max(1, len(c) - 1) for c in cuts), dtype=np.int32)
        for r in nonempty:
            box = tuple(slice(bisect_left(c, o), bisect_left(c, e)) for c, o, e in zip(cuts, r.offsets, r.ends))
            count[box] += 1
        if count.size and count.max(initial=0) > 1:
            where = np.unravel_index(int(np.argmax(count > 1)), count.shape)
            first = [r for r in nonempty if all(c[w] >= o and c[w] < e for c, w, o, e in
                                                zip(cuts, where, r.offsets, r.ends))][:2]
            a, b = first
            return f"regions {a.offsets}+{a.sizes} and {b.offsets}+{b.sizes} overlap"
    else:
        if total != math.prod(shape):  # a gap or an overlap, known without comparing regions
            return f"regions cover {total} of {math.prod(shape)} elements of shape {shape}"
        pair = _overlapping(nonempty)
        if pair is not None:
            a, b = pair
            return f"regions {a.offsets}+{a.sizes} and {b.offsets}+{b.sizes} overlap"
    if total != math.prod(shape):
        return f"regions cover {total} of {math.prod(shape)} elements of shape {shape}"
    return None


def _overlapping(regions: Sequence[Region]) -> tuple[Region, Region] | None:
    """Two of ``regions`` (non-empty, sorted) that overlap, else None: each compared, at numpy's speed, with the
    regions that start along the first dimension before it ends there."""
    if len(regions) < 2:
        return None
    low = np.array([r.offsets for r in regions], dtype=np.int64)
    high = np.array([r.ends for r in regions], dtype=np.int64)
    order = np.argsort(low[:, 0], kind="stable")
    low, high = low[order], high[order]
    starts = low[:, 0]
    for i in range(len(regions) - 1):
        stop = int(np.searchsorted(starts, high[i, 0], side="left"))
        if stop <= i + 1:
            continue
        hit = np.all((low[i + 1:stop] < high[i]) & (low[i] < high[i + 1:stop]), axis=1)
        if hit.any():
            return regions[int(order[i])], regions[int(order[i + 1 + int(np.argmax(hit))])]
    return None


def strides_overlap(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether two elements of a strided array (``strides`` in bytes) may share memory (a stride of 0, or
    strides that interleave): True for every layout whose elements do overlap, False for any slice or
    transpose of one array."""
    if any(n == 0 for n in shape):
        return False
    dims = sorted((abs(int(st)), int(n)) for st, n in zip(strides, shape) if n > 1)
    reach = itemsize  # bytes spanned by one element, then by the dimensions of smaller stride
    for stride, n in dims:
        if stride < reach:
            return True
        reach += stride * (n - 1)
    return False


def memory_span(address: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, int]:
    """The bytes ``[low, high)`` a strided array at ``address`` (``strides`` in bytes, any sign) touches;
    an empty span for an array without elements."""
    if any(n == 0 for n in shape):
        return address, address
    low = address + sum(min(0, (int(n) - 1) * int(st)) for n, st in zip(shape, strides))
    high = address + sum(max(0, (int(n) - 1) * int(st)) for n, st in zip(shape, strides)) + itemsize
    return low, high


def refuse_overlap(shape: Sequence[int], strides: Sequence[int], itemsize: int, leaf: str | None) -> None:
    """Refuse, as ``shape.mismatch`` naming ``leaf``, a load target whose elements share memory (see
    :func:`strides_overlap`): no load can write every element of it."""
    if strides_overlap(shape, strides, itemsize):
        raise ShapeError("the target's elements share memory (an expanded or as_strided tensor): a load cannot "
                         "write into it; load into a tensor of its own", code="shape.mismatch", leaf=leaf)
