"""An asynchronous save: copy to the host now, write and commit in the background.

:func:`start` runs the collective planning step, starts a background thread, and copies
every chunk this process writes into host buffers of its own, one plain copy per chunk (the
caller may change, donate or free its arrays as soon as it returns). When this process saved
the same structure before, the copying starts on a helper thread while the processes agree
on the plan, and is kept if they agree on the same one. The background thread encodes,
checksums and writes each chunk as a synchronous save does, as soon as it is staged, then commits. Staging is not collective: a process that
fails to copy its shards reports it through its status file, and every process raises it
from :meth:`Pending.wait`.

The background threads run at a lower CPU priority (:func:`~xckpt.engine.threads.yield_cpu`),
so the training loop keeps its cores. They never run a collective of the job's coordinator (a
``torch.distributed`` or XLA collective from a second thread could interleave with the
training loop's own). Each process writes a small status file into a directory beside
the temporary checkpoint; the coordinating process polls for all of them, then commits.
:meth:`Pending.wait` (collective: every process calls it) shares the outcome.

Staging buffers come from one process-wide pool and are kept for the next asynchronous
save, so a training loop that saves the same state again copies into memory it already
owns: the pool holds this process's share of the last asynchronous checkpoint
(:func:`release_buffers` frees it).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from typing import Any

import numpy as np

from xckpt.engine import collective, protocol
from xckpt.engine.commit import commit_failed, remove
from xckpt.engine.protocol import Prepared
from xckpt.engine.storage import Location
from xckpt.engine.threads import yield_cpu
from xckpt.engine.write import ChunkWriter
from xckpt.errors import CollectiveError, CoordinationError, XckptError
from xckpt.format import shard

#: How long the coordinating process waits for the other processes' status files, in seconds.
COMMIT_TIMEOUT_S = 3600.0
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
        self._outcome: dict[str, Any] = {"error": None}
        self.manifest: Any = None
        self.shared = p.coord.world_size == 1
        self.waited = False
        self.thread = threading.Thread(target=self._run, name="xckpt-save-async", daemon=False)

    def done(self) -> bool:
        """Whether this process's background work is over (on the coordinating process: the commit)."""
        return not self.thread.is_alive()

    def wait(self) -> Any:
        """Block until the commit; re-raise a background error. Collective in a multi-process job."""
        self.thread.join()
        self.waited = True
        if not self.shared:
            self.shared = True
            try:
                outcome = collective.broadcast(self.p.coord, self._outcome if self.p.coord.rank == 0 else None)
            except XckptError as exc:
                outcome = {"error": f"the processes could not share the outcome of the commit: {exc}"}
            if outcome["error"] and self._error is None:
                self._error = commit_failed(self.p.final, CoordinationError(outcome["error"]))
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
        try:
            store = p.tmp.store(create=True)
            with ChunkWriter(store, p.options.max_inflight_bytes, background=True) as w:
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
            if store is not None:
                store.close()
            for buf in written:
                _staging.give(buf)
        p.bytes_written = w.bytes_written

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
        if p.coord.world_size == 1:
            self._commit([status])
            return
        try:
            self._status.store(create=True).write(f"rank-{p.coord.rank}", collective.pack(status), atomic=True)
        except BaseException as exc:  # noqa: BLE001
            self._error = self._error or commit_failed(p.final, exc)
            if p.coord.rank == 0:
                self._commit(None)
            return
        if p.coord.rank == 0:
            try:
                statuses = self._collect()
            except BaseException as exc:  # noqa: BLE001 - a status file that cannot be read
                self._fail(exc)
                statuses = None
            if statuses is not None:
                self._commit(statuses)
            else:
                remove(self._status)

    def _collect(self) -> list[dict[str, Any]] | None:
        world = self.p.coord.world_size
        store = self._status.store(create=True)
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
                    self._fail(CoordinationError(f"ranks {missing} reported no status within "
                                                 f"{self._timeout_s:.0f} s", file=str(self._status)))
                    return None
                time.sleep(POLL_S)
        return [found[r] for r in range(world)]

    def _fail(self, exc: BaseException) -> None:
        remove(self.p.tmp)
        self._outcome = {"error": str(exc)}
        self._error = self._error or commit_failed(self.p.final, exc)

    def _commit(self, statuses: list[dict[str, Any]] | None) -> None:
        try:
            if statuses is None:
                raise CoordinationError(f"cannot write the status of this process to {self._status}")
            failed = {r: s["error"] for r, s in enumerate(statuses) if "error" in s}
            if failed:
                raise CollectiveError(self.p.what, failed)
            self.manifest = protocol.finish(self.p, statuses)
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
        finally:
            if self.p.coord.world_size > 1:
                remove(self._status)


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
    pending = Pending(p, Location(f"{p.tmp.url}.status"), timeout_s, spec.queue if reused else None)
    pending.thread.start()
    if not reused:
        stage(p, pending._queue)
    p.stats["stage_s"] = time.perf_counter() - started - p.stats["plan_s"]
    p.stats["staged_during_planning"] = reused
    return pending
