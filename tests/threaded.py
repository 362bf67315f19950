"""Running the engine's collective logic with N 'ranks' on threads (xckpt's own ThreadGroup coordinator).

This is our own Coordinator protocol implemented over threads (not a stand-in for a
framework): the torch and jax adapters are tested with their real distributed runtimes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from xckpt.engine.collective import ThreadCoordinator, ThreadGroup


def run_ranks(n: int, fn: Callable[[ThreadCoordinator], Any]) -> list[Any]:
    """Run ``fn(coord)`` on ``n`` threads; return results by rank, re-raising the first error."""
    group = ThreadGroup(n, timeout=60)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(group.coordinator(rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for e in errors:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    for e in errors:
        if e is not None:
            raise e
    return results


def within(fn: Callable[[], Any], limit: float, what: str = "the call") -> tuple[Any, BaseException | None]:
    """``(fn(), None)``, or ``(None, what it raised)``, run on a daemon thread; fails the test when it runs longer
    than ``limit`` seconds (a hang, or a blocked open, cannot be interrupted: it is left behind)."""
    out: list[tuple[Any, BaseException | None]] = []

    def target() -> None:
        try:
            out.append((fn(), None))
        except BaseException as exc:  # noqa: BLE001 - inspected by the caller
            out.append((None, exc))

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"{what} still runs after {limit} s"
    return out[0]
