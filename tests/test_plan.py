"""Save planning (xckpt/engine/plan.py): who writes which chunk object, on random shardings with replicas,
meshes and pipeline stages, simulated for every rank through the same functions the collective save runs."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from xckpt.engine.layout import mesh, mesh_layout
from xckpt.engine.plan import Descriptors, LeafDesc, digest, local_plan, plan_save
from xckpt.errors import CoordinationError, ShapeError, TreeError
from xckpt.format import dtypes
from xckpt.format.regions import Region, chunk_indices, intersect
from xckpt.format.tree import flatten

from test_layout import layouts
from test_regions import chunk_box, tilings

SETTINGS = settings(max_examples=100, deadline=None)
DTYPES = ("float32", "bfloat16", "int64", "uint8", "complex128")


def descriptors(leaves: list[LeafDesc]) -> Descriptors:
    """One process's descriptors: its leaves under a tree of nested dicts built from their keys."""
    tree: dict[Any, Any] = {}
    for d in leaves:
        node = tree
        for k in d.key[:-1]:
            node = node.setdefault(k, {})
        node[d.key[-1]] = 0
    structure, flat = flatten(tree)
    order = {key: i for i, (key, _) in enumerate(flat)}
    return Descriptors(structure, sorted(leaves, key=lambda d: order[d.key]))


def simulate(per_rank: list[Descriptors], inner: int = 64) -> tuple[Any, list[Any]]:
    """What the coordinating process plans and what each rank then writes: the protocol without I/O."""
    wires = [d.to_wire() for d in per_rank]
    members: dict[bytes, list[int]] = {}
    for rank, w in enumerate(wires):
        members.setdefault(digest(w), []).append(rank)
    groups = [(ranks, Descriptors.from_wire(wires[ranks[0]])) for ranks in members.values()]
    plan, answers = plan_save(groups, len(per_rank), inner_chunk_bytes=inner)
    answer_of = {r: a for (ranks, _), a in zip(groups, answers) for r in ranks}
    return plan, [local_plan(per_rank[r], answer_of[r], r) for r in range(len(per_rank))]


def written(plan: Any, per_rank: list[Descriptors], locals_: list[Any]) -> dict[tuple, list[int]]:
    """(leaf key, segment, chunk index) -> the ranks that write that object; checks each task's box."""
    out: dict[tuple, list[int]] = {}
    for rank, (descs, local) in enumerate(zip(per_rank, locals_)):
        for t in local.tasks:
            d = descs.leaves[t.leaf]
            assert intersect(t.box, t.piece) == t.box  # the chunk lies in the box the rank holds
            if d.layout is None:
                assert t.piece in d.regions
            out.setdefault((d.key, t.segment, t.index), []).append(rank)
    return out


def every_object(plan: Any) -> set[tuple]:
    return {(a.key, s, idx) for a in plan.arrays.values() if math.prod(a.shape)
            for s, (seg, _) in enumerate(a.segments) for idx in chunk_indices(seg.shape, seg.chunk)}


@st.composite
def jobs(draw: st.DrawFn, full_replication: bool = False) -> list[Descriptors]:
    """Every rank's descriptors: a few arrays tiled at random, each region held by a random non-empty set
    of ranks (replicas), and a value every rank holds."""
    world = draw(st.integers(1, 6))
    per_rank: list[list[LeafDesc]] = [[] for _ in range(world)]
    for i in range(draw(st.integers(1, 3))):
        shape, regions = draw(tilings(max_regions=8))
        dtype = draw(st.sampled_from(DTYPES))
        held: list[list[Region]] = [[] for _ in range(world)]
        for r in regions:
            ranks = list(range(world)) if full_replication else draw(
                st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
            for k in ranks:
                held[k].append(r)
        for k in range(world):
            per_rank[k].append(LeafDesc(("layer", str(i), "w"), "array", shape, dtype, tuple(held[k]),
                                        sharding={"mesh_shape": [world]}))
    for k in range(world):
        per_rank[k].append(LeafDesc(("step",), "value", value_type="int"))
    return [descriptors(leaves) for leaves in per_rank]


@SETTINGS
@given(jobs())
def test_each_chunk_object_is_written_once_by_a_holder(per_rank: list[Descriptors]) -> None:
    plan, locals_ = simulate(per_rank)
    out = written(plan, per_rank, locals_)
    assert set(out) == every_object(plan)
    assert all(len(ranks) == 1 for ranks in out.values())
    for a in plan.arrays.values():
        for seg, inner in a.segments:  # inner chunks divide chunks; chunks lie inside one held region
            assert all(c % n == 0 for c, n in zip(seg.chunk, inner))


@SETTINGS
@given(jobs())
def test_tasks_come_smallest_shard_first_each_shard_together(per_rank: list[Descriptors]) -> None:
    """A rank's tasks in order of their shard's bytes (small leaves are written before large chunks
    stream), and every chunk of one shard in one run (it is fetched once, then dropped)."""
    _, locals_ = simulate(per_rank)
    for descs, local in zip(per_rank, locals_):
        sizes = [t.piece.numel * dtypes.itemsize(descs.leaves[t.leaf].dtype) for t in local.tasks]
        assert sizes == sorted(sizes)
        shards = [(t.leaf, t.piece) for t in local.tasks]
        runs = [s for i, s in enumerate(shards) if i == 0 or shards[i - 1] != s]
        assert len(runs) == len(set(runs))


@SETTINGS
@given(jobs())
def test_greedy_balance_holds_for_every_rank(per_rank: list[Descriptors]) -> None:
    """A rank's load exceeds another holder's by at most the region that put it there."""
    plan, _ = simulate(per_rank)
    world = len(per_rank)
    load = [0] * world
    sizes: dict[tuple, int] = {}
    holders: dict[tuple, set[int]] = {}
    for i, a in plan.arrays.items():
        item = dtypes.itemsize(a.dtype)
        for r, w in a.writers.items():
            load[w] += r.numel * item
            sizes[(i, r)] = r.numel * item
            holders[(i, r)] = {k for k in range(world) for d in per_rank[k].leaves if d.key == a.key and r in d.regions}
    for rank in range(world):
        mine = [k for k in sizes if plan.arrays[k[0]].writers[k[1]] == rank]
        if not mine:
            continue
        smallest = min(sizes[k] for k in mine)
        last = [k for k in mine if sizes[k] == smallest]
        assert any(all(load[rank] - load[j] <= smallest for j in holders[k]) for k in last)


@SETTINGS
@given(jobs(full_replication=True))
def test_fully_replicated_work_is_balanced_within_the_largest_region(per_rank: list[Descriptors]) -> None:
    plan, _ = simulate(per_rank)
    load = [0] * len(per_rank)
    for i, a in plan.arrays.items():
        for r, w in a.writers.items():
            load[w] += r.numel * dtypes.itemsize(a.dtype)
    sizes = [r.numel * dtypes.itemsize(d.dtype) for d in per_rank[0].leaves if d.kind == "array" for r in d.regions]
    assert max(load) - min(load) <= max(sizes)


@SETTINGS
@given(jobs())
def test_plan_is_deterministic_and_survives_the_wire(per_rank: list[Descriptors]) -> None:
    def summary(plan: Any) -> Any:
        return plan.keys, plan.kinds, [(i, a.segments, sorted(a.writers.items())) for i, a in plan.arrays.items()]

    first = summary(simulate(per_rank)[0])
    assert summary(simulate(per_rank)[0]) == first
    assert summary(simulate([Descriptors.from_wire(d.to_wire()) for d in per_rank])[0]) == first


@SETTINGS
@given(layouts())
def test_mesh_layouts_need_one_group_and_write_every_object_once(case: tuple) -> None:
    shape, mesh_shape, placements = case
    world = math.prod(mesh_shape)
    lay = mesh_layout(shape, mesh(mesh_shape, tuple(range(world))), placements)
    per_rank = [descriptors([LeafDesc(("w",), "array", shape, "float32", layout=lay),
                             LeafDesc(("step",), "value", value_type="int")]) for _ in range(world)]
    assert len({digest(d.to_wire()) for d in per_rank}) == 1  # every rank sends the same descriptors
    plan, locals_ = simulate(per_rank)
    out = written(plan, per_rank, locals_)
    assert set(out) == every_object(plan) and all(len(r) == 1 for r in out.values())
    for rank, local in enumerate(locals_):  # a rank writes only what it holds
        mine = {region for region, _ in lay.pieces_of(rank)}
        assert all(t.piece in mine for t in local.tasks)


def test_pipeline_stages_hold_different_keys() -> None:
    """Ranks 0-1 hold layer 0, ranks 2-3 layer 1, all hold the step: one plan, each layer from its stage."""
    stage = [mesh_layout((8, 4), mesh((2,), (0, 1)), (("S", 0),)), mesh_layout((8, 4), mesh((2,), (2, 3)), (("S", 0),))]
    per_rank = [descriptors([LeafDesc(("layers", str(r // 2), "w"), "array", (8, 4), "float32", layout=stage[r // 2]),
                             LeafDesc(("step",), "value", value_type="int")]) for r in range(4)]
    plan, locals_ = simulate(per_rank)
    assert plan.keys == [("layers", "0", "w"), ("layers", "1", "w"), ("step",)]  # the stages' trees merged
    assert len(plan.groups) == 2
    out = written(plan, per_rank, locals_)
    assert set(out) == every_object(plan)
    assert {r for (key, _, _), ranks in out.items() if key[1] == "0" for r in ranks} == {0, 1}
    assert {r for (key, _, _), ranks in out.items() if key[1] == "1" for r in ranks} == {2, 3}


def test_replicas_are_split_between_holders() -> None:
    """Four equal shards, each on two of four ranks: every rank writes exactly one."""
    shards = [Region((2 * i, 0), (2, 4)) for i in range(4)]
    per_rank = [descriptors([LeafDesc(("w",), "array", (8, 4), "float32", (shards[k], shards[(k + 1) % 4]))])
                for k in range(4)]
    plan, locals_ = simulate(per_rank)
    assert sorted(plan.arrays[0].writers.values()) == [0, 1, 2, 3]
    assert [len(local.tasks) for local in locals_] == [1, 1, 1, 1]


def test_ranks_that_disagree_are_refused() -> None:
    a = descriptors([LeafDesc(("w",), "array", (4,), "float32", (Region((0,), (4,)),))])
    with pytest.raises(CoordinationError) as info:
        simulate([a, descriptors([LeafDesc(("w",), "array", (5,), "float32", (Region((0,), (5,)),))])])
    assert info.value.leaf == "w" and "[5]" in str(info.value) and "rank 1" in str(info.value)
    with pytest.raises(CoordinationError):
        simulate([a, descriptors([LeafDesc(("w",), "array", (4,), "int32", (Region((0,), (4,)),))])])
    with pytest.raises(CoordinationError):
        simulate([a, descriptors([LeafDesc(("w",), "value", value_type="int")])])
    lay = mesh_layout((4,), mesh((2,), (0, 1)), (("S", 0),))
    with pytest.raises(CoordinationError, match="do not hold it"):  # the mesh puts a shard on rank 1
        simulate([descriptors([LeafDesc(("w",), "array", (4,), "float32", layout=lay)]), descriptors([])])
    beyond = mesh_layout((4,), mesh((3,), (0, 1, 2)), (("S", 0),))  # rank 2 in a job of 2
    leaves = [LeafDesc((k,), "array", (4,), "float32", layout=beyond) for k in ("a", "b")]
    with pytest.raises(CoordinationError, match=r"ranks \[2\] do not hold it") as info:
        simulate([descriptors(leaves), descriptors(leaves)])
    assert info.value.leaf == "a"


@pytest.mark.parametrize("regions, why", [
    ([Region((0,), (3,))], "cover"),
    ([Region((0,), (3,)), Region((2,), (2,))], "overlap"),
    ([Region((0,), (5,))], "exceeds"),
])
def test_shards_that_do_not_tile_are_refused(regions: list[Region], why: str) -> None:
    per_rank = [descriptors([LeafDesc(("a", "w"), "array", (4,), "float32", (r,))]) for r in regions]
    with pytest.raises(ShapeError) as info:
        simulate(per_rank)
    assert why in str(info.value) and info.value.code == "shape.tiling" and info.value.leaf == "a/w"


def test_orbax_names_must_not_collide() -> None:
    per_rank = [descriptors([LeafDesc(("a.b",), "array", (2,), "float32", (Region((0,), (2,)),)),
                             LeafDesc(("a", "b"), "value", value_type="float")])]
    with pytest.raises(TreeError) as info:
        simulate(per_rank)
    assert info.value.code == "tree.name_collision"


def test_chunk_boxes_are_clipped_to_the_array() -> None:
    per_rank = [descriptors([LeafDesc(("w",), "array", (10,), "float32",
                                      (Region((0,), (4,)), Region((4,), (4,)), Region((8,), (2,))))])]
    plan, (local,) = simulate(per_rank)
    assert sorted((t.box for t in local.tasks), key=lambda b: b.offsets) == [chunk_box((i,), (4,), (10,))
                                                                            for i in range(3)]


def test_replicated_submeshes_are_one_array() -> None:
    """FSDP2 + TP: a parameter FSDP shards over the dp submesh of its tp column, the same split in each
    column: ranks (0, 2) and (1, 3) describe different meshes of the same boxes, each box written once."""
    column = [mesh_layout((6, 2), mesh((2,), (0, 2)), (("S", 0),)), mesh_layout((6, 2), mesh((2,), (1, 3)), (("S", 0),))]
    per_rank = [descriptors([LeafDesc(("emb",), "array", (6, 2), "float32", layout=column[r % 2])]) for r in range(4)]
    plan, locals_ = simulate(per_rank)
    assert len(plan.groups) == 2 and plan.arrays[0].layout is None  # planned from the boxes both describe
    out = written(plan, per_rank, locals_)
    assert set(out) == every_object(plan) and all(len(r) == 1 for r in out.values())
    writers = plan.arrays[0].writers  # one of each box's holders
    assert writers[Region((0, 0), (3, 2))] in (0, 1) and writers[Region((3, 0), (3, 2))] in (2, 3)


def test_commit_refuses_a_stale_plan_or_missing_bytes() -> None:
    from xckpt.engine.protocol import check_complete

    leaves = [LeafDesc(("w",), "array", (8, 4), "float32", (Region((0, 0), (8, 4)),)),
              LeafDesc(("b",), "array", (3,), "bfloat16", (Region((0,), (3,)),))]
    plan, _ = simulate([descriptors(leaves), descriptors(leaves)])
    key, want = b"k" * 16, 8 * 4 * 4 + 3 * 2
    check_complete(plan, key, [{"plan": key, "bytes": want - 6}, {"plan": key, "bytes": 6}])
    with pytest.raises(CoordinationError, match=r"ranks \[1\] wrote their part of another plan"):
        check_complete(plan, key, [{"plan": key, "bytes": want}, {"plan": b"x" * 16, "bytes": 0}])
    with pytest.raises(CoordinationError, match=f"wrote {want - 6} bytes of array data, the arrays hold {want}"):
        check_complete(plan, key, [{"plan": key, "bytes": want - 6}, {"plan": key, "bytes": 0}])
