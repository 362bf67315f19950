"""The commit protocol on an S3 object store (spec 6.2, 6.4, 6.6), against a real moto server on loopback.

TensorStore's s3 driver talks to ``python -m moto.server`` (started as in
``test_object_store.py``); the connection tests put a small TCP proxy of our own between
the two that can cut every connection, or drop one chosen response, while a save runs.
No mocks: every outcome is read back from the store (object listings compared exactly,
bytes compared, values compared element by element).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest

import xckpt
from xckpt.engine import claims, protocol
from xckpt.engine.commit import Hold, SaveOptions, check_target
from xckpt.engine.storage import Location
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

#: What the loser of two saves racing for one prefix may be told (spec 9.2).
LOST_RACE = {"save.in_progress", "save.exists", "save.conflict"}


# -- the store ------------------------------------------------------------------------------------


@pytest.fixture()
def bucket(moto):
    """A fresh, empty bucket of its own for one test (so listings of the whole bucket are exact)."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    moto.client.create_bucket(Bucket=name)
    return SimpleNamespace(name=name, client=moto.client, url=f"s3://{name}")


def _keys(b, prefix: str = "") -> list[str]:
    out: list[str] = []
    for page in b.client.get_paginator("list_objects_v2").paginate(Bucket=b.name, Prefix=prefix):
        out.extend(o["Key"] for o in page.get("Contents", []))
    return sorted(out)


def _snapshot(b, prefix: str = "") -> dict[str, bytes]:
    """Every object under ``prefix``, by key, with its bytes."""
    return {k: b.client.get_object(Bucket=b.name, Key=k)["Body"].read() for k in _keys(b, prefix)}


def _names(b, prefix: str) -> list[str]:
    """The object names under ``prefix/``, relative to it."""
    p = prefix.rstrip("/") + "/"
    return [k[len(p):] for k in _keys(b, p)]


def _outside(snapshot: dict[str, bytes], prefix: str) -> dict[str, bytes]:
    p = prefix.rstrip("/") + "/"
    return {k: v for k, v in snapshot.items() if not k.startswith(p)}


def _put(b, key: str, data: bytes) -> None:
    b.client.put_object(Bucket=b.name, Key=key, Body=data)


def _claim_record(generation: str, heartbeat: float) -> bytes:
    """A claim as a save writes it (spec 6.4: generation, host, process, last heartbeat)."""
    return json.dumps({"generation": generation, "host": "elsewhere", "pid": 1, "heartbeat": heartbeat}).encode()


# -- trees ----------------------------------------------------------------------------------------


def _tree(seed: int, *, extra: bool = False, n: int = 48) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    t: dict[str, Any] = {"params": {"w": rng.standard_normal((n, 32)).astype(np.float32),
                                    "b": np.arange(32, dtype=np.int64) * seed},
                         "step": seed, "name": f"run-{seed}"}
    if extra:
        t["opt"] = {"mu": rng.standard_normal((16, 8)).astype(np.float64)}
    return t


def _assert_same(got: Any, want: Any) -> None:
    """Element by element for arrays, equality for values, the same keys everywhere."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want)
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    else:
        assert type(got) is type(want) and got == want


def _committed(b, url: str, want: Any) -> None:
    """``url`` holds a complete checkpoint of ``want``: it loads exactly, validates deep, and no claim is left."""
    _assert_same(xckpt.load(url), want)
    report = xckpt.validate(url, deep=True)
    assert report.ok, [str(f) for f in report.findings]
    prefix = url[len(b.url) + 1:]
    top = _keys(b) if not prefix else _names(b, prefix)
    assert "xckpt.json" in top and claims.CLAIM not in top


def _reference_names(b, tree: Any) -> list[str]:
    """The exact objects a successful save of ``tree`` writes (saved into a scratch bucket of its own)."""
    ref = SimpleNamespace(name=f"r-{uuid.uuid4().hex[:12]}", client=b.client)
    ref.client.create_bucket(Bucket=ref.name)
    xckpt.save(tree, f"s3://{ref.name}/ckpt")
    return _names(ref, "ckpt")


def _populated(b) -> Any:
    """``run1/notes.txt``, a committed checkpoint at ``run1/step_100`` and ``other/x``; returns step_100's tree."""
    _put(b, "run1/notes.txt", b"lr=3e-4, do not delete\n")
    _put(b, "other/x", bytes(range(256)) * 8)
    tree = _tree(100)
    xckpt.save(tree, f"{b.url}/run1/step_100")
    return tree


def _failing_source() -> ArraySource:
    def boom() -> np.ndarray:
        raise RuntimeError("device lost")

    return ArraySource((64,), "float32", [Shard(Region((0,), (64,)), boom)])


# -- 1. objects outside the checkpoint survive --------------------------------------------------


def test_save_beside_other_objects_touches_only_its_prefix(bucket):
    """A save to ``run1/step_200`` writes exactly a checkpoint's objects there and leaves every other object
    byte-identical; ``run1/step_10`` (a string prefix of ``step_100``) is a free destination too."""
    t100 = _populated(bucket)
    before = _snapshot(bucket)
    t200 = _tree(200)
    xckpt.save(t200, f"{bucket.url}/run1/step_200")
    after = _snapshot(bucket)
    assert _outside(after, "run1/step_200") == before
    assert _names(bucket, "run1/step_200") == _names(bucket, "run1/step_100")  # same structure, same objects
    _committed(bucket, f"{bucket.url}/run1/step_200", t200)
    _committed(bucket, f"{bucket.url}/run1/step_100", t100)

    t10 = _tree(10, n=8)
    xckpt.save(t10, f"{bucket.url}/run1/step_10")
    assert _outside(_snapshot(bucket), "run1/step_10") == after
    _committed(bucket, f"{bucket.url}/run1/step_10", t10)


@pytest.mark.parametrize("failure", ["source", "mid_write", "after_write", "after_values"])
def test_failed_save_removes_only_what_it_wrote(bucket, monkeypatch, failure):
    """A save that fails (a leaf whose data cannot be fetched, or a failpoint raising at a later step) leaves
    nothing under its prefix, claim included, and every object outside it byte-identical; the prefix is usable."""
    _populated(bucket)
    before = _snapshot(bucket)
    url = f"{bucket.url}/run1/step_300"
    tree = _tree(300, extra=True)
    if failure == "source":
        tree["bad"] = _failing_source()
    else:
        monkeypatch.setenv("XCKPT_FAILPOINTS", f"{failure}:raise")
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.save(tree, url)
    assert ("device lost" if failure == "source" else f"failpoint {failure}") in str(info.value)
    assert _keys(bucket, "run1/step_300") == []
    assert _snapshot(bucket) == before
    with pytest.raises(xckpt.XckptError) as missing:
        xckpt.load(url)
    assert missing.value.code == "manifest.missing"

    monkeypatch.delenv("XCKPT_FAILPOINTS", raising=False)
    tree.pop("bad", None)
    xckpt.save(tree, url)
    _committed(bucket, url, tree)
    assert _outside(_snapshot(bucket), "run1/step_300") == before


@pytest.mark.parametrize("failure", ["after_write", "after_values"])
def test_failed_dcp_save_removes_what_it_wrote(bucket, monkeypatch, failure):
    """The same through DCP's ``XckptStorageWriter``: a save failing after the chunks were written, or after the
    commit files, leaves nothing under its prefix (its chunk objects, commit files and claim), so the prefix is
    usable; before, a failure in ``finish`` left every object there and the prefix refused any save."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from xckpt_torch import XckptStorageWriter

    _populated(bucket)
    before = _snapshot(bucket)
    url = f"{bucket.url}/run1/step_300"
    state = {"w": torch.arange(96, dtype=torch.float32).reshape(8, 12), "b": torch.ones(5, dtype=torch.float64),
             "step": 300}
    monkeypatch.setenv("XCKPT_FAILPOINTS", f"{failure}:raise")
    with pytest.raises(BaseException) as info:  # DCP raises its CheckpointException, a BaseException
        dcp.save(state, storage_writer=XckptStorageWriter(url))
    assert f"failpoint {failure}" in str(info.value)
    assert _keys(bucket, "run1/step_300") == []
    assert _snapshot(bucket) == before
    monkeypatch.delenv("XCKPT_FAILPOINTS")
    dcp.save(state, storage_writer=XckptStorageWriter(url))
    got = xckpt.load(url)
    assert got["step"] == 300
    for k in ("w", "b"):
        np.testing.assert_array_equal(got[k], state[k].numpy())
        assert got[k].dtype == state[k].numpy().dtype
    assert _outside(_snapshot(bucket), "run1/step_300") == before


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Make failpoint ``point`` raise KeyboardInterrupt (Ctrl-C right there), every other one as it is."""
    from xckpt.engine import failpoints

    real = failpoints.hit

    def hit(at: str, rank: int = 0) -> None:
        if at == point:
            raise KeyboardInterrupt
        real(at, rank)
    monkeypatch.setattr(failpoints, "hit", hit)


@pytest.mark.parametrize("what", ["warning", "interrupt"])
def test_a_warning_made_an_error_or_an_interrupt_after_the_commit_fails_no_process(bucket, monkeypatch, what):
    """Two processes save; right after the manifest (the commit) the marker's write fails and the warning it is
    becomes an error (``simplefilter("error")``), or Ctrl-C comes: the coordinating process raises that XckptWarning
    (the KeyboardInterrupt) as it is, the other returns as from a committed save, and no process removes its part
    (rank 1 was told the save failed and deleted its chunks of the committed checkpoint, ``chunk.missing``; or,
    interrupted, waited out the collective timeout for ``save.outcome_unknown``); the checkpoint loads exactly."""
    import warnings

    from threaded import run_ranks

    url = f"{bucket.url}/run1/step_5"
    full = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    raised: dict[int, BaseException] = {}
    returned: dict[int, Any] = {}

    def body(coord: Any) -> None:
        r = coord.rank
        src = ArraySource((64, 16), "float32", [Shard(Region((32 * r, 0), (32, 16)),
                                                      lambda: full[32 * r:32 * (r + 1)].copy())])
        try:
            returned[r] = xckpt.save({"w": src, "step": 5}, url, coordinator=coord)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            raised[r] = exc
    if what == "warning":
        monkeypatch.setenv("XCKPT_FAILPOINTS", "after_manifest:raise")
    else:
        _interrupt_at(monkeypatch, "after_manifest")
    with warnings.catch_warnings():
        warnings.simplefilter("error", xckpt.XckptWarning)
        run_ranks(2, body)
    monkeypatch.undo()
    assert set(raised) == {0}, raised
    if what == "warning":
        assert isinstance(raised[0], xckpt.XckptWarning), raised
        assert "is committed, but a failure followed the commit" in str(raised[0])
    else:
        assert isinstance(raised[0], KeyboardInterrupt), raised
    assert returned == {1: None}
    got = xckpt.load(url)
    np.testing.assert_array_equal(got["w"], full)
    assert got["step"] == 5


@pytest.mark.parametrize("failure", ["after_manifest", "after_commit_marker"])
def test_a_failure_after_the_commit_keeps_the_checkpoint(bucket, monkeypatch, failure):
    """On an object store the manifest is the commit: a failure after it (writing Orbax's commit marker) undoes
    nothing, since readers may be loading the checkpoint already. The save returns its manifest with a warning;
    the checkpoint loads exactly, and its claim is left, so that once stale, gc writes the marker if it is
    missing (``commit.missing`` until then) and removes the claim."""
    url = f"{bucket.url}/run1/step_8"
    tree = _tree(8)
    monkeypatch.setenv("XCKPT_FAILPOINTS", f"{failure}:raise")
    with pytest.warns(xckpt.XckptWarning, match="a failure followed the commit"):
        manifest = xckpt.save(tree, url)
    assert manifest is not None
    monkeypatch.delenv("XCKPT_FAILPOINTS")
    _assert_same(xckpt.load(url), tree)
    top = _names(bucket, "run1/step_8")
    assert "xckpt.json" in top and claims.CLAIM in top
    assert ("commit_success.txt" in top) == (failure == "after_commit_marker")
    codes = [f.code for f in xckpt.validate(url, deep=True).findings]
    assert codes == ([] if failure == "after_commit_marker" else ["commit.missing"]), codes
    assert [c for c in xckpt.gc(f"{bucket.url}/run1") if c.action == "removed"] == []  # its claim is fresh
    assert claims.CLAIM in _names(bucket, "run1/step_8")
    monkeypatch.setenv("XCKPT_STALE_AFTER_S", "0.5")
    time.sleep(1.0)
    done = xckpt.gc(f"{bucket.url}/run1")
    assert [(c.leftover.path, c.action) for c in done] == [(url, "removed")]
    _committed(bucket, url, tree)
    assert "commit_success.txt" in _names(bucket, "run1/step_8")


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_an_interrupt_after_the_commit_keeps_the_checkpoint(bucket, monkeypatch, how):
    """Ctrl-C (KeyboardInterrupt) right after the manifest was created: the interrupt goes on to the caller, and
    the committed checkpoint stays (it was deleted as a failed save's), with its claim left for gc to write the
    marker; it loads exactly. In ``save_async``'s thread (where only a failpoint can raise it) ``wait()`` raises
    the interrupt too, where it reported the committed save as failed, "nothing was committed"."""
    url = f"{bucket.url}/run1/step_9"
    tree = _tree(9)
    _interrupt_at(monkeypatch, "after_manifest")
    with pytest.raises(KeyboardInterrupt):
        if how == "save":
            xckpt.save(tree, url)
        else:
            xckpt.save_async(tree, url).wait()
    monkeypatch.undo()
    _assert_same(xckpt.load(url), tree)
    top = _names(bucket, "run1/step_9")
    assert "xckpt.json" in top and claims.CLAIM in top and "commit_success.txt" not in top


def test_a_save_not_yet_committed_is_never_read(bucket, monkeypatch):
    """A save paused just before its manifest (the commit on an object store): its Orbax view is written already,
    yet a load or inspect of the prefix is ``manifest.missing`` naming the manifest, never the data of a save that
    may still fail and be removed; Orbax's commit marker, which Orbax takes for a finished checkpoint on object
    stores, is written only after the manifest. Once it commits, the prefix loads exactly."""
    from xckpt.engine import failpoints

    url = f"{bucket.url}/run1/step_7"
    tree = _tree(7)
    paused, go = threading.Event(), threading.Event()
    real = failpoints.hit
    seen: dict[str, set[str]] = {}

    def hit(point: str, rank: int = 0) -> None:
        if point in ("after_values", "after_manifest", "after_commit_marker"):
            seen[point] = {k.rpartition("/")[2] for k in _keys(bucket, "run1/step_7")}
        if point == "after_values":
            paused.set()
            go.wait(60)
        real(point, rank)
    monkeypatch.setattr(failpoints, "hit", hit)
    saver = threading.Thread(target=xckpt.save, args=(tree, url))
    saver.start()
    try:
        assert paused.wait(60)
        deadline = time.monotonic() + 30  # the Orbax view's writes are sent, their answers not yet awaited
        while "_METADATA" not in _names(bucket, "run1/step_7") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "_METADATA" in _names(bucket, "run1/step_7")
        for read in (xckpt.load, xckpt.inspect):
            with pytest.raises(xckpt.XckptError) as info:
                read(url)
            assert info.value.code == "manifest.missing" and info.value.file == f"{url}/xckpt.json", info.value
    finally:
        go.set()
        saver.join(60)
    assert {"xckpt.json", "commit_success.txt"} & seen["after_values"] == set()
    assert {"xckpt.json", "_METADATA"} <= seen["after_manifest"] and "commit_success.txt" not in seen["after_manifest"]
    assert {"xckpt.json", "commit_success.txt"} <= seen["after_commit_marker"]
    _committed(bucket, url, tree)


def _state(pid: int) -> str:
    """The scheduler state of process ``pid`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


#: A process saving ``{'a': {w0..w<n-1>: (64, 16) float32 of seed <seed>}, 'step': 1}`` to ``argv[1]`` with
#: ``argv[4]`` (save, save_async, dcp); it prints FAILED (exit 3) or SAVED.
SLEEPER = """
import sys, numpy as np, xckpt
url, seed, n, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(seed)
tree = {'a': {f'w{i}': rng.standard_normal((64, 16)).astype(np.float32) for i in range(n)}, 'step': 1}
try:
    if how == 'save':
        xckpt.save(tree, url)
    elif how == 'save_async':
        xckpt.save_async(tree, url).wait()
    else:
        import torch, torch.distributed.checkpoint as dcp
        from xckpt_torch import XckptStorageWriter
        tree['a'] = {k: torch.from_numpy(v) for k, v in tree['a'].items()}
        dcp.save(tree, storage_writer=XckptStorageWriter(url))
except BaseException as exc:  # DCP raises its CheckpointException, a BaseException
    print('FAILED', getattr(exc, 'code', type(exc).__name__), str(exc)[-400:], flush=True)
    sys.exit(3)
print('SAVED', flush=True)
"""


def _stopped(url: str, stop: str, *, seed: int = 1, n: int = 6, how: str = "save") -> subprocess.Popen:
    """A :data:`SLEEPER` process (lease 1 s) once it stands still at failpoint ``stop`` (SIGSTOP, as a paused
    machine does)."""
    env = dict(os.environ, XCKPT_FAILPOINTS=f"{stop}:stop", XCKPT_STALE_AFTER_S="1")
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, url, str(seed), str(n), how], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _state(proc.pid) != "T":
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)
        time.sleep(0.05)
    return proc


def _woken(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGCONT, then its exit status and what it printed."""
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.decode() + err.decode(errors="replace")[-3000:]


@pytest.mark.parametrize("how, winner", [("save", "same"), ("save", "other"), ("save_async", "other"),
                                         ("dcp", "other")])
def test_a_save_stopped_past_its_lease_never_writes_over_the_save_that_took_its_prefix(bucket, monkeypatch, how,
                                                                                        winner):
    """A save whose whole process is stopped (SIGSTOP, as a paused machine is) mid-write for longer than its lease
    is judged dead: a second save takes the prefix over and commits. When the first wakes (SIGCONT):

    - ``same``: the second saved the same leaves (``a/...``), so every object the first goes on writing exists
      already: it fails with ``save.conflict`` having replaced nothing and deleted nothing;
    - ``other``: the second holds other leaves (``b/...``), so every object the first goes on writing is created,
      none is refused, until its commit finds the prefix taken; it then deletes exactly the objects it created
      (each only while still its version) and nothing else (through ``save_async``, and through DCP's
      ``XckptStorageWriter``, stopped before its first write: its ``finish`` removes what every rank created, as
      each rank reported it).

    Either way the bucket is the second save's checkpoint alone, byte for byte, and it loads exactly."""
    url = f"{bucket.url}/run/step_9"
    proc = _stopped(url, {"save": "mid_write", "save_async": "after_stage", "dcp": "after_plan"}[how], how=how)
    try:
        assert claims.CLAIM in _names(bucket, "run/step_9")
        time.sleep(2.5)  # its lease is 1 s old and more: judged dead
        rng = np.random.default_rng(2)
        name, n, shape = ("a", 6, (64, 16)) if winner == "same" else ("b", 3, (32, 16))
        tree = {name: {f"w{i}": rng.standard_normal(shape).astype(np.float32) for i in range(n)}, "step": 2}
        monkeypatch.setenv("XCKPT_STALE_AFTER_S", "1")
        xckpt.save(tree, url)
        committed = _snapshot(bucket)
        assert winner == "same" or not any(k.startswith("run/step_9/a.") for k in committed)
    finally:
        code, text = _woken(proc)
    assert code == 3 and ("FAILED save.conflict" if winner == "same" else "FAILED") in text, text
    assert _snapshot(bucket) == committed  # nothing of the winner's replaced or deleted, nothing of its own left
    _committed(bucket, url, tree)


def test_a_save_judged_dead_before_the_new_owner_commits_removes_only_its_chunk_objects(bucket):
    """Two saves of the same structure, each stopped once its objects are written: the first past its lease, so the
    second takes its prefix over and writes the same ``zarr.json`` files again (same bytes, so the same ETags as the
    first's). The first wakes, finds its claim gone and, with no committed manifest there to say which objects are
    the second's, deletes only chunk objects it created (none is left: their place tags differ from the second's), no
    ``zarr.json``; the second then commits a whole checkpoint that validates deep and loads exactly. (Deleting every
    object it created by ETag would delete the second's ``zarr.json`` files.)"""
    url = f"{bucket.url}/run/step_7"
    first = _stopped(url, "after_write", seed=1, n=4)
    second = None
    try:
        time.sleep(2.5)  # the first's lease is 1 s old and more: judged dead
        second = _stopped(url, "after_write", seed=2, n=4)
        code, text = _woken(first)
        assert code == 3 and "FAILED save.conflict" in text, text
        code, text = _woken(second)
        assert code == 0 and "SAVED" in text, text
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                _woken(proc)
    rng = np.random.default_rng(2)
    tree = {"a": {f"w{i}": rng.standard_normal((64, 16)).astype(np.float32) for i in range(4)}, "step": 1}
    _committed(bucket, url, tree)


def test_overwrite_of_committed_prefix_is_refused(bucket):
    """``overwrite=True`` onto a committed prefix is ``save.exists`` (no atomic replace on S3): nothing changes."""
    t100 = _populated(bucket)
    before = _snapshot(bucket)
    for overwrite in (True, False):
        with pytest.raises(xckpt.XckptError) as info:
            xckpt.save(_tree(101), f"{bucket.url}/run1/step_100", overwrite=overwrite)
        assert info.value.code == "save.exists"
        assert _snapshot(bucket) == before
    _committed(bucket, f"{bucket.url}/run1/step_100", t100)


@pytest.mark.parametrize("where", ["run1", "run1/", "", "/"])
def test_non_empty_prefix_without_checkpoint_is_refused(bucket, where):
    """A prefix holding objects but no checkpoint (``run1``, or the bucket root) is ``save.not_empty``, and
    nothing is written or deleted anywhere in the bucket."""
    t100 = _populated(bucket)
    before = _snapshot(bucket)
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.save(_tree(1), bucket.url + ("/" + where if where else ""))
    assert info.value.code == "save.not_empty"
    assert _snapshot(bucket) == before
    _committed(bucket, f"{bucket.url}/run1/step_100", t100)


# -- 2. one winner ------------------------------------------------------------------------------


def _race(fns: list[Callable[[], Any]], timeout: float = 60) -> list[tuple[Any, BaseException | None]]:
    """Run the functions on threads released together; (result, error) of each."""
    start = threading.Barrier(len(fns))
    out: list[tuple[Any, BaseException | None]] = [(None, None)] * len(fns)

    def body(i: int) -> None:
        start.wait()
        try:
            out[i] = (fns[i](), None)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[i] = (None, exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a save hung"
    return out


def test_concurrent_saves_to_one_prefix_have_one_winner(bucket):
    """Two savers race for one new prefix, five rounds (same and different structures): exactly one commits,
    the other gets save.in_progress / save.exists / save.conflict; the prefix holds exactly the winner's
    objects, which load with the winner's values and validate deep."""
    _put(bucket, "other/x", b"keep")
    winners = []
    for r in range(5):
        url = f"{bucket.url}/race/step_{r}"
        trees = [_tree(10 * r + 1), _tree(10 * r + 2, extra=r % 2 == 1)]
        results = _race([lambda t=t: xckpt.save(t, url) for t in trees])
        won = [i for i, (_, err) in enumerate(results) if err is None]
        assert len(won) == 1, [str(e) for _, e in results]
        lost = results[1 - won[0]][1]
        assert isinstance(lost, xckpt.XckptError) and lost.code in LOST_RACE, repr(lost)
        winners.append(won[0])
        _committed(bucket, url, trees[won[0]])
        assert _names(bucket, f"race/step_{r}") == _reference_names(bucket, trees[won[0]])
    assert _keys(bucket, "other/") == ["other/x"]
    print("winners by round:", winners)


@pytest.mark.parametrize("how", ["old heartbeat", "small stale age"])
def test_stale_claim_is_taken_over(bucket, monkeypatch, how):
    """A claim whose heartbeat is older than the stale age belongs to a dead save: a new save removes what the
    dead one left under the prefix (and only there), takes the prefix and commits exactly its own objects."""
    _put(bucket, "run/notes.txt", b"keep me")
    _put(bucket, "run/step_50x/obj", b"a neighbour whose name starts like the prefix")
    if how == "old heartbeat":
        beat = time.time() - 2 * claims.STALE_AFTER_S
    else:
        monkeypatch.setenv("XCKPT_STALE_AFTER_S", "0.5")
        beat = time.time()
    _put(bucket, "run/step_50/.xckpt-claim", _claim_record(uuid.uuid4().hex, beat))
    _put(bucket, "run/step_50/params.w/c/0/0", b"half a chunk of a dead save")
    _put(bucket, "run/step_50/junk/zarr.json", b"{}")
    before = _outside(_snapshot(bucket), "run/step_50")
    if how == "small stale age":
        time.sleep(0.7)
    tree = _tree(50)
    xckpt.save(tree, f"{bucket.url}/run/step_50")
    _committed(bucket, f"{bucket.url}/run/step_50", tree)
    assert _names(bucket, "run/step_50") == _reference_names(bucket, tree)
    assert {k: v for k, v in _snapshot(bucket).items() if k.startswith("run/") and not k.startswith("run/step_50/")} \
        == before


def test_live_claim_is_refused(bucket):
    """A claim with a fresh heartbeat is a save in progress: another save gets save.in_progress and writes or
    deletes nothing, the claim and the objects under it included."""
    _put(bucket, "run/step_60/.xckpt-claim", _claim_record(uuid.uuid4().hex, time.time()))
    _put(bucket, "run/step_60/params.w/zarr.json", b"{}")
    _put(bucket, "run/other", b"x")
    before = _snapshot(bucket)
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.save(_tree(60), f"{bucket.url}/run/step_60")
    assert info.value.code == "save.in_progress"
    assert _snapshot(bucket) == before


def test_claim_after_a_commit_is_refused(bucket):
    """A save that checked an empty prefix, then lost the race to a save that committed there before it claimed
    the prefix, must not claim (nor later write into) the committed prefix: save.exists, nothing changes."""
    url = f"{bucket.url}/run/step_70"
    target = check_target(Location(url), SaveOptions())  # the prefix is empty: this save may go on
    tree = _tree(70)
    xckpt.save(tree, url)  # meanwhile, another save commits there
    before = _snapshot(bucket)
    with pytest.raises(xckpt.XckptError) as info:
        Hold(target, claims.new_generation(), 3600.0)
    assert info.value.code == "save.exists"
    assert _snapshot(bucket) == before
    _committed(bucket, url, tree)


def test_stale_claim_judged_twice_is_removed_once(bucket):
    """Two cleaners (two saves, or a save and ``xckpt gc``) that judged the same claim dead: the first takes the
    prefix over and commits; the second, acting on its older judgement, must remove nothing of that checkpoint."""
    _put(bucket, "run/step_80/.xckpt-claim", _claim_record(uuid.uuid4().hex, time.time() - 2 * claims.STALE_AFTER_S))
    _put(bucket, "run/step_80/params.w/c/0/0", b"left by the dead save")
    judged = [x for x in claims.scan(Location(f"{bucket.url}/run"), name="step_80") if x.kind == "claim"]
    assert len(judged) == 1 and judged[0].stale
    tree = _tree(80)
    xckpt.save(tree, f"{bucket.url}/run/step_80")  # the first cleaner: takes over, commits
    before = _snapshot(bucket)
    claims.remove(judged[0])  # the second cleaner
    assert _snapshot(bucket) == before
    _committed(bucket, f"{bucket.url}/run/step_80", tree)


def test_save_judged_dead_removes_nothing_of_the_new_owner(bucket, monkeypatch):
    """A save stalls past the stale age; another save takes its prefix over and commits. When the stalled one
    then fails, its cleanup must not delete the new owner's objects (same names: same structure)."""
    url = f"{bucket.url}/run/step_90"
    slow_tree = _tree(91)
    slow = protocol.prepare(slow_tree, url, options=SaveOptions(stale_after_s=3600.0))  # heartbeat every 60 s
    protocol.write(slow)
    assert claims.CLAIM in _names(bucket, "run/step_90") and "params.w/c/0/0" in _names(bucket, "run/step_90")
    monkeypatch.setenv("XCKPT_STALE_AFTER_S", "0.3")  # the other save judges the stalled one dead
    time.sleep(0.5)
    tree = _tree(92)
    xckpt.save(tree, url)
    before = _snapshot(bucket)
    with pytest.raises(xckpt.XckptError):
        protocol.commit(slow, RuntimeError("device lost after a long stall"))
    assert _snapshot(bucket) == before
    _committed(bucket, url, tree)


# -- 3. connections that drop -------------------------------------------------------------------


class CutProxy:
    """A TCP proxy 127.0.0.1:port -> the moto server that a test can cut.

    ``cut_after(n)``: once ``n`` more request bytes went through, every connection is closed and new ones
    are closed as soon as they are accepted, until ``restore()``. ``drop_response(marker, nth)``: the response to
    the ``nth`` next request whose first bytes contain ``marker`` is not delivered (its connection is closed once
    the request reached the server): the request took effect, the client never heard.
    """

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.sent = 0  # request bytes forwarded
        self.limit: int | None = None
        self.down = False
        self.cuts = 0
        self.drop_marker: bytes | None = None
        self.drop_nth = 0
        self.drop_then: bytes | None = None
        self.dropped = 0
        self.closed = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def cut_after(self, n: int) -> None:
        with self.lock:
            self.limit = self.sent + n

    def cut(self) -> None:
        with self.lock:
            self.down = True
            self.limit = None
            self.cuts += 1
            conns, self.conns = list(self.conns), set()
        for s in conns:
            _kill(s)

    def restore(self) -> None:
        with self.lock:
            self.down = False
            self.limit = None

    def drop_response(self, marker: bytes, nth: int = 1, then: bytes | None = None) -> None:
        """Drop the response to the ``nth`` next request holding ``marker``; then (``then``) the response to the
        next request holding ``then``."""
        with self.lock:
            self.drop_marker, self.drop_nth, self.drop_then = marker, nth, then

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.thread.join(5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self.lock:
                down = self.down
            if down:
                _kill(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                _kill(client)
                continue
            pair = {"doomed": False}
            with self.lock:
                self.conns.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True, pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False, pair), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, request: bool, pair: dict[str, bool]) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                cut = False
                with self.lock:
                    if request:
                        if self.drop_marker is not None and self.drop_marker in data[:1024]:
                            self.drop_nth -= 1
                            if self.drop_nth == 0:
                                pair["doomed"], self.drop_marker, self.drop_nth = True, self.drop_then, 1
                                self.drop_then = None
                        self.sent += len(data)
                        if self.limit is not None and self.sent >= self.limit:
                            cut = True
                    elif pair["doomed"]:
                        self.dropped += 1
                        pair["doomed"] = False
                        _kill(src)
                        _kill(dst)
                        return
                if cut:
                    self.cut()
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _kill(src)
            _kill(dst)
            with self.lock:
                self.conns.discard(src)
                self.conns.discard(dst)


def _kill(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


@pytest.fixture()
def proxy(moto, monkeypatch):
    """A :class:`CutProxy` in front of the moto server; xckpt's s3 driver goes through it for this test."""
    p = CutProxy(moto.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", p.endpoint)
    yield p
    p.close()


def _in_thread(fn: Callable[[], Any], timeout: float) -> tuple[Any, BaseException | None, float]:
    """``fn()`` on a thread, bounded: (result, error, seconds); fails the test if it is still running."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc

    started = time.monotonic()
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s"
    return box.get("result"), box.get("error"), time.monotonic() - started


def test_connection_cut_mid_save_commits_nothing(bucket, proxy, monkeypatch):
    """Every connection to the store is cut 1 MiB into the upload of a 4 MiB save and stays down: the save fails
    with an XckptError (io.write) at once (``AWS_MAX_ATTEMPTS=1``: no retries), nothing is committed and nothing
    outside its prefix changes; once the network is back and the dead save's claim (its release could not get
    through) is stale, a save to the same prefix removes the leftovers and commits exactly."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("XCKPT_STALE_AFTER_S", "0.5")
    _put(bucket, "keep/notes.txt", b"keep")
    keep_tree = _tree(1)
    xckpt.save(keep_tree, f"{bucket.url}/keep/step_1")  # through the proxy, still up
    before = _snapshot(bucket)
    rng = np.random.default_rng(7)
    tree = {"w": rng.standard_normal((1024, 1024)).astype(np.float32), "b": np.arange(1000, dtype=np.int32),
            "step": 7}
    url = f"{bucket.url}/run/step_7"

    proxy.cut_after(1 << 20)
    _, err, took = _in_thread(lambda: xckpt.save(tree, url), timeout=60)
    assert proxy.cuts == 1
    assert isinstance(err, xckpt.XckptError) and err.code in ("io.write", "save.failed"), repr(err)
    assert took < 10
    assert "run/step_7/xckpt.json" not in _keys(bucket, "run/")
    assert _outside(_snapshot(bucket), "run/step_7") == before

    assert claims.CLAIM in _names(bucket, "run/step_7")  # the cut kept the failed save from releasing its claim
    proxy.restore()
    time.sleep(0.7)  # the dead save's claim goes stale
    _, err, _ = _in_thread(lambda: xckpt.save(tree, url), timeout=60)
    assert err is None, repr(err)
    _committed(bucket, url, tree)
    assert _names(bucket, "run/step_7") == _reference_names(bucket, tree)
    assert _outside(_snapshot(bucket), "run/step_7") == before
    _committed(bucket, f"{bucket.url}/keep/step_1", keep_tree)


def test_connection_dropped_once_is_retried(bucket, proxy, monkeypatch):
    """Every connection is cut once, 1 MiB into the upload, and the network comes straight back: the s3 driver
    retries and the save commits exactly."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    tree = {"w": np.random.default_rng(8).standard_normal((1024, 1024)).astype(np.float32), "step": 8}
    url = f"{bucket.url}/run/step_8"
    proxy.cut_after(1 << 20)

    def restore_soon() -> None:
        while proxy.cuts == 0:
            time.sleep(0.01)
        proxy.restore()

    threading.Thread(target=restore_soon, daemon=True).start()
    _, err, _ = _in_thread(lambda: xckpt.save(tree, url), timeout=60)
    assert proxy.cuts == 1
    assert err is None, repr(err)
    _committed(bucket, url, tree)
    assert _names(bucket, "run/step_8") == _reference_names(bucket, tree)


@pytest.mark.parametrize("name,nth,attempts", [("xckpt.json", 1, ""), (".xckpt-claim", 1, ""), (".xckpt-claim", 2, ""),
                                               ("xckpt.json", 1, "1"), (".xckpt-claim", 1, "1")],
                         ids=["manifest", "claim", "claim renewal", "manifest, no retry", "claim, no retry"])
def test_lost_answer_to_a_conditional_write_is_not_a_conflict(bucket, proxy, monkeypatch, name, nth, attempts):
    """The store creates the manifest (the commit) or the claim, or renews the claim, but the connection drops
    before the answer arrives; the driver retries the conditional write and finds the object changed, or
    (``AWS_MAX_ATTEMPTS=1``) does not retry and fails. It is this save's own doing: the save must commit (not
    report save.exists / save.in_progress / save.conflict / io.write, never delete its own committed objects,
    leaving a manifest without its data, and not leave its claim behind)."""
    if attempts:
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", attempts)
    tree: dict[str, Any] = _tree(9)
    url = f"{bucket.url}/run/step_9"
    if nth == 2:  # the first renewal of the claim: a heartbeat every 0.1 s, and a save that lasts 3 s
        monkeypatch.setenv("XCKPT_STALE_AFTER_S", "0.8")
        slow = np.arange(256, dtype=np.float32)

        def fetch() -> np.ndarray:
            time.sleep(3)
            return slow

        tree["slow"] = ArraySource(slow.shape, "float32", [Shard(Region((0,), slow.shape), fetch)])
    proxy.drop_response(f"PUT /{bucket.name}/run/step_9/{name} ".encode(), nth)
    _, err, _ = _in_thread(lambda: xckpt.save(tree, url), timeout=60)
    assert proxy.dropped == 1
    assert err is None, repr(err)
    if nth == 2:
        tree["slow"] = slow
    _committed(bucket, url, tree)
    assert _names(bucket, "run/step_9") == _reference_names(bucket, tree)


@pytest.mark.parametrize("how", ["xckpt", "dcp"])
def test_a_manifest_that_landed_unheard_goes_first_when_the_save_fails(bucket, proxy, monkeypatch, how):
    """The manifest's write lands but its answer is lost (no retry left), and so is the answer to reading it back:
    the save cannot know it committed, fails, and removes what it wrote, its manifest first, so that no reader
    finds a manifest over deleted chunks; the prefix can be saved to again. Through DCP's ``XckptStorageWriter``
    alike (it deleted the chunks and left the manifest over them)."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"{bucket.url}/run/step_4"
    at = f"/{bucket.name}/run/step_4/xckpt.json".encode()
    proxy.drop_response(b"PUT " + at + b" ", 1, then=b"GET " + at + b" ")
    if how == "xckpt":
        _, err, _ = _in_thread(lambda: xckpt.save(_tree(4), url), timeout=60)
        assert isinstance(err, xckpt.XckptError), repr(err)
    else:
        torch = pytest.importorskip("torch")
        import torch.distributed.checkpoint as dcp
        from xckpt_torch import XckptStorageWriter

        def as_torch(x: Any) -> Any:
            return {k: as_torch(v) for k, v in x.items()} if isinstance(x, dict) else \
                torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        state = as_torch(_tree(4))
        _, err, _ = _in_thread(lambda: dcp.save(state, storage_writer=XckptStorageWriter(url)), timeout=60)
        assert err is not None and "xckpt.json" in str(err), repr(err)
    assert proxy.dropped == 2
    assert _names(bucket, "run/step_4") == []
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    xckpt.save(_tree(4), url)
    _committed(bucket, url, _tree(4))


def test_conditional_put_switch(bucket, monkeypatch):
    """``XCKPT_S3_CONDITIONAL_PUT=1``: every write is one conditional PUT (TensorStore's use_conditional_write);
    a save commits exactly, a write over an object there already is still refused (``save.conflict``, the
    object unchanged); a value that is not a switch is ``config.env`` naming the variable."""
    from xckpt.engine.storage import KvStore, s3_spec

    monkeypatch.setenv("XCKPT_S3_CONDITIONAL_PUT", "1")
    assert s3_spec(f"{bucket.url}/x")["use_conditional_write"] is True
    url = f"{bucket.url}/run/step_3"
    tree = _tree(3)
    xckpt.save(tree, url)
    _committed(bucket, url, tree)
    store = KvStore(Location(url))
    try:
        with pytest.raises(xckpt.XckptError) as info:
            store.write("values.msgpack", b"something else")
            store.sync()
        assert info.value.code == "save.conflict" and info.value.file == f"{url}/values.msgpack"
    finally:
        store.close()
    _committed(bucket, url, tree)
    monkeypatch.setenv("XCKPT_S3_CONDITIONAL_PUT", "maybe")
    with pytest.raises(xckpt.XckptError) as bad:
        s3_spec(url)
    assert bad.value.code == "config.env" and "XCKPT_S3_CONDITIONAL_PUT" in str(bad.value)


def test_a_chunk_that_landed_unheard_is_its_own_on_the_retry(bucket, proxy):
    """A chunk's write lands but its answer is lost: the driver's retry finds the object there (every write of a
    save only creates), reads it back, finds the bytes it sent, and the save goes on and commits exactly."""
    url = f"{bucket.url}/run/step_6"
    at = f"/{bucket.name}/run/step_6/params.w/c/0/0".encode()
    proxy.drop_response(b"PUT " + at + b" ", 1)
    tree = _tree(6)
    _, err, _ = _in_thread(lambda: xckpt.save(tree, url), timeout=120)
    assert err is None and proxy.dropped == 1, repr(err)
    _committed(bucket, url, tree)


# -- 4. removing a dead save's claimed prefix deletes only what that save wrote ------------------


def test_a_save_to_a_bucket_root_a_dead_save_claimed_takes_it_over(bucket):
    """A save to the bucket itself (s3://b) finds the claim a dead save left there: it removes that save's
    objects and claim and commits (it raised save.in_progress forever: the bucket's claim was looked for in a
    local directory 's3:/')."""
    _dead_claim(bucket, "")
    tree = _tree(5)
    xckpt.save(tree, bucket.url)
    _committed(bucket, bucket.url, tree)


def _dead_claim(b, prefix: str) -> None:
    """What a save to ``prefix`` ("": the bucket) that died long ago leaves: its claim (an old heartbeat) and half
    a chunk."""
    at = f"{prefix}/" if prefix else ""
    _put(b, f"{at}.xckpt-claim", _claim_record(uuid.uuid4().hex, time.time() - 2 * claims.STALE_AFTER_S))
    _put(b, f"{at}w/c/0", b"half a chunk of a dead save")


@pytest.mark.parametrize("how", ["gc of the prefix", "gc of the checkpoint inside", "save to the prefix"])
def test_dead_claim_removal_keeps_a_checkpoint_committed_inside_the_prefix(bucket, how):
    """A save to ``run`` claimed the empty prefix and died; meanwhile a save to ``run/step_1`` committed. Removing
    the dead claim (``xckpt.gc``, or a later save to ``run``) removes only the dead save's objects: the checkpoint
    at ``run/step_1`` is kept byte for byte, and a gc asked about ``run/step_1`` leaves ``run``'s claim alone."""
    _dead_claim(bucket, "run")
    tree = _tree(1)
    xckpt.save(tree, f"{bucket.url}/run/step_1")
    step = _snapshot(bucket, "run/step_1/")
    if how == "gc of the prefix":
        done = xckpt.gc(f"{bucket.url}/run")
        assert [(c.leftover.path, c.action) for c in done] == [(f"{bucket.url}/run", "removed")]
        assert _snapshot(bucket) == step
    elif how == "gc of the checkpoint inside":
        before = _snapshot(bucket)
        assert xckpt.gc(f"{bucket.url}/run/step_1") == []
        assert _snapshot(bucket) == before
    else:
        with pytest.raises(xckpt.XckptError) as info:  # the dead save's objects go; the checkpoint stays
            xckpt.save(_tree(2), f"{bucket.url}/run")
        assert info.value.code == "save.not_empty"
        assert _snapshot(bucket) == step
    _committed(bucket, f"{bucket.url}/run/step_1", tree)


def test_gc_keeps_a_checkpoint_whose_save_died_after_committing(bucket, moto, tmp_path):
    """A save killed (SIGKILL) right after creating its manifest, before its commit marker and before releasing its
    claim, committed: once the claim is stale, gc removes the claim, writes the marker the save did not, and the
    checkpoint still loads exactly and validates."""
    url = f"{bucket.url}/run/step_5"
    script = tmp_path / "die.py"
    script.write_text("import sys, numpy as np, xckpt\n"
                      "xckpt.save({'w': np.arange(40, dtype=np.float32).reshape(5, 8), 'step': 5}, sys.argv[1])\n")
    env = dict(os.environ, XCKPT_FAILPOINTS="after_manifest:kill")
    proc = subprocess.run([sys.executable, str(script), url], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode(errors="replace")[-2000:]
    assert claims.CLAIM in _names(bucket, "run/step_5") and "xckpt.json" in _names(bucket, "run/step_5")
    assert "commit_success.txt" not in _names(bucket, "run/step_5")  # it follows the manifest
    done = xckpt.gc(f"{bucket.url}/run", older_than_s=0)
    assert [(c.leftover.path, c.action) for c in done] == [(url, "removed")]
    assert "commit_success.txt" in _names(bucket, "run/step_5")  # written by gc: Orbax takes it as finished
    want = {"w": np.arange(40, dtype=np.float32).reshape(5, 8), "step": 5}
    _committed(bucket, url, want)


def test_gc_writes_no_marker_for_a_manifest_another_save_committed(bucket):
    """A dead claim over a prefix whose manifest is another save's (its generation differs) and that has no commit
    marker: gc removes the claim and writes nothing into the checkpoint, since the marker was not the dead save's
    to write."""
    url = f"{bucket.url}/run/step_2"
    tree = _tree(2)
    xckpt.save(tree, url)
    bucket.client.delete_object(Bucket=bucket.name, Key="run/step_2/commit_success.txt")
    _put(bucket, "run/step_2/.xckpt-claim", _claim_record(uuid.uuid4().hex, time.time() - 2 * claims.STALE_AFTER_S))
    before = _snapshot(bucket)
    done = xckpt.gc(f"{bucket.url}/run")
    assert [(c.leftover.path, c.action) for c in done] == [(url, "removed")]
    assert _snapshot(bucket) == {k: v for k, v in before.items() if not k.endswith("/.xckpt-claim")}
    _assert_same(xckpt.load(url), tree)


def test_dead_claim_removal_keeps_objects_put_into_the_prefix(bucket):
    """Objects put into a dead save's claimed prefix by someone else (a note, a folder of files: names no save
    writes) are not the dead save's: gc removes its claim and chunks and keeps them, byte for byte."""
    _dead_claim(bucket, "run")
    mine = {"run/README.md": b"why this run stopped", "run/tokenizer/vocab.json": b"{}",
            "run/.hidden": b"x", "run/w/notes.txt": b"beside a chunk"}
    for k, v in mine.items():
        _put(bucket, k, v)
    done = xckpt.gc(f"{bucket.url}/run")
    assert [(c.leftover.path, c.action) for c in done] == [(f"{bucket.url}/run", "removed")]
    assert _snapshot(bucket) == mine


def test_gc_of_a_bucket_touches_only_the_bucket(bucket, tmp_path, monkeypatch):
    """``xckpt.gc("s3://bucket")``: a dead save's claim on the whole bucket is removed with its chunk, and nothing
    on the local file system is looked at (``s3:/`` is not the bucket's parent directory, even where a local
    ``s3:`` directory holds what looks like a leftover of a save named after the bucket)."""
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "s3:" / f".{bucket.name}.xckpt-tmp-{'0' * 32}"
    local.mkdir(parents=True)
    old = time.time() - 2 * claims.STALE_AFTER_S
    os.utime(local, (old, old))
    _dead_claim(bucket, "")
    _put(bucket, "run/step_1/notes.txt", b"keep")
    done = xckpt.gc(bucket.url)
    assert [(c.leftover.path, c.action) for c in done] == [(bucket.url, "removed")]
    assert _snapshot(bucket) == {"run/step_1/notes.txt": b"keep"}
    assert local.is_dir()


def _status(b, name: str, generation: str, objects: dict[str, float | None]) -> None:
    """The status objects a multi-process save_async to ``name`` leaves beside it (spec 6.5), each written at the
    time given (None: a record without a time, as written before records carried one)."""
    import msgpack
    for obj, at in objects.items():
        record = {"bytes": 10, "plan": b"k"} if obj.startswith("rank-") else {"failures": None}
        if at is not None:
            record["time"] = at
        _put(b, f"run/.{name}.xckpt-status-{generation}/{obj}", msgpack.packb(record, use_bin_type=True))


def test_gc_removes_the_status_objects_of_a_dead_asynchronous_save(bucket):
    """The status objects beside a prefix that a multi-process save_async left when its coordinating process died:
    gc removes them once their save's claim is stale, or, with no claim of their save, once their newest record is
    older than the limit; fresh ones, those of a live claim and records that do not say when they were written stay,
    as does anything else beside them."""
    old, now = time.time() - 2 * claims.STALE_AFTER_S, time.time()
    dead_claimed, dead_over, fresh, live, legacy = (uuid.uuid4().hex for _ in range(5))
    _put(bucket, "run/step_1/.xckpt-claim", _claim_record(dead_claimed, old))
    _status(bucket, "step_1", dead_claimed, {"rank-1": now, "rank-2": now})  # its claim says: dead
    _status(bucket, "step_2", dead_over, {"rank-0": old, "rank-3": old, "outcome": old})  # no claim: its records
    _status(bucket, "step_3", fresh, {"rank-0": old, "rank-1": now - 5})  # one recent record: the save may run
    _put(bucket, "run/step_4/.xckpt-claim", _claim_record(live, now))
    _status(bucket, "step_4", live, {"rank-0": old})  # its claim is live
    _status(bucket, "step_5", legacy, {"rank-0": None})  # no time: never judged dead
    _put(bucket, f"run/.step_2.xckpt-status-{dead_over}/notes.txt", b"not a status object")

    found = {(x.kind, x.name): x.stale for x in claims.scan(Location.of(f"{bucket.url}/run"))}
    assert found == {("claim", "step_1"): True, ("claim", "step_4"): False, ("status", "step_1"): True,
                     ("status", "step_2"): True, ("status", "step_3"): False, ("status", "step_4"): False,
                     ("status", "step_5"): False}, found
    done = xckpt.gc(f"{bucket.url}/run")
    assert sorted((c.leftover.kind, c.leftover.name) for c in done if c.action == "removed") == [
        ("claim", "step_1"), ("status", "step_1"), ("status", "step_2")]
    assert _keys(bucket, "run/") == sorted([
        f"run/.step_2.xckpt-status-{dead_over}/notes.txt",
        f"run/.step_3.xckpt-status-{fresh}/rank-0", f"run/.step_3.xckpt-status-{fresh}/rank-1",
        "run/step_4/.xckpt-claim", f"run/.step_4.xckpt-status-{live}/rank-0",
        f"run/.step_5.xckpt-status-{legacy}/rank-0"])


def test_a_small_write_that_fails_while_others_are_in_flight_fails_the_save_naming_it(bucket, proxy, monkeypatch):
    """Small objects are written without waiting for each answer (KvStore keeps up to 64 in flight). The answer to
    one of them (a vector's chunk) is lost with no retry left: the save fails with io.write naming that object and
    its leaf, commits nothing, and removes what it wrote, that object included; the prefix can be saved to again."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"{bucket.url}/run/step_9"
    tree = {f"v{i}": np.full(64, i, np.float32) for i in range(40)}
    proxy.drop_response(f"PUT /{bucket.name}/run/step_9/v17/c/0 ".encode())
    _, err, _ = _in_thread(lambda: xckpt.save(tree, url), timeout=120)
    assert isinstance(err, xckpt.XckptError) and err.code == "io.write", repr(err)
    assert (err.file, err.leaf) == (f"{url}/v17/c/0", "v17"), err
    assert _names(bucket, "run/step_9") == []
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    xckpt.save(tree, url)
    _committed(bucket, url, tree)
