"""PyTorch adapter across jobs: save on 4 gloo ranks, load on 2, on 3 and in one process.

Three spawned groups in all (4, 2 and 3 ranks); each does several checks, made
inside the workers (see ``torch_workers.py``). The tests here look at what the
groups report and at the checkpoints they leave: loaded in this process without
any process group, converted, validated, and restored by real Orbax.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xckpt  # noqa: E402
from xckpt.cli import main as cli  # noqa: E402
from xckpt.errors import KeyMismatchError  # noqa: E402

import torch_workers as tw  # noqa: E402

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The 4-rank job: checkpoints in a directory, and what each rank reported."""
    wd = tmp_path_factory.mktemp("torch4")
    results = tw.run_group(4, "save4", wd, timeout=300)
    return wd, results


def test_replicas_written_once_and_bytes_balanced(saved):
    wd, results = saved
    per_rank = results[0]["bytes_per_rank"]
    assert per_rank == [r["bytes"] for r in results]
    unique = sum(tw.full(n).nbytes for n in tw.ARRAYS) + 15 * 8  # arrays + "plain" int64 (5, 3)
    rng_rows = sum(4 * int(np.prod(e["shape"][1:])) for e in xckpt.inspect(wd / "main")["leaves"]
                   if e["key"].startswith("rng/"))
    assert sum(per_rank) == unique + rng_rows  # every distinct byte written once, replicas not repeated
    writers = {leaf: [r for r, res in enumerate(results) if leaf in res["writes"]] for leaf in ("arrays/rep", "plain")}
    assert len(writers["arrays/rep"]) == 1 and len(writers["plain"]) == 1  # replicated on 4 ranks, 1 writer
    assert results[0]["regions"]["arrays/rep"] == 1 and results[0]["regions"]["arrays/half"] == 2
    assert results[0]["regions"]["arrays/w"] == 4 and results[0]["regions"]["rng/torch_cpu"] == 4
    assert max(per_rank) <= 1.6 * (sum(per_rank) / 4), per_rank  # spread over the ranks


def test_disagreeing_plain_tensors_fail_on_every_rank(saved):
    wd, results = saved
    for r in results:
        shape, dtype = r["disagree"]
        assert shape and "[3]" in shape and "[4]" in shape and "coord.mismatch" in shape
        assert dtype and "float32" in dtype and "float64" in dtype
    out = xckpt.load(wd / "partial")  # a key held by one rank only is saved from it
    np.testing.assert_array_equal(out["extra"], np.full((2,), 3.0, np.float32))
    np.testing.assert_array_equal(out["x"], np.zeros(4, np.float32))


def test_every_failing_rank_is_reported_on_every_rank(saved):
    _, results = saved
    for r in results:
        described, written = r["failures"]
        assert described["ranks"] == [1, 3] and "tree.unsupported_leaf" in described["text"]
        assert written["ranks"] == [0, 2] and "device 0 lost" in written["text"] and "device 2 lost" in written["text"]


def test_uneven_nested_shards_stay_one_object_each(saved):
    """(50257, 8) split unevenly twice over a (2, 2) mesh (nested Shard, and FSDP2 + TP's _StridedShard):
    four shards of 12565 or 12564 rows, whose common grid would be 50257 one-row objects."""
    wd, _ = saved
    m = xckpt.sources.detect.open_checkpoint(wd / "main").manifest
    for name in ("vocab", "vocab_strided"):
        e = m.by_key()[("arrays", name)]
        objects = [p for p in (wd / "main" / e.path).rglob("*") if p.is_file() and p.name != "zarr.json"]
        assert e.segments is not None and len(e.segments) == 2, e.segments
        assert len(objects) <= 2 * 4, objects
        np.testing.assert_array_equal(xckpt.load(wd / "main")["arrays"][name], tw.full(name))
    assert xckpt.validate(wd / "main", deep=True).ok


def test_pipeline_stages_save_one_checkpoint(saved):
    wd, _ = saved
    tree = xckpt.load(wd / "pipeline")
    assert sorted(tree["model"]) == ["embed", "head"] + [f"layers.{i}.w" for i in range(4)] and tree["step"] == 42
    for i in range(4):
        np.testing.assert_array_equal(tree["model"][f"layers.{i}.w"], tw.layer(i))
    np.testing.assert_array_equal(tree["model"]["head"], np.arange(10.0, dtype=np.float32).reshape(5, 2))
    with pytest.raises(KeyMismatchError):  # without partial=True a stage's part is a mismatch
        xckpt.load(wd / "pipeline", like={"model": {"layers.0.w": np.zeros((6, 4), np.float32)}})
    with pytest.raises(KeyMismatchError):  # with it, a leaf the checkpoint lacks still is
        xckpt.load(wd / "pipeline", like={"model": {"layers.9.w": np.zeros((6, 4), np.float32)}}, partial=True)


def test_save_async_stages_while_planning_only_on_the_agreed_plan(saved):
    wd, results = saved
    # round 0 has the structure of the pipeline save before it (reused); round 1 changes rank 3's
    # leaves (the other ranks' guesses are dropped); round 2 goes back (ranks 0-2 cached round 1's
    # plan, rank 3 the pipeline's: planned afresh again); round 3 repeats round 2
    assert [r["async_speculated"] for r in results] == [[True, False, False, True]] * 4
    for i in range(4):
        tree = xckpt.load(wd / f"async{i}")
        assert tree["step"] == 42 + i and ("extra" in tree) == (i == 1)
        for k in range(4):
            np.testing.assert_array_equal(tree["model"][f"layers.{k}.w"], tw.layer(k))
        if i == 1:
            np.testing.assert_array_equal(tree["extra"], np.full(64, 1.0, np.float32))
        assert xckpt.validate(wd / f"async{i}", deep=True).ok


def test_tp_fsdp_parameters_are_strided(saved):
    _, results = saved
    assert "_StridedShard" in results[0]["tp_placements"]["0.weight"]


def test_load_on_two_ranks(saved):
    """Also reads a sharded Hugging Face safetensors directory (written by huggingface_hub) into DTensors."""
    from huggingface_hub import save_torch_state_dict
    wd, results = saved
    (wd / "hf").mkdir()
    save_torch_state_dict({n: torch.from_numpy(tw.full(n)) for n in ("w", "uneven", "vocab")}, wd / "hf",
                          max_shard_size="100KB")
    assert (wd / "hf" / "model.safetensors.index.json").is_file()
    out = tw.run_group(2, "load2", wd, timeout=200, rand_after_save=[r["rand_after_save"] for r in results])
    assert out[0]["tp_tensors"] == 4 + 4 * 3  # parameters, and step, exp_avg, exp_avg_sq of each


@pytest.fixture(scope="module")
def loaded3(saved: tuple[Path, dict]) -> list[dict]:
    """The 3-rank job (it also leaves the 3-rank save ``from3``): what each rank reported."""
    wd, results = saved
    return tw.run_group(3, "load3", wd, timeout=200, ref_losses=results[0]["ref_losses"])


def test_load_on_three_ranks_and_resume_fsdp(saved, loaded3):
    wd, results = saved
    ref = results[0]["ref_losses"]
    out = loaded3
    np.testing.assert_allclose(out[0]["losses"], ref, rtol=1e-12, atol=0)
    assert [o["empty_here"] for o in out] == [False, False, True]
    assert [o["u_local"] for o in out] == [[1, 5], [1, 5], [0, 5]]
    assert out[0]["fsdp_tensors"] == out[0]["dcp_tensors"] == 4 + 4 * 3
    # the 3-rank save (with an empty shard) in one process
    got = xckpt.load(wd / "from3")
    np.testing.assert_array_equal(got["u"], np.arange(10, dtype=np.float32).reshape(2, 5))
    np.testing.assert_array_equal(got["v"], tw.full("uneven"))


def test_load_in_one_process_without_process_group(saved):
    wd, _ = saved
    assert not torch.distributed.is_initialized()
    tree = xckpt.load(wd / "main")
    for n in tw.ARRAYS:
        np.testing.assert_array_equal(tree["arrays"][n], tw.full(n))
        assert tree["arrays"][n].dtype == tw.full(n).dtype
    np.testing.assert_array_equal(tree["plain"], np.arange(15).reshape(5, 3))
    assert tree["rng"]["torch_cpu"].shape == (4, 5056) and len({r.tobytes() for r in tree["rng"]["torch_cpu"]}) == 4
    assert (tree["step"], tree["name"]) == (1000, "run-a")

    # plain tensors, a subset of keys, bf16 saved and float32 loaded, in place
    w, bf = torch.zeros(8, 12), torch.zeros(8, 6)
    like = {"arrays": {n: None for n in tw.ARRAYS}, "step": 0}
    like["arrays"].update(w=w, bf=bf)
    out = xckpt.load(wd / "main", like=like)
    assert out["arrays"]["w"] is w and out["step"] == 1000
    np.testing.assert_array_equal(w.numpy(), tw.full("w"))
    np.testing.assert_array_equal(bf.numpy(), tw.full("bf").astype(np.float32))

    # missing and unexpected keys are listed; strict=False reports and loads the rest
    with pytest.raises(KeyMismatchError) as err:
        xckpt.load(wd / "main", like={"arrays": {"w": torch.zeros(8, 12), "nope": torch.zeros(2)}})
    assert "arrays/nope" in err.value.missing and "arrays/rep" in err.value.unexpected
    w2 = torch.zeros(8, 12)
    with pytest.warns(xckpt.XckptWarning, match="arrays/nope"):
        xckpt.load(wd / "main", like={"arrays": {"w": w2, "nope": torch.zeros(2)}}, strict=False)
    np.testing.assert_array_equal(w2.numpy(), tw.full("w"))
    with pytest.raises(KeyMismatchError, match="mismatched"):
        xckpt.load(wd / "main", like={"arrays": {n: (torch.zeros(3, 3) if n == "w" else None) for n in tw.ARRAYS}})


def test_fsdp_checkpoint_into_plain_module_in_one_process(saved):
    wd, _ = saved
    model = tw.make_mlp(3)
    opt, sched = tw.optim_for(model)
    out = xckpt.load(wd / "fsdp", like={"model": model, "optim": opt, "sched": sched, "step": 0})
    want = dict(np.load(wd / "fsdp_expected.npz"))
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), want[f"model.{name}"])
    for name, p in model.named_parameters():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            np.testing.assert_array_equal(opt.state[p][k].numpy(), want[f"optim.{name}.{k}"])
    assert out["step"] == 3 and sched.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.01)

    # a module missing a parameter: listed, and strict=False keeps going
    smaller = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh()).double()
    with pytest.raises(KeyMismatchError) as err:
        xckpt.load(wd / "fsdp", like={"model": smaller})
    assert err.value.unexpected == ["model/2.weight", "model/2.bias"]
    with pytest.warns(xckpt.XckptWarning):
        xckpt.load(wd / "fsdp", like={"model": smaller}, strict=False)
    np.testing.assert_array_equal(smaller[0].weight.detach().numpy(), want["model.0.weight"])


def _check_numpy_values(tree: dict) -> None:
    """The numpy data the workers' DCP state held inside values, stored as arrays (a scalar as a 0-d array)."""
    want = np.random.RandomState(7).get_state()
    name, key, *rest = tree["np_rng"]
    assert name == want[0] and tuple(rest) == want[2:] and key.dtype == np.uint32
    np.testing.assert_array_equal(key, want[1])
    assert tree["lr"].shape == () and tree["lr"].dtype == np.float32 and tree["lr"] == 0.125
    arr, t, tag = tree["stage3"]  # held by rank 3 only
    assert arr.dtype == np.int16 and t.dtype == np.float32 and tag == "x"
    np.testing.assert_array_equal(arr, np.arange(5, dtype=np.int16) * 3)
    np.testing.assert_array_equal(t, np.full((2,), 2.5, np.float32))


def test_dcp_round_trip_and_conversions(saved, tmp_path):
    wd, _ = saved
    want6 = dict(np.load(wd / "fsdp6_expected.npz"))
    # what XckptStorageWriter wrote is plain xckpt
    tree = xckpt.load(wd / "dcp_x")
    assert (tree["step"], tree["name"], tree["betas"]) == (6, "dcp-run", (0.5, 0.25))
    for n in ("w", "uneven", "strided", "bf"):
        np.testing.assert_array_equal(tree["arrays"][n], tw.full(n))
    np.testing.assert_array_equal(tree["model"]["0.weight"], want6["model.0.weight"])
    np.testing.assert_array_equal(tree["optim"]["state"]["2.bias"]["exp_avg"], want6["optim.2.bias.exp_avg"])
    assert tree["optim"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    _check_numpy_values(tree)

    # a checkpoint written by stock DCP (FileSystemWriter), converted by the CLI; and one saved without
    # collectives (a metadata file per rank, replicas written by every rank)
    assert sorted(p.name for p in (wd / "dcp_ranks").glob("*.metadata")) == [f"__{r}.metadata" for r in range(4)]
    assert not (wd / "dcp_ranks" / ".metadata").exists()
    for stock in ("dcp_ranks", "dcp_stock"):  # dcp_stock last: converted back to DCP below
        assert cli(["convert", "--from", "dcp", str(wd / stock), str(tmp_path / "conv"), "--overwrite"]) == 0
        conv = xckpt.load(tmp_path / "conv")
        for n in ("w", "uneven", "strided", "bf"):
            np.testing.assert_array_equal(conv["arrays"][n], tw.full(n))
            assert conv["arrays"][n].dtype == tw.full(n).dtype
        np.testing.assert_array_equal(conv["plain"], np.arange(6.0, dtype=np.float32))
        for key, value in want6.items():
            if key.startswith("model."):
                np.testing.assert_array_equal(conv["model"][key[6:]], value)
        for fqn in ("0.weight", "0.bias", "2.weight", "2.bias"):
            for k in ("step", "exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(conv["optim"]["state"][fqn][k], want6[f"optim.{fqn}.{k}"])
        assert (conv["step"], conv["name"], conv["betas"]) == (6, "dcp-run", (0.5, 0.25))
        assert conv["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
        _check_numpy_values(conv)
        assert cli(["validate", "--deep", str(tmp_path / "conv")]) == 0
    assert cli(["diff", str(wd / "dcp_ranks"), str(wd / "dcp_stock")]) == 0

    # and back to DCP, read by stock DCP
    import torch.distributed.checkpoint as dcp
    assert cli(["convert", "--to", "dcp", str(tmp_path / "conv"), str(tmp_path / "back")]) == 0
    sd = {"arrays": {n: torch.zeros(tw.ARRAYS[n][0], dtype=xckpt.torch.torch_dtype(tw.ARRAYS[n][1]))
                     for n in ("w", "uneven", "strided", "bf")},
          "model": {k[6:]: torch.zeros(v.shape, dtype=torch.float64) for k, v in want6.items()
                    if k.startswith("model.")},
          "step": 0, "name": ""}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(tmp_path / "back"), no_dist=True)
    for n, t in sd["arrays"].items():
        np.testing.assert_array_equal(xckpt.torch.to_host(t), tw.full(n))
    for k, t in sd["model"].items():
        np.testing.assert_array_equal(t.numpy(), want6[f"model.{k}"])
    assert (sd["step"], sd["name"]) == (6, "dcp-run")


def test_every_checkpoint_validates_deep(saved, loaded3):
    wd, _ = saved
    names = ["main", "fsdp", "tp", "dcp_x", "orbax_src", "mem", "mem_warm", "from3"]
    for name in names:
        assert cli(["validate", "--deep", str(wd / name)]) == 0, name
        assert xckpt.validate(wd / name, deep=True).ok, name


def test_host_memory_during_save_stays_near_the_shard(saved):
    _, results = saved
    for r in results:
        mem = r["memory"]
        assert mem["model_bytes"] == 4 * mem["shard_bytes"]
        # zero-copy fetches: growth is bounded by the staging budget, far below the shard itself
        assert mem["peak_growth"] < mem["shard_bytes"] // 2, mem


def test_memory_checkpoints_hold_what_each_rank_saved(saved):
    """``memory_save``'s checkpoints, element by element: rank r's rows of every ``t<i>`` are the i-th
    ``torch.randn`` draw of a generator seeded with r; ``warm`` is 4 ranks' (4, 4) blocks of ones."""
    wd, results = saved
    world = len(results)
    defaults = {k: p.default for k, p in inspect.signature(tw.memory_save).parameters.items()
                if p.default is not inspect.Parameter.empty}
    tensors, rows, cols = defaults["tensors"], defaults["rows"], defaults["cols"]
    assert results[0]["memory"]["shard_bytes"] == tensors * rows * cols * 4  # the defaults were the ones used
    warm = xckpt.load(wd / "mem_warm")
    assert set(warm) == {"warm"} and warm["warm"].dtype == np.float32
    np.testing.assert_array_equal(warm["warm"], np.ones((4 * world, 4), np.float32))
    model = xckpt.load(wd / "mem")["model"]
    assert sorted(model) == sorted(f"t{i}" for i in range(tensors))
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    for i in range(tensors):  # in the order each rank drew them
        want = np.concatenate([torch.randn(rows, cols, generator=g).numpy() for g in gens])
        got = model.pop(f"t{i}")
        assert got.dtype == np.float32 and got.shape == (world * rows, cols), (i, got.dtype, got.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"t{i}")


def test_orbax_restores_torch_saved_arrays(saved):
    wd, _ = saved
    jax = pytest.importorskip("jax")
    ocp = pytest.importorskip("orbax.checkpoint")
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set in conftest)")
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 12), jnp.float32, sharding=NamedSharding(mesh, P("x", "y"))),
                         "b": jax.ShapeDtypeStruct((12,), jnp.float32, sharding=NamedSharding(mesh, P("y"))),
                         "emb": jax.ShapeDtypeStruct((4, 6), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "y")))},
              "step": 0}
    out = ocp.StandardCheckpointer().restore(wd / "orbax_src", target)
    assert isinstance(out["params"]["w"], jax.Array) and out["params"]["w"].sharding == target["params"]["w"].sharding
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), tw.full("w"))
    np.testing.assert_array_equal(np.asarray(out["params"]["b"]), np.arange(12, dtype=np.float32) / 4 - 1)
    emb = np.asarray(out["params"]["emb"])
    assert emb.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(emb, np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16))
    assert out["step"] == 5
