"""Failures of ``save_async`` and of the DCP ``StorageWriter`` in a real 2-rank gloo job: every surviving
rank learns it within the save's timeout, nothing is committed, and no rank leaves data behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_workers import free_port

pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))


def run(scenario: str, wd: Path, timeout: float = 120) -> tuple[list[int], list[str], float]:
    """Run ``scenario`` of tests/commit_workers.py on 2 ranks; their exit codes and outputs, and rank 0's
    run time."""
    port = str(free_port())
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "commit_workers.py"), scenario, str(r), "2", port,
                               str(wd)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs, ended = [], 0.0
    try:
        for r, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout)
            outs.append(out.decode(errors="replace"))
            if r == 0:
                ended = time.monotonic()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs, ended - started


def seen(wd: Path, step: str, rank: int) -> dict:
    """What ``step`` recorded on ``rank``."""
    f = wd / f"{step}.rank{rank}.json"
    assert f.exists(), f"{step} left no record on rank {rank}: {sorted(os.listdir(wd))}"
    return json.loads(f.read_text())


def leftovers(wd: Path) -> list[str]:
    """Hidden entries (temporary directories, leases, status directories) in ``wd``."""
    return sorted(n for n in os.listdir(wd) if n.startswith("."))


def test_failing_and_dying_ranks(tmp_path):
    """A rank whose background write fails: both ranks' wait() raise, naming rank 1's error. A DCP save whose
    write_data fails on rank 1: both ranks raise and every rank removes what it wrote. A rank killed after
    staging: rank 0's wait() raises async.timeout within the save's 3 s timeout. Nothing is committed and,
    once rank 0 gave up, nothing is left beside the destinations."""
    codes, outs, _ = run("failing_rank", tmp_path)
    assert codes == [0, -9], (codes, outs)
    for rank in (0, 1):
        got = seen(tmp_path, "async_fails", rank)
        assert not got["ok"] and "failpoint before_status on rank 1" in got["error"], got
        assert got["seconds"] < 15, got
        got = seen(tmp_path, "dcp_fails", rank)
        assert not got["ok"] and "failpoint after_write on rank 1" in got["error"], got
        assert got["seconds"] < 15, got
    got = seen(tmp_path, "async_dies", 0)
    assert not got["ok"] and got["code"] == "async.timeout", got
    assert 2.5 < got["seconds"] < 10, got
    assert not (tmp_path / "async_dies.rank1.json").exists()  # rank 1 died before it could wait
    for name in ("async_fails", "dcp_fails", "async_dies"):
        assert not (tmp_path / name).exists()
    assert leftovers(tmp_path) == []


def test_a_pending_save_does_not_keep_the_interpreter_alive(tmp_path):
    """Rank 0 never waits on a save_async whose peer died: its interpreter exits once the save's 3 s timeout
    ran out (the background threads are daemons; at exit a pending save gets its timeout, no more), having
    removed its temporary data and committed nothing."""
    codes, outs, took = run("exit_pending", tmp_path)
    assert codes == [0, -9], (codes, outs)
    assert seen(tmp_path, "exit_pending", 0)["returned_at"] > 0
    assert took < 30, took
    assert not (tmp_path / "exit_pending").exists()
    assert leftovers(tmp_path) == []


def test_a_dead_coordinator_leaves_the_outcome_unknown_and_the_data_in_place(tmp_path):
    """Rank 0 dies in the background after reporting its own status: rank 1's wait() raises async.timeout
    within the 3 s timeout, saying the outcome is unknown, and deletes nothing (a committed checkpoint could
    hold its chunks); nothing was committed, and the dead save's temporary directory is left for gc."""
    codes, outs, _ = run("root_dies", tmp_path)
    assert codes == [-9, 0], (codes, outs)
    got = seen(tmp_path, "root_dies", 1)
    assert not got["ok"] and got["code"] == "async.timeout" and "may or may not be committed" in got["error"], got
    assert 2.5 < got["seconds"] < 10, got
    assert not (tmp_path / "root_dies").exists()
    tmp = [n for n in leftovers(tmp_path) if n.startswith(".root_dies.xckpt-tmp-")]
    assert len(tmp) == 1 and any(f.is_file() for f in (tmp_path / tmp[0]).rglob("*")), leftovers(tmp_path)


def test_status_files_name_only_ranks_of_the_job() -> None:
    """The coordinating process lists the status directory and takes only ``rank-<r>`` for a rank of the job:
    not an atomic write's temporary, the outcome, a padded or negative number, or a rank past the world."""
    from xckpt.engine.background import _status_names

    names = ["rank-0", "rank-3", "rank-4", "rank-01", "rank-", "rank--1", "rank-1.tmp", "outcome", ".rank-1.x1"]
    assert [_status_names(4).get(n) for n in names] == [0, 3, None, None, None, None, None, None, None]


EXITS_WITHOUT_WAITING = """
import sys
import numpy as np
import xckpt
wd = sys.argv[1]
big = np.arange(20_000_000, dtype=np.float32)  # 80 MB: still writing when the script ends
xckpt.save_async({"a": big, "s": 1}, wd + "/ck")
m = xckpt.CheckpointManager(wd + "/run")
m.save(7, {"a": big[:1000]}, force=True)
big[:] = -1  # after the calls returned: the checkpoints keep what was passed
"""


def test_a_process_that_ends_without_waiting_commits_its_pending_saves(tmp_path):
    """A script that ends right after save_async (no wait()) and a CheckpointManager's save (no close()): at
    exit each pending save is given its time and commits (the interpreter's thread pools must not be shut down
    under it first), with what was passed."""
    import numpy as np

    import xckpt

    got = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_WAITING, str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    want = np.arange(20_000_000, dtype=np.float32)
    out = xckpt.load(tmp_path / "ck")
    np.testing.assert_array_equal(out["a"], want)
    assert out["s"] == 1
    assert [s.step for s in xckpt.list_steps(tmp_path / "run")] == [7]
    np.testing.assert_array_equal(xckpt.load(tmp_path / "run" / "7")["a"], want[:1000])
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "run") == []
