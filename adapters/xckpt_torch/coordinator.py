"""The xckpt coordinator of a torch.distributed job: msgpack bytes in uint8 tensors.

Only byte strings cross the wire; nothing is pickled, unlike ``all_gather_object``.
Every message travels in a fixed-size *slot*: its length, a flag, and its first
:data:`INLINE_BYTES` bytes, so the small messages of a save's collective steps take one
collective each. Only the rest of a longer message takes a second operation, sized from the
lengths the slots carried: ``all_gather`` and ``broadcast`` move the rests padded to the
longest, while ``gather`` and ``scatter`` move each process's rest point to point, so the
coordinating process never allocates world size times the longest message (only world size
times a slot), and a process with nothing more to send sends nothing more.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

#: Bytes of a message carried in its slot, in the same collective operation as its length: room for a
#: save's usual step messages (a digest and a plan key, about 50 bytes; a decision, about 170), while the
#: coordinating process of 8,192 ranks gathers 2.2 MB of slots.
INLINE_BYTES = 256
_HEADER = 16  # the length (u64 LE), then a flag (u64 LE)


class TorchCoordinator:
    """Collectives of one process group (default: the world) for xckpt's save."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        if "gloo" in backend or "nccl" not in backend or not torch.cuda.is_available():
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return self._world

    def _tensor(self, data: bytes, size: int) -> torch.Tensor:
        out = torch.zeros(size, dtype=torch.uint8)
        if data:
            out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out.to(self.device)

    def _slot(self, data: bytes, flag: int = 0) -> torch.Tensor:
        """The slot of a message: its length, ``flag``, its first :data:`INLINE_BYTES` bytes."""
        head = len(data).to_bytes(8, "little") + flag.to_bytes(8, "little") + bytes(data[:INLINE_BYTES])
        return self._tensor(head, _HEADER + INLINE_BYTES)

    def _empty_slot(self) -> torch.Tensor:
        return torch.empty(_HEADER + INLINE_BYTES, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _unslot(slot: torch.Tensor) -> tuple[int, int, bytes]:
        """``(length, flag, first bytes)`` of a received slot."""
        raw = slot.cpu().numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        return n, int.from_bytes(raw[8:_HEADER], "little"), raw[_HEADER:_HEADER + min(n, INLINE_BYTES)]

    def _tail(self, data: bytes) -> torch.Tensor:
        """The part of ``data`` beyond its slot, to send."""
        return self._tensor(bytes(data[INLINE_BYTES:]), len(data) - INLINE_BYTES)

    def _rest(self, n: int) -> torch.Tensor:
        """A buffer for the part of an ``n``-byte message beyond its slot."""
        return torch.empty(n - INLINE_BYTES, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _bytes(t: torch.Tensor, n: int | None = None) -> bytes:
        return bytes(t[:n].cpu().numpy().tobytes())

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, indexed by rank, on every rank."""
        slots = [self._empty_slot() for _ in range(self._world)]
        dist.all_gather(slots, self._slot(data), group=self.group)
        got = [self._unslot(s) for s in slots]
        longest = max(n for n, _, _ in got)
        if longest <= INLINE_BYTES:
            return [head for _, _, head in got]
        outs = [self._rest(longest) for _ in range(self._world)]
        dist.all_gather(outs, self._tensor(bytes(data[INLINE_BYTES:]), longest - INLINE_BYTES), group=self.group)
        return [head + (self._bytes(o, n - INLINE_BYTES) if n > INLINE_BYTES else b"")
                for (n, _, head), o in zip(got, outs)]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Every rank's ``data`` on rank ``root`` (None elsewhere)."""
        slots = [self._empty_slot() for _ in range(self._world)] if self._rank == root else None
        dist.gather(self._slot(data), slots, dst=self._global(root), group=self.group)
        if self._rank != root:
            if len(data) > INLINE_BYTES:
                dist.send(self._tail(data), dst=self._global(root), group=self.group)
            return None
        assert slots is not None
        got = [self._unslot(s) for s in slots]
        rests: dict[int, torch.Tensor] = {}
        works = []
        for r, (n, _, _) in enumerate(got):
            if r != root and n > INLINE_BYTES:
                rests[r] = self._rest(n)
                works.append(dist.irecv(rests[r], src=self._global(r), group=self.group))
        for w in works:
            w.wait()
        return [bytes(data) if r == root else head + (self._bytes(rests[r]) if r in rests else b"")
                for r, (_, _, head) in enumerate(got)]

    def scatter_bytes(self, items: Sequence[bytes] | None, root: int = 0) -> bytes:
        """``items[rank]`` of rank ``root`` on each rank: broadcast when every rank gets the same bytes
        object (one operation when it fits a slot), else each sent point to point."""
        first: bytes | None = None
        same = False
        if self._rank == root:
            assert items is not None and len(items) == self._world
            same = all(b is items[0] for b in items)
            first = items[0] if same else b""
        n, same_flag, head = self._broadcast_slot(first, int(same), root)
        if same_flag:
            return self._broadcast_rest(first, n, head, root)
        n_t = torch.zeros(1, dtype=torch.int64, device=self.device)
        lengths = None
        if self._rank == root:
            assert items is not None
            lengths = [torch.tensor([len(b)], dtype=torch.int64, device=self.device) for b in items]
        dist.scatter(n_t, lengths, src=self._global(root), group=self.group)
        if self._rank == root:
            assert items is not None
            works = [dist.isend(self._tensor(b, len(b)), dst=self._global(r), group=self.group)
                     for r, b in enumerate(items) if r != root and b]
            for w in works:
                w.wait()
            return bytes(items[root])
        size = int(n_t.item())
        if not size:
            return b""
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.recv(buf, src=self._global(root), group=self.group)
        return self._bytes(buf)

    def _broadcast_slot(self, data: bytes | None, flag: int, root: int) -> tuple[int, int, bytes]:
        """Broadcast the slot of ``data`` (given on ``root``) with ``flag``; ``(length, flag, first bytes)``
        everywhere."""
        if self._rank == root:
            assert data is not None
            dist.broadcast(self._slot(data, flag), src=self._global(root), group=self.group)
            return len(data), flag, bytes(data[:INLINE_BYTES])
        slot = self._empty_slot()
        dist.broadcast(slot, src=self._global(root), group=self.group)
        return self._unslot(slot)

    def _broadcast_rest(self, data: bytes | None, n: int, head: bytes, root: int) -> bytes:
        """The whole message whose slot was broadcast (``n`` bytes, ``head`` first): the rest follows."""
        if n <= INLINE_BYTES:
            return head
        if self._rank == root:
            assert data is not None
            dist.broadcast(self._tail(data), src=self._global(root), group=self.group)
            return bytes(data)
        rest = self._rest(n)
        dist.broadcast(rest, src=self._global(root), group=self.group)
        return head + self._bytes(rest)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Rank ``root``'s ``data`` on every rank."""
        payload = (b"" if data is None else data) if self._rank == root else None
        n, _, head = self._broadcast_slot(payload, 0, root)
        return self._broadcast_rest(payload, n, head, root)

    def barrier(self) -> None:
        """Wait for every rank of the group."""
        dist.barrier(group=self.group)


def default_coordinator() -> TorchCoordinator | None:
    """The world's coordinator when torch.distributed is initialised, else None."""
    if dist.is_available() and dist.is_initialized():
        return TorchCoordinator()
    return None
