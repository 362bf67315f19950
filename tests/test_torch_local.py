"""PyTorch adapter in one process: placement maths, dtypes, modules, optimizers, RNG, DCP layer."""

from __future__ import annotations

import datetime
import itertools
import math
import os
import random
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

import xckpt  # noqa: E402
from xckpt.errors import UnsupportedError  # noqa: E402
from xckpt.format.regions import check_tiling  # noqa: E402
from xckpt_torch import XckptLoadPlanner, XckptStorageReader, XckptStorageWriter, bind  # noqa: E402
from xckpt.engine.layout import mesh as engine_mesh, mesh_layout  # noqa: E402
from xckpt_torch.dtensor import placement  # noqa: E402
from xckpt_torch.tensors import _BY_NAME  # noqa: E402

import torch_workers as tw  # noqa: E402

pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")


def _layouts():
    """(mesh shape, placements) pairs: Shard on any dim, Replicate, several mesh dims on one dim, strided."""
    singles = [Replicate(), Shard(0), Shard(1)]
    for mesh in [(4,), (3,), (2, 2), (2, 3), (2, 2, 2)]:
        for combo in itertools.product(singles, repeat=len(mesh)):
            yield mesh, list(combo)
    yield (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]
    yield (2, 3), [_StridedShard(1, split_factor=3), Shard(1)]
    yield (2, 2), [Shard(0), _StridedShard(0, split_factor=2)]
    yield (2, 2, 2), [_StridedShard(0, split_factor=4), Shard(0), Shard(0)]


SHAPES = [(8, 12), (7, 5), (3, 2), (1, 9), (16, 6), (0, 4)]


def _layout(shape: tuple, mesh: tuple, places: list):
    """The engine's layout of a DTensor of ``shape`` on a mesh of ranks 0..n-1 with ``places``."""
    return mesh_layout(tuple(shape), engine_mesh(tuple(mesh), tuple(range(math.prod(mesh)))),
                       tuple(placement(p) for p in places))


def test_pieces_agree_with_torch_local_shape_and_offset():
    checked = 0
    for mesh, places in _layouts():
        for shape in SHAPES:
            lay = _layout(shape, mesh, places)
            for coord in itertools.product(*(range(n) for n in mesh)):
                pieces = lay.pieces(coord)
                local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), places)
                assert lay.local_shape(coord) == tuple(local), (mesh, places, shape, coord, local)
                if pieces:  # the local tensor is exactly the pieces' slices, in order
                    got = tuple(max(sl[d].stop for _, sl in pieces) for d in range(len(shape)))
                    assert got == tuple(local), (mesh, places, shape, coord, got, local)
                    # torch reports the offset of the first local element
                    assert pieces[0][0].offsets == tuple(offset), (mesh, places, shape, coord)
                checked += 1
    assert checked > 1000


def test_pieces_of_all_ranks_tile_the_array_and_replicas_repeat():
    for mesh, places in _layouts():
        replicas = math.prod(n for n, p in zip(mesh, places) if isinstance(p, Replicate))
        for shape in SHAPES:
            held: dict = {}
            lay = _layout(shape, mesh, places)
            for coord in itertools.product(*(range(n) for n in mesh)):
                for region, _ in lay.pieces(coord):
                    held[region] = held.get(region, 0) + 1
            assert check_tiling(shape, list(held)) is None, (mesh, places, shape)
            assert set(held.values()) <= {replicas}, (mesh, places, shape, held)


def test_strided_last_placement_gives_several_boxes():
    pieces = _layout((8, 3), (2, 2), [Shard(0), _StridedShard(0, split_factor=2)]).pieces((0, 0))
    assert [(r.offsets, r.sizes) for r, _ in pieces] == [((0, 0), (1, 3)), ((2, 0), (1, 3))]
    assert [sl[0] for _, sl in pieces] == [slice(0, 1), slice(1, 2)]


def _sample(name: str) -> torch.Tensor:
    base = (np.arange(24, dtype=np.float64).reshape(4, 6) - 8) / 4
    if name == "bool":
        return torch.from_numpy(base > 0)
    if name.startswith("uint"):
        return torch.from_numpy((np.arange(24).reshape(4, 6) * 3 + 2**(np.dtype(name).itemsize * 8 - 3))
                                .astype(name))
    if name in ("bfloat16",) or name.startswith("float8"):
        return torch.from_numpy(np.abs(base).astype(np.float32)).to(_BY_NAME[name])
    if name.startswith("complex"):
        return torch.from_numpy((base + 1j * base[::-1]).astype(name))
    return torch.from_numpy(base.astype(name) if "float" in name else (base * 4).astype(name))


@pytest.mark.parametrize("name", sorted(_BY_NAME))
def test_every_torch_dtype_round_trips(tmp_path, name):
    t = _sample(name)
    xckpt.save({"t": t, "s": t[1, 2].clone()}, tmp_path / "c")
    raw = xckpt.load(tmp_path / "c")["t"]
    assert raw.dtype == xckpt.format.dtypes.numpy_dtype(name)
    want = xckpt.torch.to_host(t)
    np.testing.assert_array_equal(raw.view(np.uint8), want.view(np.uint8))
    into = {"t": torch.zeros(4, 6, dtype=t.dtype), "s": torch.zeros((), dtype=t.dtype)}
    out = xckpt.load(tmp_path / "c", like=into)
    assert out["t"] is into["t"] and out["t"].dtype == t.dtype
    bits = lambda x: xckpt.torch.to_host(x).reshape(-1).view(np.uint8)  # noqa: E731 - bitwise, NaN-safe
    np.testing.assert_array_equal(bits(into["t"]), bits(t))
    np.testing.assert_array_equal(bits(into["s"]), bits(t[1, 2]))
    assert xckpt.validate(tmp_path / "c", deep=True).ok


def test_module_optimizer_scheduler_and_rng_in_one_process(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 3)).pow(2).sum().backward()
        opt.step()
        sched.step()
    random.seed(3)
    np.random.seed(4)
    # the optimizer comes before its model: its parameters are named through the live model
    xckpt.save({"optim": opt, "model": model, "sched": sched, "step": 3, "rng": xckpt.torch.rng_state()},
               tmp_path / "c")
    after = (torch.rand(3), random.random(), np.random.rand())
    stored = xckpt.load(tmp_path / "c")
    assert sorted(stored["optim"]["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert stored["optim"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.7)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 5)
    bind(opt2, model2)
    out = xckpt.load(tmp_path / "c", like={"optim": opt2, "model": model2, "sched": sched2, "step": 0,
                                           "rng": xckpt.torch.rng_state()})
    assert out["model"] is model2 and out["optim"] is opt2 and out["step"] == 3
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=k)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for i in s1["state"]:
        for k in s1["state"][i]:
            np.testing.assert_array_equal(s1["state"][i][k].numpy(), s2["state"][i][k].numpy())
    assert s2["param_groups"][0]["lr"] == s1["param_groups"][0]["lr"] and sched2.state_dict() == sched.state_dict()
    again = (torch.rand(3), random.random(), np.random.rand())
    np.testing.assert_array_equal(after[0].numpy(), again[0].numpy())
    assert after[1:] == again[1:]
    assert xckpt.validate(tmp_path / "c", deep=True).ok


def test_load_into_meta_tensor_makes_a_new_tensor(tmp_path):
    xckpt.save({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "c")
    out = xckpt.load(tmp_path / "c", like={"w": torch.empty(2, 3, device="meta")})
    assert out["w"].device.type == "cpu"
    np.testing.assert_array_equal(out["w"].numpy(), np.arange(6.0).reshape(2, 3))
    assert xckpt.validate(tmp_path / "c", deep=True).ok
    with pytest.raises(UnsupportedError, match="meta"):
        xckpt.save({"w": torch.empty(2, device="meta")}, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_dcp_layer_in_one_process(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    bf = torch.arange(12.0).reshape(6, 2).bfloat16()
    state = {"model": msd, "optim": osd, "step": 3, "bf": bf, "tag": "x", "pair": (1, "two"),
             "f8": torch.tensor([0.5, 1.0, -2.0]).to(torch.float8_e4m3fn)}
    dcp.save(state, storage_writer=XckptStorageWriter(tmp_path / "c"), no_dist=True)
    files = [f for _, _, fs in os.walk(tmp_path / "c") for f in fs]
    assert not any(f.endswith(".distcp") or f == ".metadata" for f in files)
    assert xckpt.validate(tmp_path / "c", deep=True).ok
    stored = xckpt.load(tmp_path / "c")
    assert (stored["step"], stored["tag"], stored["pair"]) == (3, "x", (1, "two"))
    np.testing.assert_array_equal(stored["bf"], np.arange(12.0).reshape(6, 2).astype(ml_dtypes.bfloat16))

    for planner in (None, XckptLoadPlanner()):
        torch.manual_seed(5)
        m2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        o2 = torch.optim.AdamW(m2.parameters(), lr=0.9)
        msd2, osd2 = get_state_dict(m2, o2)
        target = {"model": msd2, "optim": osd2, "step": 0, "bf": torch.zeros(6, 2), "tag": "", "pair": None,
                  "f8": torch.zeros(3, dtype=torch.float8_e4m3fn)}
        dcp.load(target, storage_reader=XckptStorageReader(tmp_path / "c"), planner=planner, no_dist=True)
        for k in msd:
            np.testing.assert_array_equal(msd[k].numpy(), msd2[k].numpy())
        for k in osd["state"]:
            for n in osd["state"][k]:
                np.testing.assert_array_equal(osd["state"][k][n].numpy(), osd2["state"][k][n].numpy())
        assert osd2["param_groups"][0]["lr"] == 0.1 and osd2["param_groups"][0]["betas"] == (0.9, 0.999)
        assert (target["step"], target["tag"], target["pair"]) == (3, "x", (1, "two"))
        np.testing.assert_array_equal(target["bf"].numpy(), np.arange(12.0).reshape(6, 2))
        assert torch.equal(target["f8"].view(torch.uint8), state["f8"].view(torch.uint8))

    # a checkpoint written by xckpt.save reads through DCP too (lists of values come back whole)
    xckpt.save({"model": model, "optim": opt, "n": 4}, tmp_path / "native")
    torch.manual_seed(6)
    m3 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    o3 = torch.optim.AdamW(m3.parameters(), lr=0.3)
    msd3, osd3 = get_state_dict(m3, o3)
    t3 = {"model": msd3, "optim": osd3, "n": 0}
    dcp.load(t3, storage_reader=XckptStorageReader(tmp_path / "native"), no_dist=True)
    assert t3["n"] == 4 and osd3["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    for k in msd:
        np.testing.assert_array_equal(msd[k].numpy(), msd3[k].numpy())
    assert xckpt.validate(tmp_path / "native", deep=True).ok


def test_dcp_reads_stored_arrays_into_numpy_targets_with_the_xckpt_planner(tmp_path):
    """A checkpoint xckpt.save wrote from numpy (its arrays are tensors to DCP) loads through DCP into numpy
    targets with XckptLoadPlanner: each replaced by the stored array (stored dtype, bfloat16 too, a numpy
    scalar as a scalar, nested ones as well) while tensors load in place; a target of another shape is a
    ShapeError naming its key and the checkpoint, before anything is read."""
    import ml_dtypes
    src = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "t": torch.arange(3.0), "n": 5,
           "s": np.float32(2.5), "d": np.float64(-1.25), "bf": np.arange(4).astype(ml_dtypes.bfloat16),
           "nested": {"x": np.arange(3, dtype=np.int64), "w": torch.ones(2, 2)}}
    xckpt.save(src, tmp_path / "np")
    t_in_place = torch.zeros(3)
    target = {"a": np.zeros((2, 3), np.float32), "t": t_in_place, "n": 0, "s": np.float32(0), "d": np.float64(0),
              "bf": np.zeros(4, ml_dtypes.bfloat16), "nested": {"x": np.zeros(3, np.int64), "w": torch.zeros(2, 2)}}
    dcp.load(target, storage_reader=XckptStorageReader(tmp_path / "np"), planner=XckptLoadPlanner(), no_dist=True)
    for key in ("a", "bf"):
        assert isinstance(target[key], np.ndarray) and target[key].dtype == src[key].dtype
        np.testing.assert_array_equal(target[key], src[key])
    assert isinstance(target["nested"]["x"], np.ndarray)
    np.testing.assert_array_equal(target["nested"]["x"], src["nested"]["x"])
    assert type(target["s"]) is np.float32 and target["s"] == np.float32(2.5)
    assert type(target["d"]) is np.float64 and target["d"] == -1.25
    assert target["t"] is t_in_place and torch.equal(t_in_place, src["t"]) and target["n"] == 5
    assert torch.equal(target["nested"]["w"], torch.ones(2, 2))
    from torch.distributed.checkpoint.api import CheckpointException  # DCP's way to raise a rank's error
    with pytest.raises(CheckpointException) as info:
        dcp.load({"a": np.zeros((3, 2), np.float32)}, storage_reader=XckptStorageReader(tmp_path / "np"),
                 planner=XckptLoadPlanner(), no_dist=True)
    said = str(info.value)
    assert "[shape.invalid]" in said and "leaf 'a'" in said and "[2, 3]" in said and f"file {tmp_path / 'np'}" in said


def test_a_dcp_directory_is_read_in_place(tmp_path):
    """xckpt.load, inspect and in-place loads read a directory DCP saved (collectively, and without collectives:
    rank 0's __0.metadata), element by element: a model and its AdamW state, a step, numpy's RNG state (a tuple
    DCP pickles whole), into numpy and into preallocated tensors (a region of one too), through a mapping
    (a transposed view), as the conversion gives them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from xckpt.convert import convert
    from xckpt.format.regions import Region
    from xckpt.host import ReadSpec
    from xckpt.sources.detect import open_checkpoint

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 7, "rng": np.random.get_state()}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "solo").mkdir()
    dcp.save(state, checkpoint_id=str(tmp_path / "solo"), no_dist=True, use_collectives=False)
    assert (tmp_path / "solo" / "__0.metadata").is_file() and not (tmp_path / "solo" / ".metadata").exists()
    for name in ("dcp", "solo"):
        info = xckpt.inspect(tmp_path / name)
        assert info["format"] == "dcp" and len(info["leaves"]) == len(xckpt.inspect(tmp_path / "dcp")["leaves"])
        back = xckpt.load(tmp_path / name)
        for k, v in msd.items():
            np.testing.assert_array_equal(back["model"][k], v.numpy())
        for pid, st in osd["state"].items():
            for n, t in st.items():
                np.testing.assert_array_equal(np.asarray(back["optim"]["state"][pid][n]), t.numpy())
        assert back["step"] == 7 and back["optim"]["param_groups"][0]["lr"] == osd["param_groups"][0]["lr"]
        rng = back["rng"]
        assert rng[0] == "MT19937" and rng[1].dtype == np.uint32 and rng[2:] == state["rng"][2:]
        np.testing.assert_array_equal(rng[1], state["rng"][1])
    w = torch.full((4, 3), -1.0)
    part = xckpt.load(tmp_path / "dcp", {"model": {"0.weight": w, "1.bias": ReadSpec(Region((1,), (2,)))}},
                      strict=False)
    assert part["model"]["0.weight"] is w and torch.equal(w, msd["0.weight"])
    np.testing.assert_array_equal(part["model"]["1.bias"], msd["1.bias"].numpy()[1:3])
    from xckpt import mapping as M
    mapped = xckpt.load(tmp_path / "dcp", mapping=M.Mapping(M.rename("model/0.weight", "params/kernel",
                                                                      M.transpose(1, 0))))  # through a view
    np.testing.assert_array_equal(mapped["params"]["kernel"], msd["0.weight"].numpy().T)
    for deep in (False, True):  # the validator checks it with the same reader, and reads every array back
        report = xckpt.validate(tmp_path / "dcp", deep=deep)
        opened = open_checkpoint(tmp_path / "dcp")
        arrays = list(opened.manifest.arrays())
        opened.close()
        assert report.ok and report.format == "dcp" and report.arrays == len(arrays) >= 17, report
        assert report.bytes_checked == (sum(e.nbytes for e in arrays) if deep else 0), report
    convert(str(tmp_path / "dcp"), str(tmp_path / "x"), source="dcp")  # the same as a conversion gives
    converted = xckpt.load(tmp_path / "x")
    np.testing.assert_array_equal(converted["model"]["0.weight"], xckpt.load(tmp_path / "dcp")["model"]["0.weight"])


def test_coordinator_and_unsupported_placement_in_a_one_rank_group(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from xckpt_torch import TorchCoordinator
    store = dist.TCPStore("127.0.0.1", tw.free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        coord = xckpt.registry.default_coordinator()
        assert isinstance(coord, TorchCoordinator)
        assert coord.all_gather_bytes(b"") == [b""] and coord.all_gather_bytes(b"\x00a") == [b"\x00a"]
        assert coord.broadcast_bytes(b"hello") == b"hello"
        mesh = init_device_mesh("cpu", (1,))
        partial = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])
        with pytest.raises(UnsupportedError, match="Partial") as info:
            xckpt.save({"p": partial}, tmp_path / "c")
        assert info.value.leaf == "p"
        assert not (tmp_path / "c").exists()
        d = DTensor.from_local(torch.arange(6.0).reshape(2, 3), mesh, [Shard(1)])
        man = xckpt.save({"d": d}, tmp_path / "ok")
        assert man.leaves[0].sharding["placements"] == ["Shard(dim=1)"]
        np.testing.assert_array_equal(xckpt.load(tmp_path / "ok")["d"], np.arange(6.0).reshape(2, 3))
        assert xckpt.validate(tmp_path / "ok", deep=True).ok
    finally:
        dist.destroy_process_group()


def test_dtensors_laid_out_alike_keep_their_own_data_and_checks(tmp_path):
    """The adapter works out a layout once per (mesh, placements, shape): DTensors that share one, in
    one save and in the next (new objects, a parameter among them), each save their own data, and a
    local tensor that disagrees with its layout, or one on the meta device, is refused every time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    store = dist.TCPStore("127.0.0.1", tw.free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def tree(base: float) -> dict:
            return {f"w{i}": DTensor.from_local(torch.arange(12.0).reshape(3, 4) + base + 100 * i, mesh, [Shard(1)])
                    for i in range(3)} | {"p": torch.nn.Parameter(DTensor.from_local(torch.full((3, 4), base), mesh,
                                                                                     [Shard(1)]))}

        for n, base in enumerate([0.0, 0.5]):
            xckpt.save(tree(base), tmp_path / f"c{n}")
            got = xckpt.load(tmp_path / f"c{n}")
            for i in range(3):
                np.testing.assert_array_equal(got[f"w{i}"], np.arange(12.0).reshape(3, 4) + base + 100 * i)
            np.testing.assert_array_equal(got["p"], np.full((3, 4), base))
        for attempt in range(2):
            short = DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)], run_check=False, shape=torch.Size((3, 4)),
                                       stride=(4, 1))
            with pytest.raises(UnsupportedError) as info:
                xckpt.save({"short": short}, tmp_path / f"bad{attempt}")
            assert info.value.code == "dtensor.local_shape" and "(2, 4)" in str(info.value), info.value
            assert info.value.leaf == "short", info.value
            meta = DTensor.from_local(torch.empty(3, 4, device="meta"), mesh, [Shard(1)])
            with pytest.raises(UnsupportedError) as info:
                xckpt.save({"meta": meta}, tmp_path / f"meta{attempt}")
            assert info.value.code == "tensor.meta" and info.value.leaf == "meta", info.value
            assert not (tmp_path / f"bad{attempt}").exists() and not (tmp_path / f"meta{attempt}").exists()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("staging", [xckpt.load.__kwdefaults__["max_staging_bytes"], 0])
def test_failed_load_leaves_the_model_untouched(tmp_path_factory, staging):
    """A corrupt chunk in the last parameter: the load raises and no parameter was changed, whether the
    load reads into staging memory first (a small model) or straight into the parameters (``0``: as a
    model larger than ``max_staging_bytes``, whose small objects are read and checked whole first)."""
    tmp_path = tmp_path_factory.mktemp("corrupt")  # outside tmp_path: it is invalid on purpose
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    xckpt.save({"model": model}, tmp_path / "c")
    shard = tmp_path / "c" / "model.1.bias" / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.load(tmp_path / "c", like={"model": fresh}, max_staging_bytes=staging)
    assert info.value.code == "chunk.crc32c" and info.value.leaf == "model/1.bias"
    for k, v in fresh.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k].numpy(), err_msg=k)


def test_saving_tensors_does_not_import_dcp(tmp_path):
    """The adapter imports ``torch.distributed.checkpoint`` (a tenth of a second or more) only where a
    module, an optimizer or a DCP class is used: a save and load of tensors never pays for it. The adapter
    itself loads with ``import xckpt`` where torch is imported already."""
    import subprocess
    import sys

    code = (
        "import sys, torch, xckpt\n"
        "assert 'xckpt_torch' in sys.modules  # loaded with xckpt (torch came first), not in the first save\n"
        "t = {'w': torch.arange(6.0).reshape(2, 3), 'step': torch.tensor(3)}\n"
        f"xckpt.save(t, {str(tmp_path / 'c')!r})\n"
        f"got = xckpt.load({str(tmp_path / 'c')!r}, like={{'w': torch.zeros(2, 3), 'step': torch.tensor(0)}})\n"
        "assert torch.equal(got['w'], t['w']) and int(got['step']) == 3, got\n"
        "assert 'xckpt_torch' in sys.modules\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n"
        "import xckpt_torch\n"
        "print(xckpt_torch.XckptStorageWriter.__module__, xckpt_torch.dcp_to_xckpt.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == ["[]", "xckpt_torch.dcp_writer xckpt_torch.dcp_convert"], out.stdout
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        import xckpt_torch

        xckpt_torch.nothing  # noqa: B018


def test_stored_values_fill_tensor_targets_in_place_once_the_load_succeeds(tmp_path_factory):
    """A Python value (an optimizer's step, a learning rate) loads into a CPU tensor target in place;
    a target of another shape is refused, naming the leaf, and a failed load leaves it untouched."""
    tmp_path = tmp_path_factory.mktemp("values")  # damaged below: not one for every_checkpoint_validates
    xckpt.save({"step": 5, "lr": 0.25, "betas": xckpt.Value([0.9, 0.999]), "w": np.arange(4.0)}, tmp_path / "c")
    step, lr, betas = torch.tensor(0), torch.tensor(0.0, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    out = xckpt.load(tmp_path / "c", like={"step": step, "lr": lr, "betas": betas}, partial=True)
    assert out["step"] is step and out["lr"] is lr and out["betas"] is betas
    assert (step.item(), lr.item(), betas.tolist()) == (5, 0.25, [0.9, 0.999])
    with pytest.raises(xckpt.KeyMismatchError) as e:
        xckpt.load(tmp_path / "c", like={"step": torch.zeros(3)}, partial=True)
    assert e.value.leaf == "step" and "shape []" in str(e.value)
    # a value target is written only after every read succeeded: a missing chunk leaves it as it was
    for f in (tmp_path / "c").rglob("*"):
        if f.is_file() and f.parent.name == "c" and f.parent.parent.name == "w":
            f.unlink()
    again = torch.tensor(-1)
    with pytest.raises(xckpt.XckptError):
        xckpt.load(tmp_path / "c", like={"step": again, "w": torch.zeros(4, dtype=torch.float64)}, partial=True)
    assert again.item() == -1


def test_odd_tensor_targets(tmp_path):
    """Targets whose memory a load cannot write as a plain array: an expanded tensor is refused before
    anything is written; tensors with a lazy conjugate or negative bit are filled through torch."""
    xckpt.save({"x": np.arange(6, dtype=np.float32).reshape(3, 2), "y": np.ones(2, np.float32),
                "c": np.array([1 + 2j, 3 - 4j], np.complex64)}, tmp_path / "c")
    y = torch.zeros(2)
    with pytest.raises(xckpt.XckptError) as e:
        xckpt.load(tmp_path / "c", like={"x": torch.zeros(2).expand(3, 2), "y": y}, partial=True)
    assert e.value.code == "shape.mismatch" and e.value.leaf == "x" and "share memory" in str(e.value)
    assert (y == 0).all()
    base = torch.zeros(2, dtype=torch.complex64)
    out = xckpt.load(tmp_path / "c", like={"c": base.conj()}, partial=True)
    np.testing.assert_array_equal(out["c"].resolve_conj().numpy(), np.array([1 + 2j, 3 - 4j], np.complex64))
    np.testing.assert_array_equal(base.numpy(), np.array([1 - 2j, 3 + 4j], np.complex64))  # through the view
    neg_base = torch.zeros(2, dtype=torch.complex64)
    neg = neg_base.conj().imag  # float32 with the negative bit
    assert neg.is_neg()
    out = xckpt.load(tmp_path / "c", like={"y": neg}, partial=True)
    np.testing.assert_array_equal(out["y"].resolve_neg().numpy(), np.ones(2, np.float32))
    np.testing.assert_array_equal(neg_base.numpy().imag, -np.ones(2, np.float32))
    with pytest.raises(xckpt.KeyMismatchError) as e:  # a complex array into a real target would drop its imaginary part
        xckpt.load(tmp_path / "c", like={"c": torch.zeros(2)}, partial=True)
    assert e.value.leaf == "c" and "complex64" in str(e.value)
    # an expanded tensor that torch fills (a lazy conjugate) is refused too, before any other target is written
    with pytest.raises(xckpt.XckptError) as e:
        xckpt.load(tmp_path / "c", like={"y": y, "c": torch.zeros(1, dtype=torch.complex64).expand(2).conj()},
                   partial=True)
    assert (e.value.code, e.value.leaf, e.value.file) == ("shape.mismatch", "c", str(tmp_path / "c"))
    assert (y == 0).all()


def test_impossible_casts_and_scalar_targets_are_refused_by_leaf(tmp_path):
    """A cast ml_dtypes cannot make is refused before any target is written; a stored NaN cannot become an int."""
    xckpt.save({"a": np.ones(4, np.float32), "b": np.ones(4, ml_dtypes.float8_e4m3fn), "n": np.float64("nan"),
                "z": np.complex128(1j)}, tmp_path / "c")
    a = torch.zeros(4)
    with pytest.raises(xckpt.KeyMismatchError) as e:
        xckpt.load(tmp_path / "c", like={"a": a, "b": torch.zeros(4, dtype=torch.float8_e8m0fnu)}, partial=True)
    assert e.value.leaf == "b" and "float8_e8m0fnu" in str(e.value)
    assert (a == 0).all()
    assert e.value.file == str(tmp_path / "c")
    for (like, leaf), staging in itertools.product((({"n": 0}, "n"), ({"z": 0.0}, "z")), (None, 0)):
        # refused by the read step, before an in-place target is written (also one written unstaged)
        with pytest.raises(xckpt.KeyMismatchError) as e:
            xckpt.load(tmp_path / "c", like={"a": a, **like}, partial=True,
                       **({} if staging is None else {"max_staging_bytes": staging}))
        assert (e.value.leaf, e.value.file) == (leaf, str(tmp_path / "c"))
        assert (a == 0).all()
    assert xckpt.load(tmp_path / "c", like={"z": 0j}, partial=True)["z"] == 1j


@pytest.mark.parametrize("stored, dtype", [(None, torch.float32), (None, torch.bool), ("1.5", torch.float64),
                                           ("abc", torch.bool), (b"7", torch.int64), (1 + 2j, torch.float64),
                                           (xckpt.Value([1, None]), torch.float64)])
def test_stored_values_that_are_no_numbers_never_fill_a_tensor(tmp_path, stored, dtype):
    """numpy would make None a NaN, '1.5' a 1.5 and 'abc' a True: a stored value of another kind than a number
    is tree.key_mismatch naming its leaf and the checkpoint, and the target stays as it was."""
    xckpt.save({"v": stored}, tmp_path / "c")
    target = torch.zeros((2,) if isinstance(stored, xckpt.Value) else (), dtype=dtype)
    with pytest.raises(xckpt.KeyMismatchError) as e:
        xckpt.load(tmp_path / "c", like={"v": target})
    assert (e.value.code, e.value.leaf, e.value.file) == ("tree.key_mismatch", "v", str(tmp_path / "c"))
    assert not target.any()


def test_stored_numbers_of_any_size_fill_a_tensor_they_fit(tmp_path):
    """A Python int past 64 bits is a number: it fills a float target; an int64 target it cannot fit is
    tree.key_mismatch naming the leaf."""
    xckpt.save({"big": 2**70, "pair": xckpt.Value([True, 2**65])}, tmp_path / "c")
    big, pair = torch.zeros((), dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    xckpt.load(tmp_path / "c", like={"big": big, "pair": pair})
    assert big.item() == float(2**70) and pair.tolist() == [1.0, float(2**65)]
    with pytest.raises(xckpt.KeyMismatchError) as e:
        xckpt.load(tmp_path / "c", like={"big": torch.zeros((), dtype=torch.int64)}, partial=True)
    assert e.value.leaf == "big"


# -- in-place targets that share memory across keys ----------------------------------------------------------------


def _two(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    a = np.arange(12, dtype=np.float32).reshape(3, 4) + 0.5
    a[0, 0] = np.nan  # compared bit for bit: a NaN is equal to itself
    b = -np.arange(12, dtype=np.float32).reshape(3, 4) - 100
    path = tmp_path / "two"
    xckpt.save({"a": a, "a2": a.copy(), "b": b}, path)
    return path, a, b


@pytest.mark.parametrize("staging", [None, 0])
def test_one_tensor_under_two_keys_with_different_stored_values_is_refused(tmp_path: Path, staging: int | None) -> None:
    """The last read won unseen: out['a'] held b's values and the load succeeded."""
    path, _, _ = _two(tmp_path)
    t = torch.full((3, 4), 7.0)
    kw = {} if staging is None else {"max_staging_bytes": staging}
    with pytest.raises(xckpt.KeyMismatchError) as info:
        xckpt.load(path, like={"a": t, "b": t}, partial=True, **kw)
    assert info.value.mismatched == ["a", "b"] and "tied" in info.value.message
    assert torch.equal(t, torch.full((3, 4), 7.0))  # nothing was read into it


@pytest.mark.parametrize("staging", [None, 0])
def test_one_tensor_under_two_keys_with_equal_stored_values_loads(tmp_path: Path, staging: int | None) -> None:
    """A tied weight (an embedding and its output layer) loads as torch's load_state_dict loads it."""
    path, a, _ = _two(tmp_path)
    t = torch.zeros(3, 4)
    kw = {} if staging is None else {"max_staging_bytes": staging}
    out = xckpt.load(path, like={"a": t, "a2": t}, partial=True, **kw)
    assert out["a"] is t and out["a2"] is t
    np.testing.assert_array_equal(t.numpy().view(np.uint32), a.view(np.uint32))


@pytest.mark.parametrize("staging", [None, 0])
def test_overlapping_views_of_one_tensor_as_targets_are_refused(tmp_path: Path, staging: int | None) -> None:
    """Rows 0-2 and 2-4 of one tensor: row 2 of 'a' came back holding b's row 0."""
    path, _, _ = _two(tmp_path)
    base = torch.full((6, 4), 7.0)
    kw = {} if staging is None else {"max_staging_bytes": staging}
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.load(path, like={"a": base[:3], "b": base[2:5]}, partial=True, **kw)
    assert info.value.code == "shape.mismatch" and "share part of their memory" in info.value.message
    assert torch.equal(base, torch.full((6, 4), 7.0))


@pytest.mark.parametrize("staging", [None, 0])
def test_side_by_side_views_of_one_tensor_as_targets_load(tmp_path: Path, staging: int | None) -> None:
    """Column halves of one fused tensor span the same bytes but share no element: each loads its own."""
    path, a, b = _two(tmp_path)
    fused = torch.zeros(3, 8)
    kw = {} if staging is None else {"max_staging_bytes": staging}
    xckpt.load(path, like={"a": fused[:, :4], "b": fused[:, 4:]}, partial=True, **kw)
    np.testing.assert_array_equal(fused[:, :4].numpy().view(np.uint32), a.view(np.uint32))
    np.testing.assert_array_equal(fused[:, 4:].numpy(), b)


def test_a_module_on_the_meta_device_is_refused_not_left_unloaded(tmp_path: Path) -> None:
    """The load returned normally and the module stayed on meta: torch's copy into it is a no-op."""
    torch.manual_seed(0)
    xckpt.save({"m": torch.nn.Linear(4, 3)}, tmp_path / "m")
    with torch.device("meta"):
        m = torch.nn.Linear(4, 3)
    other = torch.zeros(4, 3)
    xckpt.save({"m": torch.nn.Linear(4, 3), "t": torch.arange(12.0).reshape(4, 3)}, tmp_path / "mt")
    with pytest.raises(UnsupportedError) as info:
        xckpt.load(tmp_path / "mt", like={"t": other, "m": m})  # refused before anything is read
    assert info.value.code == "tensor.meta" and info.value.leaf == "m"
    assert m.weight.is_meta and torch.equal(other, torch.zeros(4, 3))
    m.to_empty(device="cpu")  # materialized, it loads
    xckpt.load(tmp_path / "m", like={"m": m})
    torch.manual_seed(0)
    assert torch.equal(m.weight, torch.nn.Linear(4, 3).weight)
