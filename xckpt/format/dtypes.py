"""Logical dtypes of xckpt and how each is stored in Zarr v3.

A logical dtype is what the manifest records and what a reader produces. The
storage dtype is the Zarr v3 ``data_type`` of the array on disk. They are equal
for every type except the float8 family and the sub-byte types (format 1.4: ``int4``,
``uint4``, ``int2``, ``uint2``, ``float4_e2m1fn``), stored as raw ``uint8`` bytes: one
element per byte, its bits in the low bits of the byte (as ``ml_dtypes`` holds them in
memory and TensorStore stores them), the high bits without meaning.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from xckpt.errors import UnsupportedError

_NATIVE = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)
_EXTENSION = {"bfloat16": ml_dtypes.bfloat16}
_FLOAT8 = {
    name: getattr(ml_dtypes, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu")
    if hasattr(ml_dtypes, name)
}

#: Types of fewer than 8 bits (format 1.4), one element per byte in memory (ml_dtypes) and on disk.
_SUBBYTE = {name: getattr(ml_dtypes, name) for name in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn")
            if hasattr(ml_dtypes, name)}
#: Logical dtypes stored as raw ``uint8`` bytes.
_RAW = {**_FLOAT8, **_SUBBYTE}

#: Every logical dtype name this version of the format defines.
LOGICAL_DTYPES: tuple[str, ...] = _NATIVE + tuple(_EXTENSION) + tuple(_FLOAT8) + tuple(_SUBBYTE)
#: The logical dtypes numpy defines itself (its casting table holds for them, not for ml_dtypes' types).
NATIVE_DTYPES: frozenset[str] = frozenset(_NATIVE)
#: The logical dtypes format 1.4 added (a checkpoint holding one says 1.4; an older manifest may not name one).
SUBBYTE_DTYPES: frozenset[str] = frozenset(_SUBBYTE)


#: The numpy dtype of each logical dtype name.
_NUMPY: dict[str, np.dtype] = {
    **{name: np.dtype(name) for name in _NATIVE},
    **{name: np.dtype(t) for name, t in _EXTENSION.items()},
    **{name: np.dtype(t) for name, t in _RAW.items()},
}
#: The logical name of each numpy dtype that has one (``np.dtype.name`` is slow, and asked for every leaf).
_LOGICAL: dict[np.dtype, str] = {dt: name for name, dt in _NUMPY.items()}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a logical dtype name."""
    dt = _NUMPY.get(name) if isinstance(name, str) else None
    if dt is None:
        raise UnsupportedError(f"unknown dtype {name!r}; supported: {', '.join(LOGICAL_DTYPES)}",
                               code="dtype.unsupported")
    return dt


def logical_name(dtype: object) -> str:
    """The logical dtype name of a numpy dtype (or anything ``np.dtype`` accepts)."""
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)  # type: ignore[call-overload]
    name = _LOGICAL.get(dt)
    if name is None:
        name = dt.name
        if name not in LOGICAL_DTYPES:
            raise UnsupportedError(f"dtype {dt} is not storable; supported: {', '.join(LOGICAL_DTYPES)}",
                                   code="dtype.unsupported")
    return name


def storage_name(name: str) -> str:
    """The Zarr v3 ``data_type`` used on disk for a logical dtype name."""
    numpy_dtype(name)
    return "uint8" if name in _RAW else name


def is_raw(name: str) -> bool:
    """Whether the logical dtype is stored as raw bytes of another dtype."""
    return name in _RAW


def low_bits(name: str) -> int | None:
    """The mask of the bits a sub-byte element occupies in its byte (``0x0F``, ``0x03``), None for other types."""
    if name not in _SUBBYTE:
        return None
    return 0x03 if name.endswith("2") else 0x0F


def canonical(raw: np.ndarray, name: str) -> np.ndarray:
    """``raw`` (a sub-byte array's uint8 bytes) with every high bit clear, as stored, each element keeping the
    value ml_dtypes gives it: itself when they all are clear (checked a band of 16 MiB at a time), else a copy.
    Other dtypes' bytes are returned as they are. ml_dtypes ignores an integer type's high bits, so they are
    masked off; a ``float4_e2m1fn`` byte with any of bits 3 to 7 set is negative (0x11 is -0.5), so its
    stored form is its magnitude's three bits with the sign bit (0x09)."""
    mask = low_bits(name)
    if mask is None or raw.size == 0:
        return raw
    flat = raw.reshape(-1) if raw.flags.c_contiguous else None
    bands = ((flat[i:i + (16 << 20)] for i in range(0, flat.size, 16 << 20)) if flat is not None else (raw,))
    if not any(np.bitwise_and(band, np.uint8(~mask & 0xFF)).any() for band in bands):
        return raw
    if name == "float4_e2m1fn":
        negative = np.bitwise_and(raw, np.uint8(0xF8)) != 0
        return np.bitwise_or(np.bitwise_and(raw, np.uint8(0x07)), negative.astype(np.uint8) << np.uint8(3))
    return np.bitwise_and(raw, np.uint8(mask))


def itemsize(name: str) -> int:
    """Bytes per element of a logical dtype."""
    return numpy_dtype(name).itemsize
