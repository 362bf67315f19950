"""Layout maths (xckpt/engine/layout.py): meshes and placements against a brute-force oracle, chunk layouts."""

from __future__ import annotations

import math
from itertools import product

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from xckpt.engine.layout import Segment, chunk_layout, mesh, mesh_layout, region_boundaries, split_runs
from xckpt.format.regions import Region, check_tiling, chunk_indices, intersect

from test_regions import chunk_box, shapes, tilings

SETTINGS = settings(max_examples=150, deadline=None)


def _chunk(n: int, parts: int, i: int) -> slice:
    """torch.chunk / jax: ``parts`` chunks of ceil(n / parts), the last ones short or empty."""
    size = -(-n // parts) if n else 0
    return slice(min(size * i, n), min(size * (i + 1), n))


def oracle(shape: tuple, mesh_shape: tuple, coord: tuple, placements: tuple) -> list[np.ndarray]:
    """Per dimension, the global indices a mesh position holds, by index arithmetic on whole arrays."""
    idx = [np.arange(n) for n in shape]
    for m, p in enumerate(placements):
        if p[0] == "R":
            continue
        cur = idx[p[1]]
        if p[0] == "S":
            idx[p[1]] = cur[_chunk(len(cur), mesh_shape[m], coord[m])]
        else:
            blocks = [cur[_chunk(len(cur), p[2], b)] for b in range(p[2])]
            idx[p[1]] = np.concatenate([b[_chunk(len(b), mesh_shape[m], coord[m])] for b in blocks])
    return idx


@st.composite
def layouts(draw: st.DrawFn) -> tuple:
    """A shape, a mesh of 1 to 3 dimensions and a placement per mesh dimension (Shard, strided, Replicate)."""
    shape = draw(shapes(min_rank=1, max_rank=3, min_dim=0, max_dim=13))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        d = draw(st.integers(0, len(shape) - 1))
        placements.append(("R",) if kind == "R" else ("S", d) if kind == "S" else ("SS", d, draw(st.integers(1, 3))))
    return shape, mesh_shape, tuple(placements)


@SETTINGS
@given(layouts())
def test_pieces_are_what_index_arithmetic_says(case: tuple) -> None:
    shape, mesh_shape, placements = case
    lay = mesh_layout(shape, mesh(mesh_shape, tuple(range(math.prod(mesh_shape)))), placements)
    for coord in product(*(range(n) for n in mesh_shape)):
        want = oracle(shape, mesh_shape, coord, placements)
        assert lay.local_shape(coord) == tuple(len(i) for i in want)
        got = [np.zeros(len(i), dtype=bool) for i in want]
        for region, local in lay.pieces(coord):
            for d in range(len(shape)):  # the piece's global indices sit at its local slice, in order
                np.testing.assert_array_equal(want[d][local[d]], np.arange(region.offsets[d], region.ends[d]))
                got[d][local[d]] = True
        if lay.pieces(coord):
            assert all(g.all() for g in got)


@SETTINGS
@given(layouts())
def test_every_piece_has_one_writer_among_its_holders(case: tuple) -> None:
    shape, mesh_shape, placements = case
    ranks = tuple(np.random.default_rng(len(shape)).permutation(math.prod(mesh_shape)).tolist())
    lay = mesh_layout(shape, mesh(mesh_shape, ranks), placements)
    held: dict[Region, set[int]] = {}
    for coord in product(*(range(n) for n in mesh_shape)):
        for region, _ in lay.pieces(coord):
            held.setdefault(region, set()).add(lay.mesh.rank_at(coord))
    assert check_tiling(shape, list(held)) is None
    assert lay.n_pieces == len(held)
    for seed in (0, 7, 12345):
        written: dict[Region, list[int]] = {}
        for rank in set(ranks):
            for region, _ in lay.writes(rank, seed):
                written.setdefault(region, []).append(rank)
        assert set(written) == set(held)
        for region, writers in written.items():
            assert len(writers) == 1 and writers[0] in held[region]


def test_split_runs_examples() -> None:
    assert split_runs([(0, 10)], ("S", 0), 4, 3) == [(9, 1)]
    assert split_runs([(0, 6)], ("S", 0), 4, 3) == []  # torch.chunk makes 3 chunks of 2
    assert split_runs([(0, 8)], ("SS", 0, 2), 2, 1) == [(2, 2), (6, 2)]
    assert split_runs([(0, 2), (10, 2)], ("S", 0), 2, 1) == [(10, 2)]


def _objects(shape: tuple, segments: tuple[Segment, ...]) -> int:
    return sum(math.prod(-(-n // c) for n, c in zip(s.shape, s.chunk)) for s in segments)


@SETTINGS
@given(tilings())
def test_every_chunk_lies_in_exactly_one_region(tiling: tuple) -> None:
    shape, regions = tiling
    nonempty = [r for r in regions if not r.is_empty()]
    segments = chunk_layout(shape, region_boundaries(shape, nonempty), len(nonempty))
    assert check_tiling(shape, [s.region for s in segments]) is None
    for s in segments:
        assert all(c >= 1 for c in s.chunk)
        for idx in chunk_indices(s.shape, s.chunk):
            box = chunk_box(idx, s.chunk, s.shape)
            box = Region(tuple(o + b for o, b in zip(s.offset, box.offsets)), box.sizes)
            holders = [r for r in nonempty if intersect(box, r) is not None]
            assert len(holders) == 1 and intersect(box, holders[0]) == box, (idx, box, holders)


@SETTINGS
@given(tilings())
def test_one_segment_is_the_gcd_grid(tiling: tuple) -> None:
    """A single segment's chunk is, per dimension, the largest size every interior boundary is a multiple of."""
    shape, regions = tiling
    nonempty = [r for r in regions if not r.is_empty()]
    segments = chunk_layout(shape, region_boundaries(shape, nonempty), len(nonempty))
    if len(segments) == 1:
        for d, n in enumerate(shape):
            interior = {b for r in nonempty for b in (r.offsets[d], r.ends[d]) if 0 < b < n}
            best = max([s for s in range(1, n + 1) if all(b % s == 0 for b in interior)] or [1])
            assert segments[0].chunk[d] == best, (d, interior)


@SETTINGS
@given(layouts())
def test_boundaries_are_every_run_end_of_every_position(case: tuple) -> None:
    """A layout's boundaries (worked out split by split of each dimension's chain, not position by
    position) are 0, the size and every start and end of a run some mesh position holds (the oracle)."""
    shape, mesh_shape, placements = case
    lay = mesh_layout(shape, mesh(mesh_shape, tuple(range(math.prod(mesh_shape)))), placements)
    for d, n in enumerate(shape):
        cuts = {0, n}
        for coord in product(*(range(m) for m in mesh_shape)):
            held = oracle(shape, mesh_shape, coord, placements)[d]
            breaks = np.flatnonzero(np.diff(held) != 1) + 1  # where a run of consecutive indices ends
            for run in np.split(held, breaks) if held.size else []:
                cuts.update((int(run[0]), int(run[-1]) + 1))
        assert lay.boundaries[d] == tuple(sorted(cuts)), (d, lay.boundaries[d], sorted(cuts))


@SETTINGS
@given(layouts())
def test_stored_objects_at_most_two_per_distinct_shard(case: tuple) -> None:
    shape, mesh_shape, placements = case
    lay = mesh_layout(shape, mesh(mesh_shape, tuple(range(math.prod(mesh_shape)))), placements)
    if math.prod(shape) == 0:
        return
    segments = chunk_layout(shape, lay.boundaries, lay.n_pieces)
    assert _objects(shape, segments) <= 2 * lay.n_pieces
    assert check_tiling(shape, [s.region for s in segments]) is None


@pytest.mark.parametrize("shape, mesh_shape, placements, pieces", [
    ((50257, 768), (2, 4), (("S", 0), ("S", 0)), 8),          # nested uneven Shard(0), Shard(0)
    ((50257, 768), (2, 4), (("SS", 0, 4), ("S", 0)), 8),      # FSDP2 + TP on one non-divisible dimension
    ((1000, 77), (3, 5), (("S", 0), ("S", 1)), 15),
    ((4097, 10), (8,), (("S", 0),), 8),                        # torch.chunk: the last shard short
])
def test_uneven_nested_shards_stay_near_one_object_each(shape, mesh_shape, placements, pieces) -> None:
    lay = mesh_layout(shape, mesh(mesh_shape, tuple(range(math.prod(mesh_shape)))), placements)
    assert lay.n_pieces == pieces
    segments = chunk_layout(shape, lay.boundaries, lay.n_pieces)
    objects = _objects(shape, segments)
    assert objects <= 2 * pieces, (segments, objects)
    assert check_tiling(shape, [s.region for s in segments]) is None


def test_regular_grid_is_one_segment_of_the_shards() -> None:
    lay = mesh_layout((3328, 3328), mesh((4,), (0, 1, 2, 3)), (("S", 0),))
    assert chunk_layout(lay.shape, lay.boundaries, lay.n_pieces) == (Segment((0, 0), (3328, 3328), (832, 3328)),)
