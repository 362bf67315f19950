"""Planning: who writes which region on save, which regions to read on load.

Pure functions over plain descriptors, kept apart from storage (how bytes move),
so every process computes the same plan from the same gathered inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from xckpt.format import dtypes
from xckpt.errors import CoordinationError, ShapeError
from xckpt.engine.regions import Region, check_tiling, chunk_shape_for, inner_chunk_shape_for
from xckpt.format.tree import Key, key_str

#: Default upper bound on inner chunk bytes: the unit a reader on another mesh fetches.
INNER_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class LeafDesc:
    """What one process holds of one leaf: its kind, and for arrays the regions it holds."""

    key: Key
    kind: str  # "array" | "value"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    regions: tuple[Region, ...] = ()
    value_type: str = ""
    sharding: dict[str, Any] | None = None

    def to_wire(self) -> list[Any]:
        """A msgpack-able form."""
        return [list(self.key), self.kind, list(self.shape), self.dtype,
                [r.to_json() for r in self.regions], self.value_type, self.sharding]

    @classmethod
    def from_wire(cls, w: Sequence[Any]) -> "LeafDesc":
        """Inverse of :meth:`to_wire`."""
        return cls(tuple(w[0]), w[1], tuple(w[2]), w[3], tuple(Region.from_json(r) for r in w[4]), w[5], w[6])


@dataclass
class LeafPlan:
    """The plan of one array leaf."""

    key: Key
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    writers: dict[Region, int]  # each distinct region -> the rank that writes it
    sharding: dict[str, Any] | None


@dataclass
class SavePlan:
    """Everything every process needs to know to write its part."""

    leaves: list[LeafPlan | None]  # None for value leaves
    bytes_per_rank: list[int] = field(default_factory=list)

    def assigned(self, rank: int) -> list[tuple[int, Region]]:
        """``(leaf index, region)`` pairs that ``rank`` writes."""
        return [(i, r) for i, lp in enumerate(self.leaves) if lp is not None
                for r, w in lp.writers.items() if w == rank]


def plan_save(per_rank: Sequence[Sequence[LeafDesc]], *,
              inner_chunk_bytes: int = INNER_CHUNK_BYTES) -> SavePlan:
    """Plan a save from every rank's leaf descriptors (all ranks get the same plan).

    Checks that ranks agree on keys, kinds, shapes and dtypes, that the distinct
    regions of each array tile it exactly, picks the chunk grid, and assigns each
    distinct region to one of the ranks holding it so bytes per rank stay balanced
    (largest regions first, each to the least-loaded holder).
    """
    world = len(per_rank)
    first = per_rank[0]
    for rank, descs in enumerate(per_rank[1:], start=1):
        _check_agree(first, descs, rank)
    holders: list[dict[Region, list[int]]] = [dict() for _ in first]
    for rank, descs in enumerate(per_rank):
        for i, d in enumerate(descs):
            for r in d.regions:
                holders[i].setdefault(r, []).append(rank)
    leaves: list[LeafPlan | None] = []
    work: list[tuple[int, int, Region]] = []
    for i, d in enumerate(first):
        if d.kind != "array":
            leaves.append(None)
            continue
        regions = sorted(holders[i])
        why = check_tiling(d.shape, regions)
        if why is not None:
            raise ShapeError(f"the shards of this array do not tile it: {why}", code="shape.tiling",
                             leaf=key_str(d.key))
        chunk = chunk_shape_for(d.shape, regions)
        inner = inner_chunk_shape_for(chunk, dtypes.itemsize(d.dtype), inner_chunk_bytes)
        leaves.append(LeafPlan(d.key, d.shape, d.dtype, chunk, inner, {}, d.sharding))
        item = dtypes.itemsize(d.dtype)
        for r in regions:
            if not r.is_empty():
                work.append((r.numel * item, i, r))
    load = [0] * world
    for nbytes, i, r in sorted(work, key=lambda w: (-w[0], w[1], w[2])):
        rank = min(holders[i][r], key=lambda k: (load[k], k))
        load[rank] += nbytes
        leaves[i].writers[r] = rank  # type: ignore[union-attr]
    return SavePlan(leaves, load)


def _check_agree(a: Sequence[LeafDesc], b: Sequence[LeafDesc], rank: int) -> None:
    if [d.key for d in a] != [d.key for d in b]:
        only_a = sorted({key_str(d.key) for d in a} - {key_str(d.key) for d in b})
        only_b = sorted({key_str(d.key) for d in b} - {key_str(d.key) for d in a})
        raise CoordinationError(
            f"rank 0 and rank {rank} save different trees: only on rank 0: {only_a[:10]}, "
            f"only on rank {rank}: {only_b[:10]}" + ("" if only_a or only_b else " (same keys, other order)"))
    for x, y in zip(a, b):
        if (x.kind, x.shape, x.dtype) != (y.kind, y.shape, y.dtype):
            raise CoordinationError(
                f"rank 0 has {x.kind} {list(x.shape)} {x.dtype}, rank {rank} has {y.kind} {list(y.shape)} {y.dtype}",
                leaf=key_str(x.key))
