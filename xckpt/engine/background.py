"""An asynchronous save: copy to the host now, write and commit in the background.

:func:`start` runs the collective planning step and copies every chunk this process writes
into host buffers of its own, already in the layout its object stores
(:func:`xckpt.format.shard.lay_out`: the inner chunks' payloads one after another), one copy
per chunk, with streaming stores (:mod:`xckpt.engine.hostcopy`); the caller may change, donate
or free its arrays as soon as it returns. When this process saved the same structure before,
the copying starts on a helper thread while the processes agree on the plan, and is kept if
they agree on the same one. Only then does the background thread start: it checksums and
writes each staged chunk without copying it again (an asynchronous save copies the data once,
as a synchronous one does), and it does not compete with the copy the caller waits for.

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
checkpoint may hold, and says so); :meth:`Pending.wait` is not a collective. The threads are
daemons; at interpreter exit, pending saves are given their timeout to finish.

A shard on an accelerator (one whose source gives :attr:`~xckpt.registry.Shard.copy_into`) is
staged differently: its device-to-host copy goes straight into a page-locked buffer of the
shard's shape, every such copy is started before the first is waited for, and the background
lays its chunks out as it writes them (as a synchronous save does), so the caller waits for the
device-to-host copies and nothing more. A shard whose source fetches a copy made for the save
(:attr:`~xckpt.registry.Shard.fetch_copies`: a JAX array's shard on an accelerator, copied to
page-locked host memory of its own) is kept as fetched, laid out by the background alike. The
shards this process staged in its last asynchronous save start copying into the buffers kept
from it as each leaf is described (:class:`EarlyCopies`), before the processes agree on the plan:
the device copies while the tree is still being described.

Staging buffers come from one process-wide pool and are kept for the next asynchronous
save, so a training loop that saves the same state again copies into memory it already
owns: the pool holds this process's share of the last asynchronous checkpoint
(:func:`release_buffers` frees it).
"""

from __future__ import annotations

import atexit
import copy
import os
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from xckpt.engine import collective, failpoints, protocol
from xckpt.engine.claims import sibling
from xckpt.engine.commit import commit_failed, identity
from xckpt.engine.hostcopy import stream_copy
from xckpt.engine.protocol import Prepared
from xckpt.engine.storage import Location
from xckpt.engine.threads import Worker, background_nice, say, yield_cpu
from xckpt.engine.write import ChunkWriter
from xckpt.errors import CollectiveError, CoordinationError, SaveError
from xckpt.format import dtypes, shard
from xckpt.registry import ArraySource, Shard

#: How long a process waits for the others (their status; the outcome of the commit), in seconds.
COMMIT_TIMEOUT_S = 600.0
#: At interpreter exit, how long a pending save may run past its timeout (writing, cleaning up), in seconds.
EXIT_GRACE_S = 10.0
#: How often a process looks for status files, in seconds: in a local directory (a failed lookup is one
#: system call), and in an object store (each lookup a request).
POLL_LOCAL_S = 0.001
POLL_REMOTE_S = 0.005

#: ``(object name, geometry, host copy of the chunk clipped to the array: laid out as stored, or, for a
#: shard copied from an accelerator, as it lies in the shard's buffer, leaf)``
StagedChunk = tuple[str, shard.Geometry, "shard.LaidOut | np.ndarray", str]
#: Allocates a uint8 host buffer of the given size (None: plain memory)
Allocator = Callable[[int], np.ndarray] | None


class Staged:
    """What staging produced: this process's chunks copied to the host and a snapshot of its values,
    or the error that ended it (its buffers already back in the pool)."""

    def __init__(self) -> None:
        self.chunks: list[StagedChunk] = []
        self.buffers: list[tuple[np.ndarray, Allocator]] = []  # the shard buffers of accelerator shards
        self.device_shards: set[tuple[Any, Any, str]] = set()  # those shards: (leaf key, box, dtype)
        self.copied_early = 0  # how many of them started copying while the tree was described
        self.values: dict[int, Any] = {}
        self.error: BaseException | None = None

    def give_back(self) -> None:
        """Return every staged buffer to the pool."""
        chunks, self.chunks = self.chunks, []
        buffers, self.buffers = self.buffers, []
        for _, _, host, _ in chunks:
            if isinstance(host, shard.LaidOut):
                _staging.give(host.payloads)
        for buf, alloc in buffers:
            _staging.give(buf, alloc)


class _Buffers:
    """Host buffers of the last asynchronous save's chunks, kept for the next one (same sizes, same
    allocator)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, Allocator], list[np.ndarray]] = {}
        self._lock = threading.Lock()
        #: the accelerator shards the last asynchronous save staged: ``(leaf key, box, dtype)``
        self.device_shards: frozenset[tuple[Any, Any, str]] = frozenset()

    def take(self, nbytes: int, alloc: Allocator = None) -> np.ndarray:
        """A uint8 buffer of ``nbytes``, from ``alloc`` (default: plain memory)."""
        buf = self.reuse(nbytes, alloc)
        if buf is None:
            buf = np.empty(nbytes, dtype=np.uint8) if alloc is None else alloc(nbytes)
            assert buf.dtype == np.uint8 and buf.shape == (nbytes,)
        return buf

    def reuse(self, nbytes: int, alloc: Allocator = None) -> np.ndarray | None:
        """A kept uint8 buffer of ``nbytes`` from ``alloc``, or None where none is kept."""
        with self._lock:
            free = self._free.get((nbytes, alloc))
            return free.pop() if free else None

    def give(self, buf: np.ndarray, alloc: Allocator = None) -> None:
        """Keep a buffer :meth:`take` returned (from ``alloc``) for later."""
        # a whole buffer, not a view of one (an allocator's buffer may be a view of memory it owns)
        assert buf.dtype == np.uint8 and buf.ndim == 1 and (alloc is not None or buf.base is None)
        with self._lock:
            self._free.setdefault((buf.nbytes, alloc), []).append(buf)

    def clear(self) -> None:
        """Drop every kept buffer."""
        with self._lock:
            self._free.clear()
            self.device_shards = frozenset()


_staging = _Buffers()


def release_buffers() -> None:
    """Free the host buffers kept for the next asynchronous save (this process's share of the last one)."""
    _staging.clear()


class Pending:
    """An asynchronous save in flight on this process."""

    def __init__(self, p: Prepared, status: Location, timeout_s: float, staged: Staged) -> None:
        self.p = p
        self.path = str(p.final)
        self._staged = staged
        self._status = status
        self._timeout_s = timeout_s
        self._poll_s = POLL_LOCAL_S if status.is_local else POLL_REMOTE_S
        self._error: BaseException | None = None
        self._unknown = False  # this process lost the coordinating one: the commit's outcome is unknown
        self.manifest: Any = None
        self.claimed = False  # a caller of wait() reports the outcome (it may still be waiting)
        self.go = threading.Event()  # set when the caller may go on: the writing starts then
        self.thread = Worker(self._run, "xckpt-save-async")
        with _live_lock:
            _live.add(self)

    def done(self) -> bool:
        """Whether this process's part is over: its objects written, the commit's outcome known."""
        return not self.thread.is_alive()

    def wait(self) -> Any:
        """Block until the outcome is known (the coordinating process: until it committed); re-raise a
        failure, which every process learns within the timeout. Not a collective."""
        self.claimed = True
        self.thread.join()
        if self._error is not None:
            raise self._error
        return self.manifest

    # -- background ------------------------------------------------------------------------------

    def _write(self) -> None:
        """Write the metadata files, then each staged chunk; every staged buffer goes back to the pool,
        whatever fails."""
        p = self.p
        staged = self._staged
        store = None
        w = None
        try:
            if staged.error is not None:
                raise staged.error
            store = p.tmp.store(create=True)
            w = ChunkWriter(store, p.generation, p.options.max_inflight_bytes, background=True)
            with w:
                for name, data in protocol.metadata_files(p):
                    w.file(name, data)
                for name, geom, host, leaf in staged.chunks:
                    w.chunk(name, geom, host, leaf)
            w.sync()
        finally:
            if w is not None:
                p.written.extend(w.names)
            if store is not None:
                try:
                    store.close()  # the writes in flight land: what they created is known
                finally:
                    p.created.update(store.created)
            staged.give_back()
        p.bytes_written = w.bytes_written
        failpoints.hit("before_status", p.coord.rank)

    def _run(self) -> None:
        yield_cpu()
        self.go.wait()  # not before the caller goes on (it would wait for the interpreter lock this thread holds)
        p = self.p
        status: dict[str, Any]
        try:
            self._write()
            status = protocol.report(p, self._staged.values)
        except BaseException as exc:  # noqa: BLE001 - reported through the status files and wait()
            self._error = commit_failed(p.final, exc)
            status = {"error": collective.describe(exc)}
        reported = False  # this process told the coordinating one that its part succeeded
        try:
            if p.coord.world_size == 1:
                self._commit([status])
                return
            store = self._status.store(create=True)
            try:
                store.write(f"rank-{p.coord.rank}", collective.pack({**status, "time": time.time()}), atomic=True)
            finally:
                store.close()
            reported = "error" not in status
            failpoints.hit("after_status", p.coord.rank)
            if p.coord.rank == collective.ROOT:
                self._coordinate()
            else:
                self._follow()
        except BaseException as exc:  # noqa: BLE001 - surfaces from wait()
            if reported and p.coord.rank != collective.ROOT and not self._unknown:
                # the coordinating process may commit with this process's objects: keep them, say so (spec 6.5)
                self._unknown = True
                exc = SaveError(f"this process failed after reporting its part done ({exc}); the checkpoint at "
                                f"{p.final} may or may not be committed: load it to find out",
                                code="save.outcome_unknown", file=str(p.final))
            self._error = self._error or (exc if self._unknown else commit_failed(p.final, exc))
            if not p.committed and not self._unknown:
                p.discard()

    # the coordinating process

    def _coordinate(self) -> None:
        """Collect every status, commit or discard, publish the outcome, wait for the others to read it."""
        unread: dict[int, dict[str, Any]] | None = None
        try:
            statuses: list[dict[str, Any]] | None = self._collect()
        except BaseException as exc:  # noqa: BLE001 - a status file that cannot be read
            statuses, unread = None, {collective.ROOT: collective.describe(exc)}
        self._commit(statuses, unread)
        failures = self._error.failures if isinstance(self._error, CollectiveError) else None
        store = self._status.store(create=True)
        try:
            store.write("outcome", collective.pack({"failures": None if failures is None else
                                                    {str(r): f for r, f in failures.items()},
                                                    "time": time.time()}), atomic=True)
            deadline = time.monotonic() + self._timeout_s
            statuses = _status_names(self.p.coord.world_size)
            others = statuses.keys() - {"rank-0"}
            while others.intersection(store.list()) and time.monotonic() < deadline:
                time.sleep(self._poll_s)  # each process deletes its status once it read the outcome
            for name in (statuses.keys() | {"outcome"}).intersection(store.list()):
                store.delete(name)
        finally:
            store.close()
        _remove_dir(self._status)

    def _collect(self) -> list[dict[str, Any]]:
        """Every process's status, by rank (a rank that reported none within the timeout: an ``async.timeout``
        error status)."""
        world = self.p.coord.world_size
        store = self._status.store(create=True)
        try:
            found: dict[int, dict[str, Any]] = {}
            statuses = _status_names(world)
            deadline = time.monotonic() + self._timeout_s
            while len(found) < world:
                for name in store.list():  # one listing per look, not one lookup per process
                    r = statuses.get(name)
                    if r is not None and r not in found:
                        data = store.read(name)
                        if data is not None:
                            found[r] = collective.unpack(data)
                if len(found) < world:
                    if time.monotonic() > deadline:
                        missing = {r: collective.describe(CoordinationError(
                            f"reported no status within {self._timeout_s:g} s (did it die?)", code="async.timeout",
                            file=str(self._status))) for r in range(world) if r not in found}
                        return [found.get(r) or {"error": missing[r]} for r in range(world)]
                    time.sleep(self._poll_s)
            return [found[r] for r in range(world)]
        finally:
            store.close()

    def _commit(self, statuses: list[dict[str, Any]] | None, unread: dict[int, dict[str, Any]] | None = None) -> None:
        """Commit when every status is a success; else discard. In a job of several processes, a failure is one
        :class:`~xckpt.errors.CollectiveError` holding every failing rank's error (as a synchronous save's),
        which the outcome carries to every process; ``unread``: why the statuses could not be read (None)."""
        p = self.p
        failed = (unread or {}) if statuses is None else \
            {r: s["error"] for r, s in enumerate(statuses) if "error" in s}
        try:
            if failed:
                raise CollectiveError(p.what, failed)
            assert statuses is not None
            self.manifest = protocol.finish(p, statuses)
        except BaseException as exc:  # noqa: BLE001 - surfaces from wait(), and through the outcome
            if p.committed:
                # only an interrupt gets here after the commit (a failure there is a warning: write_marker, publish);
                # nothing undoes the commit, so no process is told the save failed (they would remove their part
                # of a committed checkpoint) and this one's wait() raises the interrupt itself, as save() does
                self._error = self._error or exc
                if p.hold is not None:
                    p.hold.end()
                return
            if p.coord.world_size == 1:
                self._error = self._error or commit_failed(p.final, exc)
            else:
                if isinstance(exc, CollectiveError):
                    self._error = exc
                else:
                    self._error = CollectiveError(p.what, {collective.ROOT: collective.describe(exc)})
                    self._error.__cause__ = exc
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
                    time.sleep(self._poll_s)
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
        if outcome.get("failures"):
            # every process raises the same error (its own failure, if any, is among them)
            self._error = CollectiveError(p.what, {int(r): f for r, f in outcome["failures"].items()})
            raise self._error


def _status_names(world: int) -> dict[str, int]:
    """The name of each process's status file (``rank-<r>``) -> its rank."""
    return {f"rank-{r}": r for r in range(world)}


def _remove_dir(loc: Location) -> None:
    if loc.is_local:
        try:
            os.rmdir(loc.local_path)
        except OSError:
            pass


_live_lock = threading.Lock()
_live: "weakref.WeakSet[Pending]" = weakref.WeakSet()
#: Threads that finish after a save, each with what it has to report at exit (None: nothing).
_followers: "weakref.WeakKeyDictionary[threading.Thread, Callable[[], str | None]]" = weakref.WeakKeyDictionary()


def finish_at_exit(thread: threading.Thread, unreported: Callable[[], str | None] = lambda: None) -> None:
    """Have interpreter exit wait for ``thread`` too (a daemon that finishes what a pending save began, such as
    a checkpoint manager moving its step into place), once the pending saves are done: up to
    :data:`EXIT_GRACE_S` seconds more; then ``unreported()``, a failure nobody was told of, goes to stderr."""
    with _live_lock:
        _followers[thread] = unreported


def _finish_at_exit() -> None:
    """At interpreter exit, give each pending save its timeout (plus :data:`EXIT_GRACE_S`) to finish; one
    still running after that is abandoned (its temporary data ages into a leftover that a later save
    or ``xckpt gc`` removes).

    It runs among the interpreter's thread shutdown hooks, registered after the thread pools' own
    (:mod:`xckpt.engine.threads` imports :mod:`concurrent.futures` first), so it runs before them: a
    pool shut down first would refuse the pending save's writes, and the save would be rolled back."""
    with _live_lock:
        pending, followers = list(_live), list(_followers.items())
    for p in pending:
        p.thread.join(p._timeout_s + EXIT_GRACE_S)
    for t, _ in followers:
        t.join(EXIT_GRACE_S)
    for p in pending:  # a failure nobody waited for would otherwise end the script in silence
        if not p.claimed and not p.thread.is_alive() and p._error is not None:
            say(f"xckpt: the asynchronous save to {p.path} failed, and nothing waited for it: {p._error}")
    for _, unreported in followers:
        message = unreported()
        if message:
            say(message)


try:
    threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined] - CPython 3.9+, before pool shutdown
except AttributeError:  # another interpreter: the plain hook, which runs after the pools are shut down
    atexit.register(_finish_at_exit)


def stage(p: Prepared, early: EarlyCopies, stop: threading.Event | None = None) -> Staged:
    """Copy every chunk this process writes into host buffers of its own, then snapshot its values; a
    failure (or ``stop``) ends it instead, its buffers given back.

    The shards on an accelerator are copied whole into buffers of their own (every copy started
    first, or taken from ``early``); a shard whose fetch is already a copy of its own
    (:attr:`~xckpt.registry.Shard.fetch_copies`) is kept as fetched; the others are copied chunk by
    chunk, laid out as stored, while those copies run."""
    staged = Staged()
    waits: list[Callable[[], None]] = []
    try:
        held = protocol.held_shards(p)
        on_device = _start_device_copies(p, held, staged, waits, early)
        kept = _keep_fetched_copies(p, held, staged, early)

        def fetch(pos: int, piece: Any) -> Any:
            return on_device[(pos, piece)] if (pos, piece) in on_device else held[(pos, piece)].fetch()

        jobs = protocol.plan_chunks(p.local, p.descs, fetch, p.options.compression)
        for t, (name, geom, data, leaf) in zip(p.local.tasks, jobs):
            if stop is not None and stop.is_set():
                raise CoordinationError("staging stopped: the processes agreed on another plan")
            if (t.leaf, t.piece) in on_device or (t.leaf, t.piece) in kept:
                staged.chunks.append((name, geom, data, leaf))  # laid out by the background as it writes
                continue
            buf = _staging.take(shard.laid_nbytes(geom, data.shape))
            try:
                host = shard.lay_out(geom, data, buf, stream_copy)
            except BaseException:
                _staging.give(buf)
                raise
            staged.chunks.append((name, geom, host, leaf))
        _wait_all(waits)
        staged.values = copy.deepcopy(protocol.local_values(p))
    except Exception as exc:  # noqa: BLE001 - reported by wait(), on every process alike
        _wait_all(waits, quiet=True)  # no copy may still be writing into a buffer given back
        staged.give_back()
        staged.error = exc
    except BaseException:  # an interrupt: the caller stops the save
        _wait_all(waits, quiet=True)
        staged.give_back()
        raise
    return staged


def _start_device_copies(p: Prepared, held: dict[tuple[int, Any], Shard], staged: Staged,
                         waits: list[Callable[[], None]], early: EarlyCopies) -> dict[tuple[int, Any], np.ndarray]:
    """Start copying every held shard that lives on an accelerator into a buffer of its own (kept in
    ``staged``), or take the copy ``early`` started; each copy's wait goes to ``waits``. The buffers,
    by ``(leaf position, box)``.

    The largest shards are queued first: the device copies them while this thread queues the small
    ones (a model's biases and norms, each costing the queueing's fixed time and few bytes), instead
    of waiting behind them."""
    out: dict[tuple[int, Any], np.ndarray] = {}
    on_device = [(dtypes.numpy_dtype(p.descs.leaves[pos].dtype), pos, piece, sh) for (pos, piece), sh in held.items()
                 if sh.copy_into is not None and sh.host_buffer is not None]
    on_device.sort(key=lambda e: -e[2].numel * e[0].itemsize)  # stable: equal sizes keep the plan's order
    for dtype, pos, piece, sh in on_device:
        assert sh.copy_into is not None and sh.host_buffer is not None
        leaf = p.descs.leaves[pos]
        staged.device_shards.add((leaf.key, piece, leaf.dtype))
        started = early.take(pos, piece)
        if started is not None:
            buf, arr, wait = started
            staged.copied_early += 1
            staged.buffers.append((buf, sh.host_buffer))
            waits.append(wait)
            out[(pos, piece)] = arr
            continue
        nbytes = piece.numel * dtype.itemsize
        buf = _staging.take(nbytes, sh.host_buffer)
        staged.buffers.append((buf, sh.host_buffer))
        arr = buf.view(dtype).reshape(piece.sizes)
        if nbytes:
            waits.append(sh.copy_into(arr))
        out[(pos, piece)] = arr
    return out


def _keep_fetched_copies(p: Prepared, held: dict[tuple[int, Any], Shard], staged: Staged,
                         early: EarlyCopies) -> set[tuple[int, Any]]:
    """The held shards whose fetch is a copy of their own (:attr:`~xckpt.registry.Shard.fetch_copies`),
    staged as fetched, by ``(leaf position, box)``; each is recorded in ``staged`` (for the next save's
    early copies), and counted there when ``early`` started it."""
    kept = {k for k, sh in held.items() if sh.fetch_copies and sh.copy_into is None}
    for pos, piece in kept:
        leaf = p.descs.leaves[pos]
        staged.device_shards.add((leaf.key, piece, leaf.dtype))
        staged.copied_early += early.prefetched(pos, piece)
    return kept


def _wait_all(waits: list[Callable[[], None]], quiet: bool = False) -> None:
    """Wait for every copy, then raise the first failure (``quiet``: none, something already failed)."""
    pending, waits[:] = list(waits), []
    first: Exception | None = None
    for w in pending:
        try:
            w()
        except Exception as exc:  # noqa: BLE001 - the first is raised once every copy is over
            first = first or exc
    if first is not None and not quiet:
        raise first


class EarlyCopies:
    """Device-to-host copies started while the tree is still being described (``prepare``'s
    ``each_leaf``), before the processes agree on the plan: the copy of each accelerator shard that
    this process's last asynchronous save staged, into the buffer kept from it (or, for a shard that
    fetches a copy of its own, its ``prefetch``). Staging takes them (:meth:`take`); :meth:`discard`
    waits for the rest and gives their buffers back."""

    def __init__(self) -> None:
        self._last = _staging.device_shards
        self._started: dict[tuple[int, Any], tuple[np.ndarray, Allocator, np.ndarray, Callable[[], None]]] = {}
        self._prefetched: set[tuple[int, Any]] = set()

    def __call__(self, pos: int, key: Any, src: Any) -> None:
        """Start the copies of leaf ``pos``'s shards that the last asynchronous save staged."""
        if not self._last or not isinstance(src, ArraySource):
            return
        dtype = None
        for sh in src.shards:
            if (key, sh.region, src.dtype) not in self._last:
                continue
            if sh.fetch_copies and sh.prefetch is not None:  # a copy into memory of its own (a JAX array's)
                try:
                    sh.prefetch()
                except Exception:  # noqa: BLE001 - staging fetches this shard again and reports the failure
                    self._last = frozenset()
                    return
                self._prefetched.add((pos, sh.region))
                continue
            if sh.copy_into is None or sh.host_buffer is None:
                continue
            dtype = dtype or dtypes.numpy_dtype(src.dtype)
            nbytes = sh.region.numel * dtype.itemsize
            buf = _staging.reuse(nbytes, sh.host_buffer) if nbytes else None
            if buf is None:
                continue
            arr = buf.view(dtype).reshape(sh.region.sizes)
            try:
                wait = sh.copy_into(arr)
            except Exception:  # noqa: BLE001 - staging copies this shard again and reports the failure
                _staging.give(buf, sh.host_buffer)
                self._last = frozenset()
                return
            self._started[(pos, sh.region)] = (buf, sh.host_buffer, arr, wait)

    def prefetched(self, pos: int, piece: Any) -> bool:
        """Whether leaf ``pos``'s box ``piece`` (a shard that fetches a copy of its own) started copying
        while the tree was described."""
        return (pos, piece) in self._prefetched

    def take(self, pos: int, piece: Any) -> tuple[np.ndarray, np.ndarray, Callable[[], None]] | None:
        """The buffer, its typed view and the wait of the copy started for leaf ``pos``'s box ``piece``."""
        got = self._started.pop((pos, piece), None)
        return None if got is None else (got[0], got[2], got[3])

    def discard(self) -> None:
        """Wait for every copy no staging took, and give their buffers back."""
        started, self._started = self._started, {}
        for buf, alloc, _, wait in started.values():
            try:
                wait()
            except Exception:  # noqa: BLE001 - a copy nobody uses: its buffer is free again either way
                pass
            _staging.give(buf, alloc)


class _Speculation:
    """Staging that starts, on a helper thread, from this process's cached plan while the processes
    agree on the plan (see :func:`xckpt.engine.protocol.prepare`); kept when they agree on it."""

    def __init__(self, early: EarlyCopies) -> None:
        self.stop = threading.Event()
        self.early = early
        self.guess: Prepared | None = None
        self.staged: Staged | None = None
        self.interrupt: BaseException | None = None  # an interrupt that ended the staging (errors: in staged)
        self.thread: threading.Thread | None = None

    def __call__(self, guess: Prepared) -> None:
        """Start staging from ``guess`` (the plan this process cached) on a helper thread."""
        self.guess = guess

        def run() -> None:
            try:
                self.staged = stage(guess, self.early, self.stop)
            except BaseException as exc:  # noqa: BLE001 - raised by confirmed(), on the caller's thread
                self.interrupt = exc

        self.thread = Worker(run, "xckpt-stage", daemon=False)
        self.thread.start()

    def confirmed(self, p: Prepared) -> Staged | None:
        """What was staged, once done, when the agreed plan is the one staged from; else None (the
        staging is stopped and undone)."""
        if self.thread is None:
            return None
        assert self.guess is not None
        if p.local is self.guess.local and p.plan_key == self.guess.plan_key:
            self.thread.join()
            if self.interrupt is not None:
                raise self.interrupt
            return self.staged
        self.cancel()
        return None

    def cancel(self) -> None:
        """Stop staging and give its buffers back to the pool."""
        if self.thread is None:
            return
        self.stop.set()
        self.thread.join()
        if self.staged is not None:
            self.staged.give_back()
        self.thread = None


def start(tree: Any, path: Any, *, coordinator: Any, options: Any, timeout_s: float) -> Pending:
    """Plan, start the background write and commit, and stage, of one asynchronous save.

    Planning is collective and raises on every process alike; staging starts during it when
    this process saved the same structure before. A failure to stage (copy a shard to the
    host) is not raised here, where the other processes would not learn of it: it is
    reported through the status files and raised by :meth:`Pending.wait` everywhere.
    """
    started = time.perf_counter()
    background_nice()  # an invalid XCKPT_BACKGROUND_NICE is config.env here, not in a background thread
    early = EarlyCopies()
    spec = _Speculation(early)
    try:
        p = protocol.prepare(tree, path, coordinator=coordinator, options=options, speculate=spec, each_leaf=early)
    except BaseException:
        spec.cancel()
        early.discard()
        raise
    try:
        staged = spec.confirmed(p)
        reused = staged is not None
        if staged is None:
            staged = stage(p, early)
    except BaseException:  # an interrupt (KeyboardInterrupt) while staging: nothing goes on in the background
        spec.cancel()
        early.discard()
        p.discard()
        raise
    early.discard()  # copies of shards the agreed plan has another process write
    if staged.error is None:
        _staging.device_shards = frozenset(staged.device_shards)
    p.sources = []  # the background needs only what was staged: the caller's arrays are not kept alive
    pending = Pending(p, sibling(p.final, "status", p.generation), timeout_s, staged)
    pending.thread.start()
    try:
        failpoints.hit("after_stage", p.coord.rank)
        p.stats["stage_s"] = time.perf_counter() - started - p.stats["plan_s"]
        p.stats["staged_during_planning"] = reused
        p.stats["early_copies"] = staged.copied_early
    finally:
        pending.go.set()  # whatever happens here, the thread goes on: it reports and cleans up
    return pending
