"""Typed msgpack encoding of non-array values (never pickle).

Plain msgpack types map to themselves: nil, bool, int (signed or unsigned 64-bit),
float (64-bit), str, bin (bytes), array (list), map with str keys (dict).
Four extension types keep what msgpack alone would lose:

==== ======================= ==========================================
code Python                  payload (msgpack)
==== ======================= ==========================================
1    tuple                   array of encoded items
2    dict with non-str keys  array of ``[key, value]`` pairs, encoded
3    int beyond 64 bits      decimal str
4    complex                 array ``[real, imag]`` of floats
==== ======================= ==========================================
"""

from __future__ import annotations

from typing import Any

import msgpack

from xckpt.errors import UnsupportedError

EXT_TUPLE, EXT_DICT, EXT_BIGINT, EXT_COMPLEX = 1, 2, 3, 4
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1
#: Type names recorded in the manifest for value leaves.
VALUE_TYPES = ("none", "bool", "int", "float", "complex", "str", "bytes", "list", "tuple", "dict")


def value_type(value: Any) -> str:
    """The manifest type name of a storable value, or raise UnsupportedError."""
    if value is None:
        return "none"
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("complex", complex),
                      ("str", str), ("bytes", bytes), ("tuple", tuple), ("list", list), ("dict", dict)):
        if isinstance(value, typ):
            return name
    raise UnsupportedError(f"cannot store a value of type {type(value).__qualname__}",
                           code="value.unsupported")


def _default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return msgpack.ExtType(EXT_TUPLE, _pack(list(obj)))
    if isinstance(obj, complex):
        return msgpack.ExtType(EXT_COMPLEX, _pack([obj.real, obj.imag]))
    if isinstance(obj, int):
        return msgpack.ExtType(EXT_BIGINT, _pack(str(obj)))
    if isinstance(obj, dict):
        return msgpack.ExtType(EXT_DICT, _pack([[k, v] for k, v in obj.items()]))
    raise UnsupportedError(f"cannot store a value of type {type(obj).__qualname__}",
                           code="value.unsupported")


def _prepare(value: Any) -> Any:
    """Turn containers into forms msgpack's default hook will see."""
    if isinstance(value, bool) or value is None or isinstance(value, (float, str, bytes)):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _UINT_MAX else _default(value)
    if isinstance(value, complex):
        return _default(value)
    if isinstance(value, tuple):
        return msgpack.ExtType(EXT_TUPLE, _pack([_prepare(v) for v in value]))
    if isinstance(value, list):
        return [_prepare(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _prepare(v) for k, v in value.items()}
        return msgpack.ExtType(EXT_DICT, _pack([[_prepare(k), _prepare(v)] for k, v in value.items()]))
    return _default(value)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def _ext_hook(code: int, data: bytes) -> Any:
    inner = _unpack(data)
    if code == EXT_TUPLE:
        return tuple(inner)
    if code == EXT_DICT:
        return {_freeze(k): v for k, v in inner}
    if code == EXT_BIGINT:
        return int(inner)
    if code == EXT_COMPLEX:
        return complex(inner[0], inner[1])
    raise UnsupportedError(f"unknown msgpack extension type {code}", code="values.invalid")


def _freeze(key: Any) -> Any:
    return tuple(_freeze(k) for k in key) if isinstance(key, (list, tuple)) else key


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, strict_map_key=False,
                           use_list=True)


def encode(value: Any) -> bytes:
    """Encode a value tree (None, bool, int, float, complex, str, bytes, list, tuple, dict)."""
    value_type(value)
    return _pack(_prepare(value))


def decode(data: bytes) -> Any:
    """Decode bytes produced by :func:`encode`."""
    return _unpack(data)
