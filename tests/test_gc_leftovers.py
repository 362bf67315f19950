"""Leftovers ``xckpt gc`` and the next save judge by their save's lease (spec 6.6, 8):

* a :class:`xckpt.CheckpointManager` run: a step save killed by SIGKILL leaves its staged step
  (``.<step>.xckpt-step-<token>/``, holding the dead save's temporary directory and lease) beside the
  steps; ``xckpt gc ROOT`` removes it, and an interrupted deletion, by the manager's own rule, while a
  live manager save's staged step (its lease renewed) is kept and then commits;
* a replace without ``renameat2`` (two renames): between them the old checkpoint is aside, and while
  its save is alive neither a recovery (a load's, another save's) nor ``gc`` moves it back; once the
  save is dead (a process of this machine that is gone: at once; another machine's: once its lease is
  stale) it is restored.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import xckpt
from xckpt.cli import main as cli_main
from xckpt.engine import atomic, claims, failpoints
from xckpt.engine.storage import Location
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard

import manager_workers as mw

HERE = Path(__file__).parent
TOKEN = "0123456789abcdef" * 2


def _entries(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def _gated(value: float, gate: threading.Event) -> ArraySource:
    """16 float32 of ``value``, fetched only once ``gate`` is set (holds a save after its planning)."""
    def fetch() -> np.ndarray:
        assert gate.wait(60), "the gate was never opened"
        return np.full(16, value, np.float32)
    return ArraySource((16,), "float32", [Shard(Region((0,), (16,)), fetch)])


def _kill_worker(root: Path, point: str) -> None:
    """``manager_workers.py kill``: steps 1 and 2 saved, the process killed (SIGKILL) while saving step 3."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for name in ("XCKPT_FAILPOINTS", "XCKPT_STALE_AFTER_S"):
        env.pop(name, None)
    res = subprocess.run([sys.executable, str(HERE / "manager_workers.py"), "kill", str(root), point], env=env,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == -signal.SIGKILL, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])


# -- a checkpoint manager's run ------------------------------------------------------------------------


def test_gc_removes_a_killed_manager_step_save_and_keeps_a_live_one(tmp_path, monkeypatch, capsys):
    root = tmp_path / "run"
    monkeypatch.setenv("XCKPT_STALE_AFTER_S", "1")  # the live save renews its lease every 0.125 s
    gate, errors = threading.Event(), []

    def live() -> None:
        try:
            with xckpt.CheckpointManager(root) as m:
                m.save(5, {"x": _gated(5.0, gate), "n": 5}, force=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=live)
    t.start()
    try:
        deadline = time.monotonic() + 60
        live_step: list[str] = []
        while not live_step and time.monotonic() < deadline and t.is_alive():
            live_step = [e for e in os.listdir(root) if e.startswith(".5.xckpt-step-")] if root.exists() else []
            if live_step and not any(".xckpt-lease-" in e for e in os.listdir(root / live_step[0])):
                live_step = []
            time.sleep(0.01)
        assert live_step, errors
        live = live_step[0]

        _kill_worker(root, "before_publish")  # step 3's save dies once committed in its staged step
        dead = [e for e in os.listdir(root) if e.startswith(".3.xckpt-step-")]
        assert len(dead) == 1, _entries(root)
        dead_files = _entries(root / dead[0])
        assert "default" in dead_files or any(".default.xckpt-lease-" in e for e in dead_files), dead_files
        deleting = f".7.xckpt-deleting-{TOKEN}"  # a deletion interrupted after its step was moved aside
        shutil.copytree(root / "1", root / deleting)
        os.symlink(root / "2", root / f".8.xckpt-step-{TOKEN}")  # a link is never a leftover
        (root / ".9.xckpt-step-foreign").mkdir()  # not a manager's name
        before = _entries(root)
        assert before == sorted(["1", "2", dead[0], live, deleting, f".8.xckpt-step-{TOKEN}",
                                 ".9.xckpt-step-foreign"])

        found = {(c.leftover.name, c.leftover.kind): c.action
                 for c in xckpt.gc(root, older_than_s=3600, dry_run=True)}
        # step 3's lease names a process of this machine that no longer runs: dead at once, however young
        assert found == {("3", "step"): "would remove", ("5", "step"): "kept", ("7", "deleting"): "would remove"}
        # gc of a step's path: only that step's leftovers
        assert [(c.leftover.path, c.action) for c in xckpt.gc(root / "3", older_than_s=3600, dry_run=True)] == [
            (str(root / dead[0]), "would remove")]
        assert _entries(root) == before

        time.sleep(1.3)  # the dead save's staged step is now older than 1 s; the live one's lease is renewed
        assert cli_main(["gc", str(root), "--older-than", "1", "--json"]) == 0
        done = json.loads(capsys.readouterr().out)
        assert {(x["name"], x["kind"], x["stale"], x["action"]) for x in done} == {
            ("3", "step", True, "removed"), ("5", "step", False, "kept"), ("7", "deleting", True, "removed")}
        assert {x["path"] for x in done} == {str(root / dead[0]), str(root / live), str(root / deleting)}
        assert _entries(root) == sorted(["1", "2", live, f".8.xckpt-step-{TOKEN}", ".9.xckpt-step-foreign"])
        assert os.listdir(root / ".9.xckpt-step-foreign") == []
    finally:
        gate.set()
        t.join(60)
    assert not errors and not t.is_alive(), errors
    assert _entries(root) == sorted(["1", "2", "5", f".8.xckpt-step-{TOKEN}", ".9.xckpt-step-foreign"])
    np.testing.assert_array_equal(xckpt.load(root / "5")["x"], np.full(16, 5.0, np.float32))
    np.testing.assert_array_equal(xckpt.load(root / "2")["a"], mw.numpy_state(2)["a"])


@pytest.mark.parametrize("point", ["before_status", "after_publish"])
def test_xckpt_gc_cli_removes_a_killed_save_at_once_and_another_machines_with_older_than_0(tmp_path, capsys, point):
    root = tmp_path / "run"
    _kill_worker(root, point)
    left = [e for e in _entries(root) if e not in ("1", "2")]
    assert len(left) == 1 and left[0].startswith(".3.xckpt-step-"), _entries(root)
    size = sum(f.stat().st_size for f in (root / left[0]).rglob("*") if f.is_file())
    assert size > 1_000_000  # step 3's arrays (a: 1.2 MB)

    # the same staged step, as a save on another machine would leave it: its lease cannot be judged from here
    other = f".4.xckpt-step-{TOKEN}"
    shutil.copytree(root / left[0], root / other)
    leases = [f for f in (root / other).iterdir() if ".xckpt-lease-" in f.name]
    assert len(leases) in (1, 2), _entries(root / other)  # its item's save's (before that committed), the step's
    for lease in leases:
        record = json.loads(lease.read_text())
        lease.write_text(json.dumps(dict(record, host=record["host"] + "-elsewhere")))

    # default age, an hour: the killed save's step goes at once (its lease names a process of this machine that
    # no longer runs); the other machine's step is still fresh
    assert cli_main(["gc", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "2 leftovers, removed 1, kept 1 live", out
    assert out[0].split()[:3] == ["removed", "step", "dead"] and out[0].endswith(str(root / left[0]))
    assert out[1].split()[:3] == ["kept", "step", "live"] and out[1].endswith(str(root / other))
    assert _entries(root) == [other, "1", "2"]
    left = [other]

    time.sleep(0.05)
    assert cli_main(["gc", str(root), "--older-than", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["removed", "step", "dead"] and out[0].endswith(str(root / left[0]))
    assert out[-1] == "1 leftovers, removed 1, kept 0 live"
    assert _entries(root) == ["1", "2"]
    assert [(s.step, s.committed) for s in xckpt.list_steps(root)] == [(1, True), (2, True)]
    assert xckpt.gc(root, older_than_s=0) == []


# -- a side copy (a replace without renameat2) -------------------------------------------------------


def _hidden(directory: Path) -> list[str]:
    return sorted(e.split("-")[1] if e.startswith(".ck.xckpt-") else e for e in os.listdir(directory))


def test_recovery_and_gc_leave_a_live_replaces_side_copy_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_renameat2", None)  # as XCKPT_NO_RENAMEAT2=1, or off Linux: two renames
    path = tmp_path / "ck"
    xckpt.save({"a": np.arange(5.0), "s": 0}, path)
    seen: dict[str, object] = {}
    orig = failpoints.hit

    def hit(point: str, rank: int = 0) -> None:
        if point == "after_aside":  # what another process's load, save or gc would do now
            seen["at"] = _hidden(tmp_path)
            seen["recover"] = claims.recover(Location(str(path)))
            seen["gc"] = sorted((c.leftover.kind, c.action) for c in xckpt.gc(tmp_path, older_than_s=3600))
            seen["gc dir"] = sorted((c.leftover.kind, c.action) for c in xckpt.gc(path, older_than_s=3600))
            seen["after"] = _hidden(tmp_path)
        orig(point, rank)

    monkeypatch.setattr(failpoints, "hit", hit)
    xckpt.save({"a": np.arange(5.0), "s": 1}, path, overwrite=True)  # commits: its side copy was left alone
    assert seen == {"at": ["lease", "old", "tmp"], "recover": False,
                    "gc": [("lease", "kept"), ("old", "kept"), ("tmp", "kept")],
                    "gc dir": [("lease", "kept"), ("old", "kept"), ("tmp", "kept")],
                    "after": ["lease", "old", "tmp"]}
    assert _entries(tmp_path) == ["ck"] and xckpt.load(path)["s"] == 1


LEASE_AND_EXIT = """
import sys
from xckpt.engine import claims
from xckpt.engine.storage import Location
claims.Lease(Location(sys.argv[1]), sys.argv[2]).acquire()  # and dies holding it
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        st = f.read()
    return st[st.rindex(b")") + 2:][:1].decode()


def test_side_copy_restored_once_its_saves_lease_is_dead(tmp_path):
    gen = "ab" * 16
    path = tmp_path / "ck"
    final = Location(str(path))
    aside = tmp_path / f".ck.xckpt-old-{gen}"
    lease = tmp_path / f".ck.xckpt-lease-{gen}"
    xckpt.save({"a": np.arange(5.0), "s": 0}, aside)  # the replaced checkpoint, moved aside

    # a live save of this process holds the lease
    mine = claims.Lease(final, gen)
    mine.acquire()
    assert not claims.recover(final) and not claims.recover(final, dry_run=True)
    assert [(c.leftover.kind, c.action) for c in xckpt.gc(tmp_path, older_than_s=3600)] == [
        ("lease", "kept"), ("old", "kept")]
    assert _entries(tmp_path) == [lease.name, aside.name]
    mine.release()

    # a save of another machine: alive until its lease is stale
    lease.write_bytes(json.dumps({"generation": gen, "host": "elsewhere", "pid": os.getpid(),
                                  "heartbeat": time.time() - 100}).encode())
    past = time.time() - 100
    os.utime(lease, (past, past))
    assert not claims.recover(final, stale_after=3600)
    assert claims.recover(final, stale_after=50, dry_run=True)
    assert _entries(tmp_path) == [lease.name, aside.name]
    lease.unlink()

    # a save of this machine whose process is gone (a zombie not yet reaped, then reaped): dead at once
    proc = subprocess.Popen([sys.executable, "-c", LEASE_AND_EXIT, str(path), gen])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sys.platform.startswith("linux") and _state(proc.pid) == "Z" and lease.exists():
                break
            time.sleep(0.02)
        if sys.platform.startswith("linux"):
            assert _state(proc.pid) == "Z"
            assert claims.recover(final, dry_run=True)
    finally:
        assert proc.wait(60) == 0
    assert time.time() - lease.stat().st_mtime < 60  # the lease is fresh: only its process is gone
    assert not claims.lease_live(final, gen)
    assert claims.recover(final)
    assert _entries(tmp_path) == [lease.name, "ck"]
    assert xckpt.load(path)["s"] == 0
    assert not claims.recover(final)  # nothing more to restore
