"""Reading checkpoints written by Orbax, without jax: zarr v2 or v3, with or without OCDBT.

:func:`open_orbax` turns an Orbax checkpoint directory into a
:class:`~xckpt.reader.Checkpoint` whose manifest is built from Orbax's ``_METADATA``:

* the tree comes from each record's ``key_metadata`` (``key_type`` 1: sequence, 2: dict);
  tuples and namedtuples are recovered when the optional rich ``value_metadata_tree`` is there;
* ``jax.Array`` and ``np.ndarray`` records are array leaves; shape and dtype come from each
  array's own zarr metadata (``.zarray`` or ``zarr.json``, inside OCDBT when it is used);
* ``scalar`` records (0-d arrays) are value leaves read as Python scalars, as Orbax gives them;
* ``string`` records are value leaves read from ``_strings.json``;
* ``None``, ``Dict``, ``List``, ``Tuple`` and ``NamedTuple`` records are None and empty containers.

The array data is opened with TensorStore exactly as Orbax writes it. Every defect is a
specific :class:`~xckpt.errors.XckptError` naming the file and the leaf. Registering the
``orbax`` to ``xckpt`` converter (``xckpt convert --from orbax``) is done on import.
"""

from __future__ import annotations

import ast
import base64
import json
import keyword
import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts

from . import convert as convert_mod, dtypes, manifest as manifest_mod, naming, storage
from .errors import DataError, ManifestError, NotACheckpointError, UnsafePathError, UnsupportedError
from .manifest import ArrayEntry, Entry, Manifest, ValueEntry
from .reader import Checkpoint, translate
from .storage import Location
from .tree import Key, Node, key_str

STRINGS = "_strings.json"
OCDBT_MANIFEST = "manifest.ocdbt"
_KEY_SEQUENCE, _KEY_DICT = 1, 2
_ARRAY_TYPES = ("jax.Array", "np.ndarray")
_EMPTY_TYPES = {"Dict": "dict", "List": "list", "Tuple": "tuple", "NamedTuple": "namedtuple"}
#: Orbax records without data that xckpt reads as None (``placeholder`` is Orbax's ``...``).
_NONE_TYPES = ("None", "placeholder")
_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")
#: Bytes of OCDBT B-tree nodes kept in memory while reading (array data itself is not cached).
_OCDBT_CACHE_BYTES = 32 << 20


@dataclass
class _Record:
    """One entry of ``_METADATA``'s ``tree_metadata``."""

    key: Key
    name: str
    value_type: str
    skip: bool
    write_shape: list[int] | None


@dataclass
class _ArrayInfo:
    """What an array's zarr metadata says."""

    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    compression: str


class OrbaxCheckpoint(Checkpoint):
    """A checkpoint written by Orbax, opened for reading through the xckpt interface."""

    format = "orbax"

    def __init__(self, loc: Location, manifest: Manifest, *, zarr3: bool, ocdbt: bool,
                 strict_fill: bool) -> None:
        super().__init__(loc, manifest)
        self.zarr3 = zarr3
        self.ocdbt = ocdbt
        self.strict_fill = strict_fill
        #: The stored dtype of each scalar's 0-d array, by array name.
        self.scalar_dtypes: dict[str, str] = {}
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                                    "cache_pool#ocdbt": {"total_bytes_limit": _OCDBT_CACHE_BYTES}})

    def values(self) -> dict[int, Any]:
        """Value leaves by leaf index: scalars read from their 0-d arrays, strings, None."""
        if self._values is None:
            self._values = _read_values(self)
        return self._values

    def kvstore_spec(self, path: str = "") -> dict[str, Any]:
        """The kvstore spec of ``path`` (a directory) inside the checkpoint, through OCDBT if used."""
        if not self.ocdbt:
            return self.loc.kvstore(path)
        out: dict[str, Any] = {"driver": "ocdbt", "base": self.loc.kvstore(), "cache_pool": "cache_pool#ocdbt"}
        if path:
            out["path"] = path.rstrip("/") + "/"
        return out

    def array_spec(self, entry: ArrayEntry) -> dict[str, Any]:
        """The TensorStore spec that opens ``entry`` as Orbax wrote it (shape and dtype enforced)."""
        spec: dict[str, Any] = {"driver": "zarr3" if self.zarr3 else "zarr",
                                "kvstore": self.kvstore_spec(entry.path),
                                "dtype": entry.dtype,
                                "schema": {"domain": {"shape": list(entry.shape)}}}
        if self.strict_fill:
            spec["fill_missing_data_reads"] = False
        return spec

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """Start opening an array leaf (or the 0-d array of a scalar) for reading."""
        return ts.open(self.array_spec(entry), open=True, read=True, context=self._context)

    def metadata_file(self, name: str) -> str:
        """The display path of an array's zarr metadata file (inside OCDBT when it is used)."""
        meta = "zarr.json" if self.zarr3 else ".zarray"
        return str(self.loc.child(f"{name}/{meta}")) + (" (in OCDBT)" if self.ocdbt else "")


def open_orbax(path: Any) -> OrbaxCheckpoint:
    """Open the Orbax checkpoint at ``path`` (a directory holding ``_METADATA``) for reading."""
    loc = Location.of(path)
    meta_file = str(loc.child(naming.ORBAX_METADATA))
    raw = storage.read_bytes(loc, naming.ORBAX_METADATA)
    if raw is None:
        raise NotACheckpointError(f"{loc} holds no Orbax checkpoint (no {naming.ORBAX_METADATA})",
                                  code="orbax.missing", file=meta_file)
    meta = _parse_metadata(raw, meta_file)
    if storage.read_bytes(loc, naming.COMMIT, slice(0, 0)) is None:
        from .load import XckptWarning
        warnings.warn(f"{loc}: {naming.COMMIT} is missing; Orbax treats this checkpoint as unfinished",
                      XckptWarning, stacklevel=3)
    has_ocdbt = storage.read_bytes(loc, OCDBT_MANIFEST, slice(0, 0)) is not None
    if meta.get("use_ocdbt") is True and not has_ocdbt:
        raise DataError(f"_METADATA says use_ocdbt but {OCDBT_MANIFEST} is missing (an unfinished or "
                        "unmerged multi-process save?)", code="orbax.ocdbt_missing",
                        file=str(loc.child(OCDBT_MANIFEST)))
    zarr3 = meta.get("use_zarr3", False)
    if not isinstance(zarr3, bool):
        raise ManifestError(f"use_zarr3 is {zarr3!r}, not a boolean", code="orbax.invalid", file=meta_file)
    records = _records(meta, meta_file)
    root = _build_tree(records, meta_file)
    _apply_rich_types(root, meta.get("value_metadata_tree"))
    tree, ordered = _finish(root, ())
    producer = {"library": "orbax-checkpoint", "framework": "jax"}
    info = {"orbax": {"use_ocdbt": has_ocdbt, "use_zarr3": zarr3,
                      "store_array_data_equal_to_fill_value": bool(meta.get("store_array_data_equal_to_fill_value")),
                      "custom_metadata": meta.get("custom_metadata")}}
    placeholder = Manifest(tree=tree, leaves=[], producer=producer, metadata=info)
    ckpt = OrbaxCheckpoint(loc, placeholder, zarr3=zarr3, ocdbt=has_ocdbt,
                           strict_fill=bool(meta.get("store_array_data_equal_to_fill_value")))
    stored = [r for r in ordered if r.value_type in _ARRAY_TYPES + ("scalar",) and not r.skip]
    _check_names(stored, meta_file)
    arrays = _read_array_infos(ckpt, stored)
    shardings = _shardings(loc)
    leaves: list[Entry] = []
    for rec in ordered:
        leaves.append(_entry(ckpt, rec, arrays.get(rec.name), shardings.get(rec.name)))
    m = Manifest(tree=tree, leaves=leaves, producer=producer, metadata=info,
                 values={"path": naming.ORBAX_METADATA} if any(isinstance(e, ValueEntry) for e in leaves)
                 else None)
    manifest_mod.check_consistency(m, meta_file)
    for e in m.arrays():
        manifest_mod.check_shape(e, ckpt.metadata_file(e.path))
    ckpt.manifest = m
    return ckpt


def _parse_metadata(raw: bytes, file: str) -> dict[str, Any]:
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"_METADATA is not valid JSON: {exc}", code="orbax.invalid", file=file) from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise ManifestError("_METADATA is not an object with a tree_metadata object", code="orbax.invalid",
                            file=file)
    return meta


def _records(meta: dict[str, Any], file: str) -> list[_Record]:
    out = []
    for tree_key, rec in meta["tree_metadata"].items():
        if not isinstance(rec, dict) or not isinstance(rec.get("value_metadata"), dict):
            raise ManifestError(f"record {tree_key} has no value_metadata object", code="orbax.invalid",
                                file=file, leaf=tree_key)
        parts = _key_parts(tree_key, rec.get("key_metadata"), file)
        if not parts:
            raise UnsupportedError("a bare leaf at the root of the tree is not supported", file=file)
        key = tuple(int(k) if t == _KEY_SEQUENCE else k for k, t in parts)
        vm = rec["value_metadata"]
        value_type = vm.get("value_type")
        if not isinstance(value_type, str):
            raise ManifestError(f"value_type is {value_type!r}, not a string", code="orbax.invalid",
                                file=file, leaf=key_str(key))
        ws = vm.get("write_shape")
        out.append(_Record(key, ".".join(k for k, _ in parts), value_type, bool(vm.get("skip_deserialize")),
                           list(ws) if isinstance(ws, list) else None))
    return out


def _key_parts(tree_key: str, km: Any, file: str) -> list[tuple[str, int]]:
    """``[(key, key_type), ...]`` of a record; old files without key_metadata hold dict keys only."""
    if km is None:
        try:
            parsed = ast.literal_eval(tree_key)
        except (ValueError, SyntaxError) as exc:
            raise ManifestError(f"record key {tree_key!r} is not a tuple and has no key_metadata",
                                code="orbax.invalid", file=file) from exc
        if not isinstance(parsed, tuple):
            raise ManifestError(f"record key {tree_key!r} is not a tuple", code="orbax.invalid", file=file)
        return [(str(k), _KEY_DICT) for k in parsed]
    if not isinstance(km, list):
        raise ManifestError(f"key_metadata of {tree_key} is not a list", code="orbax.invalid", file=file,
                            leaf=tree_key)
    parts = []
    for k in km:
        if not isinstance(k, dict) or not isinstance(k.get("key"), str) or \
                k.get("key_type") not in (_KEY_SEQUENCE, _KEY_DICT):
            raise ManifestError(f"key_metadata entry {k!r} of {tree_key} needs a str key and key_type 1 or 2",
                                code="orbax.invalid", file=file, leaf=tree_key)
        if k["key_type"] == _KEY_SEQUENCE and not _INDEX.match(k["key"]):
            raise ManifestError(f"sequence key {k['key']!r} of {tree_key} is not an index",
                                code="orbax.invalid", file=file, leaf=tree_key)
        parts.append((k["key"], k["key_type"]))
    return parts


def _new_node() -> dict[str, Any]:
    return {"kind": None, "children": {}}


def _build_tree(records: list[_Record], file: str) -> dict[str, Any]:
    """Nest the records into containers, checking that each path is used one way only."""
    root = _new_node()
    for rec in records:
        node = root
        for depth, part in enumerate(rec.key):
            kind = "list" if isinstance(part, int) else "dict"
            where = key_str(rec.key[:depth])
            if node["kind"] is None:
                node["kind"] = kind
            elif node["kind"] != kind:
                raise ManifestError(f"{where} is used both as a {node['kind']} and as a {kind}",
                                    code="orbax.tree", file=file, leaf=key_str(rec.key))
            children = node["children"]
            if depth == len(rec.key) - 1:
                if part in children:
                    raise ManifestError("two records give this leaf, or it is also a container",
                                        code="orbax.tree", file=file, leaf=key_str(rec.key))
                children[part] = {"kind": "leaf", "record": rec}
            else:
                child = children.setdefault(part, _new_node())
                if child["kind"] == "leaf":
                    raise ManifestError(f"{key_str(rec.key[:depth + 1])} is both a leaf and a container",
                                        code="orbax.tree", file=file, leaf=key_str(rec.key))
                node = child
    if root["kind"] is None:
        root["kind"] = "dict"
    _check_sequences(root, (), file)
    return root


def _check_sequences(node: dict[str, Any], key: Key, file: str) -> None:
    if node["kind"] == "leaf":
        return
    if node["kind"] == "list" and sorted(node["children"]) != list(range(len(node["children"]))):
        raise ManifestError(f"sequence indices {sorted(node['children'])} are not 0..n-1",
                            code="orbax.tree", file=file, leaf=key_str(key))
    for k, child in node["children"].items():
        _check_sequences(child, key + (k,), file)


def _is_rich(obj: Any, category: str | None = None) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("clazz"), str) and \
        obj.get("category") in ((category,) if category else ("custom", "namedtuple"))


def _apply_rich_types(root: dict[str, Any], text: Any) -> None:
    """Mark tuples and namedtuples recorded in Orbax's optional rich ``value_metadata_tree``.

    Best effort: when that tree does not match the records, it is ignored (lists and dicts stay).
    """
    if not isinstance(text, str):
        return
    try:
        rich = json.loads(text)
        marks: list[tuple[dict[str, Any], dict[str, Any]]] = []
        _match_rich(root, rich, marks)
    except (ValueError, KeyError, TypeError, IndexError):
        return
    for node, change in marks:
        node.update(change)


def _valid_namedtuple(name: str, fields: list[Any]) -> bool:
    return all(isinstance(f, str) and f.isidentifier() and not keyword.iskeyword(f) and not f.startswith("_")
               for f in fields + [name]) and len(set(fields)) == len(fields)


def _match_rich(node: dict[str, Any], rich: Any, marks: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    if node["kind"] == "leaf":
        return
    children = node["children"]
    if _is_rich(rich, "namedtuple"):
        fields = [e["key"] for e in rich["entries"]]
        if node["kind"] != "dict" or set(fields) != set(children) or not _valid_namedtuple(rich["clazz"], fields):
            raise ValueError("namedtuple does not match")
        for e in rich["entries"]:
            _match_rich(children[e["key"]], e["value"], marks)
        marks.append((node, {"kind": "namedtuple", "name": rich["clazz"], "fields": fields}))
    elif _is_rich(rich, "custom") and rich["clazz"] == "tuple":
        if node["kind"] != "list" or len(rich["entries"]) != len(children):
            raise ValueError("tuple does not match")
        for i, sub in enumerate(rich["entries"]):
            _match_rich(children[i], sub, marks)
        marks.append((node, {"kind": "tuple"}))
    elif isinstance(rich, list) and node["kind"] == "list" and len(rich) == len(children):
        for i, sub in enumerate(rich):
            _match_rich(children[i], sub, marks)
    elif isinstance(rich, dict) and not _is_rich(rich) and node["kind"] == "dict" and set(rich) == set(children):
        for k, sub in rich.items():
            _match_rich(children[k], sub, marks)
    else:
        raise ValueError("structure does not match")


def _finish(node: dict[str, Any], key: Key) -> tuple[Node, list[_Record]]:
    """The JSON tree of xckpt and the data-bearing records in leaf order."""
    ordered: list[_Record] = []

    def walk(n: dict[str, Any], k: Key) -> Node:
        kind = n["kind"]
        if kind == "leaf":
            rec: _Record = n["record"]
            empty = _EMPTY_TYPES.get(rec.value_type) if rec.skip else None
            if empty == "namedtuple":
                return {"kind": "namedtuple", "name": "EmptyNamedTuple", "fields": [], "items": []}
            if empty is not None:
                return {"kind": empty, "items": []}
            ordered.append(rec)
            return {"kind": "leaf", "index": len(ordered) - 1}
        children = n["children"]
        if kind == "dict":
            return {"kind": "dict", "items": [[c, walk(children[c], k + (c,))] for c in children]}
        if kind == "namedtuple":
            return {"kind": "namedtuple", "name": n["name"], "fields": list(n["fields"]),
                    "items": [walk(children[f], k + (f,)) for f in n["fields"]]}
        return {"kind": kind, "items": [walk(children[i], k + (i,)) for i in range(len(children))]}

    return walk(node, key), ordered


def _check_names(records: list[_Record], file: str) -> None:
    """Array names must stay inside the checkpoint and be distinct, before any is read."""
    seen: dict[str, Key] = {}
    for rec in records:
        leaf = key_str(rec.key)
        naming.check_relative(rec.name, file=file, leaf=leaf)
        if "/" in rec.name or rec.name in naming.RESERVED:
            raise UnsafePathError(f"array name {rec.name!r} must be one plain name, not reserved",
                                  file=file, leaf=leaf)
        if rec.name in seen:
            raise ManifestError(f"leaves {key_str(seen[rec.name])!r} and {leaf!r} are both stored as "
                                f"{rec.name!r}", code="manifest.path_collision", file=file, leaf=leaf)
        seen[rec.name] = rec.key


def _read_array_infos(ckpt: OrbaxCheckpoint, records: list[_Record]) -> dict[str, _ArrayInfo]:
    """Read every array's zarr metadata concurrently."""
    if not records:
        return {}
    meta_name = "zarr.json" if ckpt.zarr3 else ".zarray"
    try:
        kv = ts.KvStore.open(ckpt.kvstore_spec(), context=ckpt._context).result()
    except Exception as exc:  # noqa: BLE001 - reported as a specific xckpt error
        raise DataError(f"cannot open the checkpoint's key-value store: {str(exc)[:400]}", code="orbax.ocdbt",
                        file=str(ckpt.loc.child(OCDBT_MANIFEST if ckpt.ocdbt else ""))) from exc
    pending = [(rec, kv.read(f"{rec.name}/{meta_name}")) for rec in records]
    out = {}
    for rec, fut in pending:
        file = ckpt.metadata_file(rec.name)
        try:
            res = fut.result()
        except Exception as exc:  # noqa: BLE001
            raise DataError(f"cannot read the array's metadata: {str(exc)[:400]}", code="array.metadata",
                            file=file, leaf=key_str(rec.key)) from exc
        if res.state != "value":
            raise DataError(f"array data named in _METADATA is missing (no {meta_name})",
                            code="array.metadata_missing", file=file, leaf=key_str(rec.key))
        out[rec.name] = _array_info(bytes(res.value), ckpt.zarr3, file, key_str(rec.key))
    return out


def _ints(v: Any, what: str, file: str, leaf: str, *, positive: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and
                                          x >= (1 if positive else 0) for x in v):
        raise ManifestError(f"{what} is {v!r}, not a list of {'positive' if positive else 'non-negative'} "
                            "integers", code="array.metadata", file=file, leaf=leaf)
    return tuple(v)


def _array_info(raw: bytes, zarr3: bool, file: str, leaf: str) -> _ArrayInfo:
    """Shape, logical dtype and chunking from ``.zarray`` (zarr v2) or ``zarr.json`` (zarr v3)."""
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"array metadata is not valid JSON: {exc}", code="array.metadata_json",
                            file=file, leaf=leaf) from exc
    if not isinstance(meta, dict):
        raise ManifestError("array metadata is not a JSON object", code="array.metadata", file=file, leaf=leaf)
    shape = _ints(meta.get("shape"), "shape", file, leaf)
    if zarr3:
        grid = meta.get("chunk_grid")
        chunk_raw = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) else None
        chunk = _ints(chunk_raw, "chunk_grid chunk_shape", file, leaf, positive=True)
        dtype = _zarr3_dtype(meta.get("data_type"), file, leaf)
        inner, compression = chunk, "none"
        codecs = meta.get("codecs") if isinstance(meta.get("codecs"), list) else []
        for c in codecs:
            if isinstance(c, dict) and c.get("name") == "sharding_indexed":
                conf = c.get("configuration", {})
                inner = _ints(conf.get("chunk_shape"), "sharding_indexed chunk_shape", file, leaf, positive=True)
                codecs = conf.get("codecs", [])
        names = [c.get("name") for c in codecs if isinstance(c, dict) and c.get("name") not in ("bytes", "crc32c")]
        compression = "+".join(str(n) for n in names) or "none"
    else:
        chunk = _ints(meta.get("chunks"), "chunks", file, leaf, positive=True)
        inner = chunk
        dtype = _zarr2_dtype(meta.get("dtype"), file, leaf)
        comp = meta.get("compressor")
        compression = str(comp.get("id")) if isinstance(comp, dict) else "none"
    if len(chunk) != len(shape) or len(inner) != len(shape):
        raise ManifestError(f"chunk shape {list(chunk)} / {list(inner)} and shape {list(shape)} differ in rank",
                            code="array.metadata", file=file, leaf=leaf)
    return _ArrayInfo(shape, dtype, chunk, inner, compression)


def _zarr2_dtype(v: Any, file: str, leaf: str) -> str:
    """The logical dtype of a zarr v2 ``dtype`` (``"<f4"``, ``"|b1"``, ``"bfloat16"``, ...)."""
    if isinstance(v, str):
        if v in dtypes.LOGICAL_DTYPES:  # TensorStore's names for types numpy lacks: bfloat16, float8_*
            return v
        try:
            dt = np.dtype(v)
        except TypeError:
            dt = None
        if dt is not None and dt.fields is None and dt.name in dtypes.LOGICAL_DTYPES:
            return dt.name
    raise UnsupportedError(f"zarr v2 dtype {v!r} is not supported", code="dtype.unsupported",
                           file=file, leaf=leaf)


def _zarr3_dtype(v: Any, file: str, leaf: str) -> str:
    """The logical dtype of a zarr v3 ``data_type`` (the names are the same)."""
    if isinstance(v, str) and v in dtypes.LOGICAL_DTYPES:
        return v
    raise UnsupportedError(f"zarr v3 data_type {v!r} is not supported", code="dtype.unsupported",
                           file=file, leaf=leaf)


def _scalar_type(dtype: str) -> str:
    kind = dtypes.numpy_dtype(dtype).kind
    return {"b": "bool", "i": "int", "u": "int", "c": "complex"}.get(kind, "float")


def _entry(ckpt: OrbaxCheckpoint, rec: _Record, info: _ArrayInfo | None,
           sharding: dict[str, Any] | None) -> Entry:
    if rec.value_type in _ARRAY_TYPES + ("scalar",) and not rec.skip:
        assert info is not None
        if rec.value_type == "scalar" and info.shape == ():
            ckpt.scalar_dtypes[rec.name] = info.dtype
            return ValueEntry(rec.key, _scalar_type(info.dtype), rec.name)
        detail: dict[str, Any] = {"framework": "jax", "source": "orbax", "value_type": rec.value_type}
        if rec.write_shape is not None:
            detail["write_shape"] = rec.write_shape
        detail.update(sharding or {})
        return ArrayEntry(rec.key, rec.name, info.shape, info.dtype, info.dtype, info.chunk_shape,
                          info.inner_chunk_shape, info.compression, detail)
    if rec.value_type == "string":
        return ValueEntry(rec.key, "str")
    if rec.value_type in _NONE_TYPES or rec.skip:
        if rec.value_type not in _NONE_TYPES:
            from .load import XckptWarning
            warnings.warn(f"{key_str(rec.key)}: Orbax {rec.value_type} record has no data "
                          "(skip_deserialize); it reads as None", XckptWarning, stacklevel=4)
        return ValueEntry(rec.key, "none")
    raise UnsupportedError(f"Orbax value_type {rec.value_type!r} (a custom TypeHandler?) is not supported",
                           code="orbax.unsupported", file=str(ckpt.loc.child(naming.ORBAX_METADATA)),
                           leaf=key_str(rec.key))


def _shardings(loc: Location) -> dict[str, dict[str, Any]]:
    """Mesh shape, axis names and per-dimension axes of each array, from Orbax's ``_sharding`` (best effort).

    Orbax ignores ``_sharding`` when restoring onto a target, so a damaged file is not an error here.
    """
    raw = storage.read_bytes(loc, naming.ORBAX_SHARDING)
    if raw is None:
        return {}
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(obj, dict):
        return out
    for k, v in obj.items():
        try:
            name = base64.urlsafe_b64decode(k + "=" * (-len(k) % 4)).decode()
            desc = json.loads(v)
            if desc.get("sharding_type") == "NamedSharding":
                spec = desc.get("partition_spec") or []
                dim_axes = [[] if p is None else ([p] if isinstance(p, str) else list(p)) for p in spec]
                out[name] = {"mesh_shape": list(desc["shape"]), "axis_names": list(desc["axis_names"]),
                             "dim_axes": dim_axes}
            elif isinstance(desc.get("sharding_type"), str):
                out[name] = {"orbax_sharding": desc["sharding_type"]}
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return out


def _read_values(ckpt: OrbaxCheckpoint) -> dict[int, Any]:
    """Every value leaf: 0-d arrays read concurrently as Python scalars, strings, None."""
    m = ckpt.manifest
    out: dict[int, Any] = {}
    scalars = []
    strings: dict[str, Any] | None = None
    for i, e in enumerate(m.leaves):
        if not isinstance(e, ValueEntry):
            continue
        if e.orbax_path:
            dtype = ckpt.scalar_dtypes[e.orbax_path]
            entry = ArrayEntry(e.key, e.orbax_path, (), dtype, dtype, (), ())
            scalars.append((i, e, entry, ckpt.open_array(entry)))
        elif e.type == "str":
            if strings is None:
                strings = _strings(ckpt.loc)
            out[i] = _string(ckpt.loc, strings, e)
        else:
            out[i] = None
    reads = []
    for i, e, entry, fut in scalars:
        try:
            reads.append((i, e, entry, fut.result().read()))
        except Exception as exc:  # noqa: BLE001
            raise translate(exc, entry, str(ckpt.loc.child(entry.path))) from exc
    for i, e, entry, fut in reads:
        try:
            value = np.asarray(fut.result())
        except Exception as exc:  # noqa: BLE001
            raise translate(exc, entry, str(ckpt.loc.child(entry.path))) from exc
        out[i] = {"bool": bool, "int": int, "float": float, "complex": complex}[e.type](value.item())
    return out


def _strings(loc: Location) -> dict[str, Any]:
    file = str(loc.child(STRINGS))
    raw = storage.read_bytes(loc, STRINGS)
    if raw is None:
        raise DataError(f"{STRINGS} is missing but _METADATA lists string leaves", code="orbax.strings_missing",
                        file=file)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{STRINGS} is not valid JSON: {exc}", code="orbax.strings_invalid",
                            file=file) from exc
    if not isinstance(obj, dict):
        raise ManifestError(f"{STRINGS} is not a JSON object", code="orbax.strings_invalid", file=file)
    return obj


def _string(loc: Location, strings: dict[str, Any], e: ValueEntry) -> str:
    name = ".".join(str(k) for k in e.key)
    file = str(loc.child(STRINGS))
    if name not in strings:
        raise DataError(f"string {name!r} is missing from {STRINGS}", code="orbax.strings_missing",
                        file=file, leaf=key_str(e.key))
    value = strings[name]
    if not isinstance(value, str):
        raise ManifestError(f"{STRINGS} holds {type(value).__name__} for {name!r}, not a string",
                            code="orbax.strings_invalid", file=file, leaf=key_str(e.key))
    return value


def orbax_to_xckpt(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Convert the Orbax checkpoint at ``src`` into an xckpt checkpoint at ``dst``, leaf by leaf."""
    convert_mod.copy_checkpoint(open_orbax(src), dst, overwrite=overwrite)


convert_mod.register_converter("orbax", "xckpt", orbax_to_xckpt)

__all__ = ["OrbaxCheckpoint", "open_orbax", "orbax_to_xckpt"]
