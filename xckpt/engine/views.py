"""Reading through TensorStore views: for Orbax's arrays, mapped (transformed) leaves, lazy conversions.

A source whose arrays are TensorStore views reads a request by reading the view's region
and copying it into the request's output; :func:`translate` turns TensorStore's error
texts into the validator's codes, naming the file and the leaf.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import numpy as np
import tensorstore as ts

from xckpt.engine.read import ReadRequest
from xckpt.errors import DataError, IntegrityError, XckptError
from xckpt.format.manifest import ArrayEntry
from xckpt.format.tree import key_str

#: Bytes of read results held at once.
MAX_INFLIGHT_BYTES = 256 << 20

_context: ts.Context | None = None


def context() -> ts.Context:
    """The TensorStore context shared by reads of xckpt arrays (no cache: data is read once)."""
    global _context
    if _context is None:
        _context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    return _context


def read_views(requests: Sequence[ReadRequest], open_view: Callable[[ArrayEntry], "ts.Future[ts.TensorStore]"],
               file: Callable[[ArrayEntry], str]) -> None:
    """Fill each request's output from the entry's TensorStore view, a bounded number of bytes at a time."""
    opened: dict[int, Any] = {}
    pending: deque[tuple[ReadRequest, Any]] = deque()
    held = 0

    def finish(req: ReadRequest, fut: Any) -> None:
        try:
            got = np.asarray(fut.result())
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
            fut = opened[key][req.region.slices()].read()
        except XckptError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise translate(exc, req.entry, file(req.entry)) from exc
        pending.append((req, fut))
        held += req.out.nbytes
        while held > MAX_INFLIGHT_BYTES and len(pending) > 1:
            done = pending.popleft()
            held -= done[0].out.nbytes
            finish(*done)
    for done in pending:
        finish(*done)


def translate(exc: BaseException, entry: ArrayEntry, file: str) -> XckptError:
    """Turn a TensorStore error about an array into a specific xckpt error (the validator's codes)."""
    if isinstance(exc, XckptError):
        return exc
    text = str(exc)
    leaf = key_str(entry.key)
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
    if "size of" in text or "DATA_LOSS" in text or "OUT_OF_RANGE" in text:
        return DataError(f"array data is truncated or corrupt: {text[:400]}", code="chunk.truncated",
                         file=file, leaf=leaf)
    if "FAILED_PRECONDITION" in text or "does not match" in text:
        return DataError(f"array metadata does not match the manifest: {text[:400]}",
                         code="array.metadata_mismatch", file=file, leaf=leaf)
    return DataError(f"cannot read array: {text[:400]}", code="array.read", file=file, leaf=leaf)
