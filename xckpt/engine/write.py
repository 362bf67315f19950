"""How bytes move on save: chunk objects encoded and written by a few threads, streaming.

A :class:`ChunkWriter` takes a chunk's data (a view of the caller's shard, in the storage
dtype) and, on one of its threads, streams its object into the store in pieces of about
1 MiB, checksummed as they pass (:func:`xckpt.format.shard.encode_parts`): an inner
chunk already laid out as stored goes straight from the caller's memory, any other is
copied block by block into a small per-thread buffer, checksummed in the same pass
(:func:`xckpt.engine.hostcopy.copy_checksum`; into a local file, block after block in one
compiled call, :func:`xckpt.engine.hostcopy.write_copied`), so a save holds no copy of the
data beyond one block per thread. The chunks queued but not yet written are bounded by
``max_inflight_bytes`` (their data stays referenced until written: for device arrays, the
staged host copies). A small object (under :data:`SMALL_BYTES`: a ``zarr.json``, a bias
vector's chunk) is encoded into one buffer and written on the caller's thread at once.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Callable

import numpy as np

from xckpt.engine import hostcopy, threads
from xckpt.engine.storage import Store
from xckpt.errors import SaveError, XckptError
from xckpt.format import shard

#: Default bound on bytes of chunk data queued for writing, per process.
MAX_INFLIGHT_BYTES = 256 << 20
#: Writes smaller than this run on the caller's thread: their cost is Python, which threads only contend for.
SMALL_BYTES = 64 << 10


class _Room:
    """A byte budget: ``take`` waits while more than ``limit`` bytes are out (one item always fits)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._out = 0
        self._cond = threading.Condition()

    def take(self, n: int) -> None:
        """Take ``n`` bytes, waiting while the budget is spent."""
        with self._cond:
            while self._out and self._out + n > self.limit:
                self._cond.wait()
            self._out += n

    def give(self, n: int) -> None:
        with self._cond:
            self._out -= n
            self._cond.notify_all()


class _Scratch(threading.local):
    """One encoding buffer per writer thread, grown as needed and reused."""

    buf: np.ndarray | None = None

    def get(self, n: int) -> np.ndarray:
        if self.buf is None or self.buf.size < n:
            self.buf = np.empty(n, dtype=np.uint8)
        return self.buf


_scratch = _Scratch()


class ChunkWriter:
    """Writes chunk objects and small files into one store, on a few threads.

    Used as a context manager: leaving it normally waits for every write and raises the
    first error; leaving it on an exception still waits for every write already started, so
    nothing writes into a directory that is about to be cleaned up.
    """

    def __init__(self, store: Store, generation: str, max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
                 background: bool = False) -> None:
        self.store = store
        self.generation = generation  # the save's: every chunk object's place tag names it
        self.bytes_written = 0  # array bytes (chunk payloads), not counting indexes and metadata
        self.names: list[str] = []  # every object it began to write (for the cleanup of a failed save)
        self._leaf_at: dict[str, str | None] = {}  # each object's name -> its leaf (for errors that name its path)
        self._room = _Room(max_inflight_bytes)
        self._exec = threads.pool(background)
        self._pending: deque[Future[None]] = deque()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def _submit(self, fn: Callable[[], None], nbytes: int) -> None:
        if nbytes < SMALL_BYTES:
            if self._error is None:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - raised by wait(), after the threads' writes
                    self._error = exc
            return
        self._pending.append(self._exec.submit(fn))
        while len(self._pending) > 64 and self._pending[0].done():
            self._pending.popleft().result()

    def chunk(self, name: str, geom: shard.Geometry, data: np.ndarray | shard.LaidOut, leaf: str) -> None:
        """Encode and write one chunk object (``data``: the chunk clipped to the array, storage dtype, or
        already laid out as stored), tagged with its place (:func:`xckpt.format.shard.place_of`)."""
        place = shard.place_of(self.generation, name)
        if data.nbytes < SMALL_BYTES:  # one buffer, one write, on this thread: no memory held past the call
            self._submit(lambda: self._put(name, shard.encode(geom, data, place), leaf,
                                           shard.array_nbytes(geom, data)), data.nbytes)
            return
        self._room.take(data.nbytes)

        def run() -> None:
            try:
                # a page to spare: each block is placed within a page as its file position (hostcopy.skewed)
                scratch = _scratch.get(max(geom.scratch_nbytes, shard.PIECE_BYTES) + hostcopy.PAGE_BYTES)
                parts = shard.encode_parts(geom, data, scratch, place, hostcopy.copy_checksum)
                self._put(name, parts, leaf, shard.array_nbytes(geom, data))
            finally:
                self._room.give(data.nbytes)

        self._submit(run, data.nbytes)

    def file(self, name: str, data: bytes) -> None:
        """Write a small file (a ``zarr.json``)."""
        self._submit(lambda: self._put(name, data, None, 0), len(data))

    def _put(self, name: str, data: Any, leaf: str | None, payload: int) -> None:
        """Write one object; count ``payload`` bytes of array data."""
        with self._lock:
            self.names.append(name)
            self._leaf_at[name] = leaf
        try:
            self.store.write(name, data)
        except XckptError as exc:  # a store may fsync earlier objects here: its error names the path
            raise self._named(exc, leaf) from None
        except OSError as exc:
            raise SaveError(f"cannot write: {exc.strerror or exc}", code="io.write",
                            file=str(self.store.location.child(name)), leaf=leaf) from exc
        with self._lock:
            self.bytes_written += payload

    def _named(self, exc: XckptError, leaf: str | None) -> XckptError:
        """``exc`` with the leaf of the object it names (``leaf`` where it names none)."""
        if not exc.file:
            return exc.at(leaf=leaf)
        with self._lock:
            written = list(self._leaf_at.items())
        return exc.at(leaf=next((lf for n, lf in written if str(self.store.location.child(n)) == exc.file), None))

    def sync(self) -> None:
        """Make every object written durable (:meth:`Store.sync`); an error names its object's file and leaf."""
        try:
            self.store.sync()
        except XckptError as exc:
            raise self._named(exc, None) from None

    def wait(self) -> None:
        """Wait for every write; raise the first error."""
        first: BaseException | None = self._error
        while self._pending:
            try:
                self._pending.popleft().result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised once all are done
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> "ChunkWriter":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if kind is None:
                self.wait()
            else:
                try:
                    self.wait()
                except BaseException:  # noqa: BLE001 - the first error is already propagating
                    pass
        finally:
            self._pending.clear()
