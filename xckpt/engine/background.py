"""An asynchronous save: copy to the host now, write and commit in the background.

:func:`start` runs the collective planning step, starts a background thread, and copies
every chunk this process writes into host buffers of its own, one plain copy per chunk (the
caller may change, donate or free its arrays as soon as it returns). When this process saved
the same structure before, the copying starts on a helper thread while the processes agree
on the plan, and is kept if they agree on the same one. The background thread encodes,
checksums and writes each chunk as a synchronous save does, as soon as it is staged.

The background never runs a collective of the job's coordinator (a ``torch.distributed``
or XLA collective from a second thread could interleave with the training loop's own), and
its threads run at a lower CPU priority (:func:`~xckpt.engine.threads.yield_cpu`). The
processes meet through small files in a status directory beside the destination
(``.<name>.xckpt-status-<generation>``): each writes ``rank-<r>`` (its success, or its
error); the coordinating process waits for all of them, commits or removes everything,
writes ``outcome``, and removes the directory once every process has read it (each deletes
its ``rank-<r>`` then). Every wait is bounded by the save's timeout, so when a process dies
the others learn it (``async.timeout``) instead of waiting forever (a process that lost the
coordinating one cannot know whether it committed: it keeps its objects, which a committed
checkpoint may hold, and says so); :meth:`Pending.wait` is not a collective. The threads are daemons; at interpreter exit, pending saves are given
their timeout to finish.

Staging buffers come from one process-wide pool and are kept for the next asynchronous
save, so a training loop that saves the same state again copies into memory it already
owns: the pool holds this process's share of the last asynchronous checkpoint
(:func:`release_buffers` frees it).
"""

from __future__ import annotations

import atexit
import copy
import os
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from xckpt.engine import collective, failpoints, protocol
from xckpt.engine.claims import sibling
from xckpt.engine.commit import commit_failed, identity
from xckpt.engine.protocol import Prepared
from xckpt.engine.storage import Location
from xckpt.engine.threads import yield_cpu
from xckpt.engine.write import ChunkWriter
from xckpt.errors import CollectiveError, CoordinationError
from xckpt.format import shard

#: How long a process waits for the others (their status; the outcome of the commit), in seconds.
COMMIT_TIMEOUT_S = 600.0
#: At interpreter exit, how long a pending save may run past its timeout (writing, cleaning up), in seconds.
EXIT_GRACE_S = 10.0
#: How often the coordinating process looks for status files, in seconds.
POLL_S = 0.005

#: ``(object name, geometry, host copy of the chunk clipped to the array, leaf)``
Staged = tuple[str, shard.Geometry, np.ndarray, str]


class _Buffers:
    """Host buffers of the last asynchronous save's chunks, kept for the next one (same sizes)."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes``."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, arr: np.ndarray) -> None:
        """Keep the memory of a buffer (or of an array viewing all of one) for later."""
        raw = arr if arr.base is None else arr.base
        assert isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.nbytes == arr.nbytes
        with self._lock:
            self._free.setdefault(raw.nbytes, []).append(raw)

    def clear(self) -> None:
        """Drop every kept buffer."""
        with self._lock:
            self._free.clear()


_staging = _Buffers()


def release_buffers() -> None:
    """Free the host buffers kept for the next asynchronous save (this process's share of the last one)."""
    _staging.clear()


class Pending:
    """An asynchronous save in flight on this process."""

    def __init__(self, p: Prepared, status: Location, timeout_s: float,
                 staged: "queue.SimpleQueue[Staged | _Done | _Failed] | None" = None) -> None:
        self.p = p
        self.path = str(p.final)
        # staged chunks as they are copied, then ``_Done`` (with the values) or ``_Failed``
        self._queue: queue.SimpleQueue[Staged | _Done | _Failed] = queue.SimpleQueue() if staged is None else staged
        self._values: dict[int, Any] = {}
        self._status = status
        self._timeout_s = timeout_s
        self._error: BaseException | None = None
        self._unknown = False  # this process lost the coordinating one: the commit's outcome is unknown
        self.manifest: Any = None
        self.waited = False
        self.thread = threading.Thread(target=self._run, name="xckpt-save-async", daemon=True)
        with _live_lock:
            _live.add(self)

    def done(self) -> bool:
        """Whether this process's part is over: its objects written, the commit's outcome known."""
        return not self.thread.is_alive()

    def wait(self) -> Any:
        """Block until the outcome is known (the coordinating process: until it committed); re-raise a
        failure, which every process learns within the timeout. Not a collective."""
        self.thread.join()
        self.waited = True
        if self._error is not None:
            raise self._error
        return self.manifest

    # -- background ------------------------------------------------------------------------------

    def _write(self) -> None:
        """Write the metadata files, then each chunk as it is staged; every staged buffer goes back
        to the pool, whatever fails."""
        p = self.p
        written: list[np.ndarray] = []
        ended = False
        store = None
        w = None
        try:
            store = p.tmp.store(create=True)
            w = ChunkWriter(store, p.generation, p.options.max_inflight_bytes, background=True)
            with w:
                for name, data in protocol.metadata_files(p):
                    w.file(name, data)
                while True:
                    item = self._queue.get()
                    if not isinstance(item, tuple):
                        ended = True
                        if isinstance(item, _Failed):
                            raise item.error
                        self._values = item.values
                        break
                    name, geom, host, leaf = item
                    written.append(host)
                    w.chunk(name, geom, host, leaf)
            store.sync()
        except BaseException:
            while not ended:  # the caller's thread may still be staging: take back what it queues
                item = self._queue.get()
                ended = not isinstance(item, tuple)
                if not ended:
                    written.append(item[2])  # type: ignore[index]
            raise
        finally:
            if w is not None:
                p.written.extend(w.names)
            if store is not None:
                store.close()
            for buf in written:
                _staging.give(buf)
        p.bytes_written = w.bytes_written
        failpoints.hit("before_status", p.coord.rank)

    def _run(self) -> None:
        yield_cpu()
        p = self.p
        status: dict[str, Any]
        try:
            self._write()
            status = protocol.report(p, self._values)
        except BaseException as exc:  # noqa: BLE001 - reported through the status files and wait()
            self._error = commit_failed(p.final, exc)
            status = {"error": collective.describe(exc)}
        try:
            if p.coord.world_size == 1:
                self._commit([status])
                return
            store = self._status.store(create=True)
            try:
                store.write(f"rank-{p.coord.rank}", collective.pack(status), atomic=True)
            finally:
                store.close()
            failpoints.hit("after_status", p.coord.rank)
            if p.coord.rank == collective.ROOT:
                self._coordinate()
            else:
                self._follow()
        except BaseException as exc:  # noqa: BLE001 - surfaces from wait()
            self._error = self._error or (exc if self._unknown else commit_failed(p.final, exc))
            if not p.committed and not self._unknown:
                p.discard()

    # the coordinating process

    def _coordinate(self) -> None:
        """Collect every status, commit or discard, publish the outcome, wait for the others to read it."""
        try:
            statuses = self._collect()
        except BaseException as exc:  # noqa: BLE001 - a status file that cannot be read, or missing ones
            statuses = None
            self._error = self._error or commit_failed(self.p.final, exc)
        self._commit(statuses)
        store = self._status.store(create=True)
        try:
            store.write("outcome", collective.pack({"error": None if self._error is None else str(self._error)}),
                        atomic=True)
            deadline = time.monotonic() + self._timeout_s
            others = [f"rank-{r}" for r in range(1, self.p.coord.world_size)]
            while any(store.exists(n) for n in others) and time.monotonic() < deadline:
                time.sleep(POLL_S)  # each process deletes its status once it read the outcome
            for name in ["rank-0", "outcome", *others]:
                store.delete(name)
        finally:
            store.close()
        _remove_dir(self._status)

    def _collect(self) -> list[dict[str, Any]]:
        world = self.p.coord.world_size
        store = self._status.store(create=True)
        try:
            found: dict[int, dict[str, Any]] = {}
            deadline = time.monotonic() + self._timeout_s
            while len(found) < world:
                for r in range(world):
                    if r not in found:
                        data = store.read(f"rank-{r}")
                        if data is not None:
                            found[r] = collective.unpack(data)
                if len(found) < world:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world)) - set(found))
                        raise CoordinationError(f"ranks {missing[:16]} reported no status within "
                                                f"{self._timeout_s:g} s (did they die?)", code="async.timeout",
                                                file=str(self._status))
                    time.sleep(POLL_S)
            return [found[r] for r in range(world)]
        finally:
            store.close()

    def _commit(self, statuses: list[dict[str, Any]] | None) -> None:
        p = self.p
        try:
            if statuses is None:
                raise self._error or CoordinationError("no status")
            failed = {r: s["error"] for r, s in enumerate(statuses) if "error" in s}
            if failed:
                raise CollectiveError(p.what, failed)
            self.manifest = protocol.finish(p, statuses)
        except BaseException as exc:  # noqa: BLE001 - surfaces from wait(), and through the outcome
            self._error = self._error or commit_failed(p.final, exc)
            if not p.committed:
                p.discard()
            elif p.hold is not None:
                p.hold.end()

    # the other processes

    def _follow(self) -> None:
        """Wait (bounded) for the coordinating process's outcome; on failure remove what this process wrote."""
        p = self.p
        store = self._status.store(create=True)
        try:
            deadline = time.monotonic() + self._timeout_s
            outcome = None
            while outcome is None and time.monotonic() < deadline:
                data = store.read("outcome")
                if data is not None:
                    outcome = collective.unpack(data)
                else:
                    time.sleep(POLL_S)
            store.delete(f"rank-{p.coord.rank}")
        finally:
            store.close()
        if outcome is None:
            if identity(p.final) == p.generation:
                return  # committed; the outcome was gone before this process looked
            self._unknown = self._error is None  # a process whose own part failed knows nothing is committed
            raise CoordinationError(f"rank 0 did not report the outcome of the commit within {self._timeout_s:g} s "
                                    f"(did it die?); the checkpoint at {p.final} may or may not be committed: load it "
                                    "to find out", code="async.timeout", file=str(self._status))
        if outcome["error"] is not None:
            raise CoordinationError(outcome["error"])


def _remove_dir(loc: Location) -> None:
    if loc.is_local:
        try:
            os.rmdir(loc.local_path)
        except OSError:
            pass


_live_lock = threading.Lock()
_live: "weakref.WeakSet[Pending]" = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    """At interpreter exit, give each pending save its timeout (plus :data:`EXIT_GRACE_S`) to finish; one
    still running after that is abandoned (its temporary data ages into a leftover that a later save
    or ``xckpt gc`` removes)."""
    with _live_lock:
        pending = list(_live)
    for p in pending:
        p.thread.join(p._timeout_s + EXIT_GRACE_S)


class _Done:
    """The end of staging, with this process's values."""

    def __init__(self, values: dict[int, Any]) -> None:
        self.values = values


class _Failed:
    """Staging failed: nothing more comes; the error is reported through the status files."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def stage(p: Prepared, out: "queue.SimpleQueue[Staged | _Done | _Failed]",
          stop: threading.Event | None = None) -> None:
    """Copy every chunk this process writes into host buffers of its own, handing each to ``out``
    as soon as it is copied, then snapshot its values; a failure (or ``stop``) ends the stream instead."""
    try:
        for name, geom, data, leaf in protocol.chunk_jobs(p):
            if stop is not None and stop.is_set():
                raise CoordinationError("staging stopped: the processes agreed on another plan")
            buf = _staging.take(data.nbytes)
            try:
                host = buf.view(data.dtype).reshape(data.shape)
                np.copyto(host, data, casting="no")
            except BaseException:
                _staging.give(buf)
                raise
            out.put((name, geom, host, leaf))
        out.put(_Done(copy.deepcopy(protocol.local_values(p))))
    except Exception as exc:  # noqa: BLE001 - reported by wait(), on every process alike
        out.put(_Failed(exc))


class _Speculation:
    """Staging that starts, on a helper thread, from this process's cached plan while the processes
    agree on the plan (see :func:`xckpt.engine.protocol.prepare`); kept when they agree on it."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Staged | _Done | _Failed] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.guess: Prepared | None = None
        self.thread: threading.Thread | None = None

    def __call__(self, guess: Prepared) -> None:
        """Start staging from ``guess`` (the plan this process cached) on a helper thread."""
        self.guess = guess
        self.thread = threading.Thread(target=stage, args=(guess, self.queue, self.stop), name="xckpt-stage")
        self.thread.start()

    def confirmed(self, p: Prepared) -> bool:
        """Whether the agreed plan is the one staged from; if not, the staging is stopped and undone."""
        if self.thread is None:
            return False
        assert self.guess is not None
        if p.local is self.guess.local and p.plan_key == self.guess.plan_key:
            self.thread.join()
            return True
        self.cancel()
        return False

    def cancel(self) -> None:
        """Stop staging and give its buffers back to the pool."""
        if self.thread is None:
            return
        self.stop.set()
        self.thread.join()
        while not self.queue.empty():
            item = self.queue.get()
            if isinstance(item, tuple):
                _staging.give(item[2])
        self.thread = None


def start(tree: Any, path: Any, *, coordinator: Any, options: Any, timeout_s: float) -> Pending:
    """Plan, start the background write and commit, and stage, of one asynchronous save.

    Planning is collective and raises on every process alike; staging starts during it when
    this process saved the same structure before. A failure to stage (copy a shard to the
    host) is not raised here, where the other processes would not learn of it: it is
    reported through the status files and raised by :meth:`Pending.wait` everywhere.
    """
    started = time.perf_counter()
    spec = _Speculation()
    try:
        p = protocol.prepare(tree, path, coordinator=coordinator, options=options, speculate=spec)
    except BaseException:
        spec.cancel()
        raise
    reused = spec.confirmed(p)
    pending = Pending(p, sibling(p.final, "status", p.generation), timeout_s, spec.queue if reused else None)
    pending.thread.start()
    if not reused:
        stage(p, pending._queue)
    failpoints.hit("after_stage", p.coord.rank)
    p.stats["stage_s"] = time.perf_counter() - started - p.stats["plan_s"]
    p.stats["staged_during_planning"] = reused
    return pending
