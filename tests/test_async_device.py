"""The engine's path for shards on an accelerator in ``save_async`` (``Shard.copy_into``), through a
source registered like an adapter's whose "device" copies on threads of its own: every copy starts
before the first is waited for, the caller's later changes do not reach the checkpoint, the buffers
come from the source's allocator and are kept for the next save, and a failing copy fails the save
with nothing committed; and the path of shards whose fetch is already a host copy of their own
(``Shard.fetch_copies``, as JAX arrays on an accelerator). The CUDA path itself runs in tests/test_gpu.py
on a machine with a GPU."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

import xckpt
from xckpt import registry
from xckpt.errors import XckptError
from xckpt.format import dtypes
from xckpt.format.regions import Region


@dataclass
class DeviceArray:
    """An array on a pretend accelerator: split into row blocks, each copied to the host by a thread."""

    data: np.ndarray
    blocks: int = 2
    log: list[str] = field(default_factory=list)
    fail: bool = False
    name: str = ""  # in the log: "start <name><block>"


allocations: list[int] = []


def _alloc(nbytes: int) -> np.ndarray:
    allocations.append(nbytes)
    return np.full(nbytes, 0xAB, dtype=np.uint8)  # poisoned: every byte must be written by the copy


def _source(arr: DeviceArray) -> registry.ArraySource:
    arr.log.append(f"describe {arr.name}")
    rows = np.array_split(np.arange(arr.data.shape[0]), arr.blocks)
    shards = []
    for i, r in enumerate(rows):
        region = Region((int(r[0]), 0), (len(r), arr.data.shape[1]))

        def copy_into(out: np.ndarray, i: int = i, region: Region = region) -> Callable[[], None]:
            arr.log.append(f"start {arr.name}{i}")
            src = arr.data[region.slices()].copy()  # what the device holds now, in the order of its queue

            def run() -> None:
                time.sleep(0.05)  # the copy is still running when the next one starts
                if not arr.fail:
                    out[...] = src

            t = threading.Thread(target=run)
            t.start()

            def wait() -> None:
                arr.log.append(f"wait {arr.name}{i}")
                t.join()
                if arr.fail:
                    raise OSError(f"device copy {i} failed")
            return wait

        shards.append(registry.Shard(region, lambda region=region: arr.data[region.slices()].copy(),
                                     copy_into=copy_into, host_buffer=_alloc))
    return registry.ArraySource(arr.data.shape, dtypes.logical_name(arr.data.dtype), shards)


registry.register_source(lambda obj: isinstance(obj, DeviceArray), _source)


def _state() -> dict:
    rng = np.random.default_rng(5)
    return {"w": DeviceArray(rng.standard_normal((300, 70)).astype(np.float32), blocks=3),
            "b": DeviceArray(rng.integers(-9, 9, (64, 1000)).astype(np.int64)),
            "host": rng.standard_normal((50, 50)), "step": 7}


def test_device_shards_are_copied_at_once_and_snapshotted(tmp_path):
    xckpt.release_buffers()
    allocations.clear()
    state = _state()
    want = {k: (v.data.copy() if isinstance(v, DeviceArray) else v) for k, v in state.items()}
    handle = xckpt.save_async(state, tmp_path / "a")
    for arr in (state["w"], state["b"]):
        starts = [i for i, e in enumerate(arr.log) if e.startswith("start")]
        waits = [i for i, e in enumerate(arr.log) if e.startswith("wait")]
        assert len(starts) == len(waits) == arr.blocks and max(starts) < min(waits), arr.log
        arr.data += 1  # the caller goes on changing its arrays
    handle.wait()
    got = xckpt.load(tmp_path / "a")
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    # one buffer per device shard, of exactly its bytes
    assert sorted(allocations) == sorted([100 * 70 * 4] * 3 + [32 * 1000 * 8] * 2)

    # a second save of the same structure copies into the buffers kept from the first
    want2 = {k: v.data.copy() for k, v in state.items() if isinstance(v, DeviceArray)}
    xckpt.save_async(state, tmp_path / "b").wait()
    assert len(allocations) == 5
    got = xckpt.load(tmp_path / "b")
    for k, v in want2.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert xckpt.validate(tmp_path / "b", deep=True).ok


def test_a_failing_device_copy_fails_the_save_and_commits_nothing(tmp_path):
    state = _state()
    state["b"].fail = True
    handle = xckpt.save_async(state, tmp_path / "c")
    with pytest.raises(XckptError, match="device copy 0 failed"):
        handle.wait()
    assert not (tmp_path / "c").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing left beside it
    # the buffers went back to the pool: a good save after it allocates nothing new
    state["b"].fail = False
    xckpt.release_buffers()
    allocations.clear()
    xckpt.save_async(state, tmp_path / "d").wait()
    n = len(allocations)
    state["b"].fail = True
    with pytest.raises(XckptError):
        xckpt.save_async(state, tmp_path / "e").wait()
    state["b"].fail = False
    xckpt.save_async(state, tmp_path / "f").wait()
    assert len(allocations) == n
    np.testing.assert_array_equal(xckpt.load(tmp_path / "f")["b"], state["b"].data)


def test_the_largest_device_shards_are_queued_first(tmp_path):
    """The device copies the big shards while the small ones (biases, norms) are still being queued."""
    rng = np.random.default_rng(7)
    order: list[str] = []
    state = {f"bias{i}": DeviceArray(rng.standard_normal((4, 8)).astype(np.float32), blocks=1, log=order,
                                     name=f"bias{i}/") for i in range(3)}
    state["big"] = DeviceArray(rng.standard_normal((64, 64)).astype(np.float32), blocks=2, log=order, name="big/")
    state["mid"] = DeviceArray(rng.standard_normal((16, 64)).astype(np.float32), blocks=1, log=order, name="mid/")
    xckpt.release_buffers()  # a first save: nothing starts while describing
    xckpt.save_async(state, tmp_path / "a").wait()
    copies = [e for e in order if not e.startswith("describe")]
    starts = [e for e in copies if e.startswith("start")]
    assert starts[:3] == ["start big/0", "start big/1", "start mid/0"], order  # big's 32 x 64 blocks, then 16 x 64
    assert sorted(starts[3:]) == ["start bias0/0", "start bias1/0", "start bias2/0"], order
    assert len(starts) == 6 and all(e.startswith("start") for e in copies[:6]), order  # all start before any wait
    got = xckpt.load(tmp_path / "a")
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v.data, err_msg=k)


def test_a_later_save_starts_its_device_copies_while_the_tree_is_described(tmp_path):
    """The shards the last save_async staged start copying into the buffers kept from it as soon as their
    leaf is described, before the plan is agreed; a save that fails while planning gives those buffers back."""
    rng = np.random.default_rng(11)
    order: list[str] = []
    state = {"a": DeviceArray(rng.standard_normal((40, 30)).astype(np.float32), blocks=2, log=order, name="a/"),
             "b": DeviceArray(rng.integers(0, 9, (8, 5)).astype(np.int32), blocks=1, log=order, name="b/"),
             "host": rng.standard_normal((6, 6)), "step": 3}
    xckpt.release_buffers()
    allocations.clear()
    first = xckpt.save_async(state, tmp_path / "1")
    first.wait()
    assert [e for e in order if not e.startswith("wait")][:2] == ["describe a/", "describe b/"], order
    assert first.stats["early_copies"] == 0
    assert len(allocations) == 3

    order.clear()
    want = {k: v.data.copy() for k, v in state.items() if isinstance(v, DeviceArray)}
    handle = xckpt.save_async(state, tmp_path / "2")
    assert order[:5] == ["describe a/", "start a/0", "start a/1", "describe b/", "start b/0"], order
    assert sorted(e for e in order if e.startswith("start")) == ["start a/0", "start a/1", "start b/0"], order
    state["a"].data += 1  # the caller goes on changing its arrays
    handle.wait()
    assert len(allocations) == 3  # into the buffers kept from the first save
    assert handle.stats["staged_during_planning"]  # the host array is staged while the plan is agreed
    assert handle.stats["early_copies"] == 3
    got = xckpt.load(tmp_path / "2")
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    np.testing.assert_array_equal(got["host"], state["host"])

    # the copies started while describing a save that then fails are waited for and their buffers given
    # back: when planning fails (its path exists), and when a later leaf cannot be described at all
    for path, bad, match in ((tmp_path / "2", {}, "exists"), (tmp_path / "x", {"zz": object()}, "cannot save")):
        order.clear()
        with pytest.raises(XckptError, match=match):
            xckpt.save_async({**state, **bad}, path)
        assert sorted(e for e in order if e.startswith("start")) == ["start a/0", "start a/1", "start b/0"], order
        assert sorted(e for e in order if e.startswith("wait")) == ["wait a/0", "wait a/1", "wait b/0"], order
    assert not (tmp_path / "x").exists()
    # the next save allocates nothing new, and stores what the arrays hold then
    state["b"].data -= 2
    xckpt.save_async(state, tmp_path / "3").wait()
    assert len(allocations) == 3
    got = xckpt.load(tmp_path / "3")
    for k in ("a", "b"):
        np.testing.assert_array_equal(got[k], state[k].data, err_msg=k)
    assert xckpt.validate(tmp_path / "3", deep=True).ok



@dataclass
class CopiedArray:
    """An array on a pretend accelerator whose source fetches a host copy of its own (``Shard.fetch_copies``),
    as a JAX array's on a GPU does: ``prefetch`` takes the copy, ``fetch`` gives it."""

    data: np.ndarray
    blocks: int = 2
    log: list[str] = field(default_factory=list)
    name: str = ""


def _copied_source(arr: CopiedArray) -> registry.ArraySource:
    arr.log.append(f"describe {arr.name}")
    shards = []
    for i, r in enumerate(np.array_split(np.arange(arr.data.shape[0]), arr.blocks)):
        region = Region((int(r[0]), 0), (len(r), arr.data.shape[1]))
        held: dict[str, np.ndarray] = {}

        def prefetch(i: int = i, region: Region = region, held: dict = held) -> None:
            if "copy" not in held:
                arr.log.append(f"start {arr.name}{i}")
                held["copy"] = arr.data[region.slices()].copy()

        def fetch(prefetch: Callable[[], None] = prefetch, held: dict = held) -> np.ndarray:
            prefetch()
            return held["copy"]
        shards.append(registry.Shard(region, fetch, prefetch, fetch_copies=True))
    return registry.ArraySource(arr.data.shape, dtypes.logical_name(arr.data.dtype), shards)


registry.register_source(lambda obj: isinstance(obj, CopiedArray), _copied_source)


def test_shards_that_fetch_copies_of_their_own_are_kept_and_started_while_described(tmp_path):
    """A shard whose fetch is a copy of its own is staged as fetched, with no staging buffer (the host array
    beside it takes one); in a later save_async its copy starts as soon as its leaf is described."""
    from xckpt.engine import background

    rng = np.random.default_rng(12)
    order: list[str] = []
    state = {"a": CopiedArray(rng.standard_normal((40, 30)).astype(np.float32), log=order, name="a/"),
             "b": CopiedArray(rng.integers(0, 9, (8, 5)).astype(np.int32), blocks=1, log=order, name="b/"),
             "host": rng.standard_normal((6, 6))}
    xckpt.release_buffers()
    first = xckpt.save_async(state, tmp_path / "1")
    first.wait()
    assert order[:2] == ["describe a/", "describe b/"] and first.stats["early_copies"] == 0, order
    assert sum(len(v) for v in background._staging._free.values()) == 1  # the host array's chunk only
    for name in ("2", "3"):
        order.clear()
        want = {k: v.data.copy() for k, v in state.items() if isinstance(v, CopiedArray)}
        handle = xckpt.save_async(state, tmp_path / name)
        assert order == ["describe a/", "start a/0", "start a/1", "describe b/", "start b/0"], order
        state["a"].data += 1  # the caller goes on changing its arrays
        handle.wait()
        assert handle.stats["early_copies"] == 3
        assert sum(len(v) for v in background._staging._free.values()) == 1
        got = xckpt.load(tmp_path / name)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{name} {k}")
