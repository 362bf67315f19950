"""JAX adapter, one process with 8 host devices: resharding round trips, dtypes, pytrees, errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import xckpt
from xckpt.errors import KeyMismatchError, SaveError, UnsupportedError, XckptError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

import xckpt_jax  # noqa: E402


pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")


@pytest.fixture(scope="module")
def meshes():
    devices = np.array(jax.devices())
    assert devices.size == 8, "tests/conftest.py sets 8 host devices"
    return {"42": Mesh(devices.reshape(4, 2), ("x", "y")), "24": Mesh(devices.reshape(2, 4), ("x", "y")),
            "8": Mesh(devices, ("d",))}


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"f32": rng.standard_normal((16, 8)).astype(np.float32),
            "bf16": rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16),
            "i32": rng.integers(-2**31, 2**31 - 1, size=(8, 8), dtype=np.int32),
            "e4m3": (rng.standard_normal((8, 8)) * 4).astype(ml_dtypes.float8_e4m3fn),
            "e5m2": (rng.standard_normal((16,)) * 4).astype(ml_dtypes.float8_e5m2)}


def _assert_on(arr, want: np.ndarray, sharding) -> None:
    assert isinstance(arr, jax.Array) and arr.sharding == sharding, (type(arr), getattr(arr, "sharding", None))
    assert arr.dtype == want.dtype
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def _validate(path) -> None:
    report = xckpt.validate(path, deep=True)
    assert report.ok, [str(f) for f in report.findings]
    assert report.chunks > 0 and report.bytes_checked > 0


def test_reshard_round_trip(tmp_path, meshes):
    v = _values()
    m42 = meshes["42"]
    saved = {
        "a": {k: jax.device_put(v[k], NamedSharding(m42, P("x", "y"))) for k in ("f32", "bf16", "i32")},
        "split2": jax.device_put(v["f32"], NamedSharding(m42, P(("x", "y"), None))),  # one dim over two axes
        "repl": jax.device_put(v["i32"], NamedSharding(m42, P())),
        "single": jax.device_put(v["bf16"], SingleDeviceSharding(jax.devices()[3])),
        "f8": {"e4m3": jax.device_put(v["e4m3"], NamedSharding(m42, P("y", "x"))),
               "e5m2": jax.device_put(v["e5m2"], NamedSharding(m42, P("x")))},
        "np": np.arange(6.0).reshape(2, 3), "step": 1000, "scalar": jnp.asarray(2.5, jnp.float32),
        "cfg": {"name": "run", "lr": 0.1, "none": None},
    }
    path = tmp_path / "ckpt"
    manifest = xckpt.save(saved, path)
    entries = manifest.by_key()
    # every distinct shard is one stored chunk: (4, 2) grid of (4, 4) shards
    assert entries[("a", "f32")].chunk_shape == (4, 4)
    assert entries[("split2",)].chunk_shape == (2, 8)
    assert entries[("repl",)].chunk_shape == (8, 8) and entries[("repl",)].sharding["replicated"] is True
    assert entries[("a", "f32")].sharding["dim_axes"] == [["x"], ["y"]]
    assert entries[("split2",)].sharding["dim_axes"] == [["x", "y"], []]
    assert entries[("f8", "e4m3")].dtype == "float8_e4m3fn" and entries[("a", "bf16")].dtype == "bfloat16"
    _validate(path)

    targets = {  # name: (sharding of 2-d leaves, of 1-d leaves)
        "(2,4) P(y,x)": (NamedSharding(meshes["24"], P("y", "x")), NamedSharding(meshes["24"], P(("x", "y")))),
        "(8,) P(d)": (NamedSharding(meshes["8"], P("d")), NamedSharding(meshes["8"], P("d"))),
        "(8,) replicated": (NamedSharding(meshes["8"], P()), NamedSharding(meshes["8"], P())),
    }
    for what, (sh, sh1) in targets.items():
        like = {"a": {k: jax.ShapeDtypeStruct(v[k].shape, v[k].dtype, sharding=sh) for k in ("f32", "bf16", "i32")},
                "split2": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sh),
                "repl": jax.ShapeDtypeStruct((8, 8), np.int32, sharding=sh),
                "single": jax.ShapeDtypeStruct((8, 16), ml_dtypes.bfloat16, sharding=sh),
                "f8": {"e4m3": jax.ShapeDtypeStruct((8, 8), ml_dtypes.float8_e4m3fn, sharding=sh),
                       "e5m2": jax.ShapeDtypeStruct((16,), ml_dtypes.float8_e5m2, sharding=sh1)},
                "np": np.zeros((2, 3)), "step": 0,
                "scalar": jax.ShapeDtypeStruct((), np.float32, sharding=NamedSharding(sh.mesh, P())),
                "cfg": {"name": "", "lr": 0.0, "none": None}}
        out = xckpt.load(path, like=like)
        for k in ("f32", "bf16", "i32"):
            _assert_on(out["a"][k], v[k], sh)
        _assert_on(out["split2"], v["f32"], sh)
        _assert_on(out["repl"], v["i32"], sh)
        _assert_on(out["single"], v["bf16"], sh)
        _assert_on(out["f8"]["e4m3"], v["e4m3"], sh)
        _assert_on(out["f8"]["e5m2"], v["e5m2"], sh1)
        _assert_on(out["scalar"], np.asarray(2.5, np.float32), like["scalar"].sharding)
        np.testing.assert_array_equal(out["np"], saved["np"])
        assert out["step"] == 1000 and out["cfg"] == {"name": "run", "lr": 0.1, "none": None}, what


def test_other_target_kinds_and_casts(tmp_path, meshes):
    v = _values()
    path = tmp_path / "ckpt"
    xckpt.save({"w": jax.device_put(v["f32"], NamedSharding(meshes["42"], P("x", "y"))),
                "b": jax.device_put(v["bf16"], NamedSharding(meshes["42"], P(None, "y"))),
                "skip": jnp.ones(4)}, path)
    sh = NamedSharding(meshes["24"], P("x"))
    existing = jax.device_put(np.zeros((16, 8), ml_dtypes.bfloat16), sh)  # a real array: its sharding and dtype
    out = xckpt.load(path, like={"w": existing, "b": NamedSharding(meshes["8"], P("d")), "skip": None})
    _assert_on(out["w"], v["f32"].astype(ml_dtypes.bfloat16), sh)
    _assert_on(out["b"], v["bf16"], NamedSharding(meshes["8"], P("d")))
    assert out["skip"] is None
    # a ShapeDtypeStruct of another dtype casts; without a sharding, the first local device
    out = xckpt.load(path, like={"w": jax.ShapeDtypeStruct((16, 8), np.int32),
                                 "b": jax.ShapeDtypeStruct((8, 16), np.float32), "skip": None})
    np.testing.assert_array_equal(np.asarray(out["w"]), v["f32"].astype(np.int32))
    np.testing.assert_array_equal(np.asarray(out["b"]), v["bf16"].astype(np.float32))
    assert out["w"].sharding == SingleDeviceSharding(jax.local_devices()[0])
    # the whole tree without a target comes back as numpy
    plain = xckpt.load(path)
    np.testing.assert_array_equal(plain["w"], v["f32"])
    assert plain["b"].dtype == ml_dtypes.bfloat16


def test_each_device_region_is_read_once_and_only_local(meshes):
    # (2, 4) mesh, P(None, "y"): 4 distinct column blocks, each on 2 devices -> 4 regions read, not 8
    target = xckpt_jax.sharded_target((8, 16), np.float32, NamedSharding(meshes["24"], P(None, "y")))
    assert sorted((r.offsets, r.sizes) for r in target.regions) == [((0, c), (8, 4)) for c in (0, 4, 8, 12)]
    target = xckpt_jax.sharded_target((8, 16), np.float32, NamedSharding(meshes["8"], P()))
    assert [(r.offsets, r.sizes) for r in target.regions] == [((0, 0), (8, 16))]
    # saving lists one shard per distinct region, the lowest replica
    arr = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(meshes["42"], P("x")))
    src = xckpt_jax.array_source(arr)
    assert sorted(s.region.offsets for s in src.shards) == [(0, 0), (2, 0), (4, 0), (6, 0)]
    for s in src.shards:
        np.testing.assert_array_equal(s.fetch(), np.arange(32.0).reshape(8, 4)[s.region.slices()])


def test_flax_optax_and_custom_pytrees_keep_their_types(tmp_path, meshes):
    optax = pytest.importorskip("optax")
    nnx = pytest.importorskip("flax.nnx")
    from flax import linen as nn
    from flax.core import FrozenDict
    from flax.training import train_state

    @jax.tree_util.register_pytree_with_keys_class
    class Pair:
        def __init__(self, left, right, tag="t"):
            self.left, self.right, self.tag = left, right, tag

        def tree_flatten_with_keys(self):
            return ((jax.tree_util.GetAttrKey("left"), self.left),
                    (jax.tree_util.GetAttrKey("right"), self.right)), self.tag

        @classmethod
        def tree_unflatten(cls, tag, children):
            return cls(*children, tag=tag)

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)

    params = Dense().init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    tx = optax.adamw(1e-3)
    state = train_state.TrainState.create(apply_fn=Dense().apply, params=params, tx=tx)
    grads = jax.tree.map(jnp.ones_like, params)
    state = state.apply_gradients(grads=grads)  # non-zero moments, step 1
    graphdef, nnx_state = nnx.split(Net(nnx.Rngs(1)))
    shard = NamedSharding(meshes["42"], P())
    tree = {"train": state, "nnx": nnx_state, "frozen": FrozenDict({"k": jnp.arange(4.0)}),
            "pair": Pair(jnp.arange(8.0), {"x": jnp.ones((2, 2))}, tag="custom"),
            "opt_only": tx.init(params)}
    tree = jax.tree.map(lambda x: jax.device_put(x, shard) if isinstance(x, jax.Array) else x, tree)
    path = tmp_path / "ckpt"
    manifest = xckpt.save(tree, path)
    keys = {e.key for e in manifest.leaves}
    assert ("nnx", "lin", "kernel", "value") in keys and ("train", "opt_state", 0, "mu", "Dense_0", "kernel") in keys
    assert ("pair", "left") in keys and ("train", "step") in keys
    _validate(path)

    new = NamedSharding(meshes["8"], P())
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=new)
                        if isinstance(x, jax.Array) else x, tree)
    out = xckpt.load(path, like=like)
    assert type(out["train"]) is train_state.TrainState and out["train"].apply_fn == state.apply_fn
    assert out["train"].tx is tx and int(out["train"].step) == 1
    assert type(out["train"].opt_state[0]) is type(state.opt_state[0])  # optax ScaleByAdamState
    assert type(out["opt_only"]) is type(tree["opt_only"])
    assert type(out["nnx"]) is type(nnx_state) and type(out["nnx"]["lin"]["kernel"]) is nnx.Param
    assert type(out["nnx"]["bn"]["mean"]) is nnx.BatchStat
    assert type(out["frozen"]) is FrozenDict and type(out["pair"]) is Pair and out["pair"].tag == "custom"
    want = jax.tree_util.tree_flatten_with_path(tree)[0]
    got = jax.tree_util.tree_flatten_with_path(out)[0]
    assert [p for p, _ in want] == [p for p, _ in got]
    assert sum(isinstance(a, jax.Array) for _, a in want) >= 15
    for (p, a), (_, b) in zip(want, got):
        if isinstance(a, jax.Array):
            assert isinstance(b, jax.Array) and b.sharding == new and b.dtype == a.dtype, p
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        else:
            assert type(b) is type(a) and b == a, p
    model = nnx.merge(graphdef, out["nnx"])
    np.testing.assert_array_equal(np.asarray(model.lin.kernel[...]), np.asarray(nnx_state["lin"]["kernel"][...]))

    # an nnx Module itself is a pytree: saved as its state, restored into an abstract module of the same class
    module = nnx.merge(graphdef, nnx_state)
    xckpt.save({"model": module}, tmp_path / "module")
    restored = xckpt.load(tmp_path / "module", like={"model": nnx.eval_shape(lambda: Net(nnx.Rngs(5)))})["model"]
    assert type(restored) is Net and type(restored.bn.var) is nnx.BatchStat
    np.testing.assert_array_equal(np.asarray(restored.lin.kernel[...]), np.asarray(module.lin.kernel[...]))
    np.testing.assert_array_equal(np.asarray(restored.bn.scale[...]), np.asarray(module.bn.scale[...]))


def test_bad_input_is_a_specific_error(tmp_path, meshes):
    arr = jnp.ones(4)
    arr.delete()
    with pytest.raises(SaveError, match="deleted"):
        xckpt.save({"x": arr}, tmp_path / "d")
    path = tmp_path / "ok"
    xckpt.save({"w": jnp.ones((4, 4))}, path)
    sh = NamedSharding(meshes["8"], P())
    with pytest.raises(KeyMismatchError, match="mismatched") as info:
        xckpt.load(path, like={"w": jax.ShapeDtypeStruct((4, 5), np.float32, sharding=sh)})
    assert "w" in str(info.value)
    with pytest.raises(XckptError):
        xckpt.load(path, like={"v": jax.ShapeDtypeStruct((4, 4), np.float32, sharding=sh)})


def test_bare_shardings_memory_kinds_and_mismatched_specs(tmp_path, meshes):
    """A bare sharding takes the stored dtype, a Python value's too (an int stays an integer); a target in
    pinned host memory gets its arrays there; a spec of another rank than the stored array names the leaf."""
    path = tmp_path / "ckpt"
    xckpt.save({"step": 16777217, "flag": True, "b": np.arange(8, dtype=np.float32)}, path)
    rep = NamedSharding(meshes["8"], P())
    out = xckpt.load(path, like={"step": rep, "flag": rep, "b": None})
    assert out["step"].dtype == np.int32 and int(out["step"]) == 16777217  # int64 without x64: jax's int32
    assert out["flag"].dtype == np.bool_ and bool(out["flag"]) is True
    pinned = NamedSharding(meshes["8"], P("d"), memory_kind="pinned_host")
    got = xckpt.load(path, like={"b": jax.ShapeDtypeStruct((8,), np.float32, sharding=pinned)}, partial=True)["b"]
    assert got.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(got), np.arange(8, dtype=np.float32))
    with pytest.raises(XckptError) as exc:
        xckpt.load(path, like={"b": NamedSharding(meshes["42"], P("x", "y"))}, partial=True)
    assert exc.value.code == "shape.mismatch" and exc.value.leaf == "b"


def test_typed_prng_keys_round_trip_as_their_key_data(tmp_path, meshes):
    """Typed keys (jax.random.key, nnx.Rngs) are saved as their key data and come back as keys of their
    implementation on the target's sharding; old-style uint32 keys stay uint32; another implementation is refused."""
    keys = jax.device_put(jax.random.split(jax.random.key(7), 16), NamedSharding(meshes["42"], P("x")))
    rbg = jax.random.key(3, impl="rbg")
    old = jax.random.PRNGKey(11)
    path = tmp_path / "ckpt"
    manifest = xckpt.save({"k": keys, "rbg": rbg, "old": old}, path)
    entry = manifest.by_key()[("k",)]
    assert entry.shape == (16, 2) and entry.dtype == "uint32" and entry.sharding["prng_impl"] == "threefry2x32"
    sh, rep = NamedSharding(meshes["8"], P("d")), NamedSharding(meshes["8"], P())
    out = xckpt.load(path, like={"k": jax.ShapeDtypeStruct((16,), keys.dtype, sharding=sh),
                                 "rbg": jax.random.key(0, impl="rbg"),
                                 "old": jax.ShapeDtypeStruct((2,), np.uint32, sharding=rep)})
    assert out["k"].dtype == keys.dtype and out["k"].sharding == sh and out["k"].shape == (16,)
    want = np.asarray(jax.random.key_data(keys))
    for shard in out["k"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(shard.data)), want[shard.index])
    np.testing.assert_array_equal(np.asarray(jax.random.normal(out["k"][5], (4,))),
                                  np.asarray(jax.random.normal(keys[5], (4,))))
    assert str(jax.random.key_impl(out["rbg"])) == "rbg"
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(out["rbg"])), np.asarray(jax.random.key_data(rbg)))
    assert out["old"].dtype == np.uint32
    np.testing.assert_array_equal(np.asarray(out["old"]), np.asarray(old))
    np.testing.assert_array_equal(xckpt.load(path)["k"], want)  # without a target: the key data
    with pytest.raises(KeyMismatchError, match="rbg keys") as info:
        xckpt.load(path, like={"rbg": jax.random.key(0)}, partial=True)
    assert info.value.leaf == "rbg" and info.value.file == str(path)

    # an nnx module whose Dropout holds an Rngs stream: its state saves and restores whole
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    model = Net(nnx.Rngs(0))
    model.drop.rngs()  # the stream advanced once
    xckpt.save({"m": nnx.state(model)}, tmp_path / "nnx")
    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(5)))
    nnx.update(abstract, xckpt.load(tmp_path / "nnx", like={"m": nnx.state(abstract)})["m"])
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(abstract.drop.rngs.key[...])),
                                  np.asarray(jax.random.key_data(model.drop.rngs.key[...])))
    assert int(abstract.drop.rngs.count[...]) == int(model.drop.rngs.count[...]) == 1
    np.testing.assert_array_equal(np.asarray(abstract.lin.kernel[...]), np.asarray(model.lin.kernel[...]))


def test_targets_on_an_abstract_mesh_take_the_mesh_set_now(tmp_path):
    """``jax.eval_shape`` under ``jax.set_mesh`` (explicit sharding) gives shardings over an abstract mesh: a load
    under that mesh places the arrays on it; with no such mesh set, the error names the leaf."""
    from jax.sharding import AxisType
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    want = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    path = tmp_path / "ckpt"
    xckpt.save({"w": want, "b": np.arange(8, dtype=np.int32)}, path)
    with jax.set_mesh(mesh):
        like = jax.eval_shape(lambda: {"w": jnp.zeros((16, 8), out_sharding=P("x", "y")),
                                       "b": jnp.zeros(8, jnp.int32, out_sharding=P("y"))})
        assert isinstance(like["w"].sharding.mesh, jax.sharding.AbstractMesh)
        out = xckpt.load(path, like=like)
    assert out["w"].sharding == NamedSharding(mesh, P("x", "y")) and out["b"].sharding == NamedSharding(mesh, P("y"))
    _assert_on(out["w"], want, NamedSharding(mesh, P("x", "y")))
    _assert_on(out["b"], np.arange(8, dtype=np.int32), NamedSharding(mesh, P("y")))
    with pytest.raises(UnsupportedError, match="abstract mesh") as info:
        xckpt.load(path, like=like)
    assert info.value.leaf in ("w", "b") and info.value.file == str(path)
