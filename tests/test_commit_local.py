"""The commit protocol on a local file system (spec section 6): what dead saves leave and who removes it
(a later save, ``xckpt gc``), one winner among concurrent saves, no torn loads while a checkpoint is
replaced again and again, and the order of the durable operations (traced with strace)."""

from __future__ import annotations

import json
import os
import re
import shutil
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
from xckpt.convert import convert
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard

#: A process that saves generation ``k`` to a path (``n`` times, generations k, k+1, ...), with overwrite.
SAVER = r"""
import sys
import numpy as np
import xckpt
path, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for g in range(k, k + n):
    xckpt.save({f"a{i}": np.full((96, 128), g * 1000 + i, np.float32) for i in range(6)} | {"step": g}, path,
               overwrite=True)
print("saved", n, flush=True)
"""


def tree_of(g: int) -> dict:
    """What :data:`SAVER` saves as generation ``g``."""
    return {f"a{i}": np.full((96, 128), g * 1000 + i, np.float32) for i in range(6)} | {"step": g}


def generation_of(out: dict) -> int | None:
    """The generation every leaf of a loaded tree agrees on, or None when they disagree (a torn load)."""
    g = out["step"]
    for i in range(6):
        a = out[f"a{i}"]
        if a.shape != (96, 128) or not np.array_equal(a, np.full((96, 128), g * 1000 + i, np.float32)):
            return None
    return g


def run_saver(path: Path, k: int, n: int = 1, *, env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    """Run :data:`SAVER` in a fresh process (``env`` added to this one's)."""
    return subprocess.run([sys.executable, "-c", SAVER, str(path), str(k), str(n)], env=dict(os.environ, **(env or {})),
                          capture_output=True, text=True, timeout=timeout)


def crash(path: Path, k: int, point: str, **env: str) -> None:
    """A save of generation ``k`` to ``path`` that dies (SIGKILL) at failpoint ``point``."""
    res = run_saver(path, k, env={"XCKPT_FAILPOINTS": f"{point}:kill", **env})
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr)


def hidden(directory: Path) -> list[str]:
    """The leftover names (``.<name>.xckpt-<kind>-<generation>``) in ``directory``, as ``<name> <kind>``."""
    out = []
    for entry in os.listdir(directory):
        m = re.fullmatch(r"\.(.+)\.xckpt-(tmp|lease|status|old)-[0-9a-f]{32}", entry)
        if m:
            out.append(f"{m[1]} {m[2]}")
    return sorted(out)


def assert_holds(path: Path, g: int) -> None:
    """``path`` holds exactly generation ``g``, and validates deep."""
    assert generation_of(xckpt.load(path)) == g
    report = xckpt.validate(path, deep=True)
    assert report.ok, [str(f) for f in report.findings]


class Gate:
    """An array leaf whose data is fetched only once ``parties`` fetches wait (or ``release`` is called):
    holds concurrent saves after their planning, so that they really overlap."""

    def __init__(self, parties: int = 1) -> None:
        self.barrier = threading.Barrier(parties, timeout=30) if parties > 1 else None
        self.event = threading.Event()

    def release(self) -> None:
        """Let the fetch return."""
        self.event.set()

    def source(self, value: float) -> ArraySource:
        """The leaf: 16 float32 of ``value``."""
        def fetch() -> np.ndarray:
            if self.barrier is not None:
                self.barrier.wait()
            else:
                assert self.event.wait(30), "the gate was never opened"
            return np.full(16, value, np.float32)
        return ArraySource((16,), "float32", [Shard(Region((0,), (16,)), fetch)])


# -- leftovers of dead saves ---------------------------------------------------------------------


def test_a_later_save_removes_dead_leftovers_and_never_a_live_saves(tmp_path, monkeypatch):
    """A save killed before its commit leaves its temporary directory and lease; once they are older
    than XCKPT_STALE_AFTER_S, the next save to the same parent removes them, while a live save's
    (renewed by its heartbeat) stay and that save commits."""
    crash(tmp_path / "dead", 1, "before_publish")
    assert hidden(tmp_path) == ["dead lease", "dead tmp"] and not (tmp_path / "dead").exists()

    monkeypatch.setenv("XCKPT_STALE_AFTER_S", "1")
    gate, errors = Gate(), []

    def live() -> None:
        try:
            xckpt.save({"x": gate.source(7.0), "w": np.arange(12.0)}, tmp_path / "live")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=live)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while "live tmp" not in hidden(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.6)  # the dead save's lease is now stale; the live one's heartbeat renews it
        assert hidden(tmp_path) == ["dead lease", "dead tmp", "live lease", "live tmp"]
        xckpt.save({"y": np.ones(3)}, tmp_path / "other")
        assert hidden(tmp_path) == ["live lease", "live tmp"]
    finally:
        gate.release()
        t.join(30)
    assert not errors and not t.is_alive(), errors
    out = xckpt.load(tmp_path / "live")
    np.testing.assert_array_equal(out["x"], np.full(16, 7.0, np.float32))
    np.testing.assert_array_equal(out["w"], np.arange(12.0))
    assert hidden(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["live", "other"]


def test_gc_lists_removes_dead_leftovers_and_restores_a_side_copy(tmp_path, capsys):
    """``xckpt gc``: lists every leftover; --dry-run changes nothing; it removes only what is older
    than --older-than, and moves a side copy back to its missing destination (a replace without
    renameat2 killed between its two renames) instead of deleting it."""
    crash(tmp_path / "a", 1, "after_write")  # a new checkpoint, killed: leaves tmp + lease
    assert run_saver(tmp_path / "b", 5).returncode == 0
    crash(tmp_path / "b", 6, "after_aside", XCKPT_NO_RENAMEAT2="1")
    assert not (tmp_path / "b").exists()  # between the two renames: the old checkpoint is aside
    before = hidden(tmp_path)
    assert before == ["a lease", "a tmp", "b lease", "b old", "b tmp"]

    assert cli_main(["gc", str(tmp_path), "--dry-run"]) == 0  # default age: an hour, nothing is dead yet
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines[:-1]) == ["kept"] * 4 + ["would"]
    assert lines[-1] == "5 leftovers, would remove 0, kept 4 live"
    assert hidden(tmp_path) == before

    time.sleep(0.3)
    dry = {(c.leftover.name, c.leftover.kind): c.action for c in xckpt.gc(tmp_path, older_than_s=0.2, dry_run=True)}
    assert dry == {("a", "lease"): "would remove", ("a", "tmp"): "would remove", ("b", "lease"): "would remove",
                   ("b", "tmp"): "would remove", ("b", "old"): "would restore"}
    assert hidden(tmp_path) == before

    assert cli_main(["gc", str(tmp_path), "--older-than", "0.2", "--json"]) == 0
    done = {(x["name"], x["kind"]): x["action"] for x in json.loads(capsys.readouterr().out)}
    assert done == {k: v.replace("would ", "").replace("remove", "removed").replace("restore", "restored")
                    for k, v in dry.items()}
    assert hidden(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["b"]
    assert_holds(tmp_path / "b", 5)


def test_gc_removes_only_entries_a_save_makes_under_a_leftovers_name(tmp_path):
    """A directory named as a lease (leases are files), a file named as a temporary directory, a directory named
    as a side copy holding no checkpoint: none is what a save leaves, so however old, neither ``xckpt gc`` nor
    the cleanup a save does first removes them; a real dead save's leftovers beside them are removed."""
    g = "0123456789abcdef0123456789abcdef"
    xckpt.save({"w": np.ones(2)}, tmp_path / "d")
    (tmp_path / f".b.xckpt-lease-{g}").mkdir()
    (tmp_path / f".b.xckpt-lease-{g}" / "precious.txt").write_text("mine")
    (tmp_path / f".c.xckpt-tmp-{g}").write_text("mine too")
    (tmp_path / f".d.xckpt-old-{g}").mkdir()
    (tmp_path / f".d.xckpt-old-{g}" / "precious.txt").write_text("and mine")
    crash(tmp_path / "a", 1, "after_write")  # a dead save: tmp + lease
    old = time.time() - 7200
    for entry in tmp_path.iterdir():
        os.utime(entry, (old, old))
    looks = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".b.", ".c.", ".d.")))
    xckpt.save({"w": np.zeros(2)}, tmp_path / "e")  # a save's own cleanup first
    assert [c.leftover.name for c in xckpt.gc(tmp_path)] == []  # the dead save's went with the save's cleanup
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == looks
    assert (tmp_path / f".b.xckpt-lease-{g}" / "precious.txt").read_text() == "mine"
    assert (tmp_path / f".d.xckpt-old-{g}" / "precious.txt").read_text() == "and mine"
    np.testing.assert_array_equal(xckpt.load(tmp_path / "d")["w"], np.ones(2))


def test_gc_of_one_checkpoint_path_and_of_an_empty_directory(tmp_path):
    """``gc PATH`` where PATH is a checkpoint finds the leftovers beside it (only its own); a directory
    with none reports none."""
    crash(tmp_path / "a", 1, "before_publish")
    crash(tmp_path / "b", 1, "before_publish")
    time.sleep(0.2)
    found = xckpt.gc(tmp_path / "a", older_than_s=0.1)
    assert sorted((c.leftover.name, c.leftover.kind, c.action) for c in found) == [
        ("a", "lease", "removed"), ("a", "tmp", "removed")]
    assert hidden(tmp_path) == ["b lease", "b tmp"]
    (tmp_path / "empty").mkdir()
    assert xckpt.gc(tmp_path / "empty") == []


# -- concurrent writers ----------------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_saves_to_one_path_one_commits(tmp_path, overwrite):
    """Two saves to one path, overlapping (each holds after planning until both got there): exactly one
    commits, complete; the other fails with save.exists (a new path) or save.conflict (replacing the
    same checkpoint), leaving nothing behind."""
    for rnd in range(4):
        path = tmp_path / f"ckpt{rnd}"
        if overwrite:
            xckpt.save({"x": np.zeros(16, np.float32), "who": -1}, path)
        gate = Gate(parties=2)
        results: dict[int, BaseException | None] = {}

        def saver(who: int) -> None:
            try:
                xckpt.save({"x": gate.source(float(who)), "who": who}, path, overwrite=overwrite)
                results[who] = None
            except BaseException as exc:  # noqa: BLE001 - checked below
                results[who] = exc

        threads = [threading.Thread(target=saver, args=(who,)) for who in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == [1, 2]
        winners = [who for who, exc in results.items() if exc is None]
        assert len(winners) == 1, results
        loser = next(exc for exc in results.values() if exc is not None)
        assert isinstance(loser, xckpt.XckptError), loser
        assert loser.code == ("save.conflict" if overwrite else "save.exists"), loser
        out = xckpt.load(path)
        assert out["who"] == winners[0]
        np.testing.assert_array_equal(out["x"], np.full(16, winners[0], np.float32))
        assert xckpt.validate(path, deep=True).ok
        assert hidden(tmp_path) == []


def test_overwrite_replaces_only_a_committed_checkpoint(tmp_path):
    """overwrite=True refuses a directory that is not a checkpoint (and a file), deleting nothing."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("also mine")
    for target in (notes, tmp_path / "file"):
        with pytest.raises(xckpt.XckptError) as info:
            xckpt.save({"x": np.ones(3)}, target, overwrite=True)
        assert info.value.code == "save.not_checkpoint" and str(target) in str(info.value)
    assert (notes / "keep.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "also mine"
    assert sorted(os.listdir(tmp_path)) == ["file", "notes"]


def test_overwrite_refuses_a_checkpoint_whose_manifest_cannot_be_read(tmp_path):
    """A checkpoint whose xckpt.json was cut short: which of its files are its own cannot be told, so overwrite
    refuses (save.not_checkpoint naming the manifest) rather than delete a file put into it."""
    path = tmp_path / "ckpt"
    xckpt.save({"w": np.ones(4)}, path)
    manifest = path / "xckpt.json"
    manifest.write_bytes(manifest.read_bytes()[:20])
    (path / "tokenizer.json").write_text("{}")
    before = {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.save({"w": np.zeros(4)}, path, overwrite=True)
    assert (info.value.code, info.value.file) == ("save.not_checkpoint", str(manifest)), info.value
    assert {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("kind", ["save", "save_async"])
def test_overwrite_never_deletes_files_put_into_a_checkpoint(tmp_path, kind):
    """A README, a tokenizer folder or a stray hidden file put into a committed checkpoint's directory: overwrite
    refuses (save.foreign, naming the first) and writes nothing; once they are moved out, it replaces it."""
    path = tmp_path / "ckpt"
    xckpt.save({"w": np.ones(4), "step": 1, "tag": "a"}, path)
    (path / "NOTES.txt").write_text("hand-written")
    (path / "tokenizer").mkdir()
    (path / "tokenizer" / "vocab.json").write_text("{}")
    (path / ".DS_Store").write_bytes(b"x")
    before = {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}

    def save(tree):
        if kind == "save":
            xckpt.save(tree, path, overwrite=True)
        else:
            xckpt.save_async(tree, path, overwrite=True).wait()
    with pytest.raises(xckpt.XckptError) as info:
        save({"w": np.zeros(4), "step": 2, "tag": "b"})
    assert info.value.code == "save.foreign" and info.value.file == str(path / ".DS_Store"), info.value
    assert "NOTES.txt" in str(info.value) and "tokenizer" in str(info.value)
    assert {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert hidden(tmp_path) == []
    for name in ("NOTES.txt", "tokenizer", ".DS_Store"):
        shutil.move(path / name, tmp_path / name)
    save({"w": np.zeros(4), "step": 2, "tag": "b"})
    out = xckpt.load(path)
    np.testing.assert_array_equal(out["w"], np.zeros(4))
    assert (out["step"], out["tag"]) == (2, "b")


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("kind", ["save", "save_async"])
def test_overwrite_never_deletes_files_put_below_a_checkpoints_top_level(tmp_path, kind):
    """A note in a leaf's directory, a folder among its chunk directories: not what a save writes there, so an
    overwrite refuses (save.foreign, naming the first) and writes nothing; once they are moved out, it replaces
    the checkpoint."""
    path = tmp_path / "ckpt"
    xckpt.save({"model": {"w0": np.ones((4, 4)), "w1": np.ones(3)}, "step": 1}, path)
    (path / "model.w0" / "NOTES.txt").write_text("mine")
    (path / "model.w1" / "c" / "mine").mkdir()
    (path / "model.w1" / "c" / "mine" / "data").write_bytes(b"x")
    before = _files(path)

    def save(tree):
        if kind == "save":
            xckpt.save(tree, path, overwrite=True)
        else:
            xckpt.save_async(tree, path, overwrite=True).wait()
    new = {"model": {"w0": np.zeros((4, 4)), "w1": np.zeros(3)}, "step": 2}
    with pytest.raises(xckpt.XckptError) as info:
        save(new)
    assert info.value.code == "save.foreign" and info.value.file == str(path / "model.w0" / "NOTES.txt"), info.value
    assert "model.w1/c/mine" in str(info.value) and "model.w1/c/mine/data" not in str(info.value)
    assert _files(path) == before and hidden(tmp_path) == []
    (path / "model.w0" / "NOTES.txt").unlink()
    shutil.rmtree(path / "model.w1" / "c" / "mine")
    save(new)
    out = xckpt.load(path)
    np.testing.assert_array_equal(out["model"]["w0"], np.zeros((4, 4)))
    np.testing.assert_array_equal(out["model"]["w1"], np.zeros(3))
    assert out["step"] == 2


def test_a_manifest_owns_what_its_save_wrote_and_nothing_else(tmp_path):
    """Every file and directory a save wrote (nested names, a value's Orbax mirror, strings, a multi-chunk array,
    the Orbax marker) is one its manifest owns; a note in a leaf's directory, a folder among its chunks, a
    ``zarr.json`` in a chunk directory, a file under the marker's directory, a reserved name as a directory, are
    not."""
    from xckpt.format.manifest import parse

    path = tmp_path / "ckpt"
    xckpt.save({"mlp/~/lin": {"w": np.ones((64, 64))}, "a": {"b": np.arange(6)}, "step": 3, "tag": "x"}, path,
               inner_chunk_bytes=1024)
    m = parse((path / "xckpt.json").read_bytes(), file="xckpt.json")
    written = [(str(p.relative_to(path)), p.is_dir()) for p in path.rglob("*")]
    assert any(n.count("/") >= 4 for n, _ in written) and ("step/c", False) in written
    assert all(m.owns(n, d) for n, d in written), [n for n, d in written if not m.owns(n, d)]
    for name, is_dir in (("a.b/NOTES.txt", False), ("a.b/c/mine", True), ("a.b/c/0/zarr.json", False),
                         (".orbax_marker/other", False), ("xckpt.json", True), ("a.b", False), ("mlp", False),
                         ("a.b/zarr.json", True), ("step/c/x", False), ("zarr.json", False), ("a.c/c/0", False)):
        assert not m.owns(name, is_dir), name


@pytest.mark.parametrize("exchange", [True, False])
@pytest.mark.parametrize("kind", ["save", "save_async"])
def test_files_put_into_a_checkpoint_while_it_is_replaced_are_kept(tmp_path, monkeypatch, kind, exchange):
    """Files put into the old checkpoint after the save checked it (while it wrote, for as long as an asynchronous
    save runs): the new checkpoint commits, the old one's own files are deleted, and the files put there are
    kept, with the directories they lie in, in ``<name>.xckpt-kept-<generation>``, with a warning naming it;
    with an atomic exchange and with two renames alike."""
    from xckpt.engine import atomic, commit

    path = tmp_path / "ckpt"
    xckpt.save({"model": {"w0": np.ones((4, 4))}, "step": 1}, path)
    real = commit.identity

    def identity(loc, kind_):  # called on the displaced checkpoint just before it is removed
        if os.path.basename(loc.local_path).startswith("."):
            (Path(loc.local_path) / "README.md").write_text("late")
            (Path(loc.local_path) / "model.w0" / "NOTES.txt").write_text("later")
        return real(loc, kind_)
    monkeypatch.setattr(commit, "identity", identity)
    if not exchange:
        monkeypatch.setattr(atomic, "_renameat2", None)
    with pytest.warns(xckpt.XckptWarning, match="xckpt-kept-") as said:
        if kind == "save":
            xckpt.save({"model": {"w0": np.zeros((4, 4))}, "step": 2}, path, overwrite=True)
        else:
            xckpt.save_async({"model": {"w0": np.zeros((4, 4))}, "step": 2}, path, overwrite=True).wait()
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.xckpt-kept-")]
    assert len(kept) == 1 and str(kept[0]) in str(said[0].message)
    assert _files(kept[0]) == {"README.md": b"late", "model.w0/NOTES.txt": b"later"}  # only what was put there
    assert sorted(str(p.relative_to(kept[0])) for p in kept[0].rglob("*")) == ["README.md", "model.w0",
                                                                                "model.w0/NOTES.txt"]
    out = xckpt.load(path)
    np.testing.assert_array_equal(out["model"]["w0"], np.zeros((4, 4)))
    assert out["step"] == 2 and hidden(tmp_path) == []
    assert xckpt.validate(path).ok


@pytest.mark.parametrize("kind", ["save", "save_async"])
@pytest.mark.parametrize("where", ["commit_marker", "manifest", "publish"])
def test_an_io_error_in_the_commit_names_its_file(tmp_path, monkeypatch, kind, where):
    """The disk fails while the commit writes commit_success.txt or the manifest, or while it moves the new
    checkpoint into place: io.write naming that file (not a bare OSError), the previous checkpoint whole and
    nothing left beside it."""
    import errno

    from xckpt.engine import atomic, storage

    path = tmp_path / "ckpt"
    xckpt.save({"w": np.ones(4)}, path)
    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "publish":
        def fail(*args):
            raise full
        monkeypatch.setattr(atomic, "exchange", fail)
        monkeypatch.setattr(atomic, "move_new", fail)
        want = str(path)
    else:
        name = "commit_success.txt" if where == "commit_marker" else "xckpt.json"
        write, create = storage.LocalStore.write, storage.LocalStore.create

        def failing_write(self, n, data, **kw):
            if n == name:
                raise full
            return write(self, n, data, **kw)

        def failing_create(self, n, data):
            if n == name:
                raise full
            return create(self, n, data)
        monkeypatch.setattr(storage.LocalStore, "write", failing_write)
        monkeypatch.setattr(storage.LocalStore, "create", failing_create)
        want = name
    with pytest.raises(xckpt.XckptError) as info:
        if kind == "save":
            xckpt.save({"w": np.zeros(4)}, path, overwrite=True)
        else:
            xckpt.save_async({"w": np.zeros(4)}, path, overwrite=True).wait()
    assert info.value.code == "io.write" and info.value.file.endswith(want), info.value
    assert "No space left on device" in str(info.value)
    monkeypatch.undo()
    np.testing.assert_array_equal(xckpt.load(path)["w"], np.ones(4))
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("kind", ["save", "save_async"])
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("warned", ["warn", "error"])
def test_a_failure_after_the_move_into_place_keeps_the_checkpoint(tmp_path, monkeypatch, kind, overwrite, warned):
    """The disk fails right after the new checkpoint moved into place (the parent directory's sync): the move was
    the commit and nothing undoes it, so the save returns its manifest with an XckptWarning saying so, and does not
    report a failure (it said "failed" before); the checkpoint loads exactly. The checkpoint it replaced is not
    removed (the move may not be durable yet): it is a leftover that ``xckpt gc`` removes. With warnings turned
    into errors, the save raises that XckptWarning itself, never a failure, and the checkpoint stays all the same."""
    import errno
    import warnings

    from xckpt.engine import atomic

    if overwrite and not atomic.supported():
        pytest.skip("no renameat2 here: a replacement syncs the parent before its commit too")
    path = tmp_path / "ckpt"
    if overwrite:
        xckpt.save({"w": np.ones(4)}, path)
    real = atomic.sync_dir

    def sync_dir(d):
        if os.path.realpath(d) == os.path.realpath(tmp_path):  # the parent, synced after the move
            raise OSError(errno.EIO, "Input/output error")
        return real(d)
    monkeypatch.setattr(atomic, "sync_dir", sync_dir)

    def save() -> Any:
        if kind == "save":
            return xckpt.save({"w": np.arange(4.0)}, path, overwrite=overwrite)
        return xckpt.save_async({"w": np.arange(4.0)}, path, overwrite=overwrite).wait()
    if warned == "warn":
        with pytest.warns(xckpt.XckptWarning, match="is committed, but a failure followed the commit"):
            manifest = save()
        assert manifest is not None
        assert manifest.generation == json.loads((path / "xckpt.json").read_text())["generation"]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", xckpt.XckptWarning)
            with pytest.raises(xckpt.XckptWarning, match="is committed, but a failure followed the commit"):
                save()
    monkeypatch.undo()
    np.testing.assert_array_equal(xckpt.load(path)["w"], np.arange(4.0))
    assert xckpt.validate(path).ok
    assert len(hidden(tmp_path)) == (1 if overwrite else 0)  # the replaced checkpoint, kept as a leftover
    xckpt.gc(tmp_path, older_than_s=0)
    assert hidden(tmp_path) == []
    np.testing.assert_array_equal(xckpt.load(path)["w"], np.arange(4.0))


def _replace_leaving_the_old_beside(tmp_path: Path, monkeypatch: Any, how: str) -> tuple[Path, set[str]]:
    """Replace the checkpoint ``tmp_path/ckpt`` while the parent directory's sync after the move into place fails,
    putting notes into the replaced checkpoint meanwhile: it is left beside the new one (at the save's temporary
    name after an atomic exchange, ``how="exchange"``, or a format 1.0 checkpoint, ``"format-1.0"``, which has no
    generation; at its side-copy name after two renames, ``"aside"``; a safetensors export replaced by another,
    ``"safetensors"``). Returns that leftover and the names of the replaced checkpoint's own entries."""
    import errno

    from xckpt.engine import atomic

    if how != "aside" and not atomic.supported():
        pytest.skip("no renameat2 here")
    if how == "aside":  # the replacement without an atomic exchange: two renames
        def unsupported(a, b):
            raise atomic.Unsupported(errno.EINVAL, "no exchange")
        monkeypatch.setattr(atomic, "exchange", unsupported)
    path = tmp_path / "ckpt"
    if how == "safetensors":
        xckpt.save({"w": np.ones(4, np.float32)}, tmp_path / "src")
        xckpt.save({"w": np.arange(4, dtype=np.float32)}, tmp_path / "src2")
        convert(str(tmp_path / "src"), str(path), target="safetensors")
    elif how == "format-1.0":
        shutil.copytree(Path(__file__).resolve().parent.parent / "spec/conformance/valid_1.0/sharded/checkpoint", path)
        assert "generation" not in json.loads((path / "xckpt.json").read_text())
    else:
        xckpt.save({"w": np.ones(4)}, path)
    replaced = {name for name, _ in _walk(path)}
    real = atomic.sync_dir
    parent_syncs = []

    def sync_dir(d):
        if os.path.realpath(d) == os.path.realpath(tmp_path):
            parent_syncs.append(d)
            # the aside path syncs the parent between its renames too: the one after the move into place fails
            if len(parent_syncs) == (2 if how == "aside" else 1):
                (left,) = [tmp_path / e for e in os.listdir(tmp_path) if e.startswith(".ckpt.xckpt-")
                           and e.split("-")[-2] in ("tmp", "old") and (tmp_path / e).is_dir()]
                (left / "notes.txt").write_text("mine")  # put into the replaced checkpoint while the save ran
                if how in ("exchange", "aside"):
                    (left / "w" / "NOTE").write_text("mine too")
                raise OSError(errno.EIO, "Input/output error")
        return real(d)
    monkeypatch.setattr(atomic, "sync_dir", sync_dir)
    with pytest.warns(xckpt.XckptWarning, match="is committed, but a failure followed the commit"):
        if how == "safetensors":
            convert(str(tmp_path / "src2"), str(path), target="safetensors", overwrite=True)
        else:
            xckpt.save({"w": np.arange(4.0)}, path, overwrite=True)
    monkeypatch.undo()
    (left,) = [tmp_path / e for e in os.listdir(tmp_path) if e.startswith(".ckpt.xckpt-")]
    return left, replaced


def _check_kept(tmp_path: Path, kept: Path, how: str, replaced: set[str]) -> None:
    """``kept`` holds exactly the notes :func:`_replace_leaving_the_old_beside` put in, nothing of the replaced
    checkpoint; no leftover remains; the new checkpoint is whole."""
    want = {"notes.txt": "mine"} | ({"w/NOTE": "mine too"} if how in ("exchange", "aside") else {})
    assert {name: (kept / name).read_text() for name, kind in _walk(kept) if kind == "file"} == want
    assert not replaced & {name for name, _ in _walk(kept)} - {"w"}
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".ckpt.")]
    path = tmp_path / "ckpt"
    if how == "safetensors":
        from safetensors.numpy import load_file
        np.testing.assert_array_equal(load_file(str(path / "model.safetensors"))["w"], np.arange(4, dtype=np.float32))
    else:
        np.testing.assert_array_equal(xckpt.load(path)["w"], np.arange(4.0))
        assert xckpt.validate(path).ok


@pytest.mark.parametrize("how", ["exchange", "format-1.0", "aside", "safetensors"])
def test_gc_keeps_files_put_into_a_replaced_checkpoint_a_failed_step_after_the_commit_left_beside(
        tmp_path, monkeypatch, how):
    """Files put into a checkpoint while a save replaced it survive when the parent directory's sync after the move
    into place fails: ``xckpt gc`` deletes only what the replaced checkpoint left beside is made of, moving the rest
    to ``<name>.xckpt-kept-<generation>`` with a warning (it deleted the directory whole before, the notes with it;
    a replaced checkpoint of format 1.0, whose manifest has no generation, was still taken for the save's own)."""
    left, replaced = _replace_leaving_the_old_beside(tmp_path, monkeypatch, how)
    generation = left.name.rpartition("-")[2]
    with pytest.warns(xckpt.XckptWarning, match="not known to be its own"):
        found = xckpt.gc(tmp_path, older_than_s=0)
    assert [c.action for c in found if c.leftover.path == str(left)] == ["removed"]
    _check_kept(tmp_path, tmp_path / f"ckpt.xckpt-kept-{generation}", how, replaced)


class _Killed(BaseException):
    """A process killed at this point (nothing of it runs after)."""


def test_gc_cut_short_while_removing_a_replaced_checkpoint_is_finished_by_the_next(tmp_path, monkeypatch):
    """A gc killed midway through deleting a replaced checkpoint (after some of its files went) leaves its manifest,
    which goes last: the next gc still knows which files are its own and keeps the notes (before, the manifest
    could go first, and the next gc took what was left for the save's own writing and deleted it whole). Then a
    kept name that is taken: the notes go to the next free one."""
    left, replaced = _replace_leaving_the_old_beside(tmp_path, monkeypatch, "exchange")
    generation = left.name.rpartition("-")[2]
    real = os.unlink
    gone = []

    def unlink(p, *a, **k):
        real(p, *a, **k)
        gone.append(p)
        if len(gone) == 3:
            raise _Killed
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(_Killed):
        xckpt.gc(tmp_path, older_than_s=0)
    monkeypatch.undo()
    assert (left / "xckpt.json").is_file() and (left / "notes.txt").is_file()
    taken = tmp_path / f"ckpt.xckpt-kept-{generation}"
    taken.mkdir()
    (taken / "other").write_text("not these")
    with pytest.warns(xckpt.XckptWarning, match="not known to be its own"):
        found = xckpt.gc(tmp_path, older_than_s=0)
    assert [c.action for c in found if c.leftover.path == str(left)] == ["removed"]
    assert (taken / "other").read_text() == "not these"
    _check_kept(tmp_path, tmp_path / f"ckpt.xckpt-kept-{generation}-1", "exchange", replaced)


def test_gc_reports_a_replaced_checkpoint_it_cannot_delete_and_keeps_it_for_a_later_try(tmp_path, monkeypatch):
    """Files of the replaced checkpoint that cannot be deleted (a permission) make gc report the leftover "failed"
    with ``io.write`` naming one, and leave it where it was, manifest included, so that a later gc finishes it
    (before, it was reported "removed" and its files moved aside as if they were not its own)."""
    left, replaced = _replace_leaving_the_old_beside(tmp_path, monkeypatch, "exchange")
    generation = left.name.rpartition("-")[2]
    real = os.unlink

    def unlink(p, *a, **k):
        if str(p) in ("0", "1") or "/c/" in str(p):  # a chunk object (unlinked relative to its directory)
            raise PermissionError(13, "Permission denied")
        return real(p, *a, **k)
    monkeypatch.setattr(os, "unlink", unlink)
    found = xckpt.gc(tmp_path, older_than_s=0)
    monkeypatch.undo()
    (mine,) = [c for c in found if c.leftover.path == str(left)]
    assert mine.action == "failed" and "cannot delete" in mine.error and "/c/" in mine.error, mine
    assert (left / "xckpt.json").is_file() and (left / "notes.txt").is_file()
    with pytest.warns(xckpt.XckptWarning, match="not known to be its own"):
        xckpt.gc(tmp_path, older_than_s=0)
    _check_kept(tmp_path, tmp_path / f"ckpt.xckpt-kept-{generation}", "exchange", replaced)


def test_gc_removes_a_killed_exports_own_temporary_directory_whole(tmp_path):
    """A safetensors export (with a config.json beside its weights) killed before its move into place, to a new path
    and over an earlier export: gc removes its temporary directory whole, with no warning and no kept directory
    (its config.json is one of the files its kind writes)."""
    import warnings
    src = tmp_path / "src"
    xckpt.save({"a": np.ones(64, np.float32)}, src)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2"}')
    child = ("import sys\nfrom xckpt.interop.safetensors.writer import xckpt_to_safetensors\n"
             "xckpt_to_safetensors(sys.argv[1], sys.argv[2], extra_files={'config.json': sys.argv[3]}, overwrite=True)")
    for over in (False, True):
        dst = tmp_path / f"hf{int(over)}"
        if over:
            subprocess.run([sys.executable, "-c", child, str(src), str(dst), str(config)], check=True, timeout=120)
        res = subprocess.run([sys.executable, "-c", child, str(src), str(dst), str(config)], timeout=120,
                             env=dict(os.environ, XCKPT_FAILPOINTS="before_publish:kill"))
        assert res.returncode == -9, res
        (left,) = [e for e in os.listdir(tmp_path) if e.startswith(f".{dst.name}.xckpt-tmp-")]
        assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / left))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = xckpt.gc(tmp_path, older_than_s=0)
    assert {c.action for c in found} == {"removed"}
    assert sorted(os.listdir(tmp_path)) == ["config.json", "hf1", "src"]


def test_gc_removes_a_dead_saves_own_temporary_directory_whole(tmp_path):
    """A save killed after writing its own manifest into its temporary directory (before the move into place) left
    only its own writing there: gc removes it whole, leaving no kept directory (the rule above applies to a
    checkpoint of another generation only)."""
    path = tmp_path / "ckpt"
    crash(path, 1, "before_publish")
    (left,) = [e for e in os.listdir(tmp_path) if e.startswith(".ckpt.xckpt-tmp-")]
    assert (tmp_path / left / "xckpt.json").is_file()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = xckpt.gc(tmp_path, older_than_s=0)
    assert {c.action for c in found} == {"removed"}
    assert os.listdir(tmp_path) == []


def _walk(root: Path) -> list[tuple[str, str]]:
    """Every entry below ``root``: (relative name, "file" or "dir")."""
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        for n in dirs:
            out.append((os.path.normpath(os.path.join(rel, n)), "dir"))
        for n in files:
            out.append((os.path.normpath(os.path.join(rel, n)), "file"))
    return out


# -- readers against a writer ------------------------------------------------------------------------


def test_loads_against_an_overwriter_are_never_torn(tmp_path):
    """A process replaces a checkpoint hundreds of times while two threads load it in a loop: every
    load returns one generation whole (or, replaced under it more often than it retries, a
    load.replaced error); 0 torn."""
    path = tmp_path / "ckpt"
    assert run_saver(path, 0).returncode == 0
    commits = 300
    writer = subprocess.Popen([sys.executable, "-c", SAVER, str(path), "1", str(commits)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    stats = {"whole": 0, "torn": 0, "replaced": 0, "generations": set()}
    failures: list[BaseException] = []
    loads = [0, 0]  # whole loads per thread: each must have done some
    lock = threading.Lock()

    def loader(me: int) -> None:
        while writer.poll() is None:
            try:
                g = generation_of(xckpt.load(path))
            except xckpt.XckptError as exc:
                if exc.code != "load.replaced":
                    failures.append(exc)
                    return
                with lock:
                    stats["replaced"] += 1
                continue
            except BaseException as exc:  # noqa: BLE001 - any other error is a failure the test reports
                failures.append(exc)
                return
            with lock:
                loads[me] += 1
                if g is None:
                    stats["torn"] += 1
                else:
                    stats["whole"] += 1
                    stats["generations"].add(g)

    threads = [threading.Thread(target=loader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        out, err = writer.communicate(timeout=240)
    finally:
        if writer.poll() is None:
            writer.kill()
        for t in threads:
            t.join(60)
    assert writer.returncode == 0 and out.strip() == f"saved {commits}", err
    assert not failures, failures
    assert not any(t.is_alive() for t in threads) and min(loads) > 0, loads
    print({k: (len(v) if isinstance(v, set) else v) for k, v in stats.items()})
    assert stats["torn"] == 0, stats
    assert stats["whole"] >= 100 and len(stats["generations"]) >= 20, stats
    assert_holds(path, commits)
    assert hidden(tmp_path) == []


# -- durable order ----------------------------------------------------------------------------------

_SYSCALL = re.compile(r"^(?P<pid>\d+)\s+(?:(?P<name>\w+)\((?P<args>.*?)(?: <unfinished \.\.\.>|\) += (?P<ret>-?\d+).*)"
                      r"|<\.\.\. (?P<resumed>\w+) resumed>.*\) += (?P<ret2>-?\d+).*)$")


def _trace(path: Path, k: int, out: Path) -> list[tuple[str, str, int]]:
    """Run one save under strace; return its completed syscalls in order: ``(name, args, result)``."""
    res = subprocess.run(["strace", "-f", "-qq", "-y", "-o", str(out), "-e",
                          "trace=openat,fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat,rmdir",
                          sys.executable, "-c", SAVER, str(path), str(k), "1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    calls, pending = [], {}
    for line in out.read_text().splitlines():
        m = _SYSCALL.match(line)
        if m is None:
            continue
        if m["resumed"]:
            name, args = pending.pop(m["pid"], (m["resumed"], ""))
            calls.append((name, args, int(m["ret2"])))
        elif m["ret"] is None:
            pending[m["pid"]] = (m["name"], m["args"])
        else:
            calls.append((m["name"], m["args"], int(m["ret"])))
    return calls


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (.ci/run installs it)")
def test_commit_order_data_and_directories_synced_before_the_rename_parent_after(tmp_path):
    """Traced system calls of a new save and of a replacement: every file and directory of the checkpoint
    is fsynced before renameat2 moves it into place (NOREPLACE, then EXCHANGE), the parent directory is
    fsynced after it, and the replaced checkpoint is deleted only after that."""
    path = tmp_path / "ckpt"
    for k, flag in ((1, "RENAME_NOREPLACE"), (2, "RENAME_EXCHANGE")):
        calls = _trace(path, k, tmp_path / f"trace{k}")
        renames = [(i, a) for i, (n, a, r) in enumerate(calls) if n == "renameat2" and r == 0]
        assert len(renames) == 1, renames
        at, args = renames[0]
        tmp, final, how = re.fullmatch(r'[^,]+, "([^"]+)", [^,]+, "([^"]+)", (\w+)', args).groups()
        assert final == str(path) and how == flag and os.path.basename(tmp).startswith(".ckpt.xckpt-tmp-")
        synced = {re.match(r"\d+<([^>]*)>", a)[1]: i for i, (n, a, r) in enumerate(calls)
                  if n in ("fsync", "fdatasync") and r == 0}
        objects = [str(p.relative_to(path)) for p in path.rglob("*")] + ["."]
        assert len(objects) > 20
        for rel in objects:
            where = os.path.normpath(os.path.join(tmp, rel))
            assert where in synced and synced[where] < at, f"{rel} not synced before the commit rename"
        parent = [i for i, (n, a, r) in enumerate(calls) if n == "fsync" and re.match(r"\d+<([^>]*)>", a)[1] == str(tmp_path) and i > at]
        assert parent, "the parent directory is not synced after the rename"
        if how == "RENAME_EXCHANGE":  # the displaced checkpoint (now at tmp) goes only once the swap is durable
            deletes = [i for i, (n, a, r) in enumerate(calls) if n in ("unlinkat", "unlink", "rmdir") and tmp in a]
            assert deletes and min(deletes) > parent[0]
        assert_holds(path, k)
    assert hidden(tmp_path) == []


def test_a_load_waits_for_this_process_pending_save_async_to_the_path(tmp_path):
    """A load of a path this process is still saving to asynchronously (replacing generation 1 by 2) waits
    for that save and returns generation 2 whole (loads of other paths go ahead meanwhile)."""
    path = tmp_path / "ckpt"
    xckpt.save({"w": np.full((2048, 2048), 1.0, np.float32), "step": 1}, path)
    xckpt.save({"x": np.arange(5)}, tmp_path / "other")
    handle = xckpt.save_async({"w": np.full((2048, 2048), 2.0, np.float32), "step": 2}, path, overwrite=True)
    other = xckpt.load(tmp_path / "other")
    np.testing.assert_array_equal(other["x"], np.arange(5))
    out = xckpt.load(path)
    assert handle.done() and out["step"] == 2
    np.testing.assert_array_equal(out["w"], np.full((2048, 2048), 2.0, np.float32))
    handle.wait()
    assert hidden(tmp_path) == []


def test_a_wait_interrupted_by_ctrl_c_waits_again(tmp_path, monkeypatch):
    """Ctrl-C in ``SaveHandle.wait()`` (a KeyboardInterrupt) leaves the save running and known to be running:
    ``done()`` is False, a load of the path waits for it, and ``wait()`` again returns its manifest (CPython
    before 3.13 forgets a thread whose ``join`` was interrupted: ``is_alive()`` then says False)."""
    import signal

    from xckpt.engine import background

    go = threading.Event()
    real = background.Pending._write

    def held(self):
        go.wait(60)
        real(self)
    monkeypatch.setattr(background.Pending, "_write", held)
    path = tmp_path / "ckpt"
    xckpt.save({"w": np.ones(4)}, path)
    h = xckpt.save_async({"w": np.zeros(4)}, path, overwrite=True)
    main = threading.main_thread().ident
    threading.Timer(0.05, lambda: signal.pthread_kill(main, signal.SIGINT)).start()  # a real Ctrl-C wakes a wait
    with pytest.raises(KeyboardInterrupt):
        h.wait()
    assert not h.done()
    threading.Timer(0.2, go.set).start()
    np.testing.assert_array_equal(xckpt.load(path)["w"], np.zeros(4))  # waited for the pending save
    assert h.done() and h.wait() is not None


def test_a_failure_in_save_async_after_staging_lets_the_background_finish(tmp_path, monkeypatch):
    """A failure after staging (a failpoint that raises) reaches the caller of save_async, and the
    background save it had started still writes, commits and ends: it is not left waiting to begin."""
    from xckpt.engine import background
    from xckpt.engine.storage import Location

    monkeypatch.setenv("XCKPT_FAILPOINTS", "after_stage:raise")
    path = tmp_path / "ckpt"
    with pytest.raises(OSError, match="failpoint after_stage"):
        xckpt.save_async({"w": np.arange(4096.0).reshape(64, 64), "step": 3}, path)
    monkeypatch.delenv("XCKPT_FAILPOINTS")
    pending = [p for p in list(background._live) if p.path == str(Location.of(path))]
    assert len(pending) == 1
    pending[0].thread.join(60)
    assert not pending[0].thread.is_alive()
    out = xckpt.load(path)
    assert out["step"] == 3
    np.testing.assert_array_equal(out["w"], np.arange(4096.0).reshape(64, 64))
    assert hidden(tmp_path) == []


def _open_files_under(root: Path) -> list[str]:
    """The files under ``root`` this process holds open (from /proc/self/fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root) + os.sep) and os.path.isfile(target):
            out.append(target)
    return sorted(out)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_local_store_fsyncs_written_files_at_sync_and_holds_a_bounded_number_open(tmp_path, monkeypatch):
    """Files a LocalStore writes stay open until sync() fsyncs them all (the strace test above checks the
    fsyncs themselves); never more than MAX_UNSYNCED at once; close() without sync closes the rest; atomic
    writes and create() are synced at once."""
    from xckpt.engine import storage

    monkeypatch.setattr(storage, "MAX_UNSYNCED", 4)
    root = tmp_path / "s"
    store = storage.LocalStore(str(root), create=True)
    most = 0
    for i in range(11):
        store.write(f"a{i % 3}/f{i}", bytes([i]) * (i + 1))
        most = max(most, len(_open_files_under(root)))
    assert 0 < most <= 5, most
    held = _open_files_under(root)
    assert held and all(os.path.basename(p).startswith("f") for p in held)
    store.write("atomic", b"x", atomic=True)
    assert store.create("made", b"y")
    assert _open_files_under(root) == held  # synced at once, closed
    store.sync()
    assert _open_files_under(root) == []
    for i in range(11):
        assert (root / f"a{i % 3}" / f"f{i}").read_bytes() == bytes([i]) * (i + 1)
    store.write("later", b"z")
    assert _open_files_under(root) == [str(root / "later")]
    store.close()
    assert _open_files_under(root) == []
    assert (root / "later").read_bytes() == b"z"


def test_a_failed_fsync_names_its_file_and_leaf(tmp_path):
    """An fsync that fails when a save syncs its files raises io.write naming the file and the leaf of the
    object (not the leaf written last): one held descriptor is swapped for a pipe's, which fsync refuses."""
    from xckpt.engine import storage
    from xckpt.engine.write import ChunkWriter
    from xckpt.errors import SaveError

    root = tmp_path / "s"
    store = storage.LocalStore(str(root), create=True)
    from xckpt.format import zarr

    w = ChunkWriter(store, "0" * 32)
    geom = zarr.geometry("float32", (4,), (4,), "none")
    with w:
        w.chunk("a/c/0", geom, np.arange(4, dtype="<f4"), "leaf.a")
        w.chunk("b/c/0", geom, np.arange(4, dtype="<f4"), "leaf.b")
        w.file("b/zarr.json", b"{}")
    path = str(root / "a" / "c" / "0")
    i = next(k for k, (_, p) in enumerate(store._unsynced) if p == path)
    os.close(store._unsynced[i][0])
    r, wr = os.pipe()
    os.close(wr)
    store._unsynced[i] = (r, path)
    with pytest.raises(SaveError) as e:
        w.sync()
    assert (e.value.code, e.value.file, e.value.leaf) == ("io.write", path, "leaf.a")
    store.close()


def test_a_directory_that_cannot_be_synced_is_named(tmp_path):
    """sync() fsyncs the directories a store wrote into together with its files; a directory gone meanwhile (it
    cannot be opened to fsync) raises io.write naming it, and every file is still closed."""
    from xckpt.engine import storage
    from xckpt.errors import SaveError

    root = tmp_path / "s"
    store = storage.LocalStore(str(root), create=True)
    for i in range(6):
        store.write(f"d{i}/c/0", bytes([i]))
    shutil.rmtree(root / "d4")
    with pytest.raises(SaveError) as e:
        store.sync()
    assert e.value.code == "io.write" and e.value.file in (str(root / "d4"), str(root / "d4" / "c")), e.value
    assert _open_files_under(root) == [] and store._unsynced == []
    store.close()
    assert store._unsynced == []
    store.close()
    assert _open_files_under(root) == []


def test_a_save_that_cannot_write_its_lease_leaves_nothing_beside_the_path(tmp_path: Path) -> None:
    """On a full disk the lease file is created but not written: the save said "nothing was written" and left
    an empty lease file, one per retry, which gc kept as a live save's for an hour (file-size limit 0 here)."""
    child = (
        "import resource, signal, sys, numpy as np, xckpt\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        xckpt.save({'a': np.ones(4)}, sys.argv[1])\n"
        "    except xckpt.XckptError as e:\n"
        "        print(e.code)\n")
    r = subprocess.run([sys.executable, "-c", child, str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.split() == ["io.write"] * 3, r.stderr[-500:]
    assert sorted(os.listdir(tmp_path)) == []


_REPLACER = """
import sys, numpy as np, xckpt, warnings
warnings.simplefilter("ignore")
state = {"a": np.full(1000, 7.0), "s": "new"}
try:
    if sys.argv[2] == "save_async":
        xckpt.save_async(state, sys.argv[1], overwrite=True).wait()
    else:
        xckpt.save(state, sys.argv[1], overwrite=True)
    print("SAVED")
except xckpt.XckptError as e:
    print("FAILED", e.code, e)
"""


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_replacing_save_stopped_past_its_lease_after_the_exchange_reports_its_commit(tmp_path: Path,
                                                                                       how: str) -> None:
    """Stopped (SIGSTOP, as a paused machine is) right after swapping its checkpoint in, past its lease: another
    save in the parent judged it dead and removed its temporary directory, which then held the replaced
    checkpoint. Woken, it reported failure (a bare FileNotFoundError, or "nothing was committed") while the new
    checkpoint it had committed stood at the path. It reports its commit."""
    path = tmp_path / "ck"
    xckpt.save({"a": np.full(1000, 1.0), "s": "old"}, path)
    env = dict(os.environ, XCKPT_FAILPOINTS="after_exchange:stop", XCKPT_STALE_AFTER_S="1")
    proc = subprocess.Popen([sys.executable, "-c", _REPLACER, str(path), how], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)
        time.sleep(0.05)
    time.sleep(1.5)  # past its lease
    other = subprocess.run([sys.executable, "-c", "import sys, numpy as np, xckpt\n"
                            "xckpt.save({'b': np.ones(3)}, sys.argv[1])", str(tmp_path / "other")],
                           env=dict(os.environ, XCKPT_STALE_AFTER_S="1"), capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    assert not [n for n in os.listdir(tmp_path) if "xckpt-tmp" in n]  # the cleanup removed its temporary directory
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert out.split() == ["SAVED"], out + err[-2000:]
    got = xckpt.load(path)
    assert got["s"] == "new" and np.array_equal(got["a"], np.full(1000, 7.0))
    assert xckpt.validate(path, deep=True).ok
    assert sorted(os.listdir(tmp_path)) == ["ck", "other"]
