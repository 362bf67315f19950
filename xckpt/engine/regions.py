"""Pure region maths: boxes in an N-d index space, chunk grids, tilings.

A region is ``(offsets, sizes)``, both tuples of ints of the array's rank.
Nothing here does I/O; everything is a pure function, tested directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Iterable, Iterator, Sequence

from xckpt.errors import ShapeError


@dataclass(frozen=True, order=True)
class Region:
    """A box ``[offsets, offsets + sizes)`` in an array's index space."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ShapeError(f"region rank mismatch: offsets {self.offsets}, sizes {self.sizes}")
        if any(s < 0 for s in self.sizes) or any(o < 0 for o in self.offsets):
            raise ShapeError(f"negative region {self.offsets}+{self.sizes}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Region":
        """The region covering a whole array of ``shape``."""
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ends(self) -> tuple[int, ...]:
        """Exclusive end of each dimension."""
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    @property
    def numel(self) -> int:
        """Number of elements in the region."""
        return math.prod(self.sizes)

    def is_empty(self) -> bool:
        """Whether the region holds no element."""
        return any(s == 0 for s in self.sizes)

    def slices(self) -> tuple[slice, ...]:
        """Slices selecting this region from the full array."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def relative_to(self, outer: "Region") -> "Region":
        """This region in the coordinates of ``outer`` (which must contain it)."""
        return Region(tuple(o - b for o, b in zip(self.offsets, outer.offsets)), self.sizes)

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the region lies inside an array of ``shape``."""
        return len(shape) == len(self.sizes) and all(e <= s for e, s in zip(self.ends, shape))

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


def chunk_shape_for(shape: Sequence[int], regions: Iterable[Region]) -> tuple[int, ...]:
    """The largest regular chunk grid in which every chunk lies inside one region.

    Per dimension, the chunk size is the gcd of all region boundaries except the
    array's end, so a regular shard grid (even an uneven ``torch.chunk`` split,
    whose last shard is short) gets chunks equal to its shards.
    """
    shape = tuple(int(s) for s in shape)
    gcds = [0] * len(shape)
    for r in regions:
        if r.is_empty():
            continue
        for d, (o, e) in enumerate(zip(r.offsets, r.ends)):
            for b in (o, e):
                if 0 < b < shape[d]:
                    gcds[d] = math.gcd(gcds[d], b)
    return tuple(max(1, g if g else s) for g, s in zip(gcds, shape))


def inner_chunk_shape_for(chunk: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """An inner chunk shape dividing ``chunk`` evenly, of at most ``target_bytes`` where possible.

    Repeatedly divides the largest dimension by its smallest prime factor, so a
    reader on another mesh can read part of a shard.
    """
    inner = [int(c) for c in chunk]
    while math.prod(inner) * itemsize > target_bytes:
        candidates = sorted(range(len(inner)), key=lambda d: -inner[d])
        for d in candidates:
            p = _smallest_prime_factor(inner[d])
            if p:
                inner[d] //= p
                break
        else:
            break
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


def chunk_indices(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every chunk grid index of an array, in C order."""
    return product(*(range(n) for n in grid_shape(shape, chunk)))


def chunks_of(region: Region, chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Grid indices of every chunk that intersects ``region``."""
    if region.is_empty():
        return iter(())
    ranges = [range(o // c, -(-e // c)) for o, e, c in zip(region.offsets, region.ends, chunk)]
    return product(*ranges)


def check_tiling(shape: Sequence[int], regions: Sequence[Region]) -> str | None:
    """None when ``regions`` tile ``shape`` exactly (no gap, no overlap), else why not."""
    shape = tuple(int(s) for s in shape)
    total = 0
    nonempty = sorted(r for r in regions if not r.is_empty())
    for r in nonempty:
        if not r.within(shape):
            return f"region {r.offsets}+{r.sizes} exceeds shape {shape}"
        total += r.numel
    # Overlap check: sweep-free pairwise test is quadratic; shard counts per leaf are small
    # (one per device), so this stays cheap in practice.
    for i, a in enumerate(nonempty):
        for b in nonempty[i + 1:]:
            if intersect(a, b) is not None:
                return f"regions {a.offsets}+{a.sizes} and {b.offsets}+{b.sizes} overlap"
    if total != math.prod(shape):
        return f"regions cover {total} of {math.prod(shape)} elements of shape {shape}"
    return None
