"""How processes taking part in one save or load talk to each other.

The engine never starts a distributed runtime. Adapters implement
:class:`Coordinator` with theirs (``torch.distributed``, ``jax.distributed``);
everything exchanged is msgpack bytes, so nothing is ever unpickled.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgpack


@runtime_checkable
class Coordinator(Protocol):
    """Collective operations over the processes of one job."""

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

    def barrier(self) -> None:
        """One process: nothing to wait for."""


def pack(obj: Any) -> bytes:
    """msgpack-encode a plain object (lists, dicts, str, int, float, bool, None, bytes)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack`."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def all_gather(coord: Coordinator, obj: Any) -> list[Any]:
    """Gather a plain object from every process."""
    return [unpack(b) for b in coord.all_gather_bytes(pack(obj))]


def broadcast(coord: Coordinator, obj: Any, root: int = 0) -> Any:
    """Broadcast a plain object from ``root``."""
    return unpack(coord.broadcast_bytes(pack(obj) if coord.rank == root else None, root))
