"""The checkpoint manager (:class:`xckpt.CheckpointManager`) and :func:`xckpt.list_steps`.

* a JAX training loop in one process: the interval policy, a time interval, a save request, a
  SIGTERM, retention (last N, every K steps, best by a metric, younger than a duration; a step
  being read is kept; nothing but committed steps is ever deleted), resuming from the latest;
* a PyTorch loop on 2 gloo ranks (module, AdamW, RNG state, a data loader's state): a save
  request and a SIGTERM on one rank that both ranks agree on, retention, resuming;
* a process killed by SIGKILL at points of a manager save: the last committed step is the
  latest and restores exactly, and the next save removes the dead save's leftovers;
* Orbax's ``CheckpointManager`` lists and restores a run written by xckpt's (metrics
  included), and xckpt's lists, restores and continues a run written by Orbax's.
"""

from __future__ import annotations

import warnings

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import xckpt
from xckpt.cli import main as cli_main
from xckpt.errors import XckptError

import manager_workers as mw
from spawn import free_port, run_processes

HERE = Path(__file__).parent


def _entries(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def _params(step: int) -> dict[str, np.ndarray]:
    """The JAX loop's parameters after ``step`` (as numpy)."""
    return {"w": np.arange(24, dtype=np.float32).reshape(4, 6) * 0.25 + step,
            "b": np.full((6,), -step, dtype=np.int32)}


def _backdate(step_dir: Path, seconds: float) -> None:
    """Make a step look committed ``seconds`` ago (its ``_CHECKPOINT_METADATA`` commit time)."""
    f = step_dir / "_CHECKPOINT_METADATA"
    meta = json.loads(f.read_text())
    meta["commit_timestamp_nsecs"] = int((time.time() - seconds) * 1e9)
    f.write_text(json.dumps(meta))


# -- list_steps ---------------------------------------------------------------------------------


def test_list_steps_layouts(tmp_path: Path) -> None:
    root = tmp_path / "run"
    xckpt.save({"a": np.arange(5.0), "n": 1}, root / "5", metadata={"manager": {"metrics": {"acc": 0.5}}})
    xckpt.save({"a": np.arange(3.0)}, root / "7" / "default")  # a CheckpointManager step's item
    (root / "9").mkdir()  # incomplete: no checkpoint
    (root / (".11.xckpt-tmp-" + "0" * 32)).mkdir()  # what a save leaves beside its destination
    (root / "12").write_text("a file, not a step")
    os.symlink(root / "5", root / "13")  # a link is never a step
    (root / "step_x").mkdir()
    steps = xckpt.list_steps(root)
    assert [(s.step, s.committed, s.format, s.leaves) for s in steps] == [
        (5, True, "xckpt", 2), (7, True, "xckpt", 1), (9, False, None, None)]
    five = steps[0]
    assert five.path == str(root / "5") and five.metrics == {"acc": 0.5}
    assert five.size_bytes == sum(p.stat().st_size for p in (root / "5").rglob("*") if p.is_file())
    assert five.commit_time is not None and abs(five.commit_time - time.time()) < 60
    assert steps[2].size_bytes == 0 and steps[2].metrics == {} and steps[2].commit_time is None
    assert [s.size_bytes for s in xckpt.list_steps(root, sizes=False)] == [None, None, None]
    assert xckpt.list_steps(tmp_path / "missing") == []


# -- JAX, one process ------------------------------------------------------------------------------


def test_jax_loop_policies_retention_resume(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    root = tmp_path / "run"
    root.mkdir()
    (root / "notes.txt").write_text("kept")
    (root / "3").mkdir()  # an integer-named directory without a checkpoint: never deleted
    (root / "logs").mkdir()

    def loss_of(step: int) -> float:
        return abs(step - 10) + 1.0  # best (lowest) at step 10

    original = signal.getsignal(signal.SIGTERM)
    saved = []
    with xckpt.CheckpointManager(root, save_interval_steps=5, max_to_keep=2, keep_period=20, best_fn="loss",
                                 best_mode="min", keep_best=1, preemption_signal=signal.SIGTERM) as m:
        assert m.coordinator.world_size == 1
        for step in range(1, 41):
            state = {"params": {k: jnp.asarray(v) for k, v in _params(step).items()}, "step": step}
            if step == 23:
                m.request_save()  # a user-set flag
            if step == 31:
                os.kill(os.getpid(), signal.SIGTERM)
            if m.should_save(step):
                assert m.should_save(step)  # asked again: the same answer
                assert m.save(step, state, metrics={"loss": loss_of(step)})
                saved.append(step)
            else:
                assert not m.save(step, state)  # save() asks the policy itself
            assert m.reached_preemption(step) == (step >= 31)
        m.wait()
        assert saved == [5, 10, 15, 20, 23, 25, 30, 31, 35, 40]
        infos = m.all_steps()
        # last 2 (35, 40), every 20 (20, 40), best loss (10); 23 and 31 (unscheduled) went too
        assert [s.step for s in infos] == [10, 20, 35, 40]
        assert [s.metrics["loss"] for s in infos] == [1.0, 11.0, 26.0, 31.0]
        assert all(s.format == "xckpt" and s.leaves == 3 and s.size_bytes and s.commit_time for s in infos)
        assert m.latest_step() == 40
        with pytest.raises(XckptError) as exc:
            m.save(40, {"x": np.zeros(1)}, force=True)
        assert exc.value.code == "manager.step_exists"
    assert signal.getsignal(signal.SIGTERM) == original
    assert _entries(root) == ["10", "20", "3", "35", "40", "logs", "notes.txt"]

    # younger-than and a step being read, in a new manager over the same run
    _backdate(root / "10", 7200)
    _backdate(root / "20", 7200)
    with xckpt.CheckpointManager(root, max_to_keep=1, keep_younger_than_s=3600) as m:
        with m.reading(10):
            m.save(45, {"params": _params(45), "step": 45}, force=True)
            m.wait()
            assert [s.step for s in m.all_steps()] == [10, 35, 40, 45]  # 20 is old; 10 is being read
        assert m.steps_to_delete() == [10]
        m.save(46, {"params": _params(46), "step": 46}, force=True)
        m.wait()
        assert [s.step for s in m.all_steps()] == [35, 40, 45, 46]

    # a time interval
    with xckpt.CheckpointManager(root, save_interval_s=0.3) as m:
        assert not m.should_save(47)
        time.sleep(0.35)
        assert m.should_save(48)
        assert not m.should_save(46)  # not newer than the last saved step

    # resume: the latest, into abstract JAX arrays; an older step by number
    with xckpt.CheckpointManager(root) as m:
        assert m.latest_step() == 46
        like = {"params": {"w": jax.ShapeDtypeStruct((4, 6), jnp.float32), "b": jax.ShapeDtypeStruct((6,), jnp.int32)},
                "step": 0}
        out = m.restore(like=like)
        assert out["step"] == 46 and isinstance(out["params"]["w"], jax.Array)
        for k, v in _params(46).items():
            np.testing.assert_array_equal(np.asarray(out["params"][k]), v)
        old = m.restore(35)
        for k, v in _params(35).items():
            np.testing.assert_array_equal(old["params"][k], v)
        with pytest.raises(XckptError):
            m.restore(3)  # incomplete


def test_best_only_keeps_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with xckpt.CheckpointManager(root, save_interval_steps=1, keep_best=1, best_fn=lambda mt: mt["acc"][1]) as m:
        for step, acc in ((1, 0.9), (2, 0.5), (3, 0.4), (4, 0.1)):
            assert m.save(step, {"x": np.full(3, step)}, metrics={"acc": [0, np.float32(acc)]})
        m.wait()
        # the best (1) and the newest committed (4), which is never deleted
        infos = m.all_steps()
        assert [s.step for s in infos] == [1, 4]
        assert infos[0].metrics == {"acc": [0, float(np.float32(0.9))]}  # numpy scalars recorded as numbers
        np.testing.assert_array_equal(m.restore()["x"], np.full(3, 4))


def test_a_step_saved_without_the_ranked_metric_is_said(tmp_path: Path) -> None:
    """best_fn names a metric a save does not record: that step cannot be ranked, and the save says so (keep_best
    would otherwise silently keep nothing); steps that record it are ranked."""
    with xckpt.CheckpointManager(tmp_path / "run", save_interval_steps=1, keep_best=1, best_fn="val_loss",
                                 best_mode="min") as m:
        with pytest.warns(xckpt.XckptWarning, match="without the metric 'val_loss'"):
            m.save(1, {"x": np.ones(2)}, metrics={"loss": 1.0})
        for step, val in ((2, 0.3), (3, 0.7), (4, 0.9)):
            with warnings.catch_warnings():
                warnings.simplefilter("error", xckpt.XckptWarning)
                m.save(step, {"x": np.full(2, step)}, metrics={"loss": 1.0, "val_loss": val})
        m.wait()
        assert [s.step for s in m.all_steps()] == [2, 4]  # the best by val_loss, and the newest


def test_no_step(tmp_path: Path) -> None:
    with xckpt.CheckpointManager(tmp_path / "empty") as m:
        assert m.latest_step() is None and m.all_steps() == []
        with pytest.raises(XckptError) as exc:
            m.restore()
        assert exc.value.code == "manager.no_step"
    with pytest.raises(XckptError) as exc:
        m.save(1, {"a": np.zeros(2)}, force=True)
    assert exc.value.code == "manager.closed"


# -- PyTorch, 2 gloo ranks ------------------------------------------------------------------------


def test_torch_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch_workers

    results = torch_workers.run_group(2, "manager_workers:manager_torch", tmp_path, timeout=120)
    assert results[0] == results[1]  # every decision agreed
    assert results[0]["saved"] == [3, 5, 6, 7]
    assert [s.step for s in xckpt.list_steps(tmp_path / "run") if s.committed] == [6, 7]
    assert _entries(tmp_path / "run") == ["6", "7"]  # nothing else left behind


# -- JAX, 2 processes ------------------------------------------------------------------------------


def test_jax_two_processes(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    port = str(free_port())
    run_processes(lambda r: [str(HERE / "manager_workers.py"), "jax", str(r), port, str(tmp_path / "run")], 2,
                  lambda r: f"OK {r}", timeout=120, jax_devices=None)
    assert [s.step for s in xckpt.list_steps(tmp_path / "run") if s.committed] == [6, 8]
    assert _entries(tmp_path / "run") == ["6", "8"]  # nothing else left behind


# -- kill -9 during a manager save -------------------------------------------------------------


#: Points an asynchronous save of one process reaches: staged, written, half committed, committed in staging.
KILL_POINTS = ("after_stage", "before_status", "after_commit_marker", "before_publish", "after_publish")


def test_kill_during_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("XCKPT_FAILPOINTS", None)
    procs = {p: subprocess.Popen([sys.executable, str(HERE / "manager_workers.py"), "kill", str(tmp_path / p), p],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for p in KILL_POINTS}
    for point, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, out.decode()[-2000:])
    monkeypatch.setenv("XCKPT_STALE_AFTER_S", "0.2")
    time.sleep(0.3)
    for point in KILL_POINTS:
        root = tmp_path / point
        assert [(s.step, s.committed) for s in xckpt.list_steps(root)] == [(1, True), (2, True)], point
        leftovers = [e for e in _entries(root) if e not in ("1", "2")]
        assert leftovers, point  # the dead save left something behind
        with xckpt.CheckpointManager(root, save_interval_steps=1) as m:
            assert m.latest_step() == 2
            got = m.restore()
            want = mw.numpy_state(2)
            assert got["step"] == 2
            np.testing.assert_array_equal(got["a"], want["a"])
            np.testing.assert_array_equal(got["b"]["c"], want["b"]["c"])
            np.testing.assert_array_equal(got["b"]["d"], want["b"]["d"])
            assert m.save(3, mw.numpy_state(3))
            m.wait()
        assert _entries(root) == ["1", "2", "3"], (point, _entries(root))  # the leftovers are gone
        np.testing.assert_array_equal(xckpt.load(root / "3")["a"], mw.numpy_state(3)["a"])


# -- publishing a step: specific errors, nothing foreign deleted, the staged step removed ------------------


def _hook_publish(monkeypatch: pytest.MonkeyPatch, step: int, before: Any) -> None:
    """Run ``before(staging)`` whenever the manager publishes ``step`` (its checkpoint committed in the staged step)."""
    publish = xckpt.CheckpointManager._publish

    def hooked(self: Any, flight: Any, metrics: Any, started_ns: int) -> None:
        if flight.step == step:
            before(Path(flight.staging))
        publish(self, flight, metrics, started_ns)

    monkeypatch.setattr(xckpt.CheckpointManager, "_publish", hooked)


@pytest.mark.parametrize("renameat2", [True, False])
def test_step_appearing_during_its_save_is_step_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       renameat2: bool) -> None:
    from xckpt.engine import atomic

    if not renameat2:
        monkeypatch.setattr(atomic, "_renameat2", None)  # as XCKPT_NO_RENAMEAT2=1, or off Linux
    root = tmp_path / "run"
    staged: list[Path] = []

    def someone_else(staging: Path) -> None:  # another job of the run, or a user, makes the step meanwhile
        staged.append(staging)
        assert (staging / "default" / "xckpt.json").is_file()
        (root / "2").mkdir()
        (root / "2" / "other.txt").write_text("someone else's")

    _hook_publish(monkeypatch, 2, someone_else)
    with xckpt.CheckpointManager(root) as m:
        m.save(1, {"a": np.ones(10, np.float32)}, force=True)
        m.wait()
        assert m.save(2, {"a": np.arange(4000, dtype=np.float32)}, force=True)
        with pytest.raises(XckptError) as exc:
            m.wait()
        assert type(exc.value) is XckptError and exc.value.code == "manager.step_exists"
        assert exc.value.file == str(root / "2")
        assert _entries(root) == ["1", "2"] and not staged[0].exists()  # the staged step is removed
        assert os.listdir(root / "2") == ["other.txt"] and (root / "2" / "other.txt").read_text() == "someone else's"
        assert m.latest_step() == 1
        assert m.save(3, {"a": np.full(3, 3.0)}, force=True)
        m.wait()
    assert _entries(root) == ["1", "2", "3"]
    np.testing.assert_array_equal(xckpt.load(root / "3")["a"], np.full(3, 3.0))


@pytest.fixture()
def small_fs(tmp_path: Path) -> Any:
    """A 16 MiB tmpfs (mounting one needs root: skipped otherwise)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill(directory: Path, leave_pages: int) -> None:
    """Fill the file system of ``directory`` with ``directory/filler``, then free ``leave_pages`` 4 KiB pages."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in (1 << 20, 4096):
            while True:
                try:
                    os.write(fd, b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
        size = os.fstat(fd).st_size
        os.ftruncate(fd, size - size % 4096 - 4096 * leave_pages)
    finally:
        os.close(fd)


def test_one_managers_failed_step_does_not_fail_anothers(small_fs: Path, tmp_path: Path) -> None:
    """Two managers in one process (a model's run, an EMA's on another disk): A's step fails in the background
    (its disk is full); B's save goes on, A.wait() raises A's failure."""
    a = xckpt.CheckpointManager(small_fs / "a")
    b = xckpt.CheckpointManager(tmp_path / "b")
    assert a.save(1, {"w": np.ones(4_000_000)}, force=True)  # 32 MB on a 16 MiB file system
    assert b.save(1, {"w": np.arange(10.0)}, force=True)
    b.wait()
    with pytest.raises(XckptError) as exc:
        a.wait()
    assert exc.value.code == "io.write" and "No space left on device" in str(exc.value)
    a.close()
    b.close()
    np.testing.assert_array_equal(xckpt.load(tmp_path / "b" / "1")["w"], np.arange(10.0))
    assert [s.step for s in xckpt.list_steps(small_fs / "a")] == []


def test_a_failed_last_step_is_told_at_exit(small_fs: Path) -> None:
    """A script that ends without wait() or close(): its last step still commits at exit, and when it
    fails instead, stderr says so (the exit status cannot)."""
    script = (f"import numpy as np, xckpt\n"
              f"m = xckpt.CheckpointManager({str(small_fs / 'run')!r})\n"
              f"m.save(1, {{'w': np.ones(4_000_000)}}, force=True)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "could not save step 1, and nothing waited for it" in p.stderr and "io.write" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert [s.step for s in xckpt.list_steps(small_fs / "run")] == []


@pytest.mark.parametrize("warnings_as_errors", [False, True])
def test_a_step_warned_of_on_leaving_a_with_block_is_told_once(tmp_path: Path, warnings_as_errors: bool) -> None:
    """A with block left on an exception warns that its last step was not saved (it failed in the background);
    the exit hook does not say it again as a failure that nothing waited for. Where that warning is an error
    (and so never shown), the exit hook says it."""
    script = ("import warnings, numpy as np, xckpt\n"
              + ("warnings.simplefilter('error', xckpt.XckptWarning)\n" if warnings_as_errors else "")
              + f"with xckpt.CheckpointManager({str(tmp_path / 'run')!r}) as m:\n"
              "    m.save(1, {'w': np.ones(10)}, force=True)\n"
              "    raise SystemExit('training failed')\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, XCKPT_FAILPOINTS="before_status:raise"))
    assert p.returncode == 1 and "training failed" in p.stderr, p.stderr
    assert "failpoint before_status" in p.stderr, p.stderr
    told = ["step 1 was not saved" in p.stderr, "could not save step 1, and nothing waited for it" in p.stderr]
    assert told == ([False, True] if warnings_as_errors else [True, False]), p.stderr
    assert xckpt.list_steps(tmp_path / "run") == []


def test_a_managers_failure_does_not_fail_a_save_made_right_after(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager's step fails in the background; a plain xckpt.save right after save() returned, before the
    manager's own thread waited for the step (held back here), saves: the failure is the manager's to raise."""
    gate = threading.Event()

    def hold(frame: Any, event: str, arg: Any) -> None:  # threading.settrace: runs first in each new thread
        if threading.current_thread().name == "xckpt-manager-finish":
            gate.wait(60)
        sys.settrace(None)

    monkeypatch.setenv("XCKPT_FAILPOINTS", "before_status:raise")  # the asynchronous save fails
    m = xckpt.CheckpointManager(tmp_path / "a")
    threading.settrace(hold)
    try:
        assert m.save(1, {"w": np.ones(10)}, force=True)
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    try:
        xckpt.save({"x": np.arange(3)}, tmp_path / "other")
    finally:
        gate.set()
    np.testing.assert_array_equal(xckpt.load(tmp_path / "other")["x"], np.arange(3))
    with pytest.raises(XckptError) as exc:
        m.wait()
    assert "failpoint before_status" in str(exc.value)
    m.close()
    assert xckpt.list_steps(tmp_path / "a") == []


def test_a_bad_metric_or_setting_is_named_and_nothing_is_written(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A metric that is not one number (an array, an object) is manager.metrics naming its key path (as the
    leaf); metrics that are not a dict are manager.metrics; a bad XCKPT_STALE_AFTER_S is config.env."""
    root = tmp_path / "run"
    with xckpt.CheckpointManager(root) as m:
        for metrics, leaf in (({"loss": 1.0, "hist": [0.5, np.zeros(3)]}, "hist/1"),
                              ({"loss": 1.0, "cfg": {"lr": object()}}, "cfg/lr"), ([("loss", 1.0)], None)):
            with pytest.raises(XckptError) as exc:
                m.save(1, {"w": np.ones(2)}, force=True, metrics=metrics)
            assert exc.value.code == "manager.metrics" and exc.value.leaf == leaf, exc.value
            assert leaf is None or f"the metric {leaf!r}" in str(exc.value), exc.value
        monkeypatch.setenv("XCKPT_STALE_AFTER_S", "1h")
        with pytest.raises(XckptError) as exc:
            m.save(1, {"w": np.ones(2)}, force=True)
        assert exc.value.code == "config.env" and "XCKPT_STALE_AFTER_S" in str(exc.value)
        monkeypatch.delenv("XCKPT_STALE_AFTER_S")
        assert _entries(root) == []
        assert m.save(1, {"w": np.ones(2)}, force=True, metrics={"loss": np.float32(0.5)})
    assert [(s.step, s.metrics) for s in xckpt.list_steps(root)] == [(1, {"loss": 0.5})]


def test_zero_padded_directories_are_not_steps(tmp_path: Path) -> None:
    """A step's directory is its canonical decimal name: "010" is someone else's directory (listed as no step,
    never deleted by retention), so step 10 never has two directories."""
    root = tmp_path / "run"
    xckpt.save({"w": np.ones(2)}, root / "010")
    step_of = xckpt.manager.step_of
    assert step_of("010") is None and step_of("0") == 0 and step_of("010", 3) == 10 and step_of("10", 3) is None
    with xckpt.CheckpointManager(root, max_to_keep=1) as m:
        assert m.latest_step() is None
        for step in (10, 11):
            m.save(step, {"w": np.full(2, step)}, force=True)
    assert _entries(root) == ["010", "11"]
    np.testing.assert_array_equal(xckpt.load(root / "010")["w"], np.ones(2))


@pytest.mark.parametrize("bad", [b"[" * 100_000, b'{"a": 1' + b"0" * 5000 + b"}", b"\xff{}"])
def test_a_step_whose_orbax_metadata_cannot_be_parsed_is_listed_incomplete(tmp_path: Path, bad: bytes) -> None:
    """An Orbax step's _CHECKPOINT_METADATA nested 100,000 deep, holding a 5,000-digit number or no UTF-8: the
    step is listed (not committed as an Orbax step), and the listing raises nothing."""
    step = tmp_path / "run" / "7"
    step.mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_bytes(bad)
    (step / "commit_success.txt").write_text("ok")
    assert [(s.step, s.committed) for s in xckpt.list_steps(tmp_path / "run")] == [(7, False)]


@pytest.mark.parametrize(("dirs", "width", "steps"), [
    (["0001", "0002", "10000"], 4, [1, 2, 10000]),  # Orbax's step_format_fixed_length=4, past step 9999
    (["0000", "0010", "10"], 4, [0, 10]),
    (["010"], None, []),
    (["010"], 3, [10]),
    (["0", "7", "12", "007"], None, [0, 7, 12]),
    (["010", "10"], None, [10]),
    (["0001", "02", "x0003", "٣"], 4, [1]),
])
def test_step_names(tmp_path: Path, dirs: list[str], width: int | None, steps: list[int]) -> None:
    """Which directories are steps: canonical decimal names, or with step_format_fixed_length=N, Orbax's names
    zero-padded to N digits; never two names of one step, never a link or a file."""
    for name in dirs:
        (tmp_path / name).mkdir()
    (tmp_path / "0003").symlink_to(tmp_path / "0001")
    (tmp_path / "3").symlink_to(tmp_path / "0001")
    (tmp_path / "03").write_text("")
    got = xckpt.list_steps(tmp_path, sizes=False, step_format_fixed_length=width)
    assert [s.step for s in got] == steps
    assert all(os.path.basename(s.path) in dirs and not s.committed for s in got)
    with pytest.raises(ValueError):
        xckpt.list_steps(tmp_path, step_format_fixed_length=0)


@pytest.mark.parametrize(("metrics", "leave_pages", "failing"), [
    (None, 0, "_CHECKPOINT_METADATA"),
    (None, 1, "commit_success.txt"),  # _CHECKPOINT_METADATA fits in the one page left
    ({"loss": 0.5}, 0, "metrics/metrics"),
])
def test_disk_full_while_publishing_is_io_write(small_fs: Path, monkeypatch: pytest.MonkeyPatch,
                                                metrics: Any, leave_pages: int, failing: str) -> None:
    root = small_fs / "run"
    staged: list[Path] = []

    def fill(staging: Path) -> None:
        staged.append(staging)
        if len(staged) == 1:  # the first save of step 2 only
            _fill(small_fs, leave_pages)

    _hook_publish(monkeypatch, 2, fill)
    with xckpt.CheckpointManager(root) as m:
        m.save(1, {"a": np.ones(10, np.float32)}, force=True)
        m.wait()
        assert m.save(2, {"a": np.arange(100_000, dtype=np.float32)}, force=True, metrics=metrics)
        with pytest.raises(XckptError) as exc:
            m.wait()
        assert exc.value.code == "io.write" and exc.value.file == str(staged[0] / failing), exc.value
        assert "No space left on device" in str(exc.value)
        assert _entries(root) == ["1"] and not staged[0].exists()  # the staged step is removed, step 1 stays
        assert _entries(small_fs) == ["filler", "run"]
        os.unlink(small_fs / "filler")
        assert m.save(2, {"a": np.arange(100_000, dtype=np.float32)}, force=True, metrics=metrics)  # again
        m.wait()
    assert _entries(root) == ["1", "2"]
    np.testing.assert_array_equal(xckpt.load(root / "2")["a"], np.arange(100_000, dtype=np.float32))
    assert [s.step for s in xckpt.list_steps(root) if s.committed] == [1, 2]


# -- Orbax both ways --------------------------------------------------------------------------------


def test_orbax_reads_xckpt_run(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    root = tmp_path / "run"
    losses = {2: 0.7, 4: 0.2, 6: 0.5}
    with xckpt.CheckpointManager(root, save_interval_steps=2) as m:
        for step in range(1, 7):
            state = {"params": {k: jnp.asarray(v) for k, v in _params(step).items()}, "step": step}
            m.save(step, state, metrics={"loss": losses.get(step, 0.0)})
    om = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(best_fn=lambda mt: mt["loss"],
                                                                          best_mode="min"))
    assert list(om.all_steps()) == [2, 4, 6] and om.latest_step() == 6
    assert om.best_step() == 4  # Orbax read the metrics the manager recorded
    abstract = {"params": {"w": jax.ShapeDtypeStruct((4, 6), jnp.float32), "b": jax.ShapeDtypeStruct((6,), jnp.int32)},
                "step": 0}
    out = om.restore(om.latest_step(), args=ocp.args.StandardRestore(abstract))
    assert int(out["step"]) == 6
    for k, v in _params(6).items():
        np.testing.assert_array_equal(np.asarray(out["params"][k]), v)
    om.close()
    # Orbax v1's training Checkpointer lists the steps too, and loads one by its item's name
    v1 = ocp.v1.training.Checkpointer(root)
    assert [c.step for c in v1.checkpoints] == [2, 4, 6]
    out = v1.load(4, checkpointable_name="default")
    assert int(out["step"]) == 4
    for k, v in _params(4).items():
        np.testing.assert_array_equal(np.asarray(out["params"][k]), v)
    v1.close()


@pytest.mark.parametrize("fixed_length", [None, 4])
def test_xckpt_reads_and_continues_orbax_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             fixed_length: int | None) -> None:
    """A run Orbax wrote (with step_format_fixed_length too: 0010/): listed, restored, and continued in its
    naming, so that Orbax reads the continued run."""
    ocp = pytest.importorskip("orbax.checkpoint")
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    root = tmp_path / "run"
    opts = ocp.CheckpointManagerOptions(best_fn=lambda mt: mt["loss"], best_mode="min",
                                        step_format_fixed_length=fixed_length)
    with ocp.CheckpointManager(root, options=opts) as om:
        for step in (10, 20, 30):
            tree = {"params": {k: jnp.asarray(v) for k, v in _params(step).items()}, "step": step}
            om.save(step, args=ocp.args.StandardSave(tree), metrics={"loss": 1.0 / step})
        om.wait_until_finished()
    with xckpt.CheckpointManager(root, max_to_keep=2, step_format_fixed_length=fixed_length) as m:
        infos = m.all_steps()
        assert [(s.step, s.format, s.committed) for s in infos] == [(10, "orbax", True), (20, "orbax", True),
                                                                   (30, "orbax", True)]
        assert [s.metrics for s in infos] == [{"loss": 0.1}, {"loss": 0.05}, {"loss": 1.0 / 30}]
        assert all(s.commit_time and s.size_bytes and s.leaves == 3 for s in infos)
        assert m.latest_step() == 30
        out = m.restore()
        assert int(out["step"]) == 30
        for k, v in _params(30).items():
            np.testing.assert_array_equal(np.asarray(out["params"][k]), v)
        m.save(40, {"params": {k: jnp.asarray(v) for k, v in _params(40).items()}, "step": 40}, force=True)
        m.wait()
        assert [s.step for s in m.all_steps()] == [30, 40]  # Orbax's steps are retained like its own
    assert _entries(root) == ([f"{s:0{fixed_length}d}" for s in (30, 40)] if fixed_length else ["30", "40"])
    assert cli_main(["ls", "--json", str(root)] + (["--step-format-fixed-length", "4"] if fixed_length else [])) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["format"]) for s in listed["steps"]] == [(30, "orbax"), (40, "xckpt")]
    assert listed["checkpoints"] == []
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(step_format_fixed_length=fixed_length)) \
            as om:  # and Orbax reads the mixed run
        assert list(om.all_steps()) == [30, 40]
        out = om.restore(40)
        np.testing.assert_array_equal(np.asarray(out["params"]["w"]), _params(40)["w"])


def test_a_step_best_fn_cannot_score_does_not_stop_retention(tmp_path: Path) -> None:
    """A best_fn that raises on one step's metrics (a division by zero, a string where a number was meant):
    that step is not ranked; the other steps are, and max_to_keep still applies (it kept every step, and
    warned, at every save after)."""
    for name, best_fn, first in (("div", lambda m: m["loss"] / m["tokens"], {"loss": 1.0, "tokens": 0}),
                                 ("str", "loss", {"loss": "n/a", "tokens": 1})):
        with warnings.catch_warnings():
            warnings.simplefilter("error", xckpt.XckptWarning)  # no "retention failed"
            with xckpt.CheckpointManager(tmp_path / name, max_to_keep=2, keep_best=1, best_fn=best_fn,
                                         best_mode="min", async_save=False) as m:
                for step in range(1, 7):
                    metrics = first if step == 1 else {"loss": float(7 - step), "tokens": 1}
                    m.save(step, {"x": np.full(2, step)}, metrics=metrics, force=True)
        assert [s.step for s in xckpt.list_steps(tmp_path / name)] == [5, 6], name


def test_metrics_keep_their_types_through_strict_json(tmp_path: Path) -> None:
    """A NaN loss comes back a float, a metric that is the string "NaN" stays a string."""
    import math

    with xckpt.CheckpointManager(tmp_path / "run", async_save=False) as m:
        m.save(1, {"x": np.zeros(2)}, force=True,
               metrics={"loss": float("nan"), "note": "NaN", "hist": [1.0, float("-inf")], "opt": "Infinity"})
    got = xckpt.list_steps(tmp_path / "run")[0].metrics
    assert math.isnan(got["loss"]) and got["hist"] == [1.0, -math.inf], got
    assert got["note"] == "NaN" and got["opt"] == "Infinity", got


def test_should_save_after_a_save_and_after_a_forced_older_step(tmp_path: Path) -> None:
    """A step not newer than the last one saved is never saved again: asked after saving it (the answer
    was cached), or after a forced save of an older step (it lowered the mark)."""
    with xckpt.CheckpointManager(tmp_path / "run", save_interval_steps=10, async_save=False) as m:
        assert m.should_save(10)
        assert m.save(10, {"x": np.zeros(2)})
        assert not m.should_save(10) and not m.save(10, {"x": np.zeros(2)})
        assert m.save(20, {"x": np.zeros(2)})
        assert m.save(5, {"x": np.zeros(2)}, force=True)
        assert not m.should_save(20) and not m.save(20, {"x": np.zeros(2)})
        assert m.should_save(30)
    assert [s.step for s in xckpt.list_steps(tmp_path / "run")] == [5, 10, 20]
