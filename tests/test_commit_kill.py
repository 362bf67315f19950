"""Atomic replace under SIGKILL: a 2-rank torch.distributed (gloo) save killed at every point of the commit protocol.

Each scenario forks a fresh 2-rank job from one long-lived zygote (``kill_workers.py``, which
imports torch and xckpt once) and has it save a DTensor tree (four ``[Shard(0)]`` tensors on a
1-D mesh, a replicated tensor, a step and a string: 4 MiB, several chunk objects per rank)
with ``XCKPT_FAILPOINTS`` set, to a new path or over a committed checkpoint. One rank, the
other, or every rank dies by SIGKILL at the point (points only the coordinating process
reaches: rank 0 dies, and either rank 1 runs on until its collective fails or the zygote kills
it at once, as a scheduler kills a job whose node died). Then, in this process:

* the path holds exactly the old checkpoint (or nothing, for a new path) when the kill came
  before the commit point (the move into place), exactly the new one after it, never a
  missing path (renameat2 exchange) and never a partial checkpoint: the values are compared
  element by element, the manifest's generation names the save, ``validate(deep=True)`` passes;
* what the killed save left beside the path belongs to it alone (``.ck.xckpt-*-<generation>``);
  a coordinating process that survived removed everything;
* the next save (a fresh job, no failpoints) succeeds and loads exactly, leaving nothing of its own.

Without ``renameat2`` (``XCKPT_NO_RENAMEAT2=1``) a kill between the two renames leaves the
path missing, the old checkpoint aside: the next load, or the next save, restores it. And
leftovers of killed saves, once stale (``XCKPT_STALE_AFTER_S``), are removed by a later save
to the same parent.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import xckpt  # noqa: E402
from xckpt.engine.failpoints import POINTS  # noqa: E402

import kill_workers as kw  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: Points every process reaches (a kill can hit rank 0, rank 1 or both).
EVERY = ("after_plan", "mid_write", "after_write")
#: Points only the coordinating process (rank 0) reaches, in protocol order, on each kind of save.
COORD_NEW = ("before_commit_files", "after_values", "after_manifest", "after_commit_marker", "before_publish",
             "after_publish")
COORD_REPLACE = COORD_NEW[:-1] + ("after_exchange", "after_publish")
#: Points after the commit point (the new checkpoint is in place when the process dies there).
COMMITTED = ("after_exchange", "after_publish")
LEFTOVER = re.compile(r"\.(?P<name>.+)\.xckpt-(?P<kind>tmp|lease|status|old)-(?P<generation>[0-9a-f]{32})")
OLD, NEW, NEXT = 1, 2, 3  # versions of the tree: the committed one, the one being saved when killed, the next


class Zygote:
    """The ``kill_workers.py`` process: one JSON request, one JSON answer, every wait bounded."""

    def __init__(self, ctl: Path) -> None:
        self.log = ctl / "zygote.log"
        env = dict(os.environ, XCKPT_KILL_CTL=str(ctl), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for name in ("XCKPT_FAILPOINTS", "XCKPT_NO_RENAMEAT2", "XCKPT_STALE_AFTER_S"):
            env.pop(name, None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(kw.__file__))], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(ctl))
        self._buf = b""
        ready = self._read(timeout=180)
        assert ready.get("ready"), ready

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise AssertionError(f"the zygote did not answer within {timeout:.0f}s:\n{self.tail()}")
                data = os.read(fd, 1 << 16)
                if not data:
                    raise AssertionError(f"the zygote exited ({self.proc.poll()}):\n{self.tail()}")
                self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def tail(self) -> str:
        """The end of the zygote's (and its ranks') stderr."""
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def group(self, path: Path, version: int, *, overwrite: bool = False, failpoints: str | None = None,
              kill_survivors: bool = False, no_renameat2: bool = False, env: dict[str, str] | None = None,
              timeout: float = 30, **extra: Any) -> list[dict[str, Any]]:
        """Run one 2-rank save of ``version`` to ``path``; every rank's ending (see ``kill_workers.py``)."""
        req = {"op": "group", "path": str(path), "version": version, "overwrite": overwrite,
               "failpoints": failpoints, "kill_survivors": kill_survivors, "no_renameat2": no_renameat2,
               "env": env or {}, "timeout": timeout, **extra}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read(timeout + 30)
        assert "error" not in reply, (reply, self.tail())
        return reply["ranks"]

    def save_ok(self, path: Path, version: int, **kwargs: Any) -> str:
        """A save that must succeed on both ranks; returns its generation."""
        ranks = self.group(path, version, **kwargs)
        for r in ranks:
            assert r["exit"] == 0 and r["result"] and r["result"]["ok"], (ranks, self.tail())
        return ranks[0]["result"]["generation"]

    def close(self) -> None:
        """Ask it to stop; kill it if it does not."""
        try:
            self.proc.stdin.write(b'{"op": "quit"}\n')
            self.proc.stdin.close()
            self.proc.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(15)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory):
    """One zygote for the module."""
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


@pytest.fixture(scope="module")
def template(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A committed checkpoint of the OLD values, saved by a 2-rank job (each overwrite scenario copies it)."""
    path = tmp_path_factory.mktemp("template") / "ck"
    generation = zygote.save_ok(path, OLD)
    assert_holds(path, OLD, generation)
    return path, generation


# ---------------------------------------------------------------------------------------------
# checks


def generation_at(path: Path) -> str:
    """The generation recorded in the manifest at ``path``."""
    return json.loads((path / "xckpt.json").read_text())["generation"]


def assert_holds(path: Path, version: int, generation: str | None = None) -> None:
    """``path`` is a complete checkpoint of exactly ``version``: every element, the values, deep validation."""
    assert path.is_dir() and not path.is_symlink(), f"{path} is missing"
    got = xckpt.load(path)
    want = kw.tree(version)
    assert sorted(got) == sorted(want) and sorted(got["w"]) == sorted(want["w"])
    for name, arr in want["w"].items():
        assert got["w"][name].dtype == arr.dtype and got["w"][name].shape == arr.shape
        np.testing.assert_array_equal(got["w"][name], arr, err_msg=f"w/{name} of version {version}")
    assert got["rep"].dtype == want["rep"].dtype
    np.testing.assert_array_equal(got["rep"], want["rep"])
    assert (got["step"], got["tag"]) == (want["step"], want["tag"])
    report = xckpt.validate(path, deep=True)
    assert report.ok, [str(f) for f in report.findings]
    if generation is not None:
        assert generation_at(path) == generation


def leftovers(parent: Path) -> dict[str, tuple[str, str, str]]:
    """``.NAME.xckpt-KIND-GENERATION`` entries in ``parent``: entry -> (name, kind, generation)."""
    return {e: (m["name"], m["kind"], m["generation"]) for e in os.listdir(parent)
            for m in [LEFTOVER.fullmatch(e)] if m}


@dataclass(frozen=True)
class Kill:
    """One scenario: where the save goes, the point, and who dies there."""

    mode: str  # "new" (a new path), "replace" (overwrite=True, renameat2), "aside" (overwrite, no renameat2)
    point: str
    who: str  # "rank0", "rank1" (the other runs on), "all" (both die)

    @property
    def overwrite(self) -> bool:
        """Whether the save replaces a committed checkpoint."""
        return self.mode != "new"

    @property
    def failpoints(self) -> str:
        """The ``XCKPT_FAILPOINTS`` value."""
        return {"rank0": f"{self.point}@0", "rank1": f"{self.point}@1", "all": self.point}[self.who]

    @property
    def dead(self) -> set[int]:
        """Ranks that kill themselves at the point."""
        if self.who == "all":
            return {0, 1} if self.point in EVERY else {0}
        return {int(self.who[-1])}

    def __str__(self) -> str:
        return f"{self.mode}-{self.point}-{self.who}"


def kills(mode: str, coord: tuple[str, ...]) -> list[Kill]:
    """Every point a save of ``mode`` reaches, with every way to die there."""
    out = [Kill(mode, p, who) for p in EVERY for who in ("rank0", "rank1", "all")]
    return out + [Kill(mode, p, who) for p in coord for who in ("rank0", "all")]


SCENARIOS = (kills("new", COORD_NEW) + kills("replace", COORD_REPLACE)
             + [Kill("aside", p, who) for p in ("before_publish", "after_aside", "after_publish")
                for who in ("rank0", "all")])


def run_kill(zygote: Zygote, root: Path, k: Kill, template: tuple[Path, str]) -> None:
    """Run scenario ``k`` in ``root`` and check everything the module docstring lists."""
    assert k.point in POINTS
    parent = root / "ckpts"
    parent.mkdir()
    path = parent / "ck"
    old_gen = None
    if k.overwrite:
        shutil.copytree(template[0], path)
        old_gen = template[1]
    no_rename = k.mode == "aside"
    ranks = zygote.group(path, NEW, overwrite=k.overwrite, failpoints=k.failpoints,
                         kill_survivors=k.who == "all" and 1 not in k.dead, no_renameat2=no_rename)
    why = (str(k), ranks)

    # how each rank ended: the named ones died by their own SIGKILL at the point
    for r in ranks:
        assert not r["hung"], why
        if r["rank"] in k.dead:
            assert r["signal"] == 9 and not r["harness_killed"] and r["result"] is None, why
        elif k.who == "all":  # the zygote killed it, or its collective failed first
            assert (r["signal"] == 9 and r["harness_killed"]) or (r["exit"] == 0 and not r["result"]["ok"]), why
        else:  # a survivor: its collective failed when the peer died; it did not hang, and it did not commit
            assert r["exit"] == 0 and r["result"] is not None and r["result"]["ok"] is False, why
            # rank 0 knows nothing was committed (coord.lost); rank 1 cannot know (save.outcome_unknown)
            assert r["result"]["code"] == ("coord.lost" if r["rank"] == 0 else "save.outcome_unknown"), why

    # what is at the path, on disk, before anything opens it
    left = leftovers(parent)
    gens = {g for _, _, g in left.values()}
    assert len(gens) <= 1 and all(n == "ck" for n, _, _ in left.values()), (why, left)
    if 0 in k.dead:
        assert [kind for _, kind, _ in left.values()].count("lease") == 1, (why, left)  # the dead coordinator's
    else:
        assert left == {}, (why, left)  # the surviving coordinator removed everything the save wrote
    gen = gens.pop() if gens else None
    assert ("old" in {kind for _, kind, _ in left.values()}) == (k.point == "after_aside"), (why, left)
    if k.point in COMMITTED:
        assert_holds(path, NEW, gen)  # the kill came after the commit point
    elif k.point == "after_aside":
        assert not os.path.lexists(path), why  # between the two renames: the path is briefly missing
        assert_holds(parent / f".ck.xckpt-old-{gen}", OLD, old_gen)  # and the old checkpoint is aside, whole
        if k.who == "rank0":  # the next load restores it
            got = xckpt.load(path)
            np.testing.assert_array_equal(got["w"]["t0"], kw.tree(OLD)["w"]["t0"])
            assert_holds(path, OLD, old_gen)
        else:  # the next save restores it, then refuses to replace it without overwrite
            ranks = zygote.group(path, NEXT)
            assert all(r["exit"] == 0 and r["result"]["code"] == "save.exists" for r in ranks), ranks
            assert_holds(path, OLD, old_gen)
        assert not (parent / f".ck.xckpt-old-{gen}").exists()
    elif k.overwrite:
        assert_holds(path, OLD, old_gen)
    else:
        assert not os.path.lexists(path), why
    left = leftovers(parent)

    # the next save, by a fresh job, succeeds; it leaves nothing, and removes no fresh leftover
    nxt = zygote.save_ok(path, NEXT, overwrite=True)
    assert nxt != gen
    assert_holds(path, NEXT, nxt)
    assert leftovers(parent) == left
    assert sorted(os.listdir(parent)) == sorted(["ck", *left])


@pytest.mark.parametrize("k", [k for k in SCENARIOS if k.mode == "new"], ids=str)
def test_kill_saving_to_a_new_path(zygote, template, tmp_path, k):
    """A save to a new path killed anywhere: the path is absent, or (killed after the rename) complete."""
    run_kill(zygote, tmp_path, k, template)


@pytest.mark.parametrize("k", [k for k in SCENARIOS if k.mode == "replace"], ids=str)
def test_kill_replacing_a_checkpoint(zygote, template, tmp_path, k):
    """An overwrite killed anywhere: the old checkpoint, whole, until the exchange; the new one, whole, after it."""
    run_kill(zygote, tmp_path, k, template)


@pytest.mark.parametrize("k", [k for k in SCENARIOS if k.mode == "aside"], ids=str)
def test_kill_replacing_without_renameat2(zygote, template, tmp_path, k):
    """An overwrite by two renames killed around them: between them the old checkpoint is aside, and the next
    load or save puts it back."""
    run_kill(zygote, tmp_path, k, template)


def test_scenarios_cover_every_synchronous_point():
    """The scenarios kill at every point of a synchronous save, on a new path and over a checkpoint."""
    sync = [p for p in POINTS if p not in ("after_stage", "before_status", "after_status")]
    assert {k.point for k in SCENARIOS} == set(sync)
    assert {k.point for k in SCENARIOS if k.mode == "new"} == set(EVERY + COORD_NEW)
    assert {k.point for k in SCENARIOS if k.mode == "replace"} == set(sync) - {"after_aside"}
    assert len(SCENARIOS) >= 40


def test_stale_leftovers_are_removed_by_a_later_save(zygote, template, tmp_path):
    """Leftovers of killed saves, once their leases are older than XCKPT_STALE_AFTER_S, are removed by the next
    save to the same parent; what they left at the paths stays as it was."""
    parent = tmp_path / "ckpts"
    parent.mkdir()
    a, b = parent / "a", parent / "b"
    shutil.copytree(template[0], a)
    stale = {"XCKPT_STALE_AFTER_S": "1"}
    zygote.group(a, NEW, overwrite=True, failpoints="after_exchange", kill_survivors=True, env=stale)
    zygote.group(b, NEW, failpoints="mid_write", env=stale)  # both ranks die after their first chunk
    left = leftovers(parent)
    assert sorted(kind for _, kind, _ in left.values()) == ["lease", "lease", "tmp", "tmp"], left
    assert {n for n, _, _ in left.values()} == {"a", "b"}
    time.sleep(1.5)
    zygote.save_ok(parent / "c", NEXT, env=stale)
    assert leftovers(parent) == {}
    assert sorted(os.listdir(parent)) == ["a", "c"]
    assert_holds(a, NEW)
    assert_holds(parent / "c", NEXT)


def test_survivor_timeout_during_commit_never_publishes_a_partial_checkpoint(zygote, tmp_path):
    """Rank 0 is slow (not dead) inside the commit, past the process group's timeout: rank 1's wait for the
    decision times out. Rank 1 cannot know the outcome: it says so (save.outcome_unknown) and keeps its chunks,
    so rank 0, which goes on, publishes the complete checkpoint."""
    path = tmp_path / "ck"
    ranks = zygote.group(path, NEW, delay=["before_publish", 0, 2.5], pg_timeout=1)
    assert ranks[1]["result"] and ranks[1]["result"]["code"] == "save.outcome_unknown", ranks
    assert all(not r["hung"] and r["exit"] == 0 for r in ranks), ranks
    assert ranks[0]["result"] and ranks[0]["result"]["ok"] is True, ranks  # it committed, and says so
    assert any("is committed, but the other processes could not be told" in w
               for w in ranks[0]["result"]["warnings"]), ranks
    generation = ranks[0]["result"]["generation"]
    assert isinstance(generation, str) and len(generation) == 32, ranks
    assert_holds(path, NEW, generation)  # what rank 0 published is its own save
    assert leftovers(tmp_path) == {}
