"""DTensor placements round-trip element by element, across meshes, world sizes and placements.

Four spawned gloo jobs in a chain (4, 3, 6 and 2 ranks, see ``placement_workers.py``): each saves
DTensors of every placement its meshes allow (Shard of each dimension, Replicate, nested Shard,
FSDP2 + TP's ``_StridedShard``) over uneven, 1-D, 3-D and 0-size shapes in float32, bfloat16 and
int64, and loads the checkpoints of the jobs before it in place into other meshes and placements.
The expected values come from torch alone (``distribute_tensor`` and ``full_tensor`` of a seeded
permutation). This process then loads every checkpoint whole, and into plain tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xckpt  # noqa: E402

import placement_workers as pw  # noqa: E402
import torch_workers as tw  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: The jobs in order: (world size, jobs whose checkpoints it loads, rotations of those, rotations of its own).
CHAIN = ((4, [], 0, 1), (3, [4], 1, 1), (6, [4, 3], 1, 1), (2, [4, 3, 6], 1, 1))


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list]]:
    """Run the four jobs one after another in one directory; what each rank of each reported."""
    wd = tmp_path_factory.mktemp("placements")
    results = {}
    for world, sources, turns, own in CHAIN:
        results[world] = tw.run_group(world, "placement_workers:job", wd, timeout=240, sources=sources,
                                      turns=turns, own_turns=own)
    return wd, results


def test_every_job_saved_and_loaded_every_leaf(chain):
    _, results = chain
    for world, sources, _, _ in CHAIN:
        for r in results[world]:
            assert r["saved"] == len(pw.cases(world))
            assert sorted(int(k) for k in r["loaded"]) == sorted([*sources, world])
            for src, n in r["loaded"].items():
                assert n >= len(pw.cases(int(src)))


def test_partial_placements_are_refused_with_their_code(chain):
    _, results = chain
    for r in results[4]:
        assert r["save"] is not None and r["load"] is not None, r
        assert r["save"]["type"] == "CollectiveError" and r["load"]["type"] == "CollectiveLoadError"
        for what in ("save", "load"):
            assert r[what]["code"] == "dtensor.placement", r[what]
            assert r[what]["rank_codes"] == ["dtensor.placement"] * 4, r[what]
            assert "Partial" in r[what]["text"]


def test_strided_locals_submeshes_and_meshes_of_other_rank_orders(chain):
    _, results = chain
    for r in results[4]:
        assert r["noncontiguous"] == 4 and r["submesh"] == 20 and r["transposed"] == 12
        assert r["permuted"] == len([c for c in pw.cases(4).values() if c[0] == "2x2"][::2])


def test_every_checkpoint_loads_whole_and_into_plain_tensors(chain):
    wd, _ = chain
    for world in pw.MESHES:
        got = xckpt.load(wd / f"ckpt{world}")["t"]
        assert sorted(got) == sorted(pw.cases(world))
        for name, arr in got.items():
            want = pw.full(name)
            assert arr.dtype == want.dtype and arr.shape == want.shape, name
            np.testing.assert_array_equal(arr, want, err_msg=name)
        like = {n: torch.full(pw.spec_of(n)[0], pw.SENTINEL, dtype=pw.torch_full(n).dtype) for n in got}
        xckpt.load(wd / f"ckpt{world}", like={"t": like})
        for n, t in like.items():
            assert torch.equal(t, pw.torch_full(n)), n
    assert xckpt.validate(wd / "ckpt4", deep=True).ok and xckpt.validate(wd / "ckpt6", deep=True).ok


def _torch_local(value: "torch.Tensor", mesh_shape: tuple[int, ...], places: tuple,
                 coord: tuple[int, ...]) -> "torch.Tensor":
    """What torch's own splitting (``distribute_tensor`` without a scatter) leaves at ``coord``: each mesh
    dimension in order splits the part left by the ones before it."""
    from torch.distributed.tensor import Replicate
    for m, p in enumerate(places):
        if not isinstance(p, Replicate):
            value = p._split_tensor(value, mesh_shape[m], with_padding=False)[0][coord[m]]
    return value


def test_layout_maths_agrees_with_torch_splitting_on_every_position():
    """The engine's layout (boxes and local slices) against torch's own splitting, on every position of
    1-D, 2-D and 3-D meshes, for every Shard/Replicate/_StridedShard combination over uneven and empty
    dimensions (no process group: the meshes are positions only)."""
    import itertools
    import math
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from xckpt.engine.layout import mesh, mesh_layout
    from xckpt_torch.dtensor import placement
    checked = 0
    for mesh_shape in ((3,), (4,), (2, 3), (3, 2), (2, 2, 2)):
        for shape in ((7,), (13,), (0,), (5, 4), (3, 0), (3, 1, 5))[:5 if len(mesh_shape) == 3 else 6]:
            options = [Replicate()] + [Shard(d) for d in range(len(shape))] + [
                _StridedShard(d, split_factor=f) for d in range(len(shape)) for f in (2, 3)]
            value = torch.arange(math.prod(shape)).reshape(shape)
            on = mesh(mesh_shape, tuple(range(math.prod(mesh_shape))))
            for places in itertools.product(options, repeat=len(mesh_shape)):
                lay = mesh_layout(shape, on, tuple(placement(p) for p in places))
                for coord in itertools.product(*(range(s) for s in mesh_shape)):
                    want = _torch_local(value, mesh_shape, places, coord)
                    got = torch.full(lay.local_shape(coord), -1, dtype=value.dtype)
                    for region, sl in lay.pieces(coord):
                        assert got[sl].eq(-1).all(), (places, coord)  # boxes do not overlap
                        got[sl] = value[region.slices()]
                    assert torch.equal(got, want), (mesh_shape, shape, places, coord, got, want)
                    checked += 1
    assert checked > 10000
