"""Hugging Face safetensors: strict parsing of headers and ``model.safetensors.index.json``.

A safetensors file is an 8-byte little-endian unsigned length ``N``, ``N`` bytes of UTF-8 JSON
(the header), then the data buffer. The header maps each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the buffer's start)
and may hold ``"__metadata__"``, an object of strings.

Every function here is pure (bytes in, checked values out) and, in the spirit of
:mod:`xckpt.format.manifest`, refuses anything the format does not allow with a specific
:class:`~xckpt.errors.XckptError` whose code is in the ``safetensors.*`` family, naming the
file and the tensor: the length is bounded (:data:`MAX_HEADER_BYTES`) and checked against the
file's size before the header is read; shapes are JSON integers only (``1.0`` is refused);
the tensors must tile the data buffer exactly (no overlap, no hole, nothing after the last);
a name may be given once.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NoReturn

from xckpt.errors import ManifestError, ShapeError, UnsafePathError, UnsupportedError, XckptError
from xckpt.format import dtypes
from xckpt.format.jsonobj import is_unicode

#: The file of a checkpoint in one file.
SINGLE_FILE = "model.safetensors"
#: The index of a sharded checkpoint (``{"metadata": {"total_size"}, "weight_map": {tensor: file}}``).
INDEX_FILE = "model.safetensors.index.json"
#: Bytes of the little-endian u64 that gives the header's length.
PREFIX_BYTES = 8
#: Largest header accepted (the limit the safetensors library itself sets).
MAX_HEADER_BYTES = 100_000_000
#: Largest ``model.safetensors.index.json`` accepted.
MAX_INDEX_BYTES = 100_000_000
#: Most dimensions a tensor may have (as an xckpt array).
MAX_RANK = 64
#: Largest number of elements, and of bytes, of one tensor: JSON's exact-integer range.
MAX_ELEMENTS = 2**53
#: The header member that holds free-form string metadata, not a tensor.
METADATA_KEY = "__metadata__"

#: safetensors dtype -> xckpt logical dtype, for every dtype both know. Sub-byte types
#: (``F4``, ``F6_E2M3``, ``F6_E3M2``) have no xckpt dtype and are refused (``safetensors.dtype``).
DTYPES: dict[str, str] = {st: name for st, name in {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}.items() if name in dtypes.LOGICAL_DTYPES}

_ENTRY_MEMBERS = ("dtype", "shape", "data_offsets")
#: safetensors dtype -> (the same name, as this table holds it; the xckpt dtype; bytes per element): a checked
#: entry shares these strings instead of keeping the header's copy of them, one per tensor.
_DTYPE_FACTS: dict[str, tuple[str, str, int]] = {st: (st, name, dtypes.itemsize(name)) for st, name in DTYPES.items()}
#: A JSON escape of a UTF-16 surrogate: the only way a header that is valid UTF-8 can hold a string that is not
#: valid Unicode (a lone surrogate). A header without one needs no name checked for it.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
#: The order the tiling check walks the tensors in: by their offsets.
_BY_OFFSETS = attrgetter("begin", "end")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors file, checked: its place in the data buffer and what it holds."""

    name: str
    #: The safetensors dtype (``BF16``).
    st_dtype: str
    #: The xckpt logical dtype (``bfloat16``).
    dtype: str
    shape: tuple[int, ...]
    #: Offsets of its bytes relative to the start of the data buffer, ``[begin, end)``.
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes it takes in the file."""
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A parsed, checked safetensors header."""

    #: Tensors by name, in the header's order.
    tensors: dict[str, TensorInfo]
    #: ``__metadata__`` (None when absent).
    metadata: dict[str, str] | None
    #: Where the data buffer starts in the file (``8 + N``).
    data_start: int
    #: Bytes of the data buffer: the sum of every tensor's bytes.
    buffer_size: int


def _fail(cls: type[XckptError], code: str, message: str, file: str, tensor: str | None = None) -> NoReturn:
    raise cls(message, code=code, file=file, leaf=tensor)


class _Repeated(Exception):
    """Raised by :func:`_unique` at the first JSON object that gives a member twice: the header is then parsed
    again with :func:`_objects`, which finds where (see :func:`_load_json`)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The ``object_pairs_hook`` of the first parse: an object, or :class:`_Repeated` when it gives a member twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Repeated
    return out


class _Duplicated(dict):  # type: ignore[type-arg]
    """A parsed JSON object that holds, itself or at some depth, a member given twice (``json`` would keep
    the last silently). ``path``: the member names leading to the object that repeats one (list levels
    left out), then the name repeated."""

    path: tuple[str, ...] = ()


def _duplicate_in(v: Any) -> tuple[str, ...] | None:
    """The path of a member given twice inside a parsed value (see :class:`_Duplicated`), None if there is none.
    Lists are searched without recursion: objects below them are already tagged by :func:`_objects`."""
    if isinstance(v, _Duplicated):
        return v.path
    if not isinstance(v, list):
        return None
    stack = [v]
    while stack:
        for x in stack.pop():
            if isinstance(x, _Duplicated):
                return x.path
            if isinstance(x, list):
                stack.append(x)
    return None


def _objects(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The ``object_pairs_hook``: an object, tagged (:class:`_Duplicated`) when it, or an object inside it,
    gives a member twice, so that the caller can tell which tensor the repeat belongs to."""
    out: dict[str, Any] = {}
    path: tuple[str, ...] | None = None
    for k, v in pairs:
        if path is None:
            if k in out:
                path = (k,)
            else:
                inner = _duplicate_in(v)
                if inner is not None:
                    path = (k,) + inner
        out[k] = v
    if path is None:
        return out
    tagged = _Duplicated(out)
    tagged.path = path
    return tagged


def _load_json(raw: bytes | bytearray, *, file: str, code: str, what: str) -> tuple[Any, tuple[str, ...] | None]:
    """Parse UTF-8 JSON; returns the value and the path of a member given twice in it (None when none is).

    The document is parsed once with :func:`_unique`, which only tells whether some object repeats a member
    (and stops there); only then is it parsed again with :func:`_objects`, which tags where. Both parses meet
    the same syntax errors in the same place (the hooks change no syntax), so the outcome is that of the
    second parse alone."""
    try:
        text = str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        _fail(ManifestError, code, f"{what} is not UTF-8: {exc}", file)
    try:
        try:
            return json.loads(text, object_pairs_hook=_unique), None
        except _Repeated:
            obj = json.loads(text, object_pairs_hook=_objects)
    except RecursionError:
        _fail(ManifestError, code, f"{what} nests too deeply to be parsed", file)
    except ValueError as exc:  # JSONDecodeError, and an integer beyond Python's 4300 digits
        _fail(ManifestError, code, f"{what} is not valid JSON: {str(exc)[:200]}", file)
    return obj, _duplicate_in(obj) if isinstance(obj, dict) else None


def header_length(prefix: bytes, file_size: int | None, *, file: str) -> int:
    """The header length ``N`` from a file's first 8 bytes, checked against :data:`MAX_HEADER_BYTES` and,
    when known, the file's size (``safetensors.header``), so that nothing is allocated for a lying length."""
    if len(prefix) != PREFIX_BYTES or (file_size is not None and file_size < PREFIX_BYTES):
        _fail(ManifestError, "safetensors.header",
              f"file has {file_size if file_size is not None else len(prefix)} bytes, fewer than the "
              f"{PREFIX_BYTES} of the header length", file)
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER_BYTES:
        _fail(ManifestError, "safetensors.header",
              f"header length {n} is more than the {MAX_HEADER_BYTES} bytes a header may have", file)
    if file_size is not None and PREFIX_BYTES + n > file_size:
        _fail(ManifestError, "safetensors.header",
              f"header length {n} goes beyond the end of the file ({file_size} bytes)", file)
    if n < 2:
        _fail(ManifestError, "safetensors.header", f"header length {n} is too short for a JSON object", file)
    return n


def _int(v: Any) -> bool:
    """A JSON integer (``1.0`` and ``true`` are not)."""
    return isinstance(v, int) and not isinstance(v, bool)


#: What :func:`_shape` found of a shape already checked in a header: the shape (one tuple shared by every tensor
#: of that shape), its elements, and its elements with empty dimensions counted as 1 (what any chunking may hold).
_ShapeFacts = tuple[tuple[int, ...], int, int]


def _shape(v: Any, itemsize: int, file: str, name: str, seen: dict[tuple[int, ...], _ShapeFacts]
           ) -> tuple[tuple[int, ...], int]:
    """The shape ``v`` of tensor ``name`` and its number of elements, checked: a list of at most
    :data:`MAX_RANK` JSON integers ``>= 0`` (not ``1.0``, not ``true``) of at most :data:`MAX_ELEMENTS` bytes
    (no dimension multiplied past it: a hostile header's 4000-digit dimensions are refused, not multiplied).
    ``seen`` keeps the facts of the shapes already checked in this header (found only once each element is
    known to be an integer: ``[1.0]`` never meets the facts of ``[1]``)."""
    if not isinstance(v, list):
        _fail(ShapeError, "safetensors.shape", f"shape is {json.dumps(v)[:60]}, not a list of integers", file, name)
    if all(type(d) is int for d in v):
        facts = seen.get(tuple(v))
        if facts is not None:
            bound = facts[2]
            if bound * itemsize > MAX_ELEMENTS:
                _fail(ShapeError, "safetensors.shape",
                      f"shape {v} has more than {MAX_ELEMENTS} bytes, more than xckpt reads", file, name)
            return facts[0], facts[1]
    if len(v) > MAX_RANK:
        _fail(ShapeError, "safetensors.shape", f"shape has {len(v)} dimensions, more than {MAX_RANK}", file, name)
    bound = 1  # elements, with empty dimensions counted as 1: what any chunking of it may hold
    for i, d in enumerate(v):
        if not _int(d) or d < 0:
            _fail(ShapeError, "safetensors.shape",
                  f"shape[{i}] is {json.dumps(d)[:40]}, not a non-negative integer", file, name)
        bound *= max(1, d)
        if bound * itemsize > MAX_ELEMENTS:
            _fail(ShapeError, "safetensors.shape",
                  f"shape {v} has more than {MAX_ELEMENTS} bytes, more than xckpt reads", file, name)
    shape = tuple(v)
    facts = seen[shape] = (shape, math.prod(shape), bound)
    return shape, facts[1]


def _entry(name: str, v: Any, buffer_size: int | None, file: str, seen: dict[tuple[int, ...], _ShapeFacts],
           check_name: bool = True) -> TensorInfo:
    """The entry ``v`` of tensor ``name``, checked (``check_name``: its Unicode too; ``seen``: see :func:`_shape`)."""
    if not name:
        _fail(ManifestError, "safetensors.header", "a tensor has an empty name", file)
    if check_name and not is_unicode(name):
        _fail(ManifestError, "safetensors.header", f"tensor name {name!r} is not valid Unicode", file)
    if not isinstance(v, dict):
        _fail(ManifestError, "safetensors.header", f"entry is {type(v).__name__}, not an object", file, name)
    if len(v) != len(_ENTRY_MEMBERS) or not all(k in v for k in _ENTRY_MEMBERS):
        missing = [k for k in _ENTRY_MEMBERS if k not in v]
        extra = [k for k in v if k not in _ENTRY_MEMBERS]
        _fail(ManifestError, "safetensors.header",
              f"entry must have exactly {list(_ENTRY_MEMBERS)}: missing {missing}, unknown {extra}", file, name)
    st = v["dtype"]
    facts = _DTYPE_FACTS.get(st) if isinstance(st, str) else None
    if facts is None:
        _fail(UnsupportedError, "safetensors.dtype",
              f"dtype {json.dumps(st)[:40]} is not one xckpt reads ({', '.join(DTYPES)})", file, name)
    st, dtype, itemsize = facts
    shape, numel = _shape(v["shape"], itemsize, file, name, seen)
    offs = v["data_offsets"]
    if not isinstance(offs, list) or len(offs) != 2 or not all(_int(o) and o >= 0 for o in offs):
        _fail(ManifestError, "safetensors.offsets",
              f"data_offsets is {json.dumps(offs)[:60]}, not two non-negative integers", file, name)
    begin, end = offs
    if begin > end:
        _fail(ManifestError, "safetensors.offsets", f"data_offsets [{begin}, {end}] ends before it begins",
              file, name)
    want = numel * itemsize
    if end - begin != want:
        _fail(ManifestError, "safetensors.offsets",
              f"data_offsets [{begin}, {end}] hold {end - begin} bytes, but shape {list(shape)} of {st} takes {want}",
              file, name)
    if buffer_size is not None and end > buffer_size:
        _fail(ManifestError, "safetensors.offsets",
              f"data_offsets [{begin}, {end}] go beyond the data buffer ({buffer_size} bytes)", file, name)
    return TensorInfo(name, st, dtype, shape, begin, end)


def parse_header(raw: bytes | bytearray, file_size: int | None, *, file: str) -> Header:
    """Parse and check the ``N`` header bytes of a safetensors file of ``file_size`` bytes.

    ``file_size`` None (an object store that does not tell sizes) skips the checks against the
    end of the file; the data buffer is then taken to end where the last tensor does, and a read
    beyond the object's end fails when it happens. Raises (codes): ``safetensors.header`` (not UTF-8,
    not JSON, not an object, a malformed entry or ``__metadata__``), ``safetensors.duplicate`` (a name
    given twice), ``safetensors.dtype``, ``safetensors.shape``, ``safetensors.offsets`` (out of the
    buffer, wrong size, overlapping, leaving a hole, not reaching the end of the file).
    """
    data_start = PREFIX_BYTES + len(raw)
    if file_size is not None and file_size < data_start:
        _fail(ManifestError, "safetensors.header", f"header of {len(raw)} bytes goes beyond the end of the file "
              f"({file_size} bytes)", file)
    if raw[:1] != b"{":
        _fail(ManifestError, "safetensors.header", "header does not start with '{'", file)
    obj, duplicate = _load_json(raw, file=file, code="safetensors.header", what="header")
    if not isinstance(obj, dict):
        _fail(ManifestError, "safetensors.header", f"header is a JSON {type(obj).__name__}, not an object", file)
    if duplicate is not None:  # a tensor named twice, or a member repeated inside one's entry: that tensor
        top = duplicate[0]
        where = METADATA_KEY if top == METADATA_KEY else f"the entry of {top!r}"
        _fail(ManifestError, "safetensors.duplicate",
              f"the name {top!r} is given twice" if len(duplicate) == 1 else
              f"member {duplicate[-1]!r} is given twice in {where}", file, None if top == METADATA_KEY else top)
    buffer_size = None if file_size is None else file_size - data_start
    metadata = obj.get(METADATA_KEY)
    if METADATA_KEY in obj and (not isinstance(metadata, dict) or not all(
            isinstance(v, str) and is_unicode(v) and is_unicode(k) for k, v in metadata.items())):
        _fail(ManifestError, "safetensors.header", f"{METADATA_KEY} is not an object of strings", file)
    # entries are checked in the header's order, the first wrong one raising its error; a name needs its own
    # Unicode check only where the header holds a surrogate escape, the one way valid UTF-8 holds a lone surrogate
    check_names = _SURROGATE_ESCAPE.search(raw) is not None
    seen: dict[tuple[int, ...], _ShapeFacts] = {}
    tensors = {name: _entry(name, v, buffer_size, file, seen, check_names)
               for name, v in obj.items() if name != METADATA_KEY}
    del obj, seen
    expected, previous = 0, None
    for t in sorted(tensors.values(), key=_BY_OFFSETS):
        if t.begin < expected:
            _fail(ManifestError, "safetensors.offsets", f"data_offsets [{t.begin}, {t.end}] overlap those of "
                  f"{previous.name!r} [{previous.begin}, {previous.end}]", file, t.name)  # type: ignore[union-attr]
        if t.begin > expected:
            _fail(ManifestError, "safetensors.offsets", f"bytes [{expected}, {t.begin}) of the data buffer before "
                  "this tensor belong to no tensor (a hole)", file, t.name)
        expected, previous = t.end, t
    if buffer_size is not None and expected != buffer_size:
        _fail(ManifestError, "safetensors.offsets", f"the tensors cover {expected} bytes of the data buffer, but it "
              f"has {buffer_size} (the file goes on after the last tensor)", file)
    return Header(tensors, metadata, data_start, expected)


def check_file_name(name: Any, *, file: str, tensor: str | None = None) -> str:
    """A shard file name from an index: a plain ``*.safetensors`` name inside the directory
    (``safetensors.index``; an absolute path, ``..`` or a subdirectory is refused)."""
    if not isinstance(name, str) or not is_unicode(name):
        _fail(ManifestError, "safetensors.index", f"weight_map gives {json.dumps(name)[:60]}, not a file name",
              file, tensor)
    if (not name or "/" in name or "\\" in name or "\x00" in name or name in (".", "..")
            or posixpath.normpath(name) != name or name.startswith(".")):
        _fail(UnsafePathError, "safetensors.index",
              f"weight_map names {name!r}, which is not a plain file name inside the directory", file, tensor)
    if not name.endswith(".safetensors"):
        _fail(ManifestError, "safetensors.index", f"weight_map names {name!r}, which is not a .safetensors file",
              file, tensor)
    return name


def parse_index(raw: bytes, *, file: str) -> dict[str, str]:
    """Parse ``model.safetensors.index.json``: its ``weight_map`` (tensor name -> file name), checked.

    Other members (``metadata``) are not used. Raises ``safetensors.index`` (not JSON, no
    ``weight_map`` object of strings, a file name that is not a plain ``*.safetensors`` name in the
    directory) or ``safetensors.duplicate`` (a tensor named twice).
    """
    obj, duplicate = _load_json(raw, file=file, code="safetensors.index", what="index")
    if not isinstance(obj, dict):
        _fail(ManifestError, "safetensors.index", f"index is a JSON {type(obj).__name__}, not an object", file)
    if duplicate is not None:  # only a name repeated in weight_map is a tensor's
        tensor = duplicate[1] if len(duplicate) == 2 and duplicate[0] == "weight_map" else None
        _fail(ManifestError, "safetensors.duplicate",
              f"weight_map lists the tensor {tensor!r} twice" if tensor is not None else
              f"index member {'.'.join(duplicate)!r} is given twice", file, tensor)
    wm = obj.get("weight_map")
    if not isinstance(wm, dict):
        _fail(ManifestError, "safetensors.index", "index has no weight_map object", file)
    out: dict[str, str] = {}
    for name, target in wm.items():
        if not name or not is_unicode(name):
            _fail(ManifestError, "safetensors.index", f"weight_map has the tensor name {name!r}", file)
        out[name] = check_file_name(target, file=file, tensor=name)
    return out
