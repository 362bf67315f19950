"""How the processes of one save or load talk: a :class:`Coordinator`, and one helper per kind of collective step.

The engine never starts a distributed runtime. Adapters implement :class:`Coordinator`
with theirs (``torch.distributed``, ``jax.distributed``); everything exchanged is msgpack
bytes, so nothing is ever unpickled.

A collective step runs a function on every process and always reaches the exchange,
whatever the function raised: :func:`gather_step` brings every process's result to the
coordinating process, :func:`decide_step` also lets it decide from them and tells every process the decision,
:func:`answer_step` sends each process the coordinating process's answer,
:func:`agree_step` tells every process whether all succeeded, :func:`all_step` gives every
process every result. When any process failed, every process raises one
:class:`~xckpt.errors.CollectiveError` (a load's: :class:`~xckpt.errors.CollectiveLoadError`)
that lists every failing rank with its error, so no process waits forever and no failure is hidden.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any, Callable, Protocol, Sequence, TypeVar, runtime_checkable

import msgpack

from xckpt.engine import env, threads
from xckpt.errors import CollectiveError, CoordinationError, RankFailures, XckptError, XckptWarning

T = TypeVar("T")
ROOT = 0

#: Seconds one exchange waits for the other processes before this process warns that it is
#: waiting (``XCKPT_WAIT_WARN_S`` overrides it; 0 never warns). The wait itself goes on until the
#: framework's own timeout: the others may only be slow.
WAIT_WARN_S = 60.0


@runtime_checkable
class Coordinator(Protocol):
    """Collective operations over the processes of one job (every process calls each one)."""

    @property
    def rank(self) -> int:
        """This process's index, 0-based."""

    @property
    def world_size(self) -> int:
        """Number of processes."""

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every process's ``data``, indexed by rank, on every process."""

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """``data`` of process ``root``, on every process."""

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Every process's ``data``, indexed by rank, on ``root`` (None elsewhere)."""

    def scatter_bytes(self, items: Sequence[bytes] | None, root: int = 0) -> bytes:
        """``items[rank]`` of process ``root``, on each process."""

    def barrier(self) -> None:
        """Return once every process has called it."""


class LocalCoordinator:
    """The coordinator of a single process."""

    rank = 0
    world_size = 1

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """One process: a list of its own data."""
        return [data]

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """One process: its own data."""
        assert data is not None
        return data

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """One process: a list of its own data."""
        return [data]

    def scatter_bytes(self, items: Sequence[bytes] | None, root: int = 0) -> bytes:
        """One process: its own item."""
        assert items is not None
        return items[0]

    def barrier(self) -> None:
        """One process: nothing to wait for."""


class ThreadGroup:
    """Processes simulated by threads of one process: ``coordinator(rank)`` is one of them.

    For running the collective protocol in one process (tests, the conformance vectors);
    every exchange goes through shared slots and a barrier, as bytes.
    """

    def __init__(self, size: int, timeout: float = 120.0) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)

    def coordinator(self, rank: int) -> "ThreadCoordinator":
        """The coordinator of simulated process ``rank``."""
        return ThreadCoordinator(self, rank)


class ThreadCoordinator:
    """One simulated process of a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._g = group
        self.rank = rank
        self.world_size = group.size

    def _exchange(self, data: Any) -> list[Any]:
        self._g.barrier.wait()
        self._g.slots[self.rank] = data
        self._g.barrier.wait()
        out = list(self._g.slots)
        self._g.barrier.wait()
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every thread's data."""
        return self._exchange(bytes(data))

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Root's data."""
        return self._exchange(data if self.rank == root else None)[root]

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Every thread's data, on ``root``."""
        out = self._exchange(bytes(data))
        return out if self.rank == root else None

    def scatter_bytes(self, items: Sequence[bytes] | None, root: int = 0) -> bytes:
        """``items[rank]`` of ``root``."""
        return self._exchange(list(items) if self.rank == root else None)[root][self.rank]

    def barrier(self) -> None:
        """Wait for every thread."""
        self._g.barrier.wait()


def pack(obj: Any) -> bytes:
    """msgpack-encode a plain object (lists, dicts, str, int, float, bool, None, bytes); a string holding a file
    name's undecodable bytes (Python's ``surrogateescape``: a path that is not UTF-8) goes with them."""
    return msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogateescape")


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack`."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, unicode_errors="surrogateescape")


def wait_warn_s() -> float:
    """Seconds an exchange waits before warning: ``XCKPT_WAIT_WARN_S``, else :data:`WAIT_WARN_S`."""
    return env.number("XCKPT_WAIT_WARN_S", WAIT_WARN_S)


def _warn_waiting(coord: Coordinator, what: str, after: float) -> None:
    others = coord.world_size - 1
    warnings.warn(XckptWarning(
        f"rank {coord.rank} has waited {after:g} s for the other {others} process{'es' if others > 1 else ''} in "
        f"{what or 'a collective step'}; every process of the job must make the same call (one that does not "
        "keeps the others waiting until the process group's timeout). To save or load in one process alone, pass "
        "coordinator=xckpt.LocalCoordinator()"), stacklevel=2)


class _Watchdog:
    """One thread per process that runs a callback when an armed deadline passes before it is disarmed
    (arming costs a dictionary entry, not a thread per exchange)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Callable[[], None]]] = {}
        self._next = 0
        self._pid = -1

    def arm(self, after: float, fn: Callable[[], None]) -> int:
        """Run ``fn`` in ``after`` seconds unless :meth:`disarm` is called first; returns the token."""
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child: the thread is not there
                self._pid = os.getpid()
                self._armed.clear()
                threading.Thread(target=self._run, name="xckpt-watchdog", daemon=True).start()
            at = time.monotonic() + after
            if all(at < other for other, _ in self._armed.values()):
                self._cond.notify()  # the thread sleeps until a later deadline, or none
            self._next += 1
            self._armed[self._next] = (at, fn)
            return self._next

    def disarm(self, token: int) -> None:
        """Forget ``token``'s callback (nothing happens when it already ran)."""
        with self._cond:
            self._armed.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [t for t, (at, _) in self._armed.items() if at <= now]
                calls = [self._armed.pop(t)[1] for t in due]
                if not calls:
                    soonest = min((at for at, _ in self._armed.values()), default=None)
                    # (a deadline years away would overflow the wait: wake at the platform's longest wait)
                    self._cond.wait(None if soonest is None else min(soonest - now, threading.TIMEOUT_MAX))
                    continue
            for fn in calls:
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - warnings as errors, say: the thread serves every later wait
                    threads.say(f"xckpt: a collective step waits longer than it should, and saying so failed: "
                                f"{type(exc).__name__}: {exc}")


_watchdog = _Watchdog()


def exchange(fn: Callable[[], T], coord: Coordinator | None = None, what: str = "") -> T:
    """Run one message exchange of ``coord``; a transport failure (a process died, a timeout of
    the framework's process group) becomes ``coord.lost``, an :class:`~xckpt.errors.CoordinationError`.

    When the exchange waits longer than :func:`wait_warn_s` for the other processes, an
    :class:`~xckpt.errors.XckptWarning` naming ``what`` says so, once, while it goes on waiting.
    """
    token: int | None = None
    after = wait_warn_s() if coord is not None and coord.world_size > 1 else 0.0
    if after > 0:
        token = _watchdog.arm(after, lambda: _warn_waiting(coord, what, after))  # type: ignore[arg-type]
    try:
        return fn()
    except XckptError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.distributed and XLA raise RuntimeError and others
        raise CoordinationError(f"lost contact with the other processes ({type(exc).__name__}: {exc})",
                                code="coord.lost") from exc
    finally:
        if token is not None:
            _watchdog.disarm(token)


def all_gather(coord: Coordinator, obj: Any, what: str = "") -> list[Any]:
    """Gather a plain object from every process, on every process (``what``: the step, for :func:`exchange`)."""
    return [unpack(b) for b in exchange(lambda: coord.all_gather_bytes(pack(obj)), coord, what)]


def broadcast(coord: Coordinator, obj: Any, root: int = ROOT, what: str = "") -> Any:
    """Broadcast a plain object from ``root`` (``what``: the step, for :func:`exchange`)."""
    return unpack(exchange(lambda: coord.broadcast_bytes(pack(obj) if coord.rank == root else None, root),
                           coord, what))


def describe(exc: BaseException) -> dict[str, Any]:
    """A msgpack-able account of an exception: its type, code, message, file and leaf."""
    if isinstance(exc, RankFailures):
        return {"type": type(exc).__name__, "code": exc.code, "message": exc.message, "file": exc.file,
                "leaf": exc.leaf, "failures": {str(r): f for r, f in exc.failures.items()}}
    if isinstance(exc, XckptError):
        return {"type": type(exc).__name__, "code": exc.code, "message": exc.message, "file": exc.file,
                "leaf": exc.leaf}
    return {"type": type(exc).__name__, "code": "error", "message": str(exc) or type(exc).__name__,
            "file": None, "leaf": None}


def _raise(what: str, failures: dict[int, dict[str, Any]], local: BaseException | None, world: int,
           error: type[RankFailures] = CollectiveError) -> None:
    if world == 1 and isinstance(local, XckptError):
        raise local
    raise error(what, failures) from local


def _gather(coord: Coordinator, what: str,
            fn: Callable[[], Any]) -> tuple[BaseException | None, list[dict[str, Any]] | None]:
    """Run ``fn`` and gather ``{"ok": result}`` or ``{"error": ...}`` from every process to the coordinating one."""
    result, local = _run(fn)
    got = exchange(lambda: coord.gather_bytes(pack({"ok": result} if local is None else {"error": describe(local)}),
                                              ROOT), coord, what)
    return local, None if got is None else [unpack(b) for b in got]


def _run(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - every process must reach the exchange
        return None, exc


def gather_step(coord: Coordinator, what: str, fn: Callable[[], Any]) -> list[Any] | None:
    """Run ``fn`` everywhere; the coordinating process gets every result (others get None).

    Raises :class:`~xckpt.errors.CollectiveError` on every process when ``fn`` failed anywhere.
    """
    local, items = _gather(coord, what, fn)
    failures: dict[int, dict[str, Any]] = {}
    results: list[Any] | None = None
    if items is not None:
        failures = {r: x["error"] for r, x in enumerate(items) if "error" in x}
        results = [x.get("ok") for x in items]
    failures = {int(r): f for r, f in broadcast(coord, {str(r): f for r, f in failures.items()}, ROOT, what).items()}
    if failures:
        _raise(what, failures, local, coord.world_size)
    return results


def answer_step(coord: Coordinator, what: str, fn: Callable[[], Sequence[Any]] | None) -> Any:
    """The coordinating process runs ``fn`` (one answer per rank, the same object packed once
    where ranks share it); each process gets its own answer.

    When ``fn`` raises, every process raises a :class:`~xckpt.errors.CollectiveError` naming it.
    """
    items: list[bytes] | None = None
    local = None
    if coord.rank == ROOT:
        assert fn is not None
        answers, local = _run(fn)
        if local is None:
            packed: dict[int, bytes] = {}
            items = []
            for a in answers:  # type: ignore[union-attr]
                if id(a) not in packed:
                    packed[id(a)] = pack({"ok": a})
                items.append(packed[id(a)])
        else:
            items = [pack({"error": describe(local)})] * coord.world_size
    got = unpack(exchange(lambda: coord.scatter_bytes(items, ROOT), coord, what))
    if "error" in got:
        _raise(what, {ROOT: got["error"]}, local, coord.world_size)
    return got["ok"]


def decide_step(coord: Coordinator, what: str, fn: Callable[[], Any], decide: Callable[[list[Any]], Any]) -> Any:
    """Run ``fn`` everywhere; the coordinating process runs ``decide`` on every result; every
    process gets the decision (one gather and one broadcast).

    Raises :class:`~xckpt.errors.CollectiveError` on every process when ``fn`` failed anywhere
    (``decide`` then does not run) or when ``decide`` failed.
    """
    local, items = _gather(coord, what, fn)
    out: dict[str, Any] | None = None
    if items is not None:
        failures = {str(r): x["error"] for r, x in enumerate(items) if "error" in x}
        if not failures:
            decision, local = _run(lambda: decide([x["ok"] for x in items]))
            if local is not None:
                failures = {str(ROOT): describe(local)}
        out = {"failures": failures} if failures else {"ok": decision}
    out = broadcast(coord, out, ROOT, what)
    if "failures" in out:
        _raise(what, {int(r): f for r, f in out["failures"].items()}, local, coord.world_size)
    return out["ok"]


def all_step(coord: Coordinator, what: str, fn: Callable[[], T],
             error: type[RankFailures] = CollectiveError) -> list[T]:
    """Run ``fn`` everywhere; every process gets every result, by rank (one all-gather).

    Raises ``error`` on every process, with every failing rank's error, when ``fn`` failed anywhere."""
    result, local = _run(fn)
    items = all_gather(coord, {"ok": result} if local is None else {"error": describe(local)}, what)
    failures = {r: x["error"] for r, x in enumerate(items) if "error" in x}
    if failures:
        _raise(what, failures, local, coord.world_size, error)
    return [x["ok"] for x in items]


def agree_step(coord: Coordinator, what: str, fn: Callable[[], T]) -> T | None:
    """Run ``fn`` everywhere; every process learns whether all succeeded (raising if not)."""
    result, local = _run(fn)
    gather_step(coord, what, lambda: _reraise(local))
    return result


def _reraise(exc: BaseException | None) -> None:
    if exc is not None:
        raise exc
