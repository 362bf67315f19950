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


def _staged_buffers() -> int:
    from xckpt.engine import background
    return sum(len(v) for v in background._staging._free.values())


def test_shards_go_through_page_locked_host_memory_of_their_own(tmp_path, meshes, monkeypatch):
    """The accelerator path (``jax.device_put`` to ``pinned_host``, then kept as fetched), run on the CPU
    devices, which offer that memory kind too: the checkpoint holds the values of the call although a
    donating step overwrites the arrays' buffers right after it returns; staging takes no buffer of its
    own; a later save starts the copies while the tree is described; where the memory kind cannot be
    had, JAX's own path saves the same values."""
    from xckpt.engine import background
    from xckpt_jax import arrays

    monkeypatch.setattr(arrays, "copies_to_pinned_host", lambda data: True)
    step = jax.jit(lambda t: jax.tree.map(lambda a: a * 2 + 1, t), donate_argnums=0)
    m42, m24 = meshes
    want = {"a": np.arange(64 * 48, dtype=np.float32).reshape(64, 48),
            "b": np.arange(40, dtype=np.int32) - 7}
    tree = {"a": jax.device_put(want["a"], NamedSharding(m42, P("x", "y"))),
            "b": jax.device_put(want["b"], NamedSharding(m42, P()))}
    background.release_buffers()
    for i in range(2):
        before = [s.data.unsafe_buffer_pointer() for s in tree["a"].addressable_shards]
        handle = xckpt.save_async(tree, tmp_path / f"async{i}")
        tree = step(tree)  # the donated buffers are written at once
        assert [s.data.unsafe_buffer_pointer() for s in tree["a"].addressable_shards] == before
        handle.wait()
        assert _staged_buffers() == 0  # no staging buffer was taken (and given back): the pinned copies are kept
        # 8 distinct shards of "a" and one of "b", each copied early by the second save
        assert handle.stats["early_copies"] == (0 if i == 0 else 9)
        like = {"a": NamedSharding(m24, P("y", "x")), "b": NamedSharding(m24, P())}
        out = xckpt.load(tmp_path / f"async{i}", like=like)
        np.testing.assert_array_equal(np.asarray(out["a"]), want["a"])
        np.testing.assert_array_equal(np.asarray(out["b"]), want["b"])
        want = {k: v * 2 + 1 for k, v in want.items()}
    xckpt.save(tree, tmp_path / "sync")
    monkeypatch.setattr(arrays, "PINNED", "no_such_memory")  # device_put refuses it: JAX's own path
    xckpt.save_async(tree, tmp_path / "fallback").wait()
    for name in ("sync", "fallback"):
        out = xckpt.load(tmp_path / name)
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=name)


def test_which_shards_take_the_page_locked_path(monkeypatch, meshes):
    """A shard in an accelerator's memory does, unless ``XCKPT_JAX_PINNED_HOST=0``; one already in host
    memory does not (a copy of it would gain nothing); the CPU devices do not (their memory is the host's);
    a setting that is not a number is a ``config.env`` error."""
    from xckpt.errors import XckptError
    from xckpt_jax import arrays

    dev = jax.devices()[0]
    on_device = jax.device_put(np.ones(4, np.float32), dev)
    on_host = jax.device_put(np.ones(4, np.float32), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    monkeypatch.delenv("XCKPT_JAX_PINNED_HOST", raising=False)
    assert arrays.copies_to_pinned_host(on_device) is False  # a CPU device
    monkeypatch.setitem(arrays._pinned, dev, True)  # as an accelerator with that memory kind answers
    assert arrays.copies_to_pinned_host(on_device) is True
    assert arrays.copies_to_pinned_host(on_host) is False
    monkeypatch.setenv("XCKPT_JAX_PINNED_HOST", "0")
    assert arrays.copies_to_pinned_host(on_device) is False
    monkeypatch.setenv("XCKPT_JAX_PINNED_HOST", "yes")
    with pytest.raises(XckptError, match="XCKPT_JAX_PINNED_HOST") as info:
        arrays.copies_to_pinned_host(on_device)
    assert info.value.code == "config.env"
