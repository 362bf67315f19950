"""Pure maths of how an array is split: over a mesh of processes, and into stored chunk objects.

A :class:`MeshLayout` says how a sharded array lies on a mesh of processes (a DTensor's
device mesh and placements, a jax ``NamedSharding``): from it every process derives what
every other process holds, so a save needs no per-shard messages. Placements, one per
mesh dimension, apply in mesh-dimension order to the indices left along one tensor
dimension (``torch.chunk`` splits, as DTensor and jax both split):

* ``("R",)``: replicated along this mesh dimension;
* ``("S", dim)``: split into ``mesh size`` contiguous chunks of ``ceil(n / size)``;
* ``("SS", dim, split_factor)``: FSDP2 + tensor parallel's ``_StridedShard``: split into
  ``split_factor`` blocks, each block into ``mesh size`` chunks, this position taking its
  chunk of every block.

The indices a position holds along a dimension are a list of runs ``(global start,
length)``; its pieces are the products of its runs over the dimensions.

:func:`chunk_layout` turns the boundaries of an array's pieces into its stored chunk
grid: one regular Zarr grid when that costs at most two objects per piece, else several
regular *segments* (bands of equal pieces along each dimension), so that uneven nested
splits never explode into one-row chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import product
from typing import Any, Sequence

from xckpt.format.regions import Region
from xckpt.errors import ShapeError, UnsupportedError

Run = tuple[int, int]  # (global start, length)
Placement = tuple[Any, ...]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _take(runs: Sequence[Run], lo: int, hi: int) -> list[Run]:
    """Positions ``[lo, hi)`` of the indices the runs list, as runs."""
    out: list[Run] = []
    pos = 0
    for start, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            if out and out[-1][0] + out[-1][1] == start + a - pos:
                out[-1] = (out[-1][0], out[-1][1] + b - a)
            else:
                out.append((start + a - pos, b - a))
        pos += n
        if pos >= hi:
            break
    return out


def split_runs(runs: Sequence[Run], placement: Placement, size: int, index: int) -> list[Run]:
    """What position ``index`` of a mesh dimension of ``size`` keeps of ``runs`` under ``placement``."""
    n = sum(length for _, length in runs)
    if placement[0] == "S":
        step = _ceil(n, size) if n else 0
        lo = min(step * index, n)
        return _take(runs, lo, min(lo + step, n))
    if placement[0] == "SS":
        factor = int(placement[2])
        first = _ceil(n, factor) if n else 0
        out: list[Run] = []
        for b in range(factor):
            a, e = min(first * b, n), min(first * (b + 1), n)
            second = _ceil(e - a, size) if e > a else 0
            s = min(second * index, e - a)
            for run in _take(runs, a + s, a + min(s + second, e - a)):
                if out and out[-1][0] + out[-1][1] == run[0]:
                    out[-1] = (out[-1][0], out[-1][1] + run[1])
                else:
                    out.append(run)
        return out
    raise UnsupportedError(f"unknown placement {placement!r}", code="layout.placement")


Chain = tuple[tuple[Placement, int], ...]  # the (placement, mesh size) pairs splitting one dimension, in order


@lru_cache(maxsize=1 << 16)
def dim_runs(n: int, chain: Chain, index: tuple[int, ...]) -> tuple[Run, ...]:
    """The runs a position keeps of a dimension of ``n`` split by ``chain`` at mesh indices ``index``
    (each prefix of the chain is cached too: positions share their earlier splits)."""
    if not chain:
        return ((0, n),) if n else ()
    placement, size = chain[-1]
    return tuple(split_runs(dim_runs(n, chain[:-1], index[:-1]), placement, size, index[-1]))


@lru_cache(maxsize=4096)
def dim_boundaries(n: int, chain: Chain) -> tuple[int, ...]:
    """Every start and end of the runs of any position along a dimension of ``n`` split by ``chain``."""
    cuts = {0, n}
    kept = {((0, n),) if n else ()}  # the distinct runs some position keeps, after each split of the chain
    for placement, size in chain:
        kept = {tuple(split_runs(runs, placement, size, i)) for runs in kept for i in range(size)}
    for runs in kept:
        for start, length in runs:
            cuts.add(start)
            cuts.add(start + length)
    return tuple(sorted(cuts))


def parse_placement(p: Any, ndim: int) -> Placement:
    """Check one placement (``["R"]``, ``["S", dim]``, ``["SS", dim, factor]``) and return it as a tuple."""
    if isinstance(p, (list, tuple)) and p:
        if tuple(p) == ("R",):
            return ("R",)
        if p[0] == "S" and len(p) == 2 and isinstance(p[1], int) and 0 <= p[1] < ndim:
            return ("S", int(p[1]))
        if (p[0] == "SS" and len(p) == 3 and isinstance(p[1], int) and 0 <= p[1] < ndim
                and isinstance(p[2], int) and p[2] >= 1):
            return ("SS", int(p[1]), int(p[2]))
    raise UnsupportedError(f"placement {p!r} is not one of ['R'], ['S', dim], ['SS', dim, factor]",
                           code="layout.placement")


@dataclass(frozen=True, eq=False)
class Mesh:
    """Processes on an N-d grid: ``ranks`` lists the process at each position, in C order."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if math.prod(self.shape) != len(self.ranks) or any(s < 1 for s in self.shape):
            raise ShapeError(f"mesh of shape {list(self.shape)} cannot hold {len(self.ranks)} positions",
                             code="layout.mesh")
        object.__setattr__(self, "_hash", hash((self.shape, self.ranks)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Mesh) and self._hash == other._hash  # type: ignore[attr-defined]
                                 and self.shape == other.shape and self.ranks == other.ranks)

    @cached_property
    def positions(self) -> dict[int, list[tuple[int, ...]]]:
        """Every position of each process."""
        out: dict[int, list[tuple[int, ...]]] = {}
        for flat, coord in enumerate(product(*(range(s) for s in self.shape))):
            out.setdefault(self.ranks[flat], []).append(coord)
        return out

    def rank_at(self, coord: Sequence[int]) -> int:
        """The process at a position."""
        flat = 0
        for c, s in zip(coord, self.shape):
            flat = flat * s + c
        return self.ranks[flat]

    def to_wire(self) -> list[Any]:
        """A msgpack-able form: the shape and the ranks, or the first rank where they count up from it
        (so describing a mesh of thousands of processes costs a few bytes)."""
        first = self.ranks[0]
        if self.ranks == tuple(range(first, first + len(self.ranks))):
            return [list(self.shape), first]
        return [list(self.shape), list(self.ranks)]

    @classmethod
    def from_wire(cls, w: Sequence[Any]) -> "Mesh":
        """Inverse of :meth:`to_wire` (the shared :func:`mesh` of it)."""
        shape = tuple(int(s) for s in w[0])
        if isinstance(w[1], int):
            return mesh(shape, tuple(range(int(w[1]), int(w[1]) + math.prod(shape))))
        return mesh(shape, tuple(int(r) for r in w[1]))


@dataclass(frozen=True)
class MeshLayout:
    """How an array of ``shape`` lies on ``mesh`` under one placement per mesh dimension."""

    shape: tuple[int, ...]
    mesh: Mesh
    placements: tuple[Placement, ...]
    _cache: dict[Any, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.placements) != len(self.mesh.shape):
            raise ShapeError(f"{len(self.placements)} placements for a mesh of {len(self.mesh.shape)} dimensions",
                             code="layout.mesh")
        for p in self.placements:
            parse_placement(list(p), len(self.shape))

    @cached_property
    def _dims(self) -> tuple[tuple[int, ...], ...]:
        """Per tensor dimension, the mesh dimensions that split it, in order."""
        return tuple(tuple(m for m, p in enumerate(self.placements) if p[0] != "R" and p[1] == d)
                     for d in range(len(self.shape)))

    @cached_property
    def _chains(self) -> tuple[Chain, ...]:
        return tuple(tuple((self.placements[m], self.mesh.shape[m]) for m in dims) for dims in self._dims)

    def runs(self, d: int, coord: Sequence[int]) -> tuple[Run, ...]:
        """The runs of indices position ``coord`` holds along tensor dimension ``d``."""
        return dim_runs(self.shape[d], self._chains[d], tuple(coord[m] for m in self._dims[d]))

    def pieces(self, coord: Sequence[int]) -> tuple[tuple[Region, tuple[slice, ...]], ...]:
        """The non-empty boxes position ``coord`` holds: ``(global region, slices of its local array)``
        (worked out once per position: leaves laid out alike share their layout)."""
        key = ("pieces", tuple(coord))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._pieces(coord)
        return hit  # type: ignore[no-any-return]

    def _pieces(self, coord: Sequence[int]) -> tuple[tuple[Region, tuple[slice, ...]], ...]:
        per_dim = []
        for d in range(len(self.shape)):
            local, pos = [], 0
            for start, n in self.runs(d, coord):
                local.append((start, pos, n))
                pos += n
            per_dim.append(local)
        return tuple((Region(tuple(g for g, _, _ in combo), tuple(n for _, _, n in combo)),
                      tuple(slice(lo, lo + n) for _, lo, n in combo)) for combo in product(*per_dim))

    def local_shape(self, coord: Sequence[int]) -> tuple[int, ...]:
        """The shape of the local array at ``coord``."""
        key = ("local_shape", tuple(coord))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = tuple(sum(n for _, n in self.runs(d, coord)) for d in range(len(self.shape)))
        return hit  # type: ignore[no-any-return]

    def pieces_of(self, rank: int) -> list[tuple[Region, tuple[int, ...]]]:
        """Every distinct box process ``rank`` holds, with one of its positions holding it."""
        seen: dict[Region, tuple[int, ...]] = {}
        for coord in self.mesh.positions.get(rank, []):
            for region, _ in self.pieces(coord):
                seen.setdefault(region, coord)
        return list(seen.items())

    @cached_property
    def boundaries(self) -> tuple[tuple[int, ...], ...]:
        """Per tensor dimension, every start and end of a run of any position (0 and the size included)."""
        return tuple(dim_boundaries(n, chain) for n, chain in zip(self.shape, self._chains))

    @cached_property
    def n_pieces(self) -> int:
        """Number of distinct non-empty boxes (the cells between the boundaries)."""
        return math.prod(len(b) - 1 for b in self.boundaries) if self.shape else 1

    @cached_property
    def segments(self) -> tuple["Segment", ...]:
        """The stored segments of a leaf with this layout (:func:`chunk_layout`)."""
        return chunk_layout(self.shape, self.boundaries, self.n_pieces)

    def holders(self, coord: Sequence[int]) -> list[int]:
        """The processes holding the same boxes as ``coord`` (it and its replicas), sorted."""
        replicated = [m for m, p in enumerate(self.placements) if p[0] == "R"]
        key = ("holders", tuple(c for m, c in enumerate(coord) if m not in replicated))
        hit = self._cache.get(key)
        if hit is None:
            ranks = set()
            for sub in product(*(range(self.mesh.shape[m]) for m in replicated)):
                pos = list(coord)
                for m, c in zip(replicated, sub):
                    pos[m] = c
                ranks.add(self.mesh.rank_at(pos))
            hit = self._cache[key] = sorted(ranks)
        return hit

    def writes(self, rank: int, seed: int) -> list[tuple[Region, tuple[int, ...]]]:
        """The boxes ``rank`` writes: of each box it holds, one holder writes it, picked by ``seed``."""
        return [(region, coord) for region, coord in self.pieces_of(rank)
                if (h := self.holders(coord))[seed % len(h)] == rank]

    def to_wire(self, mesh_id: int) -> list[Any]:
        """A msgpack-able form naming its mesh by index in a table of meshes."""
        return ["mesh", mesh_id, [list(p) for p in self.placements]]


@lru_cache(maxsize=256)
def mesh(shape: tuple[int, ...], ranks: tuple[int, ...]) -> Mesh:
    """The (shared) :class:`Mesh` of these positions."""
    return Mesh(shape, ranks)


@lru_cache(maxsize=4096)
def mesh_layout(shape: tuple[int, ...], on: Mesh, placements: tuple[Placement, ...]) -> MeshLayout:
    """The (shared) :class:`MeshLayout`: leaves laid out alike share its caches."""
    return MeshLayout(shape, on, placements)


@dataclass(frozen=True)
class Segment:
    """One regular Zarr array holding the box ``[offset, offset + shape)`` of a leaf, in chunks of ``chunk``."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    chunk: tuple[int, ...]

    @property
    def region(self) -> Region:
        """The box of the leaf this segment holds."""
        return Region(self.offset, self.shape)


def _gcd_chunk(shape: Sequence[int], boundaries: Sequence[Sequence[int]]) -> tuple[int, ...]:
    out = []
    for n, cuts in zip(shape, boundaries):
        g = 0
        for b in cuts:
            if 0 < b < n:
                g = math.gcd(g, b)
        out.append(max(1, g or n))
    return tuple(out)


def _bands(n: int, cuts: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of equal gaps between cuts, each optionally closed by one shorter gap: ``(start, size, chunk)``."""
    gaps = [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]
    if not gaps:
        return [(0, n, max(1, n))]
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(gaps):
        start, g = gaps[i]
        j = i + 1
        while j < len(gaps) and gaps[j][1] == g:
            j += 1
        if j < len(gaps) and gaps[j][1] < g:
            j += 1
        end = gaps[j - 1][0] + gaps[j - 1][1]
        out.append((start, end - start, g))
        i = j
    return out


def chunk_layout(shape: Sequence[int], boundaries: Sequence[Sequence[int]], n_pieces: int) -> tuple[Segment, ...]:
    """The stored segments of a leaf whose pieces start and end at ``boundaries`` (per dimension).

    One segment, whose chunks are the gcd grid of the boundaries, when that grid has at most
    two chunks per piece; otherwise one segment per combination of bands (runs of equal pieces
    along each dimension), whose chunks are exactly the pieces. Every chunk lies inside one piece.
    """
    shape = tuple(int(s) for s in shape)
    if any(n == 0 for n in shape):  # no element, no object: the smallest chunk (a whole dimension may be huge)
        return (Segment((0,) * len(shape), shape, (1,) * len(shape)),)
    gcd = _gcd_chunk(shape, boundaries)
    objects = math.prod(_ceil(n, c) for n, c in zip(shape, gcd))
    if objects <= 2 * max(1, n_pieces):
        return (Segment((0,) * len(shape), shape, gcd),)
    per_dim = [_bands(n, cuts) for n, cuts in zip(shape, boundaries)]
    cells = math.prod(sum(_ceil(size, c) for _, size, c in bands) for bands in per_dim)
    if cells >= objects:
        return (Segment((0,) * len(shape), shape, gcd),)
    return tuple(Segment(tuple(b[0] for b in combo), tuple(b[1] for b in combo), tuple(b[2] for b in combo))
                 for combo in product(*per_dim))


def region_boundaries(shape: Sequence[int], regions: Sequence[Region]) -> tuple[tuple[int, ...], ...]:
    """Per dimension, every start and end of the non-empty ``regions`` (0 and the size included)."""
    out = []
    for d, n in enumerate(shape):
        cuts = {0, int(n)}
        for r in regions:
            if not r.is_empty():
                cuts.update((r.offsets[d], r.offsets[d] + r.sizes[d]))
        out.append(tuple(sorted(cuts)))
    return tuple(out)
