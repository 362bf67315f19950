"""Asynchronous save: return once the data is on the host, write and commit in the background.

:func:`save_async` runs, on the caller's thread, the collective planning step
(:func:`xckpt.save.prepare`) and then copies every shard this process was
assigned to the host (so the caller may go on changing, donating or freeing its
arrays), agrees with the other processes that staging succeeded, and returns a
:class:`SaveHandle`. A background thread then writes the shards and commits.

The background thread never runs a collective of the job's coordinator (a
``torch.distributed`` or XLA collective from a second thread could interleave
with the training loop's own). Instead each process writes a small status file
into a status directory beside the temporary checkpoint; the coordinating
process polls for all of them, then writes the metadata and renames the
checkpoint into place. :meth:`SaveHandle.wait` (a collective in a multi-process
job: every process calls it, or none does) then shares the outcome, so every
process raises the same error or returns once the checkpoint is committed.

A later :func:`save_async` or :func:`xckpt.save` first waits for the pending one.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from typing import Any

import numpy as np

from xckpt.engine import collective as coordmod, storage
from xckpt.engine.collective import Coordinator
from xckpt.errors import CoordinationError, SaveError, XckptError
from xckpt.format.manifest import Manifest
from xckpt.engine.plan import INNER_CHUNK_BYTES
from xckpt.registry import ArraySource, Shard
from xckpt.save import MAX_INFLIGHT_BYTES, PreparedSave, SaveOptions, assigned_shards, build_manifest, prepare, write_local, write_metadata
from xckpt.engine.storage import Location

#: How long the coordinating process waits for the other processes' status files, in seconds.
COMMIT_TIMEOUT_S = 3600.0

_pending_lock = threading.Lock()
_pending: "SaveHandle | None" = None


class SaveHandle:
    """A save running in the background: :meth:`done` polls it, :meth:`wait` finishes it."""

    def __init__(self, p: PreparedSave, status: Location, timeout_s: float) -> None:
        self.path = str(p.final)
        self._p = p
        self._status = status
        self._timeout_s = timeout_s
        self._error: BaseException | None = None
        self._manifest: Manifest | None = None
        self._outcome: dict[str, Any] = {"error": None}
        self._shared = p.coord.world_size == 1
        self._waited = False
        self._thread = threading.Thread(target=self._run, name="xckpt-save-async", daemon=False)

    def done(self) -> bool:
        """Whether this process's background work is over (on the coordinating process: the commit)."""
        return not self._thread.is_alive()

    def wait(self) -> Manifest:
        """Block until the checkpoint is committed and return its manifest; re-raise a background error.

        In a multi-process job every process must call it (it shares the outcome).
        """
        self._thread.join()
        self._waited = True
        if not self._shared:
            try:
                outcome = coordmod.broadcast(self._p.coord, self._outcome if self._p.coord.rank == 0 else None)
            except XckptError as exc:
                outcome = {"error": f"the processes could not share the outcome of the commit: {exc}"}
            self._shared = True
            if outcome["error"] and self._error is None:
                self._error = SaveError(f"save to {self.path} failed; nothing was committed: {outcome['error']}",
                                        file=self.path)
        if self._error is not None:
            raise self._error
        return self._manifest if self._manifest is not None else build_manifest(self._p, None)

    # -- background ------------------------------------------------------------------------------

    def _run(self) -> None:
        p = self._p
        local: BaseException | None = None
        try:
            write_local(p)
        except BaseException as exc:  # noqa: BLE001 - reported through the status files and wait()
            local = exc
        if p.coord.world_size == 1:
            self._commit_single(local)
            return
        reported = True
        try:
            storage.write_bytes(self._status, f"rank-{p.coord.rank}.json", json.dumps(
                {"error": None if local is None else f"{type(local).__name__}: {local}",
                 "bytes": p.bytes_written}).encode())
        except BaseException as exc:  # noqa: BLE001
            local, reported = local or exc, False
        if local is not None:
            self._error = _failed(self.path, local)
        if p.coord.rank == 0:
            self._commit_coordinating(reported)

    def _commit_single(self, local: BaseException | None) -> None:
        p = self._p
        try:
            if local is not None:
                raise local
            self._manifest = write_metadata(p)
            storage.publish(p.tmp, p.final, overwrite=p.options.overwrite)
        except BaseException as exc:  # noqa: BLE001
            _discard(p)
            self._error = _failed(self.path, exc)

    def _commit_coordinating(self, reported: bool) -> None:
        """Wait for every status file, then commit; where this process could not even write its own
        status file (the location is not writable), the others cannot either: give up at once."""
        p = self._p
        try:
            if not reported:
                raise SaveError(f"cannot write to {self._status}: {self._error}")
            statuses = self._collect_statuses()
            failed = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
            p.stats["bytes_per_rank"] = [s["bytes"] for s in statuses]  # type: ignore[assignment]
            if failed:
                raise SaveError(f"rank {failed[0][0]} failed while writing: {failed[0][1]}")
            self._manifest = write_metadata(p)
            storage.publish(p.tmp, p.final, overwrite=p.options.overwrite)
        except BaseException as exc:  # noqa: BLE001
            _discard(p)
            self._outcome = {"error": str(exc)}
            self._error = self._error or _failed(self.path, exc)
        finally:
            storage.remove(self._status)

    def _collect_statuses(self) -> list[dict[str, Any]]:
        world = self._p.coord.world_size
        found: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self._timeout_s
        delay = 0.01
        while True:
            for r in range(world):
                if r not in found:
                    data = storage.read_bytes(self._status, f"rank-{r}.json")
                    if data is not None:
                        found[r] = json.loads(data)
            if len(found) == world:
                return [found[r] for r in range(world)]
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(found))
                raise CoordinationError(f"ranks {missing} reported no status within {self._timeout_s:.0f} s",
                                        file=str(self._status))
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _failed(path: str, exc: BaseException) -> XckptError:
    if isinstance(exc, SaveError) and exc.message.startswith(f"save to {path} failed"):
        return exc
    err = SaveError(f"save to {path} failed; nothing was committed: {exc}", file=path)
    err.__cause__ = exc
    return err


def _discard(p: PreparedSave) -> None:
    if p.tmp != p.final:
        storage.remove(p.tmp)


def _stage(p: PreparedSave) -> None:
    """Copy every shard this process writes to host memory it owns, and snapshot value leaves.

    Afterwards ``p`` no longer refers to the caller's arrays or containers.
    """
    staged: dict[int, list[Shard]] = {}
    for i, shard in assigned_shards(p):
        data = np.array(shard.fetch(), copy=True, order="C")
        staged.setdefault(i, []).append(Shard(shard.region, lambda d=data: d))
    sources = list(p.sources)
    for i, d in enumerate(p.descs):
        if d.kind == "array":
            src = p.sources[i]
            sources[i] = ArraySource(src.shape, src.dtype, staged.get(i, []), src.sharding)
        else:
            sources[i] = copy.deepcopy(p.sources[i])
    p.sources = sources


def wait_pending() -> None:
    """Wait for the pending asynchronous save of this process, if any (its error is raised
    here unless :meth:`SaveHandle.wait` already reported it)."""
    global _pending
    with _pending_lock:
        handle, _pending = _pending, None
    if handle is not None and not handle._waited:
        handle.wait()


def save_async(tree: Any, path: Any, *, coordinator: Coordinator | None = None, overwrite: bool = False,
               compression: str = "none", metadata: dict[str, Any] | None = None,
               max_inflight_bytes: int = MAX_INFLIGHT_BYTES, inner_chunk_bytes: int = INNER_CHUNK_BYTES,
               commit_timeout_s: float = COMMIT_TIMEOUT_S) -> SaveHandle:
    """Start saving ``tree`` to ``path``; in a distributed job every process calls it.

    Returns once every shard this process writes is on the host; writing and the
    commit go on in the background. Options are those of :func:`xckpt.save`;
    ``commit_timeout_s`` bounds how long the commit waits for the other processes.
    """
    global _pending
    wait_pending()
    opts = SaveOptions(overwrite=overwrite, compression=compression, metadata=dict(metadata or {}),
                       max_inflight_bytes=max_inflight_bytes, inner_chunk_bytes=inner_chunk_bytes)
    p = prepare(tree, path, coordinator=coordinator, options=opts)
    error: BaseException | None = None
    try:
        _stage(p)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
        error = exc
    token = uuid.uuid4().hex[:12]
    if p.coord.world_size > 1:
        agreed = coordmod.all_gather(p.coord, {"error": None if error is None else str(error), "token": token})
        token = agreed[0]["token"]
        failed = [(r, g["error"]) for r, g in enumerate(agreed) if g["error"]]
        if failed and error is None:
            error = SaveError(f"rank {failed[0][0]} failed to stage its shards: {failed[0][1]}")
    if error is not None:
        if p.coord.rank == 0:
            _discard(p)
        raise _failed(str(p.final), error) from error
    status = Location(f"{p.tmp.url}.status-{token}")
    handle = SaveHandle(p, status, commit_timeout_s)
    with _pending_lock:
        _pending = handle
    handle._thread.start()
    return handle
