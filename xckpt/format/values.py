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

Decoding trusts nothing: it never recurses on the C stack (each extension payload is unpacked by
its own top-level call, from an explicit work list), refuses a document whose containers nest
deeper than :data:`MAX_DEPTH` (as :func:`encode` does), map keys that are not strings, duplicate
keys, msgpack's timestamp type, a float stored as float 32 (the rules write float 64), a dict whose
keys are all strings stored as extension type 2 (the rules write a map) and
any payload that :func:`encode` would not have written (a tuple whose payload is not an array, a
bigint that is not the canonical decimal form of an int outside 64 bits, a complex that is not two
floats), each as a :class:`~xckpt.errors.ManifestError` with code ``values.invalid``.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import msgpack

from xckpt.errors import ManifestError, UnsupportedError
from xckpt.format.hashing import crowded

EXT_TUPLE, EXT_DICT, EXT_BIGINT, EXT_COMPLEX = 1, 2, 3, 4
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1
#: Deepest nesting of containers (list, tuple, dict) a value may have. Extension payloads may nest
#: two levels more (a file's top-level dict; a complex or big int innermost).
MAX_DEPTH = 64
#: Most decimal digits of an int beyond 64 bits (Python's own limit on int/str conversion).
MAX_DIGITS = 4300
_DECIMAL = re.compile(f"-?[0-9]{{1,{MAX_DIGITS}}}")
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
    if isinstance(value, bool) or value is None:
        return value
    if type(value) in (float, str, bytes):
        return value
    if isinstance(value, str):  # a subclass (a str enum, say) is stored as its plain value
        return str.__str__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, bytes):
        return bytes(memoryview(value))
    if isinstance(value, int):
        value = int.__index__(value)  # an IntEnum: its plain int
        return value if _INT_MIN <= value <= _UINT_MAX else _default(value)
    if isinstance(value, complex):
        return _default(value)
    if isinstance(value, tuple):
        return msgpack.ExtType(EXT_TUPLE, _pack([_prepare(v) for v in value]))
    if isinstance(value, list):
        return [_prepare(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {_prepare(k): _prepare(v) for k, v in value.items()}
        return msgpack.ExtType(EXT_DICT, _pack([[_prepare(k), _prepare(v)] for k, v in value.items()]))
    return _default(value)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True)


def _depth(value: Any) -> int:
    """How deeply containers nest in ``value`` (0 for a scalar), without recursion; stops past MAX_DEPTH."""
    deepest, stack = 0, [(value, 0)]
    while stack and deepest <= MAX_DEPTH:
        v, d = stack.pop()
        if isinstance(v, (list, tuple)):
            deepest = max(deepest, d + 1)
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, dict):
            deepest = max(deepest, d + 1)
            stack.extend((x, d + 1) for kv in v.items() for x in kv)
    return deepest


def encode(value: Any) -> bytes:
    """Encode a value tree (None, bool, int, float, complex, str, bytes, list, tuple, dict)."""
    value_type(value)
    if _depth(value) > MAX_DEPTH:
        raise UnsupportedError(f"a value may nest containers at most {MAX_DEPTH} deep", code="value.unsupported")
    try:
        return _pack(_prepare(value))
    except (ValueError, TypeError) as exc:  # an int too long for its decimal form; a type msgpack refuses
        raise UnsupportedError(f"cannot store the value: {exc}", code="value.unsupported") from None


def check(value: Any) -> None:
    """Raise what :func:`encode` would raise for ``value`` (``value.unsupported``), before anything is written."""
    encode(value)


# -- decoding --------------------------------------------------------------------------------------


class _Ext:
    """An extension value whose payload is not decoded yet (decoding never nests unpack calls)."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: Any) -> None:
        self.code, self.data = code, data  # data: the payload's bytes, then its decoded value


class _Decoder:
    """Decodes one msgpack document of :func:`encode`'s rules; every defect is a ``values.invalid``."""

    def __init__(self, file: str | None) -> None:
        self.file = file

    def fail(self, what: str) -> NoReturn:
        raise ManifestError(f"values cannot be decoded: {what}", code="values.invalid", file=self.file)

    def flat(self, data: bytes, depth: int) -> Any:
        """One msgpack document, extension values left as :class:`_Ext` (their payloads undecoded)."""
        if depth > MAX_DEPTH + 2:
            self.fail(f"extension values nest deeper than {MAX_DEPTH + 2} levels")
        try:
            out = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True, ext_hook=_Ext,
                                  object_pairs_hook=self.map)
        except ManifestError:
            raise
        except (ValueError, TypeError) as exc:  # msgpack's errors (ExtraData, FormatError, StackError) included
            self.fail(f"not valid msgpack ({type(exc).__name__}{': ' if str(exc) else ''}{exc})")
        if _FLOAT32 in data:  # the byte may also be data (a str, an int); only a scan of the document can tell
            at = _float32_at(data)
            if at is not None:
                self.fail(f"a float is stored as msgpack float 32 (byte {at}); the encoding rules write float 64")
        return out

    def map(self, pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
        """A msgpack map: string keys, each once (dicts with other keys are extension type 2)."""
        if not all(type(k) is str for k, _ in pairs):
            self.fail("a map key is not a string")
        out = dict(pairs)
        if len(out) != len(pairs):
            self.fail("a map has a key twice")
        return out

    def decode(self, data: bytes) -> Any:
        """Decode ``data``: unpack, then resolve extension values children first."""
        root = [self.flat(data, 0)]
        # Pre-order walk: unpack each extension payload once (by a top-level call), remember where
        # every extension sits; resolving them in reverse order then resolves children first.
        found: list[tuple[Any, Any, _Ext]] = []  # (container, slot, extension)
        stack: list[tuple[Any, Any, Any, int]] = [(root, 0, root[0], 0)]
        while stack:
            parent, slot, v, depth = stack.pop()
            if isinstance(v, _Ext):
                if v.code not in (EXT_TUPLE, EXT_DICT, EXT_BIGINT, EXT_COMPLEX):
                    self.fail(f"unknown msgpack extension type {v.code}")
                inner = self.flat(v.data, depth + 1)
                v.data = inner
                found.append((parent, slot, v))
                stack.append((v, "data", inner, depth + 1))
            elif isinstance(v, list):
                stack.extend((v, i, x, depth) for i, x in enumerate(v))
            elif isinstance(v, dict):
                stack.extend((v, k, x, depth) for k, x in v.items())
            elif not (v is None or isinstance(v, (bool, int, float, str, bytes))):
                self.fail(f"a value of msgpack type {type(v).__name__} (only the types of the spec are allowed)")
        for parent, slot, ext in reversed(found):
            value = self.resolve(ext)
            if isinstance(parent, _Ext):
                parent.data = value
            else:
                parent[slot] = value
        if _depth(root[0]) > MAX_DEPTH:
            self.fail(f"containers nest deeper than {MAX_DEPTH} levels")
        return root[0]

    def resolve(self, ext: _Ext) -> Any:
        """The Python value of an extension whose payload (``ext.data``) is decoded and resolved."""
        inner = ext.data
        if ext.code == EXT_TUPLE:
            if not isinstance(inner, list):
                self.fail("a tuple's payload is not an array")
            return tuple(inner)
        if ext.code == EXT_DICT:
            if not isinstance(inner, list) or not all(isinstance(p, list) and len(p) == 2 for p in inner):
                self.fail("a dict's payload is not an array of [key, value] pairs")
            if all(type(k) is str for k, _ in inner):  # (an empty dict too) the rules write a plain map
                self.fail("a dict whose keys are all strings is stored as extension type 2; the encoding rules "
                          "write it as a msgpack map")
            try:
                keys = [self.key(k) for k, _ in inner]
                many = crowded(keys)
                if many is not None:
                    self.fail(f"{many[1]} keys of a dict share one hash (as {str(many[0])[:40]} does): a crafted "
                              "value, which would take time quadratic in their number to read")
                out = dict(zip(keys, (v for _, v in inner)))
            except TypeError as exc:
                self.fail(f"a dict key cannot be a key: {exc}")
            if len(out) != len(inner):
                self.fail("a dict has a key twice")
            return out
        if ext.code == EXT_BIGINT:
            if not isinstance(inner, str) or not _DECIMAL.fullmatch(inner):
                self.fail(f"a big int's payload is not a decimal string of at most {MAX_DIGITS} digits")
            n = int(inner)
            if str(n) != inner or _INT_MIN <= n <= _UINT_MAX:
                self.fail(f"big int payload {inner[:40]!r} is not the canonical form of an int beyond 64 bits")
            return n
        if not (isinstance(inner, list) and len(inner) == 2 and all(type(x) is float for x in inner)):
            self.fail("a complex's payload is not an array of two floats")
        return complex(inner[0], inner[1])

    def key(self, key: Any) -> Any:
        """A dict key: arrays become tuples (containers at most MAX_DEPTH deep)."""
        if not isinstance(key, (list, tuple)):
            return key
        if _depth(key) > MAX_DEPTH:
            self.fail(f"a dict key nests deeper than {MAX_DEPTH} levels")
        return _freeze(key)


_FLOAT32 = b"\xca"
#: Bytes after the type byte of each fixed-size msgpack format (ints, float 64, nil, bool, fixext
#: with its type byte), by type byte; 0xca (float 32) is the one looked for.
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4,
          0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
#: Length-prefixed formats: (bytes of the length, extra bytes after it: ext's type byte), by type byte.
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0),
          0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1)}
#: Container headers: bytes of the element count, by type byte (array 16/32, map 16/32).
_HEADER = {0xdc: 2, 0xdd: 4, 0xde: 2, 0xdf: 4}


def _float32_at(data: bytes) -> int | None:
    """Offset of the first msgpack float 32 in one document that msgpack decoded, else None.

    The document is well formed (it was just unpacked), so its objects are walked in order, one type
    byte after another, without recursion: containers' items follow their header, str, bin and ext
    payloads (decoded separately, as documents of their own) are skipped whole.
    """
    pos, n = 0, len(data)
    while pos < n:
        t = data[pos]
        if t == 0xca:
            return pos
        pos += 1
        if t <= 0x9f or t >= 0xe0:  # fixint, fixmap, fixarray: the type byte is all
            continue
        if t <= 0xbf:  # fixstr
            pos += t & 0x1f
        elif t in _FIXED:
            pos += _FIXED[t]
        elif t in _SIZED:
            width, extra = _SIZED[t]
            pos += width + extra + int.from_bytes(data[pos:pos + width], "big")
        else:
            pos += _HEADER.get(t, 0)
    return None


def _freeze(key: Any) -> Any:
    return tuple(_freeze(k) for k in key) if isinstance(key, (list, tuple)) else key


def decode(data: bytes, *, file: str | None = None) -> Any:
    """Decode bytes produced by :func:`encode`; a :class:`~xckpt.errors.ManifestError` (``values.invalid``,
    naming ``file``) for anything :func:`encode` would not have written."""
    return _Decoder(file).decode(data)
