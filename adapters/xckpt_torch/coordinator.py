"""The xckpt coordinator of a torch.distributed job: msgpack bytes in uint8 tensors.

Only byte strings cross the wire (``all_gather`` of lengths, then of padded uint8
tensors); nothing is pickled, unlike ``all_gather_object``.
"""

from __future__ import annotations

from typing import Any

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

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Rank ``root``'s ``data`` on every rank."""
        src = root if self.group is None else dist.get_global_rank(self.group, root)
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
