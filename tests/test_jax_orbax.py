"""Orbax interop with no conversion step, both ways, each onto another mesh (real Orbax, 8 host devices)."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import xckpt

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")


SPECS_SAVE = {"w": P("x", "y"), "e": P(("x", "y")), "i": P("y")}
SPECS_LOAD = {"w": P("y", "x"), "e": P(None, "x"), "i": P()}


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((16, 8)).astype(np.float32),
            "e": rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16),
            "i": rng.integers(-1000, 1000, size=(8, 4), dtype=np.int32)}


@pytest.fixture(scope="module")
def meshes():
    devices = np.array(jax.devices())
    return Mesh(devices.reshape(4, 2), ("x", "y")), Mesh(devices.reshape(2, 4), ("x", "y"))


def _tree(mesh: Mesh) -> dict:
    v = _values()
    params = {k: jax.device_put(v[k], NamedSharding(mesh, SPECS_SAVE[k])) for k in v}
    opt = optax.adam(1e-3).init({"w": params["w"]})
    return {"params": params, "opt": opt, "step": 1000}


def _target(mesh: Mesh) -> dict:
    v = _values()
    params = {k: jax.ShapeDtypeStruct(v[k].shape, v[k].dtype, sharding=NamedSharding(mesh, SPECS_LOAD[k]))
              for k in v}
    sds = jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
    count = jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P()))
    opt = (optax.ScaleByAdamState(count=count, mu={"w": sds}, nu={"w": sds}), optax.EmptyState())
    return {"params": params, "opt": opt, "step": 0}


def _check(out: dict, target: dict) -> None:
    v = _values()
    for k, want in v.items():
        got = out["params"][k]
        assert isinstance(got, jax.Array) and got.sharding == target["params"][k].sharding and got.dtype == want.dtype
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    adam = out["opt"][0]
    assert int(adam.count) == 0 and adam.mu["w"].sharding == target["opt"][0].mu["w"].sharding
    assert adam.nu["w"].sharding == target["opt"][0].nu["w"].sharding
    for moment in (adam.mu["w"], adam.nu["w"]):  # optax.adam(...).init: both moments start at zero
        assert moment.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(moment), np.zeros((16, 8), np.float32))
    assert int(out["step"]) == 1000


def _validate(path) -> None:
    report = xckpt.validate(path, deep=True)
    assert report.ok, [str(f) for f in report.findings]


def test_orbax_restores_what_xckpt_saved_from_jax(tmp_path, meshes):
    m42, m24 = meshes
    tree = _tree(m42)
    path = tmp_path / "ckpt"
    xckpt.save(tree, path)
    _validate(path)
    cli = subprocess.run([sys.executable, "-m", "xckpt", "validate", "--deep", str(path)], capture_output=True,
                         text=True)
    assert cli.returncode == 0 and "OK" in cli.stdout, cli.stdout + cli.stderr

    target = _target(m24)
    _check(ocp.StandardCheckpointer().restore(path, target), target)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    _check(ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(item=target,
                                                                              restore_args=restore_args)), target)

    root = tmp_path / "manager"  # a CheckpointManager step directory: root/<step>/default/<checkpoint>
    xckpt.save(tree, root / "7" / "default")
    _validate(root / "7" / "default")
    with ocp.CheckpointManager(root) as manager:
        assert manager.all_steps() == [7]
        _check(manager.restore(7, args=ocp.args.StandardRestore(target)), target)


def test_xckpt_restores_what_orbax_saved(tmp_path, meshes):
    m42, m24 = meshes
    tree = _tree(m42)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ocdbt", tree)
    with ocp.StandardCheckpointer(use_ocdbt=False) as ckptr:
        ckptr.save(tmp_path / "zarr2", tree)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)) as ckptr:
        ckptr.save(tmp_path / "zarr3", args=ocp.args.PyTreeSave(tree))
    with ocp.CheckpointManager(tmp_path / "manager") as manager:
        manager.save(3, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    assert (tmp_path / "ocdbt" / "manifest.ocdbt").exists() and not (tmp_path / "zarr2" / "manifest.ocdbt").exists()

    target = _target(m24)
    # Orbax records optax's EmptyState() as a None leaf, not as an empty container: skip it with None
    target["opt"] = (target["opt"][0], None)
    for name in ("ocdbt", "zarr2", "zarr3", "manager/3/default"):
        out = xckpt.load(tmp_path / name, like=target)
        _check(out, target)
        assert type(out["opt"][0]) is optax.ScaleByAdamState and out["opt"][1] is None

    # xckpt convert --from orbax, then the copy on a third mesh
    xckpt.convert.convert(str(tmp_path / "ocdbt"), str(tmp_path / "converted"), source="orbax")
    _validate(tmp_path / "converted")
    mesh8 = Mesh(np.array(jax.devices()[::-1]).reshape(8, 1), ("x", "y"))
    target8 = _target(mesh8)
    target8["opt"] = (target8["opt"][0], None)
    _check(xckpt.load(tmp_path / "converted", like=target8), target8)
