"""The coordinator of a multi-process JAX job: jax.distributed's key-value store.

Every exchange is msgpack bytes put under a fresh key (``xckpt/<op>/<seq>/<rank>``)
and read back with blocking gets; nothing is ever unpickled, and no XLA
collective runs, so it works the same on CPU, GPU and TPU. Every process
numbers its operations in the same order (they are collective), and deletes its
own keys once an all-gather or a barrier shows that every process is past them.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Sequence

import jax

from xckpt.errors import CoordinationError

#: How long one collective waits for the other processes, in seconds (``XCKPT_JAX_TIMEOUT_S``).
DEFAULT_TIMEOUT_S = 1800.0

_sequence = itertools.count()
_sequence_lock = threading.Lock()
#: Keys this process has put and not yet deleted (shared by every coordinator of the process).
_own_keys: list[str] = []


def _client() -> Any:
    """The running jax.distributed client, or None outside a jax.distributed job."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - a jax without this module
        return None
    return getattr(distributed.global_state, "client", None)


class JaxCoordinator:
    """Collectives over the processes of a ``jax.distributed`` job, through its key-value store."""

    def __init__(self, client: Any = None, *, timeout_s: float | None = None) -> None:
        self._client = client if client is not None else _client()
        if self._client is None:
            raise CoordinationError("jax.distributed is not initialized; call jax.distributed.initialize() "
                                    "on every process first")
        self._rank = jax.process_index()
        self._world = jax.process_count()
        if timeout_s is None:
            timeout_s = float(os.environ.get("XCKPT_JAX_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        self._timeout_ms = int(timeout_s * 1000)

    @property
    def rank(self) -> int:
        """This process's index (``jax.process_index()``)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes (``jax.process_count()``)."""
        return self._world

    def _op(self, kind: str) -> str:
        with _sequence_lock:
            return f"xckpt/{kind}/{next(_sequence)}"

    def _get(self, key: str) -> bytes:
        try:
            return bytes(self._client.blocking_key_value_get_bytes(key, self._timeout_ms))
        except Exception as exc:  # noqa: BLE001 - jaxlib raises its own error types
            raise CoordinationError(f"process {self._rank} timed out or failed waiting for {key!r} "
                                    f"from another process: {exc}", code="coord.lost") from exc

    def _forget_older(self, keep: str | None = None, only: str | None = None) -> None:
        """Delete this process's keys of earlier operations (of kind ``only``): every process is past them."""
        with _sequence_lock:
            stale = [k for k in _own_keys if k != keep and (only is None or k.startswith(f"xckpt/{only}/"))]
            _own_keys[:] = [k for k in _own_keys if k not in stale]
        for key in stale:
            try:
                self._client.key_value_delete(key)
            except Exception:  # noqa: BLE001 - cleanup is best effort
                pass

    def _remember(self, key: str) -> None:
        with _sequence_lock:
            _own_keys.append(key)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every process's ``data``, indexed by rank, on every process."""
        base = self._op("gather")
        own = f"{base}/{self._rank}"
        self._client.key_value_set_bytes(own, bytes(data))
        self._remember(own)
        out = [bytes(data) if r == self._rank else self._get(f"{base}/{r}") for r in range(self._world)]
        self._forget_older(keep=own)
        return out

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Every process's ``data`` on process ``root`` (None elsewhere)."""
        base = self._op("gather1")
        own = f"{base}/{self._rank}"
        if self._rank != root:
            self._client.key_value_set_bytes(own, bytes(data))
            self._remember(own)
            return None
        out = [bytes(data) if r == root else self._get(f"{base}/{r}") for r in range(self._world)]
        self._forget_older()  # every process has reached this gather: past all earlier operations
        return out

    def scatter_bytes(self, items: Sequence[bytes] | None, root: int = 0) -> bytes:
        """``items[rank]`` of process ``root``, on each process (stored once when they are all the same
        bytes object; each process's key then names it)."""
        base = self._op("scatter")
        if self._rank == root:
            assert items is not None
            same = all(b is items[0] for b in items)
            if same:
                self._client.key_value_set_bytes(f"{base}/all", bytes(items[0]))
                self._remember(f"{base}/all")
            for r, b in enumerate(items):
                if r != root:
                    self._client.key_value_set_bytes(f"{base}/{r}", b"@all" if same else b"=" + bytes(b))
                    self._remember(f"{base}/{r}")
            return bytes(items[root])
        got = self._get(f"{base}/{self._rank}")
        out = self._get(f"{base}/all") if got == b"@all" else got[1:]
        if root == 0:
            self._forget_older(only="gather1")  # the root read this process's earlier keys before it answered
        return out

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """``data`` of process ``root``, on every process."""
        key = f"{self._op('bcast')}/{root}"
        if self._rank == root:
            if data is None:
                raise CoordinationError("broadcast root gave no data")
            self._client.key_value_set_bytes(key, bytes(data))
            self._remember(key)
            return bytes(data)
        out = self._get(key)
        if root == 0:
            self._forget_older(only="gather1")  # the root read this process's earlier keys before it sent this
        return out

    def barrier(self) -> None:
        """Return once every process has called it."""
        name = self._op("barrier")
        try:
            self._client.wait_at_barrier(name, self._timeout_ms)
        except Exception as exc:  # noqa: BLE001
            raise CoordinationError(f"process {self._rank} failed at barrier {name!r}: {exc}",
                                    code="coord.lost") from exc
        self._forget_older()


def default_coordinator() -> JaxCoordinator | None:
    """The coordinator of the running multi-process jax.distributed job, or None."""
    client = _client()
    if client is None:
        return None
    if jax.process_count() <= 1:
        return None
    return JaxCoordinator(client)
