"""The threads that move bytes: one pool for saves and loads, one for asynchronous saves, one that fsyncs.

Pools live as long as the process, so a training loop that saves every few minutes does not
start threads (and fault in their buffers) for every checkpoint. The background pool's
threads run at a lower CPU priority (:func:`yield_cpu`), so an asynchronous save yields the
cores to the training loop. A forked child gets pools of its own.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

from xckpt.engine import env

#: How much lower the CPU priority (nice value) of an asynchronous save's threads is, unless
#: ``XCKPT_BACKGROUND_NICE`` says otherwise (0 keeps the caller's priority).
BACKGROUND_NICE = 10

#: Threads that fsync a store's files at once (:func:`sync_pool`): they wait on the device, not the CPU.
SYNC_THREADS = 8

T = TypeVar("T")

_lock = threading.Lock()
_pools: dict[bool | str, tuple[int, ThreadPoolExecutor]] = {}


class Worker(threading.Thread):
    """A thread whose end is told by an event it sets as its target returns (or raises), not by the
    interpreter's own lock: on CPython before 3.13, a ``join`` interrupted by Ctrl-C (``KeyboardInterrupt``)
    releases that lock while the thread still runs, and from then on ``join`` returns at once and
    ``is_alive()`` is False. An interrupted wait on the event changes nothing, so ``join`` and ``is_alive``
    stay true to the thread after an interrupt (a save waited for again is waited for)."""

    def __init__(self, target: Callable[[], None], name: str, daemon: bool = True) -> None:
        super().__init__(target=target, name=name, daemon=daemon)
        self._ended = threading.Event()

    def run(self) -> None:
        """Run the target, then tell that it ended."""
        try:
            super().run()
        finally:
            self._ended.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the target has returned or raised (at most ``timeout`` seconds)."""
        if self.ident is None:  # as Thread.join refuses it
            raise RuntimeError("cannot join thread before it is started")
        self._ended.wait(timeout)

    def is_alive(self) -> bool:
        """Whether it started and its target has not yet returned or raised."""
        return self.ident is not None and not self._ended.is_set()


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the system has one (a container or a
    ``taskset`` limits it), else every CPU."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def io_threads() -> int:
    """Threads that encode and write (or read and decode) per process: ``XCKPT_IO_THREADS``, else one per
    usable CPU (:func:`usable_cpus`), up to 4."""
    return int(env.number("XCKPT_IO_THREADS", min(4, usable_cpus()), minimum=1, integer=True))


def background_nice() -> int:
    """How much lower an asynchronous save's threads run: ``XCKPT_BACKGROUND_NICE``, else :data:`BACKGROUND_NICE`."""
    return int(env.number("XCKPT_BACKGROUND_NICE", BACKGROUND_NICE, integer=True))


def yield_cpu() -> None:
    """Lower the calling thread's CPU priority by :func:`background_nice` (Linux: threads have their own nice
    value; elsewhere nothing happens)."""
    nice = background_nice()
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError):
        pass


def _shared(key: bool | str, make: Callable[[], ThreadPoolExecutor]) -> ThreadPoolExecutor:
    """The process's pool under ``key``, made by ``make`` the first time (again in a forked child)."""
    pid = os.getpid()
    with _lock:
        found = _pools.get(key)
        if found is None or found[0] != pid:
            found = (pid, make())
            _pools[key] = found
        return found[1]


def pool(background: bool = False) -> ThreadPoolExecutor:
    """The process's pool of :func:`io_threads` threads (``background``: the low-priority one)."""
    return _shared(background, lambda: ThreadPoolExecutor(
        io_threads(), thread_name_prefix="xckpt-bg" if background else "xckpt-io",
        initializer=yield_cpu if background else None))


def sync_pool() -> ThreadPoolExecutor:
    """The process's pool of :data:`SYNC_THREADS` threads that fsync written files (apart from the pools of
    :func:`pool`, whose threads call it)."""
    return _shared("sync", lambda: ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="xckpt-sync"))


def gather(futures: Iterable[Future[int]], first: BaseException | None = None) -> int:
    """The sum of the futures' results, once every one is done; then the first error (``first``, an error
    the caller already met, else the earliest future's) is raised, so nothing still runs into the outputs."""
    total = 0
    for f in futures:
        try:
            total += f.result()
        except BaseException as exc:  # noqa: BLE001 - the first is raised once all are done
            first = first or exc
    if first is not None:
        raise first
    return total


_END = object()


class Pump:
    """Runs ``fn(item)`` for each item on ``ex`` in ``workers`` loops, each taking the next item when it has
    finished one (the items are made, by ``items``, only as they are taken); after the first error no loop
    takes another. A read of a million objects thus holds ``workers`` items, not a million, and a failure
    stops it after the items running, not after every object was tried. One task per loop, not per item:
    a task's completion wakes the thread that waits for it, and on a busy host that handover costs more
    than reading a small object (a tenth of a W1 load's interpreter time went to it)."""

    def __init__(self, ex: ThreadPoolExecutor, fn: Callable[[T], int], items: Iterable[T], workers: int) -> None:
        self._fn, self._items = fn, iter(items)
        self._lock = threading.Lock()
        self._taken = 0
        self._errors: list[tuple[int, BaseException]] = []  # (the item's place in the order taken, its error)
        self._loops = [ex.submit(self._loop) for _ in range(max(1, workers))]

    @property
    def first(self) -> BaseException | None:
        """The earliest error met so far, in the order the items were taken (None: none yet)."""
        with self._lock:
            return min(self._errors, key=lambda e: e[0])[1] if self._errors else None

    def _take(self) -> tuple[int, object] | None:
        """The next item and its place, or None when there is none or an error was met (``items`` raising is
        that item's error)."""
        with self._lock:
            if self._errors:
                return None
            k = self._taken
            try:
                item = next(self._items, _END)
            except BaseException as exc:  # noqa: BLE001 - raised by finish(), once no loop runs
                self._errors.append((k, exc))
                return None
            if item is _END:
                return None
            self._taken += 1
            return k, item

    def _loop(self) -> int:
        total = 0
        while (got := self._take()) is not None:
            k, item = got
            try:
                total += self._fn(item)  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001 - raised by finish(), once no loop runs
                with self._lock:
                    self._errors.append((k, exc))
        return total

    def finish(self, first: BaseException | None = None) -> int:
        """Wait for every loop (none takes another item after an error: ``first``, an error the caller already
        met, or one of the items'); return the sum of the results, or raise ``first``, else the earliest
        error, once nothing runs any more."""
        if first is not None:
            with self._lock:
                self._errors.append((-1, first))  # the caller's error comes first, as with gather()
        total = sum(f.result() for f in self._loops)
        found = self.first
        if found is not None:
            raise found
        return total


def say(message: str) -> None:
    """Write a line to stderr from where no caller can be told (a background thread, interpreter exit);
    nothing when stderr is closed or gone."""
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
