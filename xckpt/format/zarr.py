"""The ``zarr.json`` of the Zarr v3 nodes a leaf is stored as.

Each array leaf is one Zarr v3 array (or, for a leaf saved with uneven nested shards,
a Zarr group of regular arrays, its segments). An array's regular chunk grid follows the
saving job's shards (one stored object per shard), and the ``sharding_indexed`` codec
splits each object into inner chunks with crc32c on every inner chunk and on the shard
index (see :mod:`xckpt.format.shard`), so readers on another mesh read only the inner
chunks they need. TensorStore and zarr-python read these arrays as they are.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np

from xckpt.format import dtypes
from xckpt.format.codecs import ZSTD_LEVEL
from xckpt.format.shard import Geometry

#: Codec names a conforming xckpt writer may use inside ``sharding_indexed``.
COMPRESSIONS = ("none", "zstd")
METADATA = "zarr.json"
#: Top-level members a zarr.json may have; anything else could change how the data is read.
_ZARR_KEYS = frozenset({"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                        "fill_value", "codecs", "attributes", "dimension_names", "storage_transformers"})


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
        inner_codecs.append({"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": False}})
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


def group_metadata(segments: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``zarr.json`` of a segmented leaf: a Zarr group naming where each segment array lies."""
    return {"zarr_format": 3, "node_type": "group", "attributes": {"xckpt_segments": list(segments)}}


def encode_metadata(meta: dict[str, Any]) -> bytes:
    """The bytes of a ``zarr.json`` (compact JSON)."""
    return json.dumps(meta, separators=(",", ":")).encode()


def chunk_key(index: Sequence[int]) -> str:
    """The object name of a chunk, relative to its array (default encoding, '/' separator)."""
    return "c/" + "/".join(str(i) for i in index) if len(index) else "c"


def geometry(storage_dtype: str, chunk_shape: Sequence[int], inner_chunk_shape: Sequence[int],
             compression: str) -> Geometry:
    """The object encoding of an array's chunks."""
    return Geometry(tuple(int(c) for c in chunk_shape), tuple(int(c) for c in inner_chunk_shape),
                    np.dtype(dtypes.numpy_dtype(storage_dtype)), compression)


def mismatch(meta: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why a ``zarr.json`` disagrees with the metadata the manifest implies (``expected``), or None."""
    for name in ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "fill_value", "codecs"):
        if _normal(meta.get(name)) != _normal(expected[name]):
            return f"zarr.json {name} is {meta.get(name)!r}, the manifest implies {expected[name]!r}"
    enc = meta.get("chunk_key_encoding")
    conf = enc.get("configuration", {}) if isinstance(enc, dict) else None
    if not (isinstance(enc, dict) and enc.get("name") == "default" and isinstance(conf, dict)
            and conf.get("separator", "/") == "/"):
        return f"chunk_key_encoding is {enc!r}, expected default with '/'"
    unknown = sorted(set(meta) - _ZARR_KEYS)
    if unknown or meta.get("storage_transformers", []) != []:
        return f"zarr.json has members the format does not allow: {unknown or ['storage_transformers']}"
    return None


def _normal(v: Any) -> Any:
    """Normalise JSON for comparison (TensorStore omits defaults such as index_location)."""
    if isinstance(v, dict):
        out = {k: _normal(x) for k, x in v.items()}
        if v.get("name") == "sharding_indexed" and isinstance(out.get("configuration"), dict):
            out["configuration"].setdefault("index_location", "end")
        return out
    if isinstance(v, list):
        return [_normal(x) for x in v]
    if isinstance(v, bool):
        return ("bool", v)  # False must not equal a fill value of 0
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    return v


def check_metadata(raw: bytes, expected: dict[str, Any]) -> str | None:
    """Why stored ``zarr.json`` bytes disagree with ``expected``, or None (exact bytes: no parsing)."""
    if raw == encode_metadata(expected):
        return None
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return f"zarr.json is not valid JSON: {exc}"
    if not isinstance(meta, dict):
        return "zarr.json is not a JSON object"
    return mismatch(meta, expected)
