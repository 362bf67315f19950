"""Save planning (xckpt/plan.py): who writes which region, on random shardings with replicas."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from xckpt.engine import collective as coord
from xckpt.format import dtypes
from xckpt.errors import CoordinationError, ShapeError
from xckpt.engine.plan import LeafDesc, SavePlan, plan_save
from xckpt.engine.regions import Region, chunk_indices, chunk_shape_for, inner_chunk_shape_for, intersect

from test_regions import chunk_box, tilings

SETTINGS = settings(max_examples=120, deadline=None)
DTYPES = ("float32", "bfloat16", "int64", "uint8", "complex128")


@st.composite
def jobs(draw: st.DrawFn, full_replication: bool = False) -> tuple[int, list[list[LeafDesc]]]:
    """A world size and every rank's descriptors: a few array leaves, each tiled at random, each region
    held by a random non-empty set of ranks (replicas), plus a value leaf."""
    world = draw(st.integers(1, 6))
    n_leaves = draw(st.integers(1, 3))
    per_rank: list[list[LeafDesc]] = [[] for _ in range(world)]
    for i in range(n_leaves):
        shape, regions = draw(tilings(max_regions=8))
        dtype = draw(st.sampled_from(DTYPES))
        held: list[list[Region]] = [[] for _ in range(world)]
        for r in regions:
            ranks = list(range(world)) if full_replication else draw(
                st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
            for k in ranks:
                held[k].append(r)
        for k in range(world):
            per_rank[k].append(LeafDesc(("layer", i, "w"), "array", shape, dtype, tuple(held[k]),
                                        sharding={"mesh_shape": [world]}))
    at = draw(st.integers(0, n_leaves))
    for k in range(world):
        per_rank[k].insert(at, LeafDesc(("step",), "value", value_type="int"))
    return world, per_rank


def _holders(per_rank: list[list[LeafDesc]], i: int) -> dict[Region, set[int]]:
    out: dict[Region, set[int]] = {}
    for k, descs in enumerate(per_rank):
        for r in descs[i].regions:
            out.setdefault(r, set()).add(k)
    return out


def _wire_roundtrip(per_rank: list[list[LeafDesc]]) -> list[list[LeafDesc]]:
    """What every process gets after the all-gather: msgpack bytes, decoded."""
    return [[LeafDesc.from_wire(w) for w in coord.unpack(coord.pack([d.to_wire() for d in descs]))]
            for descs in per_rank]


def _bytes(d: LeafDesc, r: Region) -> int:
    return r.numel * dtypes.itemsize(d.dtype)


@SETTINGS
@given(jobs())
def test_each_distinct_region_is_written_once_by_a_holder(job: tuple) -> None:
    world, per_rank = job
    plan = plan_save(per_rank, inner_chunk_bytes=64)
    assert len(plan.leaves) == len(per_rank[0]) and len(plan.bytes_per_rank) == world
    total = 0
    for i, d in enumerate(per_rank[0]):
        lp = plan.leaves[i]
        if d.kind == "value":
            assert lp is None
            continue
        assert lp is not None and (lp.key, lp.shape, lp.dtype) == (d.key, d.shape, d.dtype)
        holders = _holders(per_rank, i)
        assert set(lp.writers) == {r for r in holders if not r.is_empty()}
        for r, writer in lp.writers.items():
            assert writer in holders[r]
        total += math.prod(d.shape) * dtypes.itemsize(d.dtype)
        # the chunk grid puts every chunk inside one written region; inner chunks divide chunks
        assert lp.chunk_shape == chunk_shape_for(d.shape, list(holders))
        assert lp.inner_chunk_shape == inner_chunk_shape_for(lp.chunk_shape, dtypes.itemsize(d.dtype), 64)
        assert all(c % n == 0 for c, n in zip(lp.chunk_shape, lp.inner_chunk_shape))
        for idx in chunk_indices(d.shape, lp.chunk_shape):
            box = chunk_box(idx, lp.chunk_shape, d.shape)
            assert sum(intersect(box, r) == box for r in lp.writers) == 1
    assert sum(plan.bytes_per_rank) == total  # every element written exactly once
    for rank in range(world):
        mine = plan.assigned(rank)
        assert sum(_bytes(per_rank[0][i], r) for i, r in mine) == plan.bytes_per_rank[rank]
        assert all(plan.leaves[i].writers[r] == rank for i, r in mine)  # type: ignore[union-attr]
    assert sum(len(plan.assigned(k)) for k in range(world)) == sum(
        len(lp.writers) for lp in plan.leaves if lp is not None)


@SETTINGS
@given(jobs())
def test_greedy_balance_holds_for_every_rank(job: tuple) -> None:
    """A rank's load exceeds another holder's by at most the size of the region that put it there:
    for some smallest region a rank writes, every other holder of it has at least load - its size."""
    world, per_rank = job
    plan = plan_save(per_rank)
    load = plan.bytes_per_rank
    for rank in range(world):
        mine = [(i, r) for i, r in plan.assigned(rank)]
        if not mine:
            continue
        smallest = min(_bytes(per_rank[0][i], r) for i, r in mine)
        last = [(i, r) for i, r in mine if _bytes(per_rank[0][i], r) == smallest]
        assert any(all(load[rank] - load[j] <= smallest for j in _holders(per_rank, i)[r]) for i, r in last)


@SETTINGS
@given(jobs(full_replication=True))
def test_fully_replicated_work_is_balanced_within_the_largest_region(job: tuple) -> None:
    world, per_rank = job
    plan = plan_save(per_rank)
    sizes = [_bytes(d, r) for d in per_rank[0] if d.kind == "array" for r in d.regions]
    assert max(plan.bytes_per_rank) - min(plan.bytes_per_rank) <= max(sizes)


@SETTINGS
@given(jobs())
def test_plan_is_deterministic_across_processes(job: tuple) -> None:
    _, per_rank = job

    def summary(plan: SavePlan) -> Any:
        return [None if lp is None else (lp.chunk_shape, lp.inner_chunk_shape, sorted(lp.writers.items()))
                for lp in plan.leaves], plan.bytes_per_rank

    first = summary(plan_save(per_rank))
    assert summary(plan_save(per_rank)) == first
    assert summary(plan_save(_wire_roundtrip(per_rank))) == first  # what each process computes


def test_replicas_are_split_between_holders() -> None:
    """Four equal shards, each on two of four ranks: every rank writes exactly one."""
    shape = (8, 4)
    shards = [Region((2 * i, 0), (2, 4)) for i in range(4)]
    per_rank = [[LeafDesc(("w",), "array", shape, "float32", (shards[k], shards[(k + 1) % 4]))] for k in range(4)]
    plan = plan_save(per_rank)
    assert plan.bytes_per_rank == [32, 32, 32, 32]
    assert sorted(plan.leaves[0].writers.values()) == [0, 1, 2, 3]  # type: ignore[union-attr]


def test_ranks_that_disagree_are_refused() -> None:
    a = [LeafDesc(("w",), "array", (4,), "float32", (Region((0,), (4,)),))]
    with pytest.raises(CoordinationError) as info:
        plan_save([a, [LeafDesc(("v",), "array", (4,), "float32", (Region((0,), (4,)),))]])
    assert info.value.code == "coord.mismatch" and "only on rank 0: ['w']" in str(info.value)
    with pytest.raises(CoordinationError) as info:
        plan_save([a, [LeafDesc(("w",), "array", (5,), "float32", (Region((0,), (5,)),))]])
    assert info.value.leaf == "w" and "[5]" in str(info.value)
    with pytest.raises(CoordinationError):
        plan_save([a, [LeafDesc(("w",), "array", (4,), "int32", (Region((0,), (4,)),))]])


@pytest.mark.parametrize("regions, why", [
    ([Region((0,), (3,))], "cover"),
    ([Region((0,), (3,)), Region((2,), (2,))], "overlap"),
    ([Region((0,), (5,))], "exceeds"),
])
def test_shards_that_do_not_tile_are_refused(regions: list[Region], why: str) -> None:
    per_rank = [[LeafDesc(("a", "w"), "array", (4,), "float32", (r,))] for r in regions]
    with pytest.raises(ShapeError) as info:
        plan_save(per_rank)
    assert info.value.code == "shape.tiling" and info.value.leaf == "a/w" and why in str(info.value)
