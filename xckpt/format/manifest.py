"""The manifest ``xckpt.json``: the single source of truth of a checkpoint.

Parsing is strict, in the spirit of safetensors: one ``parse_*`` function per part of
the document checks every field (JSON integers only where the spec says integer, no
member the format does not define, bounds before any arithmetic), then the parts are
checked against each other (tree and leaves agree, paths stay inside the checkpoint,
segments tile their leaf) before anything else is trusted. The same rules are published
as a JSON Schema (``spec/manifest-1.4.schema.json``); the test suite holds the two to agreeing.
"""

from __future__ import annotations

import json
import keyword
import math
import re
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NoReturn, Union

from xckpt.format.regions import MAX_INNER, Region, check_tiling, grid_shape
from xckpt.errors import ManifestError, ShapeError, UnsafePathError, VersionError, XckptError, XckptWarning
from xckpt.format import dtypes, jsonobj, names
from xckpt.format.hashing import crowded
from xckpt.format.jsonobj import is_unicode
from xckpt.format.tree import MAX_DEPTH, Key, Node, iter_nodes, key_str
from xckpt.format.values import VALUE_TYPES

FORMAT = "xckpt"
#: The version this writer writes (:func:`version_for`: a later one only for a checkpoint a 1.2 reader cannot read).
VERSION = "1.2"
#: The version whose stored paths may nest in directories (a key component holding ``/``).
NESTED_VERSION = "1.3"
#: The version that added the sub-byte dtypes (:data:`xckpt.format.dtypes.SUBBYTE_DTYPES`).
SUBBYTE_VERSION = "1.4"
#: Versions this reader reads (1.1 added segmented arrays and the generation; 1.2 requires the
#: generation and tags every chunk object with its place, see :mod:`xckpt.format.shard`; 1.3 lets
#: a stored path nest, see :mod:`xckpt.format.names`; 1.4 adds the sub-byte dtypes).
SUPPORTED_VERSIONS = ("1.0", "1.1", "1.2", "1.3", "1.4")
#: A save's generation: 128 random bits, as lowercase hex.
GENERATION = re.compile(r"[0-9a-f]{32}")
#: Largest number of elements (and of bytes) a leaf may declare: 2**53, JSON's exact-integer range.
MAX_ELEMENTS = 2**53
#: Largest number of chunk objects one array may declare.
MAX_CHUNKS = 2**24
#: Most dimensions an array may have.
MAX_RANK = 64
#: A segment path: ASCII decimal digits (the schema's ``^[0-9]+$``).
_DECIMAL = re.compile(r"[0-9]+")
#: A JSON escape of a UTF-16 surrogate, the only way a JSON document can hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


@dataclass(frozen=True)
class StoredArray:
    """One regular Zarr array holding the box ``[offset, offset + shape)`` of a leaf."""

    path: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]

    @property
    def region(self) -> Region:
        """The box of the leaf it holds."""
        return Region(self.offset, self.shape)


@dataclass
class ArrayEntry:
    """An array leaf as the manifest records it.

    A leaf is one Zarr array at ``path`` with ``chunk_shape`` and ``inner_chunk_shape``, or
    (format 1.1) a Zarr group at ``path`` whose ``segments`` are arrays tiling the leaf.
    """

    key: Key
    path: str
    shape: tuple[int, ...]
    dtype: str
    storage_dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    compression: str = "none"
    sharding: dict[str, Any] | None = None
    segments: tuple[StoredArray, ...] | None = None

    kind = "array"

    @property
    def nbytes(self) -> int:
        """Logical bytes of the whole array."""
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    def arrays(self) -> tuple[StoredArray, ...]:
        """The Zarr arrays holding this leaf (one, or its segments), with paths from the checkpoint root."""
        return self._arrays

    @cached_property
    def _arrays(self) -> tuple[StoredArray, ...]:
        if self.segments is None:
            return (StoredArray(self.path, (0,) * len(self.shape), self.shape, self.chunk_shape,
                                self.inner_chunk_shape),)
        return tuple(StoredArray(f"{self.path}/{s.path}", s.offset, s.shape, s.chunk_shape, s.inner_chunk_shape)
                     for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        """The manifest form."""
        out: dict[str, Any] = {"key": list(self.key), "kind": "array", "path": self.path, "shape": list(self.shape),
                               "dtype": self.dtype, "storage_dtype": self.storage_dtype}
        if self.segments is None:
            out["chunk_shape"] = list(self.chunk_shape)
            out["inner_chunk_shape"] = list(self.inner_chunk_shape)
        else:
            out["segments"] = [{"path": s.path, "offset": list(s.offset), "shape": list(s.shape),
                                "chunk_shape": list(s.chunk_shape), "inner_chunk_shape": list(s.inner_chunk_shape)}
                               for s in self.segments]
        out["compression"] = self.compression
        out["sharding"] = self.sharding
        return out

    @cached_property
    def json_line(self) -> str:
        """The entry's line in the manifest file (encoded once: the entries of a reused plan are reused)."""
        return json.dumps(self.to_json(), separators=(",", ":"))


@dataclass
class ValueEntry:
    """A non-array leaf, whose value is in ``values.msgpack``."""

    key: Key
    type: str
    orbax_path: str | None = None

    kind = "value"

    def to_json(self) -> dict[str, Any]:
        """The manifest form."""
        out: dict[str, Any] = {"key": list(self.key), "kind": "value", "type": self.type}
        if self.orbax_path:
            out["orbax_path"] = self.orbax_path
        return out

    @property
    def json_line(self) -> str:
        """The entry's line in the manifest file."""
        return json.dumps(self.to_json(), separators=(",", ":"))


Entry = Union[ArrayEntry, ValueEntry]


@dataclass
class Manifest:
    """A parsed, checked manifest."""

    tree: Node
    leaves: list[Entry]
    producer: dict[str, Any]
    values: dict[str, Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    version: str = VERSION
    generation: str | None = None  # 32 hex digits naming this save (format 1.1; required from 1.2)

    @property
    def tag_generation(self) -> str | None:
        """The generation its chunk objects' place tags name (format 1.2 and later), else None."""
        return None if self.version in ("1.0", "1.1") else self.generation

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON object."""
        out = self._head()
        out["leaves"] = [e.to_json() for e in self.leaves]
        return {k: out[k] for k in ("format", "version", "generation", "producer", "tree", "leaves", "values",
                                    "metadata") if k in out}

    def _head(self) -> dict[str, Any]:
        """Every member but the leaves."""
        out: dict[str, Any] = {"format": FORMAT, "version": self.version}
        if self.generation is not None:
            out["generation"] = self.generation
        out.update(producer=self.producer, tree=self.tree)
        if self.values is not None:
            out["values"] = self.values
        if self.metadata:
            out["metadata"] = jsonobj.finite(self.metadata)  # strict JSON: a NaN metric as the string "NaN"
        return out

    def dumps(self) -> bytes:
        """The manifest file's bytes: compact JSON, one leaf per line."""
        head = self._head()
        leaves = ",\n  ".join(e.json_line for e in self.leaves)
        body = json.dumps(head, separators=(",", ":"), allow_nan=False)
        return (body[:-1] + ',\n "leaves": [\n  ' + leaves + "\n ]\n}\n").encode() if self.leaves else \
            (body[:-1] + ',"leaves":[]}\n').encode()

    def arrays(self) -> list[ArrayEntry]:
        """The array leaves, in tree order."""
        return [e for e in self.leaves if isinstance(e, ArrayEntry)]

    def by_key(self) -> dict[Key, Entry]:
        """Leaves indexed by key."""
        return {e.key: e for e in self.leaves}

    def stored_paths(self) -> list[tuple[str, Key]]:
        """Every stored path with its leaf's key: each array's directory and each value's Orbax mirror."""
        return [(e.path, e.key) if isinstance(e, ArrayEntry) else (e.orbax_path, e.key) for e in self.leaves
                if isinstance(e, ArrayEntry) or e.orbax_path]

    def owns(self, name: str, is_dir: bool) -> bool:
        """Whether ``name`` (relative to the checkpoint's root) is a file (or, ``is_dir``, a directory) a save of
        this manifest writes: a reserved file at the top, the Orbax marker and its directory, each array's (a
        segment's, a value's mirror's) directory and those it lies in, its ``zarr.json``, its chunk objects and
        the directories they lie in (``c/0``), a segmented leaf's directory and group ``zarr.json``."""
        homes, groups, between = self._homes
        if "/" not in name and not is_dir:
            return name in names.RESERVED
        if name == (names.ORBAX_MARKER_DIR if is_dir else names.ORBAX_MARKER):
            return True
        if is_dir and (name in homes or name in groups or name in between):
            return True
        head, _, last = name.rpartition("/")
        if not is_dir and last == "zarr.json" and (head in homes or head in groups):
            return True
        parts = name.split("/")  # a chunk object (or its directory): <home>/c/<i>/<j>...
        for at in range(1, len(parts)):
            if parts[at] == "c" and all(p.isdigit() for p in parts[at + 1:]) and "/".join(parts[:at]) in homes:
                return True
        return False

    @cached_property
    def _homes(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """The Zarr arrays' directories (segments and mirrors included), the segmented leaves' directories, and
        the directories a nested one lies in."""
        homes = {a.path for e in self.arrays() for a in e.arrays()} | {
            e.orbax_path for e in self.leaves if isinstance(e, ValueEntry) and e.orbax_path}
        groups = {e.path for e in self.arrays() if e.segments is not None}
        between = {p for h in homes | groups for p in names.parents(h)}
        return frozenset(homes), frozenset(groups), frozenset(between)

    def top_names(self) -> set[str]:
        """The names at the checkpoint's top level that belong to it: the reserved files, every array's
        directory and every value's Orbax mirror (the first part of one that nests); anything else there
        was put by hand."""
        return set(names.RESERVED) | {path.partition("/")[0] for path, _ in self.stored_paths()}


# -- parsing ------------------------------------------------------------------------------------


class _Parser:
    """Checks one manifest document; every failure names the member where it happened."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.leaf: str | None = None

    def fail(self, where: str, what: str, code: str = "manifest.schema") -> NoReturn:
        error = ShapeError if code.startswith("shape.") else ManifestError
        raise error(f"manifest does not match the schema at {where}: {what}", code=code, file=self.file,
                    leaf=self.leaf)

    def object(self, v: Any, where: str, required: tuple[str, ...], allowed: tuple[str, ...] | None) -> dict:
        if not isinstance(v, dict):
            self.fail(where, f"expected an object, got {_json_type(v)}")
        missing = [k for k in required if k not in v]
        if missing:
            self.fail(where, f"{missing[0]!r} is a required property")
        if allowed is not None:
            extra = [k for k in v if k not in allowed]
            if extra:
                self.fail(where, f"additional property {extra[0]!r} is not allowed")
        return v

    def string(self, v: Any, where: str, *, nonempty: bool = False) -> str:
        if not isinstance(v, str):
            self.fail(where, f"expected a string, got {_json_type(v)}")
        if nonempty and not v:
            self.fail(where, "expected a non-empty string")
        return self.text(v, where)

    def text(self, v: str, where: str) -> str:
        """A string that is valid Unicode (JSON's ``\\ud800`` escapes can make a lone surrogate)."""
        if not is_unicode(v):
            self.fail(where, "a string holds a lone surrogate (not valid UTF-8)", "manifest.unicode")
        return v

    def count(self, v: Any, where: str, *, minimum: int = 0, maximum: int = MAX_ELEMENTS - 1,
              too_large: str = "manifest.schema") -> int:
        """A JSON integer in ``[minimum, maximum]``; above ``maximum`` the code is ``too_large`` (only a
        dimension is a shape: ``shape.too_large``; any other count is a schema violation)."""
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(where, f"expected an integer, got {json.dumps(v)[:40]}")
        if v < minimum:
            self.fail(where, f"{v} is less than the minimum of {minimum}")
        if v > maximum:
            self.fail(where, f"{v} is greater than the maximum of {maximum}", too_large)
        return v

    def shape(self, v: Any, where: str, *, minimum: int = 0) -> tuple[int, ...]:
        if not isinstance(v, list):
            self.fail(where, "expected an array of integers")
        if len(v) > MAX_RANK:
            self.fail(where, f"more than {MAX_RANK} dimensions")
        if all(type(x) is int and minimum <= x < MAX_ELEMENTS for x in v):  # the usual case, in one pass
            return tuple(v)
        return tuple(self.count(x, f"{where}/{i}", minimum=minimum, too_large="shape.too_large")
                     for i, x in enumerate(v))

    def key_part(self, v: Any, where: str) -> str | int:
        if isinstance(v, str):
            return self.text(v, where)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        self.fail(where, "a key part is a string or an integer")

    def key(self, v: Any, where: str) -> Key:
        if not isinstance(v, list):
            self.fail(where, "expected an array of key parts")
        return tuple(self.key_part(x, f"{where}/{i}") for i, x in enumerate(v))

    def node(self, v: Any, where: str) -> None:
        stack = [(v, where)]
        while stack:
            n, at = stack.pop()
            self.object(n, at, ("kind",), None)
            kind = n["kind"]
            if kind == "dict":
                self.object(n, at, ("items",), ("kind", "items"))
                items = self.list_(n["items"], f"{at}/items")
                keys: set[tuple[type, str | int]] = set()
                for i, item in enumerate(items):
                    if not isinstance(item, list) or len(item) != 2:
                        self.fail(f"{at}/items/{i}", "a dict item is a [key, node] pair")
                    k = self.key_part(item[0], f"{at}/items/{i}/0")
                    if (type(k), k) in keys:
                        self.fail(f"{at}/items/{i}/0", f"key {k!r} is given twice in one dict", "manifest.tree")
                    keys.add((type(k), k))
                    stack.append((item[1], f"{at}/items/{i}/1"))
            elif kind in ("list", "tuple"):
                self.object(n, at, ("items",), ("kind", "items"))
                stack.extend((x, f"{at}/items/{i}") for i, x in enumerate(self.list_(n["items"], f"{at}/items")))
            elif kind == "namedtuple":
                self.object(n, at, ("name", "fields", "items"), ("kind", "name", "fields", "items"))
                self.identifier(n["name"], f"{at}/name")
                fields = self.list_(n["fields"], f"{at}/fields")
                for i, f in enumerate(fields):
                    self.identifier(f, f"{at}/fields/{i}")
                    if f.startswith("_") and f != f"_{i}":  # the only field names namedtuple(rename=True) makes
                        self.fail(f"{at}/fields/{i}", f"field {f!r} starts with '_' but is not '_{i}'",
                                  "manifest.tree")
                if len(set(fields)) != len(fields):
                    self.fail(f"{at}/fields", "a field is named twice", "manifest.tree")
                stack.extend((x, f"{at}/items/{i}") for i, x in enumerate(self.list_(n["items"], f"{at}/items")))
            elif kind == "leaf":
                self.object(n, at, ("index",), ("kind", "index"))
                self.count(n["index"], f"{at}/index", maximum=2**53 - 1)
            else:
                self.fail(f"{at}/kind", f"unknown node kind {kind!r}")

    def identifier(self, v: Any, where: str) -> str:
        """A namedtuple's name or field: a Python identifier that is not a keyword."""
        name = self.string(v, where)
        if not name.isidentifier() or keyword.iskeyword(name):
            self.fail(where, f"{name[:80]!r} is not a Python identifier", "manifest.tree")
        return name

    def list_(self, v: Any, where: str) -> list:
        if not isinstance(v, list):
            self.fail(where, f"expected an array, got {_json_type(v)}")
        return v

    def segment(self, v: Any, where: str) -> StoredArray:
        self.object(v, where, ("path", "offset", "shape", "chunk_shape", "inner_chunk_shape"),
                    ("path", "offset", "shape", "chunk_shape", "inner_chunk_shape"))
        return StoredArray(self.string(v["path"], f"{where}/path", nonempty=True),
                           self.shape(v["offset"], f"{where}/offset"), self.shape(v["shape"], f"{where}/shape"),
                           self.shape(v["chunk_shape"], f"{where}/chunk_shape", minimum=1),
                           self.shape(v["inner_chunk_shape"], f"{where}/inner_chunk_shape", minimum=1))

    def entry(self, raw: Any, where: str, version: str) -> Entry:
        self.leaf = None
        self.object(raw, where, ("key", "kind"), None)
        key = self.key(raw["key"], f"{where}/key")
        self.leaf = key_str(key)
        if raw["kind"] == "value":
            self.object(raw, where, ("type",), ("key", "kind", "type", "orbax_path"))
            if raw["type"] not in VALUE_TYPES:
                self.fail(f"{where}/type", f"{raw['type']!r} is not one of {list(VALUE_TYPES)}")
            orbax = None
            if "orbax_path" in raw:  # present: a non-empty string (null is not 'absent')
                orbax = self.string(raw["orbax_path"], f"{where}/orbax_path", nonempty=True)
            return ValueEntry(key, raw["type"], orbax)
        if raw["kind"] != "array":
            self.fail(f"{where}/kind", f"{raw['kind']!r} is neither 'array' nor 'value'")
        common = ("key", "kind", "path", "shape", "dtype", "storage_dtype", "compression", "sharding")
        segmented = version != "1.0" and "segments" in raw
        if segmented:
            self.object(raw, where, ("path", "shape", "dtype", "storage_dtype", "segments", "compression"),
                        common + ("segments",))
        else:
            self.object(raw, where, ("path", "shape", "dtype", "storage_dtype", "chunk_shape",
                                     "inner_chunk_shape", "compression"), common + ("chunk_shape", "inner_chunk_shape"))
        path = self.string(raw["path"], f"{where}/path", nonempty=True)
        shape = self.shape(raw["shape"], f"{where}/shape")
        dtype = self.string(raw["dtype"], f"{where}/dtype")
        storage_dtype = self.string(raw["storage_dtype"], f"{where}/storage_dtype")
        if raw["compression"] not in ("none", "zstd"):
            self.fail(f"{where}/compression", f"{raw['compression']!r} is not one of ['none', 'zstd']")
        sharding = raw.get("sharding")
        if sharding is not None and not isinstance(sharding, dict):
            self.fail(f"{where}/sharding", "expected an object or null")
        try:
            dtypes.numpy_dtype(dtype)
        except XckptError as exc:
            raise ManifestError(exc.message, code="dtype.unsupported", file=self.file, leaf=self.leaf) from None
        if dtype in dtypes.SUBBYTE_DTYPES and _before(version, SUBBYTE_VERSION):
            raise ManifestError(f"dtype {dtype!r} is not a dtype of format {version} (sub-byte dtypes are "
                                f"format {SUBBYTE_VERSION}'s)", code="dtype.unsupported", file=self.file,
                                leaf=self.leaf)
        if storage_dtype != dtypes.storage_name(dtype):
            raise ManifestError(f"storage_dtype {storage_dtype!r} does not match dtype {dtype!r}",
                                code="dtype.mismatch", file=self.file, leaf=self.leaf)
        if segmented:
            segs = self.list_(raw["segments"], f"{where}/segments")
            if not segs:
                self.fail(f"{where}/segments", "a segmented leaf has at least one segment")
            segments = tuple(self.segment(s, f"{where}/segments/{i}") for i, s in enumerate(segs))
            e = ArrayEntry(key, path, shape, dtype, storage_dtype, (), (), raw["compression"], sharding, segments)
        else:
            e = ArrayEntry(key, path, shape, dtype, storage_dtype,
                           self.shape(raw["chunk_shape"], f"{where}/chunk_shape", minimum=1),
                           self.shape(raw["inner_chunk_shape"], f"{where}/inner_chunk_shape", minimum=1),
                           raw["compression"], sharding)
        check_shape(e, self.file)
        return e


def _json_type(v: Any) -> str:
    """The JSON type of a parsed value, for messages (``null``, not Python's ``NoneType``)."""
    if v is None:
        return "null"
    for name, typ in (("a boolean", bool), ("an integer", int), ("a number", float), ("a string", str),
                      ("an array", list), ("an object", dict)):
        if isinstance(v, typ):
            return name
    return type(v).__name__


def _check_text(obj: Any, p: "_Parser", where: str) -> None:
    """Every string of a JSON document (keys included) is valid Unicode; walked without recursion."""
    stack = [(obj, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            p.text(v, at)
        elif isinstance(v, dict):
            for k, x in v.items():
                p.text(k, at)
                stack.append((x, f"{at}/{k}"))
        elif isinstance(v, list):
            stack.extend((x, f"{at}/{i}") for i, x in enumerate(v))


def parse(data: bytes, *, file: str = names.MANIFEST) -> Manifest:
    """Parse and check manifest bytes; raise a specific :class:`~xckpt.errors.XckptError` on any defect."""
    try:
        obj = jsonobj.loads_marking_constants(data.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, a number beyond 4300 digits, a member twice,
        # NaN or Infinity (not JSON)
        raise ManifestError(f"manifest is not valid JSON: {exc}", code="manifest.json", file=file) from None
    except RecursionError:
        raise ManifestError("manifest nests too deeply to be parsed", code="manifest.json", file=file) from None
    if not isinstance(obj, dict):
        raise ManifestError("manifest is not a JSON object", code="manifest.schema", file=file)
    constants = (b"NaN" in data or b"Infinity" in data) and jsonobj.has_constant(obj)  # (no walk without the words)
    if constants and jsonobj.has_constant({k: v for k, v in obj.items() if k != "metadata"}):
        raise ManifestError("manifest is not valid JSON: it holds NaN or Infinity (RFC 8259 has neither)",
                            code="manifest.json", file=file)
    if constants:  # in metadata only: xckpt before 1.2's strict writer put a NaN metric there
        warnings.warn(XckptWarning(f"{file}: metadata holds NaN or Infinity, which is not JSON (an older xckpt "
                                   "wrote it); read as the floats"), stacklevel=2)
    if obj.get("format") != FORMAT:
        raise ManifestError(f"format is {obj.get('format')!r}, expected 'xckpt'", code="manifest.format",
                            file=file)
    version = obj.get("version")
    if version not in SUPPORTED_VERSIONS:
        raise VersionError(f"format version {version!r} is not supported "
                           f"(this reader supports {', '.join(SUPPORTED_VERSIONS)})", file=file)
    if _depth(obj.get("tree")) > MAX_DEPTH:
        raise ManifestError(f"tree nests deeper than {MAX_DEPTH} levels", code="manifest.tree", file=file)
    p = _Parser(file)
    if _SURROGATE_ESCAPE.search(data):  # only a \\uD800-\\uDFFF escape can make a lone surrogate
        _check_text(obj, p, "<root>")
    required = ("format", "version", "producer", "tree", "leaves") + (() if version in ("1.0", "1.1") else
                                                                       ("generation",))
    p.object(obj, "<root>", required,
             ("format", "version", "producer", "tree", "leaves", "values", "metadata")
             + (() if version == "1.0" else ("generation",)))
    generation = None
    if "generation" in obj:  # present (required in 1.2): a string of 32 hex digits, never null
        generation = obj["generation"]
        if not isinstance(generation, str) or not GENERATION.fullmatch(generation):
            p.fail("generation", f"expected 32 lowercase hexadecimal digits, got {json.dumps(generation)[:60]}")
    producer = p.object(obj["producer"], "producer", ("library", "library_version"), None)
    for k in ("library", "library_version", "framework", "framework_version"):
        if k in producer:
            p.string(producer[k], f"producer/{k}")
    p.node(obj["tree"], "tree")
    leaves = [p.entry(raw, f"leaves/{i}", version) for i, raw in enumerate(p.list_(obj["leaves"], "leaves"))]
    p.leaf = None
    values = None
    if "values" in obj:  # present: an object (null is not 'absent')
        values = obj["values"]
        p.object(values, "values", ("path", "size", "crc32c"), ("path", "size", "crc32c"))
        if values["path"] != names.VALUES:
            p.fail("values/path", f"expected {names.VALUES!r}")
        p.count(values["size"], "values/size")
        p.count(values["crc32c"], "values/crc32c", maximum=2**32 - 1)
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        p.fail("metadata", "expected an object")
    m = Manifest(tree=obj["tree"], leaves=leaves, producer=producer, values=values, metadata=metadata,
                 version=version, generation=generation)
    check_consistency(m, file)
    return m


def _depth(node: Any) -> int:
    """Longest key of any node of a tree, computed without recursion (checked before anything else)."""
    deepest, stack = 0, [(node, 0)]
    while stack and deepest <= MAX_DEPTH:
        n, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(n, dict) and isinstance(n.get("items"), list):
            for item in n["items"]:
                pair = n.get("kind") == "dict" and isinstance(item, list) and len(item) == 2
                stack.append((item[1] if pair else item, d + 1))
    return deepest


def check_shape(e: ArrayEntry, file: str = names.MANIFEST) -> None:
    """Sanity of an array entry's shape and chunking, before any byte is read or allocated."""
    leaf = key_str(e.key)
    rank = len(e.shape)
    numel = math.prod(e.shape)
    if numel > MAX_ELEMENTS or numel * dtypes.itemsize(e.dtype) > MAX_ELEMENTS:
        raise ShapeError(f"shape {list(e.shape)} has {numel} elements, more than the format allows (2**53 bytes)",
                         code="shape.too_large", file=file, leaf=leaf)
    seen: set[str] = set()
    for a in e.arrays():
        if len(a.chunk_shape) != rank or len(a.inner_chunk_shape) != rank or len(a.offset) != rank \
                or len(a.shape) != rank:
            raise ShapeError(f"shape {list(e.shape)}, chunk_shape {list(a.chunk_shape)} and inner_chunk_shape "
                             f"{list(a.inner_chunk_shape)} differ in rank", code="shape.rank", file=file, leaf=leaf)
        if any(c % i for c, i in zip(a.chunk_shape, a.inner_chunk_shape)):
            raise ShapeError(f"inner_chunk_shape {list(a.inner_chunk_shape)} does not divide chunk_shape "
                             f"{list(a.chunk_shape)}", code="shape.chunking", file=file, leaf=leaf)
        if math.prod(grid_shape(a.shape, a.chunk_shape)) > MAX_CHUNKS:
            raise ShapeError(f"chunk_shape {list(a.chunk_shape)} splits shape {list(a.shape)} into more than "
                             f"{MAX_CHUNKS} objects", code="shape.too_many_chunks", file=file, leaf=leaf)
        if math.prod(grid_shape(a.chunk_shape, a.inner_chunk_shape)) > MAX_INNER:
            raise ShapeError(f"inner_chunk_shape {list(a.inner_chunk_shape)} splits chunk_shape {list(a.chunk_shape)} "
                             f"into more than {MAX_INNER} inner chunks", code="shape.too_many_chunks",
                             file=file, leaf=leaf)
        if math.prod(a.chunk_shape) * dtypes.itemsize(e.dtype) > MAX_ELEMENTS:
            raise ShapeError("chunk is too large", code="shape.too_large", file=file, leaf=leaf)
        if e.segments is not None:
            name = a.path[len(e.path) + 1:]
            if not _DECIMAL.fullmatch(name) or name in seen:  # ASCII digits only (str.isdigit takes '\u0660')
                raise UnsafePathError(f"segment path {name!r} must be a decimal number, once",
                                      file=file, leaf=leaf)
            seen.add(name)
            if not a.region.within(e.shape):
                raise ShapeError(f"segment {a.offset}+{a.shape} lies outside shape {list(e.shape)}",
                                 code="shape.segments", file=file, leaf=leaf)
    if e.segments is not None:
        why = check_tiling(e.shape, [a.region for a in e.arrays()])
        if why is not None:
            raise ShapeError(f"segments do not tile the leaf: {why}", code="shape.segments", file=file, leaf=leaf)


def check_consistency(m: Manifest, file: str = names.MANIFEST, *, bounded_paths: bool = True) -> None:
    """Check that tree, leaves and paths agree with each other; ``bounded_paths``: each path within what an
    xckpt writer stores (:func:`xckpt.format.names.check_relative`; not an Orbax checkpoint's names)."""
    keys_in_tree: dict[int, Key] = {}
    for key, node in iter_nodes(m.tree):
        if node["kind"] == "leaf":
            idx = node["index"]
            if idx in keys_in_tree or idx >= len(m.leaves):
                raise ManifestError(f"tree leaf index {idx} is duplicated or out of range",
                                    code="manifest.tree", file=file, leaf=key_str(key))
            keys_in_tree[idx] = key
        elif node["kind"] == "namedtuple" and len(node["fields"]) != len(node["items"]):
            raise ManifestError("namedtuple fields and items differ in length", code="manifest.tree",
                                file=file, leaf=key_str(key))
    if len(keys_in_tree) != len(m.leaves):
        raise ManifestError(f"tree names {len(keys_in_tree)} leaves but the manifest lists {len(m.leaves)}",
                            code="manifest.tree", file=file)
    many = crowded(keys_in_tree.values())
    if many is not None:  # every reader indexes the leaves by key
        raise ManifestError(f"{many[1]} leaf keys share one hash (as {key_str(many[0])[:60]!r} does): a crafted "
                            "manifest, which would take time quadratic in their number to read", code="manifest.tree",
                            file=file)
    paths: dict[str, Key] = {}
    has_values = False
    for i, e in enumerate(m.leaves):
        if keys_in_tree[i] != e.key:
            raise ManifestError(f"leaf {i} has key {list(e.key)} but the tree puts {list(keys_in_tree[i])} there",
                                code="manifest.tree", file=file, leaf=key_str(e.key))
        if isinstance(e, ValueEntry):
            has_values = True
            if e.orbax_path is not None:
                _check_path(e.orbax_path, e.key, paths, m.version, file, bounded_paths)
            continue
        _check_path(e.path, e.key, paths, m.version, file, bounded_paths)
    if has_values and m.values is None:
        raise ManifestError("value leaves are listed but no values file is", code="manifest.values", file=file)
    clash = names.nesting(m.stored_paths()) if any("/" in p for p in paths) else None
    if clash is not None:
        raise ManifestError(f"path {clash[2]!r} lies in the directory of leaf {key_str(clash[0])!r}'s path",
                            code="manifest.path_collision", file=file, leaf=key_str(clash[1]))


def _before(version: str, other: str) -> bool:
    """Whether format ``version`` came before ``other`` (both of :data:`SUPPORTED_VERSIONS`)."""
    return SUPPORTED_VERSIONS.index(version) < SUPPORTED_VERSIONS.index(other)


def version_for(leaves: list[Entry]) -> str:
    """The version a writer writes for these leaves: :data:`VERSION`; :data:`NESTED_VERSION` where a stored
    path nests (which a 1.2 reader refuses); :data:`SUBBYTE_VERSION` where an array has a sub-byte dtype (which
    a 1.3 reader refuses). Every checkpoint an older reader can read says the oldest version it reads."""
    if any(isinstance(e, ArrayEntry) and e.dtype in dtypes.SUBBYTE_DTYPES for e in leaves):
        return SUBBYTE_VERSION
    nested = any("/" in (e.path if isinstance(e, ArrayEntry) else e.orbax_path or "") for e in leaves)
    return NESTED_VERSION if nested else VERSION


def _check_path(path: str, key: Key, paths: dict[str, Key], version: str, file: str, bounded: bool = True) -> None:
    leaf = key_str(key)
    names.check_relative(path, file=file, leaf=leaf, bounded=bounded)
    parts = path.split("/")
    if len(parts) > 1 and version in ("1.0", "1.1", "1.2"):
        raise UnsafePathError(f"array path {path!r} must be one plain name in format {version} (paths nest from 1.3)",
                              file=file, leaf=leaf)
    if parts[0] in names.RESERVED:
        raise UnsafePathError(f"array path {path!r} is (or lies in) a reserved name", file=file, leaf=leaf)
    if path in paths:
        raise ManifestError(f"path {path!r} is used by two leaves", code="manifest.path_collision",
                            file=file, leaf=leaf)
    paths[path] = key

