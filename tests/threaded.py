"""An in-process Coordinator over threads, to run the engine's collective logic with N 'ranks'.

This is our own Coordinator protocol implemented over threads (not a stand-in for a
framework): the torch and jax adapters are tested with their real distributed runtimes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier_ = threading.Barrier(n, timeout=60)
        self.slots: list[Any] = [None] * n


class ThreadCoordinator:
    """Rank ``rank`` of a group of threads."""

    def __init__(self, group: _Group, rank: int) -> None:
        self._g = group
        self.rank = rank
        self.world_size = group.n

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every thread's data."""
        self._g.barrier_.wait()
        self._g.slots[self.rank] = data
        self._g.barrier_.wait()
        out = list(self._g.slots)
        self._g.barrier_.wait()
        return out

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Root's data."""
        return self.all_gather_bytes(data if self.rank == root else b"")[root]

    def barrier(self) -> None:
        """Wait for all threads."""
        self._g.barrier_.wait()


def run_ranks(n: int, fn: Callable[[ThreadCoordinator], Any]) -> list[Any]:
    """Run ``fn(coord)`` on ``n`` threads; return results by rank, re-raising the first error."""
    group = _Group(n)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadCoordinator(group, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            group.barrier_.abort()

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
