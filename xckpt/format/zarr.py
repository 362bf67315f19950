"""The ``zarr.json`` of the Zarr v3 nodes a leaf is stored as.

Each array leaf is one Zarr v3 array (or, for a leaf saved with uneven nested shards,
a Zarr group of regular arrays, its segments). An array's regular chunk grid follows the
saving job's shards (one stored object per shard), and the ``sharding_indexed`` codec
splits each object into inner chunks with crc32c on every inner chunk and on the shard
index (see :mod:`xckpt.format.shard`), so readers on another mesh read only the inner
chunks they need. TensorStore and zarr-python read these arrays as they are.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Sequence

import numpy as np

from xckpt.format import dtypes
from xckpt.format.codecs import ZSTD_LEVEL
from xckpt.format.jsonobj import loads as json_loads
from xckpt.format.shard import Geometry

#: Codec names a conforming xckpt writer may use inside ``sharding_indexed``.
COMPRESSIONS = ("none", "zstd")
METADATA = "zarr.json"
#: Most bytes of a ``zarr.json`` a reader takes (one array's metadata is a few hundred bytes).
MAX_METADATA_BYTES = 1 << 20
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


def is_chunk_object(name: str) -> bool:
    """Whether an object name (relative to the checkpoint's root) is a chunk object's: its last parts are ``c``
    then only numbers (:func:`chunk_key`), as no ``zarr.json`` or other file a save writes is named."""
    parts = name.split("/")
    for at in range(len(parts) - 1, -1, -1):
        if parts[at] == "c":
            return True
        if not parts[at].isdigit():
            return False
    return False


def parse_chunk_key(name: str, grid: Sequence[int]) -> tuple[int, ...] | None:
    """The grid index a chunk object name (relative to its array) stands for: the inverse of
    :func:`chunk_key` within a grid of ``grid`` chunks per dimension; None for any other name (another
    spelling of a number, an index outside the grid, another rank)."""
    if not grid:
        return () if name == "c" else None
    parts = name.split("/")
    if len(parts) != len(grid) + 1 or parts[0] != "c":
        return None
    index = []
    for part, n in zip(parts[1:], grid):
        if not part.isascii() or not part.isdigit() or (len(part) > 1 and part[0] == "0"):
            return None
        i = int(part)
        if i >= n:
            return None
        index.append(i)
    return tuple(index)


def geometry(storage_dtype: str, chunk_shape: Sequence[int], inner_chunk_shape: Sequence[int],
             compression: str) -> Geometry:
    """The object encoding of an array's chunks (one shared :class:`Geometry` per encoding, so what it
    derives is worked out once for every chunk of every array encoded alike)."""
    return _geometry(storage_dtype, tuple(int(c) for c in chunk_shape), tuple(int(c) for c in inner_chunk_shape),
                     compression)


@functools.lru_cache(maxsize=4096)
def _geometry(storage_dtype: str, chunk_shape: tuple[int, ...], inner_chunk_shape: tuple[int, ...],
              compression: str) -> Geometry:
    return Geometry(chunk_shape, inner_chunk_shape, np.dtype(dtypes.numpy_dtype(storage_dtype)), compression)


def mismatch(meta: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why a ``zarr.json`` disagrees with the metadata the manifest implies (``expected``), or None.

    Numbers compare by JSON type (``2.0`` is not the integer ``2``) except in the ``fill_value`` of a floating
    or complex type (``0`` equals ``0.0`` there, not for an integer type);
    members nested more than :data:`MAX_NESTING` deep never match (and are never walked further).
    """
    for name in ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "fill_value", "codecs"):
        # a floating (or complex) fill value of zero may be written 0 or 0.0; an integer type's is the
        # integer literal 0 (spec 4: integers are integer literals), so 0.0 differs from it
        numbers = name == "fill_value" and not isinstance(expected[name], int)
        if _normal(meta.get(name), numbers=numbers) != _normal(expected[name], numbers=numbers):
            return f"zarr.json {name} is {_brief(meta.get(name))}, the manifest implies {expected[name]!r}"
    enc = meta.get("chunk_key_encoding")
    conf = enc.get("configuration", {}) if isinstance(enc, dict) else None
    if not (isinstance(enc, dict) and enc.get("name") == "default" and isinstance(conf, dict)
            and conf.get("separator", "/") == "/" and set(enc) <= {"name", "configuration"}
            and set(conf) <= {"separator"}):
        return f"chunk_key_encoding is {_brief(enc)}, expected default with '/'"
    unknown = sorted(set(meta) - _ZARR_KEYS)
    if unknown or meta.get("storage_transformers", []) != []:
        return f"zarr.json has members the format does not allow: {_brief(unknown or ['storage_transformers'])}"
    return None


#: Deepest nesting of a ``zarr.json`` member compared with what the manifest implies (xckpt's own
#: metadata nests 5 deep).
MAX_NESTING = 16


class _Unequal:
    """Stands for JSON nested deeper than :data:`MAX_NESTING`: equal to nothing."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True


def _normal(v: Any, depth: int = 0, *, numbers: bool = False) -> Any:
    """Normalise JSON for comparison (TensorStore omits defaults such as index_location).

    Booleans, and floats unless ``numbers``, are tagged with their type, so that ``False`` does not
    equal a fill value of 0 nor ``2.0`` a dimension of 2; with ``numbers``, integral floats are ints.
    """
    if depth > MAX_NESTING:
        return _Unequal()
    if isinstance(v, dict):
        out = {k: _normal(x, depth + 1, numbers=numbers) for k, x in v.items()}
        if v.get("name") == "sharding_indexed" and isinstance(out.get("configuration"), dict):
            out["configuration"].setdefault("index_location", "end")
        return out
    if isinstance(v, list):
        return [_normal(x, depth + 1, numbers=numbers) for x in v]
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, float):
        if not numbers:
            return ("float", v)
        if math.isfinite(v) and v == int(v):
            return int(v)
    return v


def _brief(v: Any, limit: int = 160) -> str:
    """A short repr of untrusted JSON: bounded in depth and length (``repr`` recurses without bound)."""
    parts: list[str] = []
    size = [0]

    def put(text: str) -> None:
        parts.append(text)
        size[0] += len(text)

    def walk(x: Any, depth: int) -> None:
        if size[0] > limit:
            return
        if depth > 4 and isinstance(x, (dict, list)):
            put("...")
        elif isinstance(x, dict):
            put("{")
            for i, (k, y) in enumerate(x.items()):
                if size[0] > limit:
                    break
                put((", " if i else "") + repr(k)[:40] + ": ")
                walk(y, depth + 1)
            put("}")
        elif isinstance(x, list):
            put("[")
            for i, y in enumerate(x):
                if size[0] > limit:
                    break
                put(", " if i else "")
                walk(y, depth + 1)
            put("]")
        else:
            put(repr(x)[:60])

    walk(v, 0)
    text = "".join(parts)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_metadata(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """A ``zarr.json``'s object, or None and why it cannot be read: UTF-8 JSON (no BOM, every number
    within Python's 4300 digits, nesting within the interpreter's recursion limit, no ``NaN`` or
    ``Infinity``), an object, no member twice in one object."""
    try:
        meta = json_loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors, and
        # so are NaN / Infinity (not JSON) and a member given twice
        return None, f"zarr.json is not valid JSON: {exc}"
    if not isinstance(meta, dict):
        return None, "zarr.json is not a JSON object"
    return meta, None


@functools.lru_cache(maxsize=4096)
def array_json(shape: tuple[int, ...], storage_dtype: str, chunk_shape: tuple[int, ...],
               inner_chunk_shape: tuple[int, ...], compression: str) -> bytes:
    """The bytes of an array's ``zarr.json`` as xckpt writes it (:func:`zarr_metadata`, encoded once for
    every array alike: a model's many equal vectors share them)."""
    return encode_metadata(zarr_metadata(shape, storage_dtype, chunk_shape, inner_chunk_shape, compression))


#: The code of a ``zarr.json`` that is not a JSON object as the format reads it (:func:`parse_metadata`).
METADATA_JSON = "array.metadata_json"
#: The code of a ``zarr.json`` that is one but differs from what the manifest implies (:func:`mismatch`).
METADATA_MISMATCH = "array.metadata_mismatch"


def metadata_defect(raw: bytes, expected: dict[str, Any]) -> tuple[str, str] | None:
    """``(code, why)`` when stored ``zarr.json`` bytes disagree with ``expected``, else None: the code is
    :data:`METADATA_JSON` when :func:`parse_metadata` refuses the bytes, :data:`METADATA_MISMATCH` when
    :func:`mismatch` finds a difference (decided by which check failed, never by the message)."""
    if raw == encode_metadata(expected):
        return None
    meta, why = parse_metadata(raw)
    if meta is None:
        return METADATA_JSON, why or "zarr.json cannot be read"
    why = mismatch(meta, expected)
    return None if why is None else (METADATA_MISMATCH, why)


def check_metadata(raw: bytes, expected: dict[str, Any]) -> str | None:
    """Why stored ``zarr.json`` bytes disagree with ``expected``, or None (exact bytes: no parsing)."""
    defect = metadata_defect(raw, expected)
    return None if defect is None else defect[1]
