"""Staging accelerator tensors into pinned host memory for writing.

Each fetch allocates a pinned buffer from torch's caching host allocator, issues a
non-blocking device-to-host copy on a side stream and waits only for that copy.
The core's save loop hands each staged buffer to TensorStore asynchronously and
then fetches the next shard, so the copy of one shard overlaps the writes of the
ones before it. Pinned bytes alive at once are bounded by the core's
``max_inflight_bytes`` plus one shard: a buffer is released (and reused by the
caching allocator) as soon as its write completes and the array is dropped.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from xckpt.errors import UnsupportedError

from .tensors import cpu_to_numpy

_streams: dict[int, "torch.cuda.Stream"] = {}
_lock = threading.Lock()


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            _streams[index] = stream
    return stream


def stage_to_host(t: torch.Tensor) -> np.ndarray:
    """Copy an accelerator tensor into a pinned host buffer; return it as numpy (the buffer lives on)."""
    t = t.detach()
    if t.device.type != "cuda":
        return cpu_to_numpy(t.to("cpu"))
    buf = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu", pin_memory=True)
    stream = _side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        buf.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    # The source must not be reused by the allocator until the side-stream copy finished.
    t.record_stream(stream)
    done.synchronize()
    return cpu_to_numpy(buf)


def to_host(t: torch.Tensor) -> np.ndarray:
    """The data of a tensor on any device as host numpy (zero-copy on CPU, staged on CUDA)."""
    if t.device.type == "cpu":
        return cpu_to_numpy(t)
    if t.device.type == "meta":
        raise UnsupportedError("a tensor on the meta device has no data to save", code="tensor.meta")
    return stage_to_host(t)
