"""Staging accelerator tensors into pinned host memory for writing.

A synchronous save fetches each shard in turn: a pinned buffer from torch's caching
host allocator, a non-blocking device-to-host copy on a side stream, a wait for that
copy only. The core's save loop hands each staged buffer to TensorStore asynchronously
and then fetches the next shard, so the copy of one shard overlaps the writes of the
ones before it. Pinned bytes alive at once are bounded by the core's
``max_inflight_bytes`` plus one shard: a buffer is released (and reused by the
caching allocator) as soon as its write completes and the array is dropped.

An asynchronous save copies every CUDA shard at once, straight into buffers the core
keeps for the next save (:attr:`xckpt.registry.Shard.copy_into`): plain host memory of
exactly the shard's size, page-locked with ``cudaHostRegister`` (and unlocked when the
core frees it), so the caller waits for the device-to-host copies alone. The copies are
queued on the stream that was current when the save described the tensor, after the work
already queued there; waiting for them records one event per stream, after the last copy queued.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Callable

import numpy as np
import torch

from xckpt.errors import UnsupportedError
from xckpt.format.regions import Region
from xckpt.registry import Shard

from .tensors import cpu_to_numpy, from_numpy, logical_dtype

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


def pinned_buffer(nbytes: int) -> np.ndarray:
    """A uint8 host buffer of ``nbytes`` page-locked for CUDA copies: plain memory of exactly that size
    locked with ``cudaHostRegister`` (unlocked before it is freed), or where CUDA refuses to lock it,
    memory from torch's pinned allocator (which rounds sizes up to a power of two)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if not nbytes or not torch.cuda.is_available():
        return t.numpy()
    ptr = t.data_ptr()
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0:
        arr = t.numpy()
        # unlocked once the last array over the memory is gone: the object every view of it keeps alive is
        # the array's base (a tensor of its own, not ``t``); the finalizer keeps the memory until then
        weakref.finalize(arr.base if arr.base is not None else arr, _unregister, t.untyped_storage(), ptr)
        return arr
    del t
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def _unregister(storage: object, ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class _Queue:
    """What this process queued on one CUDA stream for asynchronous saves: copies counted as they are
    queued, and how many of them an event has been seen past (waiting on one event, recorded after
    every copy queued so far, waits for all of them: one event per wait that finds its copy unfinished,
    not one per copy)."""

    def __init__(self) -> None:
        self.queued = 0
        self.done = 0


_queues: dict[tuple[int, int], _Queue] = {}


def start_copy_to_host(t: torch.Tensor, stream: "torch.cuda.Stream", out: np.ndarray) -> Callable[[], None]:
    """Start copying CUDA tensor ``t`` into host array ``out`` (its shape, C order) on ``stream``, the
    caller's stream when it described ``t`` (also from a helper thread, whose own current stream is
    another), after the work already queued there; returns a function that waits for the copy."""
    dst = from_numpy(out, logical_dtype(t.dtype))
    # entering a stream context costs more than the copy's own call: only where the stream is another
    on_stream = contextlib.nullcontext() if torch.cuda.current_stream(t.device) == stream else torch.cuda.stream(stream)
    with on_stream:
        dst.copy_(t.detach(), non_blocking=True)
    key = (stream.device_index, stream.cuda_stream)
    with _lock:
        q = _queues.get(key)
        if q is None:
            q = _queues[key] = _Queue()
        q.queued += 1  # counted once queued: an event recorded after this is read comes after the copy
        number = q.queued
    return functools.partial(_wait_copy, stream, q, number)


def _wait_copy(stream: "torch.cuda.Stream", q: _Queue, number: int) -> None:
    """Wait until copy ``number`` of ``q`` (queued on ``stream``) is done."""
    with _lock:
        if q.done >= number:
            return
        upto = q.queued
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()
    with _lock:
        q.done = max(q.done, upto)


def tensor_shard(region: Region, t: torch.Tensor) -> Shard:
    """The shard of a save that tensor ``t`` holds: fetched as host numpy, and for a CUDA tensor also
    copied straight into an asynchronous save's page-locked buffers."""
    if t.device.type != "cuda":
        return Shard(region, lambda: to_host(t))
    return Shard(region, lambda: to_host(t),
                 copy_into=functools.partial(start_copy_to_host, t, torch.cuda.current_stream(t.device)),
                 host_buffer=pinned_buffer)
