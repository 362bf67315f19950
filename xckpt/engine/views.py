"""Reading through TensorStore views: for Orbax's arrays, mapped (transformed) leaves, lazy conversions.

A source whose arrays are TensorStore views reads a request by reading the view's region
and copying it into the request's output; :func:`translate` turns TensorStore's error
texts into the validator's codes, naming the file and the leaf.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import tensorstore as ts

from xckpt.engine.read import ReadRequest
from xckpt.errors import DataError, IntegrityError, XckptError
from xckpt.format import dtypes
from xckpt.format.manifest import ArrayEntry
from xckpt.format.regions import Region
from xckpt.format.tree import key_str

#: Bytes of read results held at once.
MAX_INFLIGHT_BYTES = 256 << 20
#: A request copied straight into its output goes in pieces of about this many bytes (whole read chunks of
#: the stored array along its first dimension), so that TensorStore holds one piece's chunks at a time.
PIECE_BYTES = 64 << 20

#: About the bytes of one chunk of a :func:`read_view`.
VIEW_CHUNK_BYTES = 4 << 20

_context: ts.Context | None = None


def context() -> ts.Context:
    """The TensorStore context shared by reads of xckpt arrays (no cache: data is read once)."""
    global _context
    if _context is None:
        _context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    return _context


def _rows(view: Any, itemsize: int) -> list[tuple[int, int]]:
    """The pieces a copy of ``view`` goes in: ranges of its first dimension (in its own coordinates) of about
    :data:`PIECE_BYTES`, cut on its read chunks' boundaries where it has them."""
    lo, hi = view.domain[0].inclusive_min, view.domain[0].exclusive_max
    row = itemsize * int(np.prod(view.shape[1:], dtype=np.int64))
    rows = max(1, PIECE_BYTES // max(row, 1))
    chunk = view.chunk_layout.read_chunk.shape[0] if view.rank else None
    if chunk:
        rows = max(chunk, rows // chunk * chunk)
    out, at = [], lo
    while at < hi:
        end = min(hi, (at // rows + 1) * rows) if chunk else min(hi, at + rows)
        out.append((at, end))
        at = end
    return out


def _into(out: np.ndarray, view: Any) -> Iterator[Any] | None:
    """Start copying ``view`` straight into ``out`` (no copy of the region is made): the writes to wait for, in
    order; a large copy goes in pieces (:func:`_rows`), each started once the previous one is waited for, so that
    TensorStore holds one piece's chunks at a time. None when ``out`` cannot take it as it is (another shape or
    item size, a layout TensorStore cannot reference): then it is read whole, and copied."""
    src = view.dtype.numpy_dtype
    if tuple(out.shape) != tuple(view.shape) or src.itemsize != out.dtype.itemsize:
        return None
    target = out.view(src) if src != out.dtype else out
    try:
        if view.rank == 0 or out.nbytes <= 2 * PIECE_BYTES:
            return iter((ts.array(target, copy=False, write=True).write(view),))
        lo = view.domain[0].inclusive_min
        pieces = [(ts.array(target[a - lo:b - lo], copy=False, write=True), view[a:b])
                  for a, b in _rows(view, src.itemsize)]
    except (ValueError, TypeError):  # a layout TensorStore cannot reference
        return None
    return (into.write(part) for into, part in pieces)


def read_views(requests: Sequence[ReadRequest], open_view: Callable[[ArrayEntry], "ts.Future[ts.TensorStore]"],
               file: Callable[[ArrayEntry], str]) -> None:
    """Fill each request's output from the entry's TensorStore view, a bounded number of bytes at a time: copied
    into the output chunk by chunk where it can take the view as it is, else read whole and copied."""
    opened: dict[int, Any] = {}
    pending: deque[tuple[ReadRequest, Iterator[Any] | None, Any]] = deque()
    held = 0

    def finish(req: ReadRequest, writes: Iterator[Any] | None, read: Any) -> None:
        """Wait for the writes into ``req.out``, or for the ``read`` of the whole region and copy it."""
        try:
            if writes is not None:
                for w in writes:
                    w.result()
                return
            got = np.asarray(read.result())
        except Exception as exc:  # noqa: BLE001 - translated to a specific xckpt error
            raise translate(exc, req.entry, file(req.entry)) from exc
        if got.dtype != req.out.dtype:
            got = got.view(req.out.dtype)
        np.copyto(req.out, got.reshape(req.out.shape), casting="equiv")

    for req in requests:
        if req.region.is_empty():
            continue
        key = id(req.entry)
        try:
            if key not in opened:
                opened[key] = open_view(req.entry).result()
            view = opened[key][req.region.slices()]
            writes = _into(req.out, view)
            read = view.read() if writes is None else None
        except XckptError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise translate(exc, req.entry, file(req.entry)) from exc
        pending.append((req, writes, read))
        held += req.out.nbytes
        while held > MAX_INFLIGHT_BYTES and len(pending) > 1:
            done = pending.popleft()
            held -= done[0].out.nbytes
            finish(*done)
    for done in pending:
        finish(*done)


def translate(exc: BaseException, entry: ArrayEntry, file: str) -> XckptError:
    """Turn a TensorStore error about an array into a specific xckpt error (the validator's codes)."""
    leaf = key_str(entry.key)
    if isinstance(exc, XckptError):  # raised by a view's own code (a checked cast): it learns where
        return exc.at(file=file, leaf=leaf)
    text = str(exc)
    if "Error opening" in text:  # the array's metadata (zarr.json), before any chunk is read
        if "does not exist" in text or "NOT_FOUND" in text:
            return DataError(f"array metadata is missing: {text[:400]}", code="array.metadata_missing",
                             file=file, leaf=leaf)
        if "Invalid JSON" in text or "JSON" in text and "DATA_LOSS" in text:
            return DataError(f"array metadata is not valid JSON: {text[:400]}", code="array.metadata_json",
                             file=file, leaf=leaf)
        return DataError(f"array metadata does not match the manifest: {text[:400]}",
                         code="array.metadata_mismatch", file=file, leaf=leaf)
    if "Digest mismatch" in text or "checksum" in text.lower():
        return IntegrityError(f"crc32c mismatch: {text[:400]}", code="chunk.crc32c", file=file, leaf=leaf)
    if "is missing" in text or "NOT_FOUND" in text:
        return DataError(f"array data is missing: {text[:400]}", code="chunk.missing", file=file, leaf=leaf)
    if ("size of" in text or "DATA_LOSS" in text or "OUT_OF_RANGE" in text
            or "Error reading" in text and ("Not enough data" in text or "Truncated" in text)):  # a data file cut short
        return DataError(f"array data is truncated or corrupt: {text[:400]}", code="chunk.truncated",
                         file=file, leaf=leaf)
    if "FAILED_PRECONDITION" in text or "does not match" in text:
        return DataError(f"array metadata does not match the manifest: {text[:400]}",
                         code="array.metadata_mismatch", file=file, leaf=leaf)
    return DataError(f"cannot read array: {text[:400]}", code="array.read", file=file, leaf=leaf)


def view_chunk_shape(shape: tuple[int, ...], itemsize: int, target: int = VIEW_CHUNK_BYTES) -> tuple[int, ...]:
    """Chunks of about ``target`` bytes that are contiguous in the file: whole trailing dimensions and a
    slab of the first one that does not fit whole."""
    chunk = [max(1, s) for s in shape]
    for d in range(len(shape)):
        rest = math.prod(chunk[d + 1:]) * itemsize
        chunk[d] = max(1, min(chunk[d], target // max(1, rest)))
        if chunk[d] > 1 or rest <= target:
            break
    return tuple(chunk)


def read_view(entry: ArrayEntry, read: Callable[[Sequence[ReadRequest]], int]) -> "ts.Future[ts.TensorStore]":
    """A TensorStore view of an array leaf (its storage dtype) whose reads go through ``read`` (a source's
    :meth:`~xckpt.sources.base.Source.read`, for a format TensorStore cannot open), uncached, in chunks of
    :func:`view_chunk_shape`."""
    shape = tuple(entry.shape)

    def fill(domain: ts.IndexDomain, array: np.ndarray, params: Any) -> None:
        region = Region(tuple(int(x) for x in domain.origin), tuple(int(x) for x in domain.shape))
        read([ReadRequest(entry, region, array)])

    chunk = view_chunk_shape(shape, dtypes.itemsize(entry.dtype))
    view = ts.virtual_chunked(fill, dtype=ts.dtype(entry.storage_dtype), domain=ts.IndexDomain(shape=shape),
                              chunk_layout=ts.ChunkLayout(read_chunk_shape=chunk),
                              context=ts.Context({"cache_pool": {"total_bytes_limit": 0}}))
    promise, future = ts.Promise.new()
    promise.set_result(view)
    return future
