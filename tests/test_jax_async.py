"""xckpt.save_async with JAX and numpy leaves: returns once the data is on the host, commits in the background."""

from __future__ import annotations

import os

import numpy as np
import pytest

import xckpt
from xckpt.errors import SaveError
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard

jax = pytest.importorskip("jax")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")


ROWS, COLS = 2048, 8192  # 64 MiB of float32: writing it takes far longer than the checks right after return


def _big(mesh: Mesh) -> jax.Array:
    return jax.make_array_from_callback((ROWS, COLS), NamedSharding(mesh, P("x", "y")), _expected_block)


def _expected_block(index) -> np.ndarray:
    rows = np.arange(ROWS, dtype=np.float32)[index[0]]
    cols = np.arange(COLS, dtype=np.float32)[index[1]]
    return rows[:, None] * 3 - cols[None, :]


@pytest.fixture(scope="module")
def meshes():
    devices = np.array(jax.devices())
    return Mesh(devices.reshape(4, 2), ("x", "y")), Mesh(devices.reshape(2, 4), ("x", "y"))


def test_returns_before_the_commit_and_wait_commits(tmp_path, meshes):
    m42, m24 = meshes
    big = _big(m42)
    host = np.arange(1000, dtype=np.int64)
    path = tmp_path / "ckpt"
    handle = xckpt.save_async({"big": big, "host": host, "step": 5, "cfg": xckpt.Value({"lr": [0.1]})}, path)
    # returned: nothing is committed yet, but the data is already the save's own host copy
    assert not os.path.exists(path / "xckpt.json") and not os.path.exists(path)
    host[:] = -1
    big.delete()
    manifest = handle.wait()
    assert handle.done() and manifest.by_key()[("big",)].shape == (ROWS, COLS)
    assert os.path.exists(path / "xckpt.json")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary or status directory left
    report = xckpt.validate(path, deep=True)
    assert report.ok, [str(f) for f in report.findings]

    sh = NamedSharding(m24, P("y", "x"))
    out = xckpt.load(path, like={"big": jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=sh),
                                 "host": np.zeros(1000, np.int64), "step": 0, "cfg": xckpt.Value(None)})
    assert out["big"].sharding == sh
    for shard in out["big"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), _expected_block(shard.index))
    np.testing.assert_array_equal(out["host"], np.arange(1000, dtype=np.int64))
    assert out["step"] == 5 and out["cfg"] == {"lr": [0.1]}


def _failing_source() -> ArraySource:
    def boom() -> np.ndarray:
        raise RuntimeError("device lost")
    return ArraySource((4,), "float32", [Shard(Region((0,), (4,)), boom)])


def test_a_background_error_surfaces_from_wait(tmp_path, meshes):
    tree = {"w": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(meshes[0], P("x"))),
            "z": _failing_source()}
    handle = xckpt.save_async(tree, tmp_path / "ckpt")
    with pytest.raises(SaveError, match="nothing was committed") as info:
        handle.wait()
    assert str(tmp_path / "ckpt") in str(info.value) and "device lost" in str(info.value) and handle.done()
    with pytest.raises(SaveError):  # asking again gives the same answer
        handle.wait()
    assert os.listdir(tmp_path) == []  # the failed save left nothing behind: no data, lease or status
    good = {"w": tree["w"]}
    xckpt.save(good, tmp_path / "next")  # already reported: the next save goes ahead

    # an error nobody waited for is raised by the next save, which then does not start
    handle = xckpt.save_async(tree, tmp_path / "ckpt")
    with pytest.raises(SaveError, match="nothing was committed"):
        xckpt.save(good, tmp_path / "after")
    assert not os.path.exists(tmp_path / "after") and handle.done()
    xckpt.save(good, tmp_path / "after")
    np.testing.assert_array_equal(xckpt.load(tmp_path / "after")["w"], np.ones((8, 8), np.float32))


def test_a_save_beside_a_file_is_refused_before_anything_is_written(tmp_path, meshes):
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"not a directory")
    tree = {"w": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(meshes[0], P("x")))}
    for save in (xckpt.save, xckpt.save_async):
        with pytest.raises(SaveError, match="cannot write beside") as info:
            save(tree, blocker / "ckpt")
        assert info.value.code == "io.write"
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_a_later_save_waits_for_the_pending_one(tmp_path, meshes):
    big = _big(meshes[0])
    first = xckpt.save_async({"big": big}, tmp_path / "one")
    second = xckpt.save_async({"small": np.arange(4)}, tmp_path / "two")
    assert first.done() and os.path.exists(tmp_path / "one" / "xckpt.json")
    second.wait()
    third = xckpt.save_async({"big": big}, tmp_path / "three")
    xckpt.save({"small": np.arange(4)}, tmp_path / "four")
    assert third.done() and os.path.exists(tmp_path / "three" / "xckpt.json")
    third.wait()
    # overwrite replaces the checkpoint only at the commit
    replaced = xckpt.save_async({"small": np.arange(4) * 2}, tmp_path / "four", overwrite=True)
    replaced.wait()
    np.testing.assert_array_equal(xckpt.load(tmp_path / "four")["small"], np.arange(4) * 2)
    for name in ("one", "three"):
        out = xckpt.load(tmp_path / name, like={"big": NamedSharding(meshes[1], P("x"))})
        for shard in out["big"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), _expected_block(shard.index))
    assert sorted(os.listdir(tmp_path)) == ["four", "one", "three", "two"]


def test_the_same_api_saves_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    tree = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16), "step": 3}
    handle = xckpt.save_async(tree, tmp_path / "ckpt")
    tree["w"].fill_(-1)  # after the call returns, the save holds its own host copy
    handle.wait()
    out = xckpt.load(tmp_path / "ckpt", like={"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16),
                                              "step": 0})
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4)) and out["b"].dtype == torch.bfloat16
    assert torch.equal(out["b"], torch.ones(3, dtype=torch.bfloat16)) and out["step"] == 3
