"""Saving: :func:`save` and :func:`save_async` (the protocol is :mod:`xckpt.engine.protocol`)."""

from __future__ import annotations

import threading
from typing import Any

from xckpt.engine import background, protocol
from xckpt.engine.background import COMMIT_TIMEOUT_S, release_buffers
from xckpt.engine.collective import Coordinator
from xckpt.engine.commit import SaveOptions
from xckpt.engine.gcpause import paused_gc
from xckpt.engine.plan import INNER_CHUNK_BYTES
from xckpt.engine.storage import Location
from xckpt.engine.write import MAX_INFLIGHT_BYTES
from xckpt.format.manifest import Manifest

__all__ = ["save", "save_async", "SaveHandle", "release_buffers"]

_pending_lock = threading.Lock()
_pending: "SaveHandle | None" = None


def _options(overwrite: bool, compression: str, metadata: dict[str, Any] | None, max_inflight_bytes: int,
             inner_chunk_bytes: int) -> SaveOptions:
    return SaveOptions(overwrite=overwrite, compression=compression, metadata=dict(metadata or {}),
                       max_inflight_bytes=max_inflight_bytes, inner_chunk_bytes=inner_chunk_bytes)


def save(tree: Any, path: Any, *, coordinator: Coordinator | None = None, overwrite: bool = False,
         compression: str = "none", metadata: dict[str, Any] | None = None,
         max_inflight_bytes: int = MAX_INFLIGHT_BYTES, inner_chunk_bytes: int = INNER_CHUNK_BYTES) -> Manifest | None:
    """Save ``tree`` to ``path``; in a distributed job every process calls it.

    Each process writes only the chunks the plan assigns it, holding at most
    ``max_inflight_bytes`` of encoded chunks at a time; the checkpoint appears at ``path`` only
    once complete. Returns the manifest written on the coordinating process (rank 0), None on
    the others. A pending :func:`save_async` of this process finishes first.
    """
    wait_pending()
    with paused_gc():
        return protocol.save(tree, path, coordinator=coordinator,
                             options=_options(overwrite, compression, metadata, max_inflight_bytes, inner_chunk_bytes))


class SaveHandle:
    """A save running in the background: :meth:`done` polls it, :meth:`wait` finishes it."""

    def __init__(self, pending: background.Pending) -> None:
        self._pending = pending
        self.path = pending.path

    @property
    def stats(self) -> dict[str, Any]:
        """Timings and bytes of this process's part (``plan_s``, ``bytes_per_rank`` on rank 0, ...)."""
        return self._pending.p.stats

    def done(self) -> bool:
        """Whether this process's background work is over (on the coordinating process: the commit)."""
        return self._pending.done()

    def claim(self) -> None:
        """Make the caller the one who reports this save's outcome (through :meth:`wait`): a later save of this
        process then only waits for it, and does not raise its failure."""
        self._pending.claimed = True

    def wait(self) -> Manifest | None:
        """Block until the checkpoint is committed; re-raise a background error on every process.

        Returns the manifest on the coordinating process, None on the others. In a
        multi-process job every process must call it (it shares the outcome).
        """
        return self._pending.wait()


def wait_pending() -> None:
    """Wait for the pending asynchronous save of this process, if any. Its error is raised here unless
    :meth:`SaveHandle.wait` was called for it (whoever called it reports it: a checkpoint manager's
    failed step does not fail another manager's save)."""
    global _pending
    with _pending_lock:
        handle, _pending = _pending, None
    if handle is None:
        return
    if handle._pending.claimed:
        handle._pending.thread.join()
    else:
        handle.wait()


def wait_pending_for(path: Any) -> None:
    """Wait until the pending asynchronous save of this process is over if it saves to ``path``
    (its outcome stays for :meth:`SaveHandle.wait` to report)."""
    with _pending_lock:
        handle = _pending
    if handle is not None and handle.path == str(Location.of(path)):
        handle._pending.thread.join()


def save_async(tree: Any, path: Any, *, coordinator: Coordinator | None = None, overwrite: bool = False,
               compression: str = "none", metadata: dict[str, Any] | None = None,
               max_inflight_bytes: int = MAX_INFLIGHT_BYTES, inner_chunk_bytes: int = INNER_CHUNK_BYTES,
               commit_timeout_s: float = COMMIT_TIMEOUT_S) -> SaveHandle:
    """Start saving ``tree`` to ``path``; in a distributed job every process calls it.

    Returns once every chunk this process writes is copied into host memory of its own
    (kept for the next asynchronous save: see :func:`release_buffers`; a JAX array's shards on an
    accelerator are copied into JAX's page-locked host memory instead, which JAX keeps); writing and
    the commit go on in the background. Options are those of :func:`save`; ``commit_timeout_s``
    bounds how long the commit waits for the other processes.
    """
    global _pending
    wait_pending()
    with paused_gc():
        pending = background.start(tree, path, coordinator=coordinator, timeout_s=commit_timeout_s,
                                   options=_options(overwrite, compression, metadata, max_inflight_bytes,
                                                    inner_chunk_bytes))
    handle = SaveHandle(pending)
    with _pending_lock:
        _pending = handle
    return handle
