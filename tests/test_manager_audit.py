"""Audit of the checkpoint manager (:class:`xckpt.CheckpointManager`): each test fails without its fix.

* a directory named by a step that holds something other than an xckpt or Orbax checkpoint (a
  Hugging Face safetensors export) is not a committed step: never the latest, never deleted;
* the latest step and retention do not open every step's manifest again (a run of thousands of steps);
* ``restore()`` of the latest step while a save in flight commits a newer one and retention deletes it;
* steps given as numpy / JAX / torch integers; a step too large for a directory name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import xckpt
import xckpt.manager as manager_mod
from xckpt.errors import XckptError


def _entries(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def _write_safetensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """A safetensors file written by the real ``safetensors`` library (as a Hugging Face export is)."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}, str(path))


# -- a step directory holding another tool's files --------------------------------------------------


def test_a_safetensors_export_named_by_a_step_is_not_a_step_and_is_never_deleted(tmp_path: Path) -> None:
    """A training stack that exports Hugging Face weights into ``run/<step>/``: those directories are not the
    manager's checkpoints. Before the fix they were committed steps (format "safetensors"): the newest one was
    the latest step (a restart restored model weights only), and retention deleted the others, and the
    manager's own fresh steps, because the export's step was newer."""
    root = tmp_path / "run"
    for step in (5, 6):
        (root / str(step)).mkdir(parents=True)
        _write_safetensors(root / str(step) / "model.safetensors", {"w": np.full(3, float(step))})
    got = xckpt.list_steps(root, sizes=False)
    assert [(s.step, s.committed, s.format, s.leaves) for s in got] == [(5, False, None, None), (6, False, None, None)]
    with xckpt.CheckpointManager(root, max_to_keep=1, async_save=False) as m:
        assert m.latest_step() is None
        with pytest.raises(XckptError) as exc:
            m.restore()
        assert exc.value.code == "manager.no_step"
        assert m.save(1, {"a": np.arange(4.0)}, force=True)
        assert m.save(2, {"a": np.arange(4.0) + 2}, force=True)
        assert [s.step for s in m.all_steps()] == [2]
        assert m.latest_step() == 2
        np.testing.assert_array_equal(m.restore()["a"], np.arange(4.0) + 2)
    assert _entries(root) == ["2", "5", "6"]
    for step in (5, 6):
        assert (root / str(step) / "model.safetensors").is_file()
        np.testing.assert_array_equal(xckpt.load(root / str(step))["w"], np.full(3, float(step), np.float32))


# -- thousands of steps -------------------------------------------------------------------------------


def _count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every checkpoint the manager opens to learn what a step holds (the real opener is called)."""
    opened: list[str] = []
    real = manager_mod.open_checkpoint

    def counting(path: Any) -> Any:
        opened.append(os.path.basename(str(path)))
        return real(path)

    monkeypatch.setattr(manager_mod, "open_checkpoint", counting)
    return opened


def test_latest_step_and_retention_do_not_reopen_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every manifest was parsed in full at each latest_step() (creating a manager, restore()) and at each
    save's retention: on a run of 2,000 steps of 500 leaves, 32 s to create a manager, and as long after
    every save. Now the latest step is found from the newest down, and a committed step, which never
    changes, is opened once per manager (again only if its files change)."""
    root = tmp_path / "run"
    leaves = {f"l{i}": np.full(2, float(i)) for i in range(5)}
    with xckpt.CheckpointManager(root, async_save=False) as m:
        m.save(0, {**leaves, "step": 0}, force=True, metrics={"loss": 1.0})
    for step in range(1, 40):
        shutil.copytree(root / "0", root / str(step))
    (root / "40").mkdir()  # newest, incomplete: skipped
    opened = _count_opens(monkeypatch)
    m = xckpt.CheckpointManager(root, keep_period=5, max_to_keep=2, async_save=False)
    assert m.latest_step() == 39
    assert len(opened) <= 4, opened  # 40 (incomplete) and 39, at creation and again here
    del opened[:]
    m.save(100, {**leaves, "step": 100}, force=True, metrics={"loss": 0.5})
    assert [s.step for s in m.all_steps(sizes=False)] == [0, 5, 10, 15, 20, 25, 30, 35, 39, 100]
    del opened[:]
    m.save(101, {**leaves, "step": 101}, force=True)
    # the new step, and 39 (deleted: checked once more before) at most; not the 9 others again
    assert set(opened) <= {"101", "39", "40"} and len(opened) <= 5, opened
    assert [s.step for s in m.all_steps(sizes=False)] == [0, 5, 10, 15, 20, 25, 30, 35, 100, 101]
    # a step replaced in place (another job, a user) is read again, not taken from what was read before
    shutil.rmtree(root / "35")
    xckpt.save({"only": np.arange(3.0)}, root / "35", metadata={"manager": {"metrics": {"loss": 9.0}}})
    infos = {s.step: s for s in m.all_steps(sizes=False)}
    assert (infos[35].leaves, infos[35].metrics, infos[0].leaves, infos[0].metrics) == (1, {"loss": 9.0}, 6,
                                                                                      {"loss": 1.0})
    os.unlink(root / "101" / "default" / "xckpt.json")  # then an Orbax step (the checkpoint's Orbax view)
    assert [(s.step, s.format) for s in m.all_steps(sizes=False)][-2:] == [(100, "xckpt"), (101, "orbax")]
    os.unlink(root / "101" / "default" / "_METADATA")  # no longer committed
    assert m.latest_step() == 100
    np.testing.assert_array_equal(m.restore()["l3"], np.full(2, 3.0))
    m.close()
    # ranking by a metric reads every step's metrics: once per manager, not at every save
    m = xckpt.CheckpointManager(root, max_to_keep=1, keep_best=2, best_fn="loss", best_mode="min", async_save=False)
    m.save(102, {**leaves, "step": 102}, force=True, metrics={"loss": 0.7})
    assert [s.step for s in m.all_steps(sizes=False)] == [100, 102]  # the 2 best: losses 0.5 and 0.7
    del opened[:]
    m.save(103, {**leaves, "step": 103}, force=True, metrics={"loss": 0.1})
    assert set(opened) <= {"103", "102", "101", "40"} and len(opened) <= 6, opened  # new, deleted, incomplete
    assert [(s.step, s.metrics) for s in m.all_steps(sizes=False)] == [(100, {"loss": 0.5}), (103, {"loss": 0.1})]
    m.close()


# -- restore() racing retention --------------------------------------------------------------------


def test_restore_of_the_latest_while_retention_deletes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that rolls back to the latest step (a loss spike) while a save is in flight: the save commits
    step 2 and retention (max_to_keep=1) deletes step 1 between restore() choosing step 1 and reading it.
    Before the fix the restore failed (manifest.missing on step 1); now it restores step 2."""
    gate = threading.Event()

    def hold(frame: Any, event: str, arg: Any) -> None:  # threading.settrace: runs first in each new thread
        if threading.current_thread().name == "xckpt-manager-finish":
            gate.wait(60)
        sys.settrace(None)

    m = xckpt.CheckpointManager(tmp_path / "run", max_to_keep=1)
    m.save(1, {"x": np.full(3, 1.0)}, force=True)
    m.wait()
    threading.settrace(hold)
    try:
        assert m.save(2, {"x": np.full(3, 2.0)}, force=True)
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    flight = m._inflight
    assert flight is not None and flight.thread is not None
    real = xckpt.CheckpointManager.latest_step
    chosen: list[int | None] = []

    def latest(self: Any) -> int | None:
        got = real(self)
        if not chosen:  # step 1 chosen; now step 2 commits and retention deletes step 1
            gate.set()
            flight.thread.join(60)
        chosen.append(got)
        return got

    try:
        monkeypatch.setattr(xckpt.CheckpointManager, "latest_step", latest)
        out = m.restore()
    finally:
        gate.set()
    assert chosen[0] == 1 and chosen[-1] == 2, chosen
    np.testing.assert_array_equal(out["x"], np.full(3, 2.0))
    m.close()
    assert _entries(tmp_path / "run") == ["2"]


# -- retention keeps what was put into a step ------------------------------------------------------------

_PUT_IN = {"notes.txt": b"lr 3e-4; eval looked off", "default/eval.json": b'{"acc": 0.5}',
           "default/a/extra.bin": b"beside a leaf's chunks", "default/a/c/x": b"among its chunk objects",
           "metrics/notes.txt": b"beside the metrics", "tb/events.out": b"tensorboard"}


def _files(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root``, by its path relative to it, with its bytes."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            out[os.path.relpath(os.path.join(d, f), root)] = (Path(d) / f).read_bytes()
    return out


def test_retention_keeps_files_put_into_a_step(tmp_path: Path) -> None:
    """Files a user put into a step (a note at its top, a file in its item and in a leaf's directory, a folder):
    retention deletes what the step's save wrote and keeps them, byte for byte, in ``<step>.xckpt-kept-<token>``
    beside the run with a warning naming it (before, the whole directory went). A step holding nothing else
    goes whole."""
    root = tmp_path / "run"
    with xckpt.CheckpointManager(root, max_to_keep=1, async_save=False) as m:
        assert m.save(1, {"a": np.arange(6.0).reshape(2, 3), "b": {"c": np.ones(4, np.int32)}}, force=True,
                      metrics={"loss": 1.0})
        for name, data in _PUT_IN.items():
            (root / "1" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "1" / name).write_bytes(data)
        # a folder with a file named as a manifest that is not one, and a copy of another checkpoint: not the
        # step's (the first made the whole step kept, the second was deleted with it)
        (root / "1" / "config").mkdir()
        (root / "1" / "config" / "xckpt.json").write_bytes(b'{"log_level": "info"}')
        xckpt.save({"z": np.arange(3)}, root / "1" / "backup")
        put_in = {**_PUT_IN, "config/xckpt.json": b'{"log_level": "info"}',
                  **{f"backup/{k}": v for k, v in _files(root / "1" / "backup").items()}}
        with pytest.warns(xckpt.XckptWarning, match="were not deleted") as caught:
            assert m.save(2, {"a": np.zeros((2, 3)), "b": {"c": np.zeros(4, np.int32)}}, force=True,
                          metrics={"loss": 0.5})
        kept = [e for e in _entries(root) if e.startswith("1.xckpt-kept-")]
        assert len(kept) == 1 and _entries(root) == sorted(["2", kept[0]])
        assert str(root / kept[0]) in str(caught[0].message)
        assert _files(root / kept[0]) == put_in  # nothing of the save's own left, nothing of the user's lost
        assert [s.step for s in m.all_steps()] == [2]
        assert m.save(3, {"a": np.full((2, 3), 3.0), "b": {"c": np.full(4, 3, np.int32)}}, force=True)
    assert _entries(root) == sorted(["3", kept[0]])
    np.testing.assert_array_equal(xckpt.load(root / "3")["a"], np.full((2, 3), 3.0))


@pytest.mark.parametrize("item", ["state", ""])
def test_retention_deletes_a_step_whose_checkpoint_is_a_named_item_or_at_its_top(tmp_path: Path, item: str) -> None:
    """A committed step whose xckpt checkpoint is an item of another name (``2/state/``, an Orbax layout) or lies
    at its top (``xckpt.save`` into ``run/2``): retention deletes what its saves wrote, and only a note put into it
    is kept (the named item's whole checkpoint was kept, as if put there by hand)."""
    root = tmp_path / "run"
    xckpt.save({"a": np.arange(1000.0)}, root / "2" / item)
    if item:
        (root / "2" / "_CHECKPOINT_METADATA").write_text(json.dumps({"item_handlers": {item: "x"}}))
        (root / "2" / "commit_success.txt").write_text("ok")
    (root / "2" / "note.txt").write_bytes(b"keep me")
    assert [(s.step, s.committed, s.format) for s in xckpt.list_steps(root)] == [(2, True, "xckpt")]
    with xckpt.CheckpointManager(root, max_to_keep=1, async_save=False) as m:
        with pytest.warns(xckpt.XckptWarning, match="note.txt"):
            assert m.save(4, {"a": np.arange(6.0)}, force=True)
    kept = [e for e in _entries(root) if e != "4"]
    assert len(kept) == 1 and kept[0].startswith("2.xckpt-kept-")
    assert _files(root / kept[0]) == {"note.txt": b"keep me"}
    assert [d for d, _, _ in os.walk(root / kept[0])] == [str(root / kept[0])]


@pytest.mark.parametrize("cut", ["before its manifest went", "after its manifest went",
                                 "after its manifest went, an Orbax item put into it"])
def test_an_interrupted_step_deletion_is_finished_keeping_files_put_into_it(tmp_path: Path, cut: str) -> None:
    """A deletion killed midway leaves ``.<step>.xckpt-deleting-<token>``: ``xckpt gc`` of the run finishes it
    with the same rule as retention, whether the step's manifest was still there (its own files still known) or
    already gone (only its emptied directories are left of it); the files put into it are kept, an item a user
    saved into it with Orbax too (it was taken for an Orbax step's remains, and the whole directory removed)."""
    root = tmp_path / "run"
    with xckpt.CheckpointManager(root, async_save=False) as m:
        assert m.save(1, {"a": np.arange(6.0).reshape(2, 3), "b": np.ones(4, np.int32)}, force=True,
                      metrics={"loss": 1.0})
    for name, data in _PUT_IN.items():
        (root / "1" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "1" / name).write_bytes(data)
    put_in = dict(_PUT_IN)
    if "Orbax" in cut:
        ocp = pytest.importorskip("orbax.checkpoint")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(root / "1" / "ema", {"w": np.arange(5.0)})
        put_in.update({f"ema/{k}": v for k, v in _files(root / "1" / "ema").items()})
    token = "ab" * 16
    aside = root / f".1.xckpt-deleting-{token}"
    os.rename(root / "1", aside)
    ours = sorted(set(_files(aside)) - set(put_in))
    if cut == "before its manifest went":  # half the step's own files gone, the manifest kept (it goes last)
        for name in ours[: len(ours) // 2]:
            if name != "default/xckpt.json":
                os.unlink(aside / name)
    else:  # every file of its own gone: its directories remain, emptied
        for name in ours:
            os.unlink(aside / name)
    with pytest.warns(xckpt.XckptWarning, match="were not deleted"):
        done = xckpt.gc(root)
    assert [(os.path.basename(c.leftover.path), c.action) for c in done] == [(aside.name, "removed")]
    assert _entries(root) == [f"1.xckpt-kept-{token}"]
    assert _files(root / f"1.xckpt-kept-{token}") == put_in
    dirs = {os.path.relpath(d, root / f"1.xckpt-kept-{token}") for d, _, _ in os.walk(root / f"1.xckpt-kept-{token}")}
    assert {d for d in dirs if not d.startswith("ema")} == {".", "default", "default/a", "default/a/c", "metrics",
                                                            "tb"}


# -- what a step is -----------------------------------------------------------------------------------


def test_integer_steps_of_numpy_jax_and_torch(tmp_path: Path) -> None:
    """A step held as a numpy integer (np.arange loops), a JAX or torch scalar: save() refused it ("a step is
    a non-negative integer, not np.int64(3)") though should_save() took it. It is saved as its int."""
    root = tmp_path / "run"
    steps: list[Any] = [np.int64(3), np.uint32(4)]
    jnp = pytest.importorskip("jax").numpy
    steps.append(jnp.asarray(5, dtype=jnp.int32))
    torch = pytest.importorskip("torch")
    steps.append(torch.tensor(6))
    with xckpt.CheckpointManager(root, save_interval_steps=1, async_save=False) as m:
        for s in steps:
            assert m.should_save(s)
            assert m.save(s, {"x": np.full(2, int(s))}, metrics={"s": int(s)})
            assert not m.should_save(s)
        assert m.latest_step() == 6 and type(m.latest_step()) is int
        np.testing.assert_array_equal(m.restore(np.int64(4))["x"], np.full(2, 4))
        for bad in (np.float64(7.0), 7.5, True, np.int64(-1)):
            with pytest.raises(ValueError):
                m.save(bad, {"x": np.zeros(2)}, force=True)
    assert _entries(root) == ["3", "4", "5", "6"]
    man = json.loads((root / "5" / "default" / "xckpt.json").read_text())
    assert man["metadata"]["manager"]["step"] == 5


def test_a_step_too_large_for_a_directory_name_is_refused_by_name(tmp_path: Path) -> None:
    """Step 10**220: its staged directory's name is longer than a file name may be. Before the fix the save
    failed as io.read "cannot list <staged step>"; now save() says the step is too large, and writes nothing."""
    root = tmp_path / "run"
    big = 10 ** 220
    with xckpt.CheckpointManager(root, async_save=False) as m:
        with pytest.raises(ValueError, match="too large"):
            m.save(big, {"x": np.zeros(2)}, force=True)
        huge = 2 ** 64 + 1  # far beyond any int64 step, and a fine name
        assert m.save(huge, {"x": np.arange(3)}, force=True)
        assert m.latest_step() == huge
        np.testing.assert_array_equal(m.restore()["x"], np.arange(3))
    assert _entries(root) == [str(2 ** 64 + 1)]
    with xckpt.CheckpointManager(tmp_path / "padded", step_format_fixed_length=220, async_save=False) as m:
        with pytest.raises(ValueError, match="too large"):  # step 1 named by 220 digits
            m.save(1, {"x": np.zeros(2)}, force=True)
    assert not (tmp_path / "padded").exists() or _entries(tmp_path / "padded") == []


# -- an object store ------------------------------------------------------------------------------------


def test_a_run_on_s3_is_refused_by_name_and_left_as_it_is(moto: Any) -> None:
    """The manager and list_steps need a local directory (steps appear by rename): an s3:// root is
    ``unsupported`` naming it, before anything is listed, written or deleted (a real moto server)."""
    import uuid

    moto.client.create_bucket(Bucket="mgr-audit")
    url = f"s3://mgr-audit/run-{uuid.uuid4().hex[:6]}"
    xckpt.save({"w": np.arange(6.0)}, f"{url}/1")
    prefix = url[len("s3://mgr-audit/"):] + "/"

    def keys() -> list[str]:
        out = moto.client.list_objects_v2(Bucket="mgr-audit", Prefix=prefix)
        return sorted(o["Key"] for o in out.get("Contents", []))

    before = keys()
    assert f"{prefix}1/xckpt.json" in before
    for make in (lambda: xckpt.CheckpointManager(url, max_to_keep=1), lambda: xckpt.list_steps(url)):
        with pytest.raises(XckptError) as exc:
            make()
        assert exc.value.code == "unsupported" and url in str(exc.value), exc.value
    assert keys() == before
    np.testing.assert_array_equal(xckpt.load(f"{url}/1")["w"], np.arange(6.0))
