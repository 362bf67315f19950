"""Zarr v3 array metadata for a leaf, and opening it through TensorStore.

Each array leaf is one Zarr v3 array. Its regular chunk grid is the saving job's
shard grid (one stored object per shard), and the ``sharding_indexed`` codec
splits each object into inner chunks with crc32c on every inner chunk and on the
shard index, so readers on another mesh read only the inner chunks they need.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import tensorstore as ts

from xckpt.engine.storage import Location

#: Codec names a conforming xckpt writer may use inside ``sharding_indexed``.
COMPRESSIONS = ("none", "zstd")

_context: ts.Context | None = None


def context() -> ts.Context:
    """The TensorStore context shared by every xckpt open (no cache: data is read once)."""
    global _context
    if _context is None:
        _context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    return _context


def fill_value(storage_dtype: str) -> Any:
    """The Zarr v3 fill value xckpt uses for a storage dtype (zero)."""
    if storage_dtype == "bool":
        return False
    if storage_dtype.startswith("complex"):
        return [0.0, 0.0]
    if storage_dtype.startswith(("float", "bfloat")):
        return 0.0
    return 0


def zarr_metadata(shape: Sequence[int], storage_dtype: str, chunk_shape: Sequence[int],
                  inner_chunk_shape: Sequence[int], compression: str = "none") -> dict[str, Any]:
    """The ``zarr.json`` metadata of an xckpt array."""
    one_byte = storage_dtype in ("bool", "int8", "uint8")
    inner_codecs: list[dict[str, Any]] = [
        {"name": "bytes"} if one_byte else {"name": "bytes", "configuration": {"endian": "little"}}]
    if compression == "zstd":
        inner_codecs.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
    inner_codecs.append({"name": "crc32c"})
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [int(s) for s in shape],
        "data_type": storage_dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [int(c) for c in chunk_shape]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill_value(storage_dtype),
        "codecs": [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": [int(c) for c in inner_chunk_shape],
                "codecs": inner_codecs,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}],
                "index_location": "end",
            },
        }],
        "attributes": {},
    }


def spec(root: Location, path: str, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """TensorStore spec of the array stored at ``path`` under ``root``."""
    out: dict[str, Any] = {"driver": "zarr3", "kvstore": root.kvstore(path)}
    if metadata is not None:
        out["metadata"] = {k: v for k, v in metadata.items() if k not in ("zarr_format", "node_type")}
    return out


def open_for_write(root: Location, path: str, metadata: dict[str, Any]) -> ts.TensorStore:
    """Open an array for writing whole chunks without touching its ``zarr.json``."""
    out = spec(root, path, metadata)
    out["store_data_equal_to_fill_value"] = True
    return ts.open(out, open=True, assume_metadata=True, context=context()).result()


def create(root: Location, path: str, metadata: dict[str, Any]) -> None:
    """Write the array's ``zarr.json`` (done once, by the coordinating process)."""
    ts.open(spec(root, path, metadata), create=True, open=True, context=context()).result()


def index_nbytes(chunk_shape: Sequence[int], inner_chunk_shape: Sequence[int]) -> int:
    """Bytes of a shard index: an (offset, nbytes) pair of uint64 per inner chunk, then a crc32c."""
    return math.prod(c // i for c, i in zip(chunk_shape, inner_chunk_shape)) * 16 + 4
