"""A checkpoint manager's staged step left by a save killed on this machine is dead at once.

A :class:`xckpt.CheckpointManager` writes step ``s`` into ``.<s>.xckpt-step-<token>/`` beside the steps,
and the save inside holds a lease there (``.default.xckpt-lease-<generation>``: host, boot id, process-id
namespace, pid, heartbeat). Real processes only:

* a process saving a step is killed by SIGKILL (a failpoint) and reaped; the next manager save on the
  same root, with the default stale age (an hour), removes its staged step at once, as ``xckpt gc`` does,
  because its lease names a process of this machine that no longer runs;
* a staged step whose lease names a process that runs (another process's save held before it writes
  its data, or the killed save's lease record pointed at a sleeping process), or a process of another
  machine or pid namespace, or that has no readable lease and is recent, is kept; once that process is
  gone (killed and reaped), the next save removes it.

Restored values are compared element by element.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import xckpt
from xckpt.engine import claims
from xckpt.engine.storage import Location

import manager_workers as mw

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(300)

#: Points of the killed step save, each with the save's lease held: staged, written, half committed, committed in
#: its staged step (before and after the move to ``default/``).
POINTS = ("after_stage", "before_status", "after_commit_marker", "before_publish", "after_publish")

#: A process that saves step 5 with a manager, its array's data given only once a line arrives on stdin.
LIVE_SAVER = r"""
import sys
import numpy as np
import xckpt
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard

def fetch():
    sys.stdin.readline()
    return np.arange(16, dtype=np.float32) * 5

with xckpt.CheckpointManager(sys.argv[1]) as m:
    m.save(5, {"x": ArraySource((16,), "float32", [Shard(Region((0,), (16,)), fetch)]), "n": 5}, force=True)
print("saved", flush=True)
"""


def _env() -> dict[str, str]:
    """The environment of a worker process: the tests directory importable, no failpoint, the default stale age."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for name in ("XCKPT_FAILPOINTS", "XCKPT_STALE_AFTER_S"):
        env.pop(name, None)
    return env


def _entries(root: Path) -> list[str]:
    """The names in ``root``, sorted."""
    return sorted(os.listdir(root))


def _kill_worker(root: Path, point: str) -> str:
    """``manager_workers.py kill``: steps 1 and 2 saved, the process killed (SIGKILL) while saving step 3, and
    reaped; the name of the staged step it left."""
    res = subprocess.run([sys.executable, str(HERE / "manager_workers.py"), "kill", str(root), point], env=_env(),
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == -signal.SIGKILL, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    left = [e for e in _entries(root) if e not in ("1", "2")]
    assert len(left) == 1 and left[0].startswith(".3.xckpt-step-"), _entries(root)
    return left[0]


def _leases(staged: Path) -> list[Path]:
    """The lease files in the staged step ``staged``: its item's save's and the coordinating process's own on the
    step (taken before the item's save, given up when the step moves into place), or the latter alone once the
    item committed."""
    leases = sorted(p for p in staged.iterdir() if ".xckpt-lease-" in p.name)
    assert leases and all(p.name.startswith((".default.xckpt-lease-", ".step.xckpt-lease-")) for p in leases), \
        sorted(p.name for p in staged.iterdir())
    return leases


def _copy_staged(root: Path, staged: str, step: int, token: str, **record: Any) -> Path:
    """A copy of the staged step ``staged`` as step ``step``'s, the record of each of its leases with fields replaced
    by ``record`` (``remove=True``: the leases removed; ``raw=b"..."``: the leases holding those bytes)."""
    dst = root / f".{step}.xckpt-step-{token}"
    shutil.copytree(root / staged, dst)
    for lease in _leases(dst):
        if "remove" in record:
            lease.unlink()
        elif "raw" in record:
            lease.write_bytes(record["raw"])
        else:
            obj = json.loads(lease.read_bytes())
            obj.update(record)
            lease.write_bytes(json.dumps(obj).encode())
    return dst


def _restore_equals(root: Path, step: int) -> None:
    """Step ``step`` restores, element by element, what the kill worker saves at that step."""
    with xckpt.CheckpointManager(root) as m:
        got = m.restore(step)
    want = mw.numpy_state(step)
    assert got["step"] == step
    np.testing.assert_array_equal(got["a"], want["a"])
    np.testing.assert_array_equal(got["b"]["c"], want["b"]["c"])
    np.testing.assert_array_equal(got["b"]["d"], want["b"]["d"])


def _save(root: Path, step: int) -> None:
    """Save the kill worker's state of ``step`` with a new manager of ``root`` (its cleanup runs first)."""
    with xckpt.CheckpointManager(root) as m:
        assert m.save(step, mw.numpy_state(step), force=True)


@pytest.mark.parametrize("point", POINTS)
def test_a_save_killed_here_is_removed_by_the_next_save_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 point: str) -> None:
    """A step save killed at ``point`` and reaped leaves a staged step that is dead at once: the next save removes
    it with the default stale age (an hour), and ``xckpt gc`` reports it dead whatever age it is given."""
    monkeypatch.delenv("XCKPT_STALE_AFTER_S", raising=False)  # the default age: an hour
    monkeypatch.delenv("XCKPT_FAILPOINTS", raising=False)
    root = tmp_path / "run"
    staged = _kill_worker(root, point)
    record = json.loads(_leases(root / staged)[0].read_bytes())
    assert record["host"] and isinstance(record["pid"], int)
    # dead whatever the stale age: not for its age, for its lease naming a process of this machine that is gone
    for age in (None, 10.0**9):
        [found] = claims.scan_steps(Location(str(root)), stale_after=age)
        assert (found.name, found.kind, found.stale) == ("3", "step", True)
    # xckpt gc judges it by the same rule, with the default age and with an explicit one
    assert [(c.leftover.path, c.action) for c in xckpt.gc(root, dry_run=True)] == [(str(root / staged),
                                                                                   "would remove")]
    assert [c.action for c in xckpt.gc(root, older_than_s=10**6, dry_run=True)] == ["would remove"]
    assert _entries(root) == sorted(["1", "2", staged])

    with xckpt.CheckpointManager(root, save_interval_steps=1) as m:
        assert m.latest_step() == 2
        assert m.save(3, mw.numpy_state(3))
        m.wait()
    assert _entries(root) == ["1", "2", "3"]  # the dead save's staged step is gone
    for step in (2, 3):
        _restore_equals(root, step)


def test_a_staged_step_of_a_live_or_unknown_save_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged steps whose lease names a process that runs (a held save of another process, a sleeping process),
    a process of another machine or pid namespace, or that hold no readable lease and are recent, are kept;
    one whose lease names the reaped process is removed beside them, and so is the sleeping process's once
    it is killed and reaped."""
    monkeypatch.delenv("XCKPT_STALE_AFTER_S", raising=False)
    monkeypatch.delenv("XCKPT_FAILPOINTS", raising=False)
    root = tmp_path / "run"
    dead = _kill_worker(root, "before_publish")
    record = json.loads(_leases(root / dead)[0].read_bytes())
    with pytest.raises(ProcessLookupError):  # the killed worker was reaped: its pid names no process
        os.kill(record["pid"], 0)
    token = "0123456789abcdef" * 2
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    saver = None
    try:
        kept = {
            "sleeping": _copy_staged(root, dead, 6, token, pid=sleeper.pid).name,  # a process that runs
            "host": _copy_staged(root, dead, 7, token, host=record["host"] + "-elsewhere").name,
            "boot": _copy_staged(root, dead, 8, token, boot="another-boot").name,
            "pidns": _copy_staged(root, dead, 9, token, pidns="pid:[1]").name,
            "no lease": _copy_staged(root, dead, 10, token, remove=True).name,  # recent
            "unreadable": _copy_staged(root, dead, 11, token, raw=b"{not json").name,
        }
        judged = {x.name: x.stale for x in claims.scan_steps(Location(str(root)))}
        assert judged == {"3": True, "6": False, "7": False, "8": False, "9": False, "10": False, "11": False}

        # another process's save of step 5 (its manager first removes the dead step 3), held before its data
        # is given: its lease is in its staged step
        saver = subprocess.Popen([sys.executable, "-c", LIVE_SAVER, str(root)], env=_env(), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        live: list[str] = []
        while not live and time.monotonic() < deadline and saver.poll() is None:
            live = [e for e in _entries(root) if e.startswith(".5.xckpt-step-")
                    and any(n.startswith(".default.xckpt-lease-") for n in os.listdir(root / e))]
            time.sleep(0.02)
        assert live, (saver.poll(), saver.stderr.read().decode()[-3000:] if saver.poll() is not None else "")
        assert {json.loads(p.read_bytes())["pid"] for p in _leases(root / live[0])} == {saver.pid}
        assert _entries(root) == sorted(["1", "2", live[0], *kept.values()])  # the other process removed step 3's

        again = _copy_staged(root, live[0], 13, token, pid=record["pid"]).name  # the live one's, naming the dead pid
        assert sorted((c.leftover.name, c.action) for c in xckpt.gc(root, dry_run=True)) == sorted(
            [("13", "would remove")] + [(n, "kept") for n in ("5", "6", "7", "8", "9", "10", "11")])

        _save(root, 4)
        assert again not in _entries(root)
        assert _entries(root) == sorted(["1", "2", "4", live[0], *kept.values()])  # only the dead one went

        # the held save goes on and commits: nothing of it was touched
        out, err = saver.communicate(b"\n", timeout=120)
        assert saver.returncode == 0 and b"saved" in out, err.decode()[-3000:]
        got = xckpt.load(root / "5" / "default")
        np.testing.assert_array_equal(got["x"], np.arange(16, dtype=np.float32) * 5)
        assert got["n"] == 5

        # the sleeping process is killed and reaped: its staged step is now dead, at once
        sleeper.kill()
        sleeper.wait(30)
        # the staged step without a lease, once untouched for longer than the stale age, is dead too
        old = time.time() - 7200
        staged = root / kept["no lease"]
        for p in [*staged.iterdir(), staged]:
            os.utime(p, (old, old), follow_symlinks=False)
        _save(root, 12)
        assert _entries(root) == sorted(["1", "2", "4", "5", "12", kept["host"], kept["boot"], kept["pidns"],
                                         kept["unreadable"]])
    finally:
        for proc in (sleeper, saver):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(30)
    for step in (2, 4, 12):
        _restore_equals(root, step)


_KILLED_BEFORE_PUBLISH = """
import os, signal, sys, numpy as np, xckpt
from xckpt import manager
with xckpt.CheckpointManager(sys.argv[1], max_to_keep=2) as m:
    m.save(0, {"a": np.ones(1 << 16, np.float32)}, force=True)
    m.wait()
    # killed after the step's item committed (its save released its own lease), before the step is moved in place
    manager.CheckpointManager._publish = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    m.save(1, {"a": np.full(1 << 16, 2.0, np.float32)}, force=True)
    m.wait()
"""


def test_a_staged_step_whose_process_was_killed_before_it_was_moved_into_place_is_dead_at_once(tmp_path: Path) -> None:
    """The item's save releases its lease when it commits: a process killed before the step was moved into place
    left a staged step holding a whole committed checkpoint and no lease, which gc and the next save kept as
    "live" for an hour (XCKPT_STALE_AFTER_S). The coordinating process holds a lease on the staged step until
    the move."""
    root = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_PUBLISH, str(root)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    staged = [n for n in os.listdir(root) if n.startswith(".1.xckpt-step-")]
    assert len(staged) == 1 and "default" in os.listdir(root / staged[0])
    assert xckpt.validate(root / staged[0] / "default", deep=True).ok  # its item did commit
    collected = xckpt.gc(root)
    assert [(c.leftover.path, c.action) for c in collected] == [(str(root / staged[0]), "removed")]
    assert sorted(os.listdir(root)) == ["0"]
    with xckpt.CheckpointManager(root, max_to_keep=2) as m:
        assert [info.step for info in m.all_steps()] == [0]
        np.testing.assert_array_equal(m.restore(0)["a"], np.ones(1 << 16, np.float32))


def test_a_published_step_holds_no_lease_of_its_staging(tmp_path: Path) -> None:
    """The staged step's lease is given up before the step goes into place: nothing of it is left in the step."""
    root = tmp_path / "run"
    with xckpt.CheckpointManager(root, max_to_keep=2) as m:
        m.save(0, {"a": np.arange(4.0)}, force=True)
        m.wait()
    assert not [n for n in os.listdir(root / "0") if "xckpt-lease" in n]
    assert sorted(os.listdir(root)) == ["0"]


_FULL_DISK_TWO_RANKS = """
import resource, signal, sys, threading, time, numpy as np, xckpt
from xckpt.engine.collective import ThreadGroup
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # a full disk: files are made, nothing goes into them
group = ThreadGroup(2, timeout=30)
out = {}
def rank(r):
    started = time.monotonic()
    try:
        with xckpt.CheckpointManager(sys.argv[1], coordinator=group.coordinator(r)) as m:
            m.save(1, {"a": np.arange(4.0)}, force=True)
        out[r] = ("saved", 0.0)
    except xckpt.XckptError as e:
        out[r] = (e.code, time.monotonic() - started)
threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
[t.start() for t in threads]
[t.join(120) for t in threads]
for r in range(2):
    print(r, out[r][0], round(out[r][1], 1))
"""


def test_a_step_lease_that_cannot_be_written_fails_every_process_at_once(tmp_path: Path) -> None:
    """The coordinating process took the staged step's lease outside any collective step: when it could not (a
    full disk), it raised alone, and the other processes waited in the save until their timeout (30 s here).
    Taken while the step is planned, its failure is every process's, at once; nothing is left in the root."""
    root = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", _FULL_DISK_TWO_RANKS, str(root)], capture_output=True, text=True,
                       timeout=300)
    lines = [line.split() for line in r.stdout.splitlines()]
    assert [line[:2] for line in lines] == [["0", "io.write"], ["1", "io.write"]], r.stdout + r.stderr[-2000:]
    assert all(float(line[2]) < 10 for line in lines), lines
    assert os.listdir(root) == []
