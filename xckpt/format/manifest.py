"""The manifest ``xckpt.json``: the single source of truth of a checkpoint.

Parsing is strict, in the spirit of safetensors: every field is checked against
the JSON Schema, then against each other (tree and leaves agree, paths stay
inside the checkpoint, shapes are sane) before anything else is trusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Union

import jsonschema

from xckpt.format import dtypes, names as naming
from xckpt.errors import ManifestError, ShapeError, UnsafePathError, VersionError, XckptError
from xckpt.engine.regions import grid_shape
from xckpt.format.tree import MAX_DEPTH, Key, Node, iter_nodes, key_str

FORMAT = "xckpt"
VERSION = "1.0"
SUPPORTED_VERSIONS = ("1.0",)
#: Largest number of elements (and of bytes) a leaf may declare: 2**53, JSON's exact-integer range.
MAX_ELEMENTS = 2**53
#: Largest number of chunk objects one array may declare.
MAX_CHUNKS = 2**24


@dataclass
class ArrayEntry:
    """An array leaf as the manifest records it."""

    key: Key
    path: str
    shape: tuple[int, ...]
    dtype: str
    storage_dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    compression: str = "none"
    sharding: dict[str, Any] | None = None

    kind = "array"

    @property
    def nbytes(self) -> int:
        """Logical bytes of the whole array."""
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    def to_json(self) -> dict[str, Any]:
        """The manifest form."""
        return {"key": list(self.key), "kind": "array", "path": self.path, "shape": list(self.shape),
                "dtype": self.dtype, "storage_dtype": self.storage_dtype,
                "chunk_shape": list(self.chunk_shape), "inner_chunk_shape": list(self.inner_chunk_shape),
                "compression": self.compression, "sharding": self.sharding}


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

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON object."""
        out: dict[str, Any] = {"format": FORMAT, "version": self.version, "producer": self.producer,
                               "tree": self.tree, "leaves": [e.to_json() for e in self.leaves]}
        if self.values is not None:
            out["values"] = self.values
        if self.metadata:
            out["metadata"] = self.metadata
        return out

    def dumps(self) -> bytes:
        """The manifest file's bytes."""
        return (json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n").encode()

    def arrays(self) -> list[ArrayEntry]:
        """The array leaves, in tree order."""
        return [e for e in self.leaves if isinstance(e, ArrayEntry)]

    def by_key(self) -> dict[Key, Entry]:
        """Leaves indexed by key."""
        return {e.key: e for e in self.leaves}


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The JSON Schema of manifest version 1.0."""
    text = resources.files("xckpt").joinpath("schema/manifest-1.0.json").read_text()
    return json.loads(text)


def parse(data: bytes, *, file: str = naming.MANIFEST) -> Manifest:
    """Parse and check manifest bytes; raise a specific XckptError on any defect."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"manifest is not valid JSON: {exc}", code="manifest.json", file=file) from exc
    except RecursionError:
        raise ManifestError("manifest nests too deeply to be parsed", code="manifest.json", file=file) from None
    if not isinstance(obj, dict):
        raise ManifestError("manifest is not a JSON object", code="manifest.schema", file=file)
    if obj.get("format") != FORMAT:
        raise ManifestError(f"format is {obj.get('format')!r}, expected 'xckpt'", code="manifest.format",
                            file=file)
    if obj.get("version") not in SUPPORTED_VERSIONS:
        raise VersionError(f"format version {obj.get('version')!r} is not supported "
                           f"(this reader supports {', '.join(SUPPORTED_VERSIONS)})", file=file)
    if _depth(obj.get("tree")) > MAX_DEPTH:
        raise ManifestError(f"tree nests deeper than {MAX_DEPTH} levels", code="manifest.tree", file=file)
    _check_schema(obj, file)
    leaves: list[Entry] = []
    for i, raw in enumerate(obj["leaves"]):
        key = tuple(raw["key"])
        if raw["kind"] == "array":
            leaves.append(_array_entry(raw, key, file))
        else:
            leaves.append(ValueEntry(key, raw["type"], raw.get("orbax_path")))
    m = Manifest(tree=obj["tree"], leaves=leaves, producer=obj["producer"], values=obj.get("values"),
                 metadata=obj.get("metadata", {}), version=obj["version"])
    check_consistency(m, file)
    return m


def _depth(node: Any) -> int:
    """Longest key of any node of a tree, computed without recursion (checked before the schema)."""
    deepest, stack = 0, [(node, 0)]
    while stack and deepest <= MAX_DEPTH:
        n, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(n, dict) and isinstance(n.get("items"), list):
            for item in n["items"]:
                pair = n.get("kind") == "dict" and isinstance(item, list) and len(item) == 2
                stack.append((item[1] if pair else item, d + 1))
    return deepest


def _check_schema(obj: dict[str, Any], file: str) -> None:
    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        err = _explain(max(errors, key=jsonschema.exceptions.relevance))
        where = "/".join(str(p) for p in err.absolute_path) or "<root>"
        leaf = None
        path = list(err.absolute_path)
        if len(path) >= 2 and path[0] == "leaves" and isinstance(path[1], int):
            raw_key = obj["leaves"][path[1]].get("key") if isinstance(obj["leaves"][path[1]], dict) else None
            leaf = key_str(tuple(raw_key)) if isinstance(raw_key, list) else None
        code = "shape.too_large" if any(_is_size_error(e) for e in errors) else "manifest.schema"
        raise (ShapeError if code == "shape.too_large" else ManifestError)(
            f"manifest does not match the schema at {where}: {err.message[:300]}",
            code=code, file=file, leaf=leaf)


def _explain(err: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """Below a oneOf, the error of the branch whose ``kind`` matched, for a useful message."""
    while err.context:
        branches: dict[Any, list[jsonschema.ValidationError]] = {}
        for e in err.context:
            branches.setdefault(e.relative_schema_path[0] if e.relative_schema_path else None, []).append(e)
        matching = [b for b in branches.values() if not any(list(e.relative_path) == ["kind"] for e in b)]
        pool = matching[0] if len(matching) == 1 else list(err.context)
        err = max(pool, key=jsonschema.exceptions.relevance)
    return err


def _is_size_error(err: jsonschema.ValidationError) -> bool:
    """Whether the error (or one below a oneOf) is a dimension above 2**53 - 1."""
    if err.validator == "maximum" and any(p in ("shape", "chunk_shape", "inner_chunk_shape")
                                          for p in err.absolute_path):
        return True
    return any(_is_size_error(e) for e in err.context or ())


def _array_entry(raw: dict[str, Any], key: Key, file: str) -> ArrayEntry:
    leaf = key_str(key)
    try:
        dtypes.numpy_dtype(raw["dtype"])
    except XckptError as exc:
        raise ManifestError(exc.message, code="dtype.unsupported", file=file, leaf=leaf) from None
    if raw["storage_dtype"] != dtypes.storage_name(raw["dtype"]):
        raise ManifestError(f"storage_dtype {raw['storage_dtype']!r} does not match dtype {raw['dtype']!r}",
                            code="dtype.mismatch", file=file, leaf=leaf)
    entry = ArrayEntry(key=key, path=raw["path"], shape=tuple(raw["shape"]), dtype=raw["dtype"],
                       storage_dtype=raw["storage_dtype"], chunk_shape=tuple(raw["chunk_shape"]),
                       inner_chunk_shape=tuple(raw["inner_chunk_shape"]), compression=raw["compression"],
                       sharding=raw.get("sharding"))
    check_shape(entry, file)
    return entry


def check_shape(e: ArrayEntry, file: str = naming.MANIFEST) -> None:
    """Sanity of an array entry's shape and chunking, before any byte is read or allocated."""
    leaf = key_str(e.key)
    rank = len(e.shape)
    if len(e.chunk_shape) != rank or len(e.inner_chunk_shape) != rank:
        raise ShapeError(f"shape {list(e.shape)}, chunk_shape {list(e.chunk_shape)} and inner_chunk_shape "
                         f"{list(e.inner_chunk_shape)} differ in rank", code="shape.rank", file=file, leaf=leaf)
    numel = math.prod(e.shape)
    if numel > MAX_ELEMENTS or numel * dtypes.itemsize(e.dtype) > MAX_ELEMENTS:
        raise ShapeError(f"shape {list(e.shape)} has {numel} elements, more than the format allows (2**53 bytes)",
                         code="shape.too_large", file=file, leaf=leaf)
    if any(c % i for c, i in zip(e.chunk_shape, e.inner_chunk_shape)):
        raise ShapeError(f"inner_chunk_shape {list(e.inner_chunk_shape)} does not divide chunk_shape "
                         f"{list(e.chunk_shape)}", code="shape.chunking", file=file, leaf=leaf)
    if math.prod(grid_shape(e.shape, e.chunk_shape)) > MAX_CHUNKS:
        raise ShapeError(f"chunk_shape {list(e.chunk_shape)} splits shape {list(e.shape)} into more than "
                         f"{MAX_CHUNKS} objects", code="shape.too_many_chunks", file=file, leaf=leaf)
    if math.prod(e.chunk_shape) * dtypes.itemsize(e.dtype) > MAX_ELEMENTS:
        raise ShapeError("chunk is too large", code="shape.too_large", file=file, leaf=leaf)


def check_consistency(m: Manifest, file: str = naming.MANIFEST) -> None:
    """Check that tree, leaves and paths agree with each other."""
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
    paths: dict[str, Key] = {}
    has_values = False
    for i, e in enumerate(m.leaves):
        if keys_in_tree[i] != e.key:
            raise ManifestError(f"leaf {i} has key {list(e.key)} but the tree puts {list(keys_in_tree[i])} there",
                                code="manifest.tree", file=file, leaf=key_str(e.key))
        if isinstance(e, ValueEntry):
            has_values = True
            if e.orbax_path is not None:
                _check_path(e.orbax_path, e.key, paths, file)
            continue
        _check_path(e.path, e.key, paths, file)
    if has_values and m.values is None:
        raise ManifestError("value leaves are listed but no values file is", code="manifest.values", file=file)


def _check_path(path: str, key: Key, paths: dict[str, Key], file: str) -> None:
    leaf = key_str(key)
    naming.check_relative(path, file=file, leaf=leaf)
    if "/" in path or path in naming.RESERVED:
        raise UnsafePathError(f"array path {path!r} must be one plain name, not reserved", file=file, leaf=leaf)
    if path in paths:
        raise ManifestError(f"path {path!r} is used by two leaves", code="manifest.path_collision",
                            file=file, leaf=leaf)
    paths[path] = key
