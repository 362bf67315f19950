"""The xckpt coordinator of a torch.distributed job: msgpack bytes in uint8 tensors.

Only byte strings cross the wire; nothing is pickled, unlike ``all_gather_object``.
Lengths travel first (fixed-size collectives); then ``all_gather`` and ``broadcast``
move padded uint8 tensors, while ``gather`` and ``scatter`` move each process's bytes
point to point, so the coordinating process never allocates world size times the
longest message, and processes with nothing to send send nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


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

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, indexed by rank, on every rank."""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self._world)]
        dist.all_gather(sizes, n, group=self.group)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths + [1])
        outs = [torch.zeros(longest, dtype=torch.uint8, device=self.device) for _ in range(self._world)]
        dist.all_gather(outs, self._tensor(data, longest), group=self.group)
        return [bytes(o[:k].cpu().numpy().tobytes()) for o, k in zip(outs, lengths)]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Every rank's ``data`` on rank ``root`` (None elsewhere); empty data is not sent."""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self._world)] if self._rank == root else None
        dist.gather(n, sizes, dst=self._global(root), group=self.group)
        if self._rank != root:
            if data:
                dist.send(self._tensor(data, len(data)), dst=self._global(root), group=self.group)
            return None
        assert sizes is not None
        lengths = [int(s.item()) for s in sizes]
        bufs: dict[int, torch.Tensor] = {}
        works = []
        for r, k in enumerate(lengths):
            if r != root and k:
                bufs[r] = torch.empty(k, dtype=torch.uint8, device=self.device)
                works.append(dist.irecv(bufs[r], src=self._global(r), group=self.group))
        for w in works:
            w.wait()
        return [bytes(data) if r == root else
                (bytes(bufs[r].cpu().numpy().tobytes()) if r in bufs else b"") for r in range(self._world)]

    def scatter_bytes(self, items: Sequence[bytes] | None, root: int = 0) -> bytes:
        """``items[rank]`` of rank ``root`` on each rank: one broadcast when every rank gets the same
        bytes object, else each sent point to point."""
        same = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self._rank == root:
            assert items is not None and len(items) == self._world
            same.fill_(int(all(b is items[0] for b in items)))
        dist.broadcast(same, src=self._global(root), group=self.group)
        if int(same.item()):
            return self.broadcast_bytes(items[0] if items is not None else None, root)
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        lengths = None
        if self._rank == root:
            assert items is not None
            lengths = [torch.tensor([len(b)], dtype=torch.int64, device=self.device) for b in items]
        dist.scatter(n, lengths, src=self._global(root), group=self.group)
        if self._rank == root:
            assert items is not None
            works = [dist.isend(self._tensor(b, len(b)), dst=self._global(r), group=self.group)
                     for r, b in enumerate(items) if r != root and b]
            for w in works:
                w.wait()
            return bytes(items[root])
        size = int(n.item())
        if not size:
            return b""
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.recv(buf, src=self._global(root), group=self.group)
        return bytes(buf.cpu().numpy().tobytes())

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Rank ``root``'s ``data`` on every rank."""
        src = self._global(root)
        payload = data if self._rank == root and data is not None else b""
        n = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(n, src=src, group=self.group)
        size = int(n.item())
        buf = self._tensor(payload, max(size, 1))
        dist.broadcast(buf, src=src, group=self.group)
        return bytes(buf[:size].cpu().numpy().tobytes())

    def barrier(self) -> None:
        """Wait for every rank of the group."""
        dist.barrier(group=self.group)


def default_coordinator() -> TorchCoordinator | None:
    """The world's coordinator when torch.distributed is initialised, else None."""
    if dist.is_available() and dist.is_initialized():
        return TorchCoordinator()
    return None
