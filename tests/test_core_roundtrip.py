"""numpy-level round trips through real TensorStore files."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import xckpt
from xckpt.format import dtypes
from xckpt.errors import KeyMismatchError, TreeError
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard

from threaded import run_ranks

pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")
ALL_DTYPES = dtypes.LOGICAL_DTYPES


def _sample(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = dtypes.numpy_dtype(name)
    if name == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtypes.is_raw(name):  # float8: any byte; a sub-byte type: any value (its bits, the high ones clear)
        return (rng.integers(0, 256, size=shape, dtype=np.uint8) & np.uint8(dtypes.low_bits(name) or 0xFF)).view(dt)
    if name.startswith(("int", "uint")):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if name.startswith("complex"):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def _assert_bitwise_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_every_dtype_round_trips_bit_exact(tmp_path, name):
    arrays = {"m": _sample(name, (6, 5), 1), "s": _sample(name, (), 2), "e": _sample(name, (0, 3), 3),
              "v": _sample(name, (7,), 4)}
    xckpt.save({"a": arrays}, tmp_path / "c")
    out = xckpt.load(tmp_path / "c")
    for k, want in arrays.items():
        got = out["a"][k]
        assert got.dtype == want.dtype, k
        _assert_bitwise_equal(want, got)
    assert xckpt.validate(tmp_path / "c", deep=True).ok


def test_tree_structure_and_values_preserved(tmp_path):
    NT = collections.namedtuple("NT", ["mu", "nu"])
    tree = {
        "model": {"layers.0.weight": np.arange(6.0).reshape(2, 3), "layers.0.bias": np.zeros(2, np.float32)},
        "opt": [NT(np.ones(2), np.full(2, 2.0)), (1, "two", None), {}],
        "state": {0: {"step": 3}, 1: {"step": 4}},
        "step": 1000, "lr": 1e-3, "name": "run-1", "flag": True, "blob": b"\x00\x01", "z": 2 + 1j,
        "huge": 2**80, "nothing": None, "empty_list": [], "opaque": xckpt.Value({"a": [1, (2, 3)], 4: None}),
    }
    xckpt.save(tree, tmp_path / "c")
    out = xckpt.load(tmp_path / "c")
    np.testing.assert_array_equal(out["model"]["layers.0.weight"], tree["model"]["layers.0.weight"])
    np.testing.assert_array_equal(out["model"]["layers.0.bias"], tree["model"]["layers.0.bias"])
    assert type(out["opt"]) is list and type(out["opt"][1]) is tuple
    assert type(out["opt"][0]).__name__ == "NT" and out["opt"][0]._fields == ("mu", "nu")
    np.testing.assert_array_equal(out["opt"][0].mu, tree["opt"][0].mu)
    np.testing.assert_array_equal(out["opt"][0].nu, np.full(2, 2.0))
    assert out["opt"][1] == (1, "two", None) and out["opt"][2] == {}
    assert out["state"] == {0: {"step": 3}, 1: {"step": 4}}
    for k in ("step", "lr", "name", "flag", "blob", "z", "huge", "nothing", "empty_list"):
        assert out[k] == tree[k] and type(out[k]) is type(tree[k]), k
    assert out["opaque"] == {"a": [1, (2, 3)], 4: None}
    assert xckpt.validate(tmp_path / "c", deep=True).ok


def test_like_selects_subset_region_and_cast(tmp_path):
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    xckpt.save({"params": {"w": w, "b": np.ones(8, ml_dtypes.bfloat16)}, "step": 5, "other": np.ones(3)},
               tmp_path / "c")
    out = xckpt.load(tmp_path / "c", like={
        "params": {"w": xckpt.ReadSpec(region=(slice(2, 6), slice(1, 8)), dtype=np.float64),
                   "b": np.zeros(8, np.float32)},
        "step": 0})
    assert set(out) == {"params", "step"} and out["step"] == 5
    assert out["params"]["w"].dtype == np.float64
    np.testing.assert_array_equal(out["params"]["w"], w[2:6, 1:8].astype(np.float64))
    assert out["params"]["b"].dtype == np.float32
    np.testing.assert_array_equal(out["params"]["b"], np.ones(8, np.float32))
    skipped = xckpt.load(tmp_path / "c", like={"params": {"w": None, "b": np.zeros(8, np.float32)}})
    assert skipped["params"]["w"] is None


def test_strict_load_lists_missing_unexpected_and_mismatched(tmp_path):
    xckpt.save({"model": {"a": np.ones(2), "b": np.ones(3), "extra": np.ones(1)}}, tmp_path / "c")
    like = {"model": {"a": np.zeros(2), "b": np.zeros(4), "gone": np.zeros(1)}}
    with pytest.raises(KeyMismatchError) as info:
        xckpt.load(tmp_path / "c", like=like)
    err = info.value
    assert err.missing == ["model/gone"] and err.unexpected == ["model/extra"]
    assert len(err.mismatched) == 1 and err.mismatched[0].startswith("model/b")
    assert err.leaf is None  # three differences: none is "the" leaf
    for one, key in (({"b": np.zeros(3), "extra": np.zeros(1), "gone": np.zeros(1)}, "model/gone"),
                     ({"b": np.zeros(4), "extra": np.zeros(1)}, "model/b"), ({"b": np.zeros(3)}, "model/extra")):
        with pytest.raises(KeyMismatchError) as info:
            xckpt.load(tmp_path / "c", like={"model": {"a": np.zeros(2), **one}})
        assert info.value.leaf == key and f"(leaf '{key}', file " in str(info.value), info.value
    with pytest.warns(xckpt.XckptWarning, match="model/gone"):
        out = xckpt.load(tmp_path / "c", like=like, strict=False)
    np.testing.assert_array_equal(out["model"]["a"], np.ones(2))
    np.testing.assert_array_equal(out["model"]["b"], np.zeros(4))  # the target's own leaf is kept


def test_name_collision_and_bad_keys_refused(tmp_path):
    with pytest.raises(TreeError, match="would both be stored as 'a.b'") as info:
        xckpt.save({"a.b": np.ones(1), "a": {"b": np.ones(1)}}, tmp_path / "c")
    assert info.value.code == "tree.name_collision"
    with pytest.raises(TreeError, match="backslash"):
        xckpt.save({"a\\b": np.ones(1)}, tmp_path / "d")
    with pytest.raises(TreeError, match="reserved"):
        xckpt.save({"_METADATA": np.ones(1)}, tmp_path / "e")
    with pytest.raises(TreeError, match="cannot save a leaf of type"):
        xckpt.save({"x": object()}, tmp_path / "f")
    assert not os.path.exists(tmp_path / "c") and not os.listdir(tmp_path)


def test_zarr_python_reads_xckpt_float32_array(tmp_path):
    zarr = pytest.importorskip("zarr")
    w = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    xckpt.save({"w": w, "s": np.float32(2.5)}, tmp_path / "c", inner_chunk_bytes=1024)
    arr = zarr.open_array(str(tmp_path / "c" / "w"), mode="r")
    np.testing.assert_array_equal(arr[...], w)
    np.testing.assert_array_equal(arr[3:17, 5:40], w[3:17, 5:40])
    assert float(zarr.open_array(str(tmp_path / "c" / "s"), mode="r")[...]) == 2.5


def _sharded_source(full: np.ndarray, rank: int, world: int, axis: int) -> ArraySource:
    """Rank's slice of ``full`` along ``axis`` (torch.chunk-style uneven split)."""
    n = full.shape[axis]
    step = -(-n // world)
    start, stop = min(rank * step, n), min((rank + 1) * step, n)
    offs = [0] * full.ndim
    sizes = list(full.shape)
    offs[axis], sizes[axis] = start, stop - start
    region = Region(tuple(offs), tuple(sizes))
    return ArraySource(full.shape, dtypes.logical_name(full.dtype),
                       [Shard(region, lambda: full[region.slices()])], {"num_processes": world})


def test_multi_rank_save_writes_each_region_once_and_balances(tmp_path):
    big = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    rep = np.arange(1000, dtype=np.int64)
    world = 4

    def body(coord):
        tree = {"big": _sharded_source(big, coord.rank, world, 0), "rep": rep, "step": 7}
        return xckpt.save(tree, tmp_path / "c", coordinator=coord)

    manifests = run_ranks(world, body)
    entry = {e.path: e for e in manifests[0].arrays()}
    assert entry["big"].chunk_shape == (3, 6)  # ceil(10/4) rows per shard, last shard short
    assert os.listdir(tmp_path / "c" / "big" / "c") and len(os.listdir(tmp_path / "c" / "big" / "c")) == 4
    out = xckpt.load(tmp_path / "c")
    np.testing.assert_array_equal(out["big"], big)
    np.testing.assert_array_equal(out["rep"], rep)
    assert out["step"] == 7
    assert xckpt.validate(tmp_path / "c", deep=True).ok


def test_core_imports_neither_torch_nor_jax(tmp_path):
    code = (
        "import sys, numpy as np, xckpt\n"
        f"xckpt.save({{'w': np.ones((3, 3))}}, {str(tmp_path / 'c')!r})\n"
        f"assert xckpt.validate({str(tmp_path / 'c')!r}, deep=True).ok\n"
        f"np.testing.assert_array_equal(xckpt.load({str(tmp_path / 'c')!r})['w'], np.ones((3, 3)))\n"
        "import xckpt.cli, xckpt.convert, xckpt.validate\n"
        "bad = [m for m in ('torch', 'jax', 'flax', 'orbax') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_manifest_is_json_with_keys_as_lists(tmp_path):
    xckpt.save({"model": {"layers.0.weight": np.ones((2, 2))}}, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "xckpt.json").read_text())
    assert manifest["format"] == "xckpt" and manifest["version"] == "1.2"
    (leaf,) = manifest["leaves"]
    assert leaf["key"] == ["model", "layers.0.weight"] and leaf["path"] == "model.layers.0.weight"
    assert leaf["shape"] == [2, 2] and leaf["dtype"] == "float64"


def test_stored_none_matches_an_empty_container_in_the_target(tmp_path):
    Empty = collections.namedtuple("Empty", [])
    xckpt.save({"opt": [np.ones(2), None], "x": None}, tmp_path / "c")
    out = xckpt.load(tmp_path / "c", like={"opt": [np.zeros(2), Empty()], "x": {}})
    assert out["opt"][1] == Empty() and out["x"] == {}
    np.testing.assert_array_equal(out["opt"][0], np.ones(2))
    with pytest.raises(KeyMismatchError) as info:  # an empty target does not hide real stored data
        xckpt.load(tmp_path / "c", like={"opt": Empty(), "x": None})
    assert info.value.unexpected == ["opt/0", "opt/1"]


def test_default_subtree_loads_when_stored_and_is_kept_when_not(tmp_path):
    xckpt.save({"state": {"w": np.ones(2)}, "groups": [{"lr": 0.5}]}, tmp_path / "with")
    xckpt.save({"state": {"w": np.ones(2)}}, tmp_path / "without")
    like = {"state": {"w": np.zeros(2)}, "groups": xckpt.Default([{"lr": 0.1}])}
    assert xckpt.load(tmp_path / "with", like=like)["groups"] == [{"lr": 0.5}]
    out = xckpt.load(tmp_path / "without", like=like)
    assert out["groups"] == [{"lr": 0.1}]
    np.testing.assert_array_equal(out["state"]["w"], np.ones(2))
    with pytest.raises(KeyMismatchError):  # without Default the same gap is an error
        xckpt.load(tmp_path / "without", like={"state": {"w": np.zeros(2)}, "groups": [{"lr": 0.1}]})


def test_plan_reuse_follows_the_whole_job_not_one_rank(tmp_path):
    """Saves A, B, A where only rank 1's leaves change: rank 0's description is the same each
    time, but its assignment of the replicated leaves is not; the third save must use A's plan
    everywhere (a stale assignment would leave a replicated leaf unwritten)."""
    r1, r2 = np.arange(4096, dtype=np.float32), np.arange(4096, dtype=np.float32) * 2
    extra = np.ones((256, 256), np.float32)

    def body(coord):
        out = []
        for i, with_extra in enumerate((True, False, True)):
            tree = {"r1": r1, "r2": r2}
            if coord.rank == 1 and with_extra:
                tree["x"] = ArraySource(extra.shape, "float32", [Shard(Region.full(extra.shape), lambda: extra)])
            xckpt.save(tree, tmp_path / f"s{i}", coordinator=coord)
            out.append(coord.rank)
        return out

    run_ranks(2, body)
    for i in range(3):
        out = xckpt.load(tmp_path / f"s{i}")
        np.testing.assert_array_equal(out["r1"], r1)
        np.testing.assert_array_equal(out["r2"], r2)
        if i != 1:
            np.testing.assert_array_equal(out["x"], extra)
        assert xckpt.validate(tmp_path / f"s{i}", deep=True).ok


def test_io_threads_follow_the_cpu_affinity(tmp_path):
    """A process limited to one CPU (a container, ``taskset``) writes and reads on one thread, unless
    ``XCKPT_IO_THREADS`` says otherwise; a save and a load on that one thread still round-trip a
    multi-chunk tree exactly (inner chunks of several 1 MiB pieces, copied block by block)."""
    code = (
        "import os, sys, numpy as np, xckpt\n"
        "from xckpt.engine import threads\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "print(threads.usable_cpus(), threads.io_threads())\n"
        "rng = np.random.default_rng(3)\n"
        "tree = {'w': rng.standard_normal((1024, 1536)).astype(np.float32), 'v': np.arange(7, dtype=np.int64)}\n"
        "xckpt.save(tree, sys.argv[1], inner_chunk_bytes=3 << 20)\n"
        "got = xckpt.load(sys.argv[1])\n"
        "assert got['w'].shape == tree['w'].shape and got['w'].dtype == tree['w'].dtype\n"
        "assert np.array_equal(got['w'].view(np.uint32), tree['w'].view(np.uint32))\n"
        "assert np.array_equal(got['v'], tree['v'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XCKPT_IO_THREADS"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "one")], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["1", "1"]
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "three")], env={**env, "XCKPT_IO_THREADS": "3"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "3"]


def test_make_dirs_creates_missing_parents_and_refuses_a_file_in_the_way(tmp_path):
    """The save's directory maker: one level, several missing levels, an existing directory (nothing to
    do), and a regular file at the path or at a parent (refused, as ``os.makedirs`` refuses it)."""
    from xckpt.engine.storage import make_dirs

    make_dirs(str(tmp_path / "a"))
    make_dirs(str(tmp_path / "b" / "c" / "d"))
    make_dirs(str(tmp_path / "b" / "c"))
    assert (tmp_path / "a").is_dir() and (tmp_path / "b" / "c" / "d").is_dir()
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        make_dirs(str(tmp_path / "f"))
    with pytest.raises(NotADirectoryError):
        make_dirs(str(tmp_path / "f" / "g"))
    assert (tmp_path / "f").read_bytes() == b"x"


def test_a_load_that_visits_more_directories_than_the_store_keeps_open(tmp_path, monkeypatch):
    """The directory descriptors a local store keeps are bounded (a quarter of the process's limit, at most
    1,024): a load visiting more directories closes the least recently used ones and still reads every leaf
    through the directory it opened first; none stays open after the load."""
    from xckpt.engine import storage

    tree = {f"g{i}": {"w": np.full((3, i + 1), i, np.float32), "v": np.arange(i + 2, dtype=np.int64)} for i in range(12)}
    xckpt.save(tree, tmp_path / "c")
    assert 32 <= storage._dir_cache() <= 1024
    monkeypatch.setattr(storage, "_DIR_CACHE", 4)
    before = len(os.listdir("/proc/self/fd"))
    out = xckpt.load(tmp_path / "c")
    assert len(os.listdir("/proc/self/fd")) == before
    for k, sub in tree.items():
        for name, arr in sub.items():
            np.testing.assert_array_equal(out[k][name], arr)
            assert out[k][name].dtype == arr.dtype


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_save_async_writes_the_objects_a_synchronous_save_writes(tmp_path, compression):
    """An asynchronous save stages each chunk already laid out as stored; what it writes is byte for byte
    what a synchronous save writes (but for each object's place tag, which names its save), whatever
    the arrays' memory layout, byte order and edge chunks (padded inner chunks)."""
    rng = np.random.default_rng(7)
    wide = rng.standard_normal((37, 46)).astype(np.float32)
    edge = rng.standard_normal((40, 8)).astype(np.float32)  # 3 ranks: chunks of 14 rows, the last clipped to 12
    tree = {
        "fortran": np.asfortranarray(rng.standard_normal((40, 24))),
        "strided": wide[:, ::2],
        "big_endian": rng.standard_normal((33, 17)).astype(">f4"),
        "ints": rng.integers(-9, 9, size=(5, 7, 9), dtype=np.int16),
        "scalar": np.float64(2.5),
    }
    options = {"compression": compression, "inner_chunk_bytes": 256}  # edge: inner chunks of 7 rows, one padded

    def body(coord):
        mine = {**tree, "edge": _sharded_source(edge, coord.rank, 3, 0)}
        xckpt.save(mine, tmp_path / "sync", coordinator=coord, **options)
        xckpt.save_async(mine, tmp_path / "async", coordinator=coord, **options).wait()

    run_ranks(3, body)
    objects = 0
    for root, _, files in os.walk(tmp_path / "sync"):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), tmp_path / "sync")
            with open(tmp_path / "sync" / rel, "rb") as f:
                want = f.read()
            with open(tmp_path / "async" / rel, "rb") as f:
                got = f.read()
            if "/c/" in rel.replace(os.sep, "/"):  # a chunk object: equal but for its 16-byte place tag
                at = want.rfind(b"XCKPLACE")
                assert at > 0 and got.rfind(b"XCKPLACE") == at, rel
                assert got[:at] == want[:at] and got[at + 16:] == want[at + 16:], rel
                objects += 1
            elif name == "zarr.json":
                assert got == want, rel
    assert objects >= 5
    back = xckpt.load(tmp_path / "async")
    for key, want in {**tree, "edge": edge}.items():
        np.testing.assert_array_equal(back[key], want)


def test_save_async_keeps_no_reference_to_the_saved_arrays(tmp_path):
    """Once save_async returns, what it saves is staged: the caller's arrays are not kept alive by the pending save
    (nor by its handle after wait()), so a loop that replaces its arrays holds one copy, not two."""
    import gc
    import weakref

    class Array(np.ndarray):  # a weakly referenceable array
        pass

    big = Array((1 << 20,), np.float32)  # it owns its memory: every view of it keeps it alive
    big[:] = np.arange(1 << 20, dtype=np.float32)
    ref = weakref.ref(big)
    handle = xckpt.save_async({"w": big, "step": 1}, tmp_path / "c")
    del big
    gc.collect()
    assert ref() is None  # already before wait()
    handle.wait()
    np.testing.assert_array_equal(xckpt.load(tmp_path / "c")["w"], np.arange(1 << 20, dtype=np.float32))
    xckpt.release_buffers()


def test_metadata_with_non_finite_floats_is_written_as_strict_json(tmp_path):
    """A diverged run's NaN loss in the metadata: xckpt.json stays JSON every parser reads (NaN is not JSON),
    holding the string "NaN"; the manager reads its metrics back as the floats."""
    import json
    import math

    from xckpt.sources.detect import open_checkpoint

    def refuse(token):
        raise AssertionError(f"{token} written into xckpt.json")

    xckpt.save({"w": np.ones(2)}, tmp_path / "c", metadata={"loss": float("nan"), "best": [float("-inf"), 1.5]})
    json.loads((tmp_path / "c" / "xckpt.json").read_text(), parse_constant=refuse)
    ckpt = open_checkpoint(tmp_path / "c")
    try:
        assert ckpt.manifest.metadata == {"loss": "NaN", "best": ["-Infinity", 1.5]}
    finally:
        ckpt.close()
    with xckpt.CheckpointManager(tmp_path / "run", async_save=False) as m:
        m.save(1, {"x": np.zeros(2)}, metrics={"loss": float("nan"), "acc": float("inf")}, force=True)
    got = xckpt.list_steps(tmp_path / "run")[0].metrics
    assert math.isnan(got["loss"]) and got["acc"] == math.inf, got


def test_a_nan_metric_an_older_xckpt_wrote_into_metadata_still_loads(tmp_path):
    """Before the writer wrote strict JSON, a NaN metric went into xckpt.json as the bare token: such a
    checkpoint (weeks of training) still loads, with a warning; the token anywhere else is manifest.json."""
    xckpt.save({"w": np.arange(3.0)}, tmp_path / "c", metadata={"loss": 1.0})
    m = tmp_path / "c" / "xckpt.json"
    m.write_bytes(m.read_bytes().replace(b'"loss":1.0', b'"loss":NaN', 1))
    with pytest.warns(xckpt.XckptWarning, match="metadata holds NaN"):
        np.testing.assert_array_equal(xckpt.load(tmp_path / "c")["w"], np.arange(3.0))
    report = xckpt.validate(tmp_path / "c", deep=True)
    assert report.ok and [(f.code, f.severity) for f in report.findings] == [("manifest.json", "warning")]
    older = m.read_bytes()
    m.write_bytes(older.replace(b'"producer":{', b'"producer":{"x":NaN,', 1))
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.load(tmp_path / "c")
    assert info.value.code == "manifest.json"
    m.write_bytes(older)  # (every checkpoint a test leaves must validate)


def test_subclassed_values_are_stored_as_plain_values(tmp_path):
    """An IntEnum, a str enum, a float subclass come back as the plain int, str and float (as JSON would)."""
    import enum

    class Color(enum.IntEnum):
        RED = 3

    class Mode(str, enum.Enum):
        TRAIN = "train"

    class Loss(float):
        pass

    tree = {"color": Color.RED, "mode": Mode.TRAIN, "loss": Loss(0.5),
            "cfg": xckpt.Value({Mode.TRAIN: [Color.RED, (Loss(1.5), b"x")]})}
    xckpt.save(tree, tmp_path / "c")
    out = xckpt.load(tmp_path / "c")
    assert out == {"color": 3, "mode": "train", "loss": 0.5, "cfg": {"train": [3, (1.5, b"x")]}}
    assert [type(out[k]) for k in ("color", "mode", "loss")] == [int, str, float]
    assert type(next(iter(out["cfg"]))) is str


def test_empty_arrays_with_huge_dimensions_and_arrays_the_format_cannot_record(tmp_path):
    """An array with no element gets the smallest chunk, whatever its other dimensions (its reader's chunk
    bound holds); a dimension of 2**53 or more is refused by the save, naming the leaf."""
    for shape in [(2**52, 0), (3, 2**51, 0), (0,), (4, 0, 7)]:
        xckpt.save({"x": np.zeros(shape, np.float32)}, tmp_path / f"e{len(shape)}{shape[0]}")
        got = xckpt.load(tmp_path / f"e{len(shape)}{shape[0]}")["x"]
        assert got.shape == shape and got.dtype == np.float32
    with pytest.raises(xckpt.XckptError) as e:
        xckpt.save({"big": np.zeros((0, 2**53), np.int8)}, tmp_path / "big")
    assert e.value.code == "shape.too_large" and e.value.leaf == "big"
    assert not (tmp_path / "big").exists()


def test_an_int_key_beyond_64_bits_is_refused_by_leaf(tmp_path):
    with pytest.raises(xckpt.XckptError) as e:
        xckpt.save({"opt": {2**70: 1.0}}, tmp_path / "c")
    assert e.value.code == "tree.invalid" and e.value.leaf == "opt" and "64-bit" in str(e.value)
    xckpt.save({"opt": {-(2**63): 1.0, 2**63 - 1: 2.0}}, tmp_path / "ok")
    assert xckpt.load(tmp_path / "ok") == {"opt": {-(2**63): 1.0, 2**63 - 1: 2.0}}


def test_a_storage_name_too_long_for_a_file_system_is_refused_before_writing(tmp_path):
    with pytest.raises(xckpt.XckptError) as e:
        xckpt.save({"other": np.ones(2), "x" * 300: np.ones(2)}, tmp_path / "c")
    assert e.value.code == "tree.invalid" and e.value.leaf == "x" * 300 and "255" in str(e.value)
    assert os.listdir(tmp_path) == []  # nothing written, nothing left
    xckpt.save({"é" * 127: np.ones(2)}, tmp_path / "ok")  # 254 bytes in UTF-8
    np.testing.assert_array_equal(xckpt.load(tmp_path / "ok")["é" * 127], np.ones(2))


@pytest.mark.parametrize("region", [(-1, slice(0, 4)), (Ellipsis,), (np.int64(1), slice(None)),
                                    (slice(4, 100), slice(0, 4)), (slice(0, 7), slice(None)),
                                    (slice(-9, 2), slice(None))])
def test_a_region_of_indices_or_past_the_end_is_refused(tmp_path, region):
    """A region is one slice per dimension within the array: an index or an Ellipsis (which would drop or add
    a dimension), or a slice reaching past the end (it was cut short silently), is shape.invalid."""
    xckpt.save({"a": np.arange(24.0).reshape(6, 4)}, tmp_path / "c")
    with pytest.raises(xckpt.XckptError) as e:
        xckpt.load(tmp_path / "c", like={"a": xckpt.ReadSpec(region=region)}, partial=True)
    assert e.value.code == "shape.invalid" and e.value.leaf == "a", e.value
    got = xckpt.load(tmp_path / "c", like={"a": xckpt.ReadSpec(region=(slice(-2, 6), slice(0, 4)))}, partial=True)
    np.testing.assert_array_equal(got["a"], np.arange(24.0).reshape(6, 4)[-2:])


def test_a_destination_whose_name_is_not_utf8_saves_and_loads(tmp_path):
    """A directory named in bytes that are not UTF-8 (Python holds them as surrogate escapes) is a destination like
    any other: save, save_async, load and deep validate (the save said coord.lost: msgpack refused the name)."""
    import os

    parent = os.path.join(str(tmp_path), os.fsdecode(b"run-\xff\xfe"))
    os.mkdir(parent)
    tree = {"a": np.arange(5, dtype=np.float32), "step": 3}
    xckpt.save(tree, os.path.join(parent, "ck"))
    xckpt.save_async(tree, os.path.join(parent, "ck2")).wait()
    for name in ("ck", "ck2"):
        out = xckpt.load(os.path.join(parent, name))
        np.testing.assert_array_equal(out["a"], tree["a"])
        assert out["step"] == 3
        assert xckpt.validate(os.path.join(parent, name), deep=True).ok
    assert sorted(os.listdir(parent)) == ["ck", "ck2"]  # nothing left beside them
