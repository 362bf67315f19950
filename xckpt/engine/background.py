"""An asynchronous save: copy to the host now, write and commit in the background.

:func:`start` runs the collective planning step, then copies every chunk this process
writes into host buffers of its own, one plain copy per chunk (the caller may change,
donate or free its arrays as soon as it returns), and starts a background thread that
encodes, checksums and writes them as a synchronous save does, then commits. Staging is
not collective: a process that fails to copy its shards reports it through its status
file, and every process raises it from :meth:`Pending.wait`.

The background threads run at a lower CPU priority (:func:`~xckpt.engine.write.yield_cpu`),
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
import math
import threading
import time
from typing import Any

import numpy as np

from xckpt.engine import collective, protocol
from xckpt.engine.commit import commit_failed, remove
from xckpt.engine.protocol import Prepared
from xckpt.engine.storage import Location
from xckpt.engine.write import ChunkWriter, yield_cpu
from xckpt.errors import CollectiveError, CoordinationError, XckptError
from xckpt.format import shard

#: How long the coordinating process waits for the other processes' status files, in seconds.
COMMIT_TIMEOUT_S = 3600.0
#: How often the coordinating process looks for status files, in seconds.
POLL_S = 0.005

#: ``(object name, geometry, host copy of the chunk clipped to the array, leaf)``
Staged = list[tuple[str, shard.Geometry, np.ndarray, str]]


class _Buffers:
    """Host buffers of the last asynchronous save's chunks, kept for the next one (same sizes)."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` (kept memory of the same size where there is some)."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            free = self._free.get(nbytes)
            raw = free.pop() if free else None
        if raw is None:
            raw = np.empty(nbytes, dtype=np.uint8)
        return raw.view(dtype).reshape(shape)

    def give(self, arr: np.ndarray) -> None:
        """Keep an array's memory for later."""
        raw = arr.base if arr.base is not None else arr
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

    def __init__(self, p: Prepared, staged: Staged, values: dict[int, Any], status: Location,
                 timeout_s: float, failure: BaseException | None = None) -> None:
        self.p = p
        self.path = str(p.final)
        self._staged = staged
        self._values = values
        self._status = status
        self._timeout_s = timeout_s
        self._failure = failure  # staging failed: nothing to write, only to report
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
        p = self.p
        store = p.tmp.store(create=True)
        try:
            with ChunkWriter(store, p.options.max_inflight_bytes, background=True) as w:
                for name, data in protocol.metadata_files(p):
                    w.file(name, data)
                for name, geom, data, leaf in self._staged:
                    w.chunk(name, geom, data, leaf)
            store.sync()
        finally:
            store.close()
            for _, _, data, _ in self._staged:
                _staging.give(data)
            self._staged = []
        p.bytes_written = w.bytes_written

    def _run(self) -> None:
        yield_cpu()
        p = self.p
        status: dict[str, Any]
        try:
            if self._failure is not None:
                raise self._failure
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


def stage(p: Prepared) -> tuple[Staged, dict[int, Any]]:
    """Copy every chunk this process writes into host buffers of its own, and snapshot its values."""
    staged: Staged = []
    try:
        for name, geom, data, leaf in protocol.chunk_jobs(p):
            host = _staging.take(data.shape, data.dtype)
            staged.append((name, geom, host, leaf))
            np.copyto(host, data, casting="no")
        values = copy.deepcopy(protocol.local_values(p))
    except BaseException:
        for _, _, host, _ in staged:
            _staging.give(host)
        raise
    return staged, values


def start(tree: Any, path: Any, *, coordinator: Any, options: Any, timeout_s: float) -> Pending:
    """Plan, stage and start the background write and commit of one asynchronous save.

    Planning is collective and raises on every process alike. A failure to stage (copy a
    shard to the host) is not raised here, where the other processes would not learn of it:
    it is reported through the status files and raised by :meth:`Pending.wait` everywhere.
    """
    p = protocol.prepare(tree, path, coordinator=coordinator, options=options)
    started = time.perf_counter()
    try:
        staged, values = stage(p)
        p.stats["stage_s"] = time.perf_counter() - started
        failure: BaseException | None = None
    except Exception as exc:  # noqa: BLE001 - reported by wait(), on every process alike
        staged, values, failure = [], {}, exc
    pending = Pending(p, staged, values, Location(f"{p.tmp.url}.status"), timeout_s, failure)
    pending.thread.start()
    return pending
