"""The validator: does a directory conform to the xckpt 1.0 spec (``spec/xckpt-1.0.md``)?

Every finding has a stable code (listed in the spec) and names the file and leaf.
Without ``deep``, only metadata and shard indexes are read: every offset in every
shard index is checked against the object's size before it is trusted. With
``deep``, every inner chunk's crc32c is recomputed, one chunk at a time.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Any, Iterator

import google_crc32c
import numpy as np
import tensorstore as ts

from xckpt.format import zarr as arrays, dtypes, names as naming
from xckpt.engine import storage
from xckpt.errors import XckptError
from xckpt.format.manifest import ArrayEntry, Manifest, ValueEntry
from xckpt.interop.orbax import files as orbax_files
from xckpt.sources.native import read_manifest, read_values
from xckpt.engine.regions import grid_shape
from xckpt.engine.storage import Location
from xckpt.format.tree import key_str

_MISSING = 2**64 - 1
#: zarr data type of the 0-d array mirroring a value of each type, for Orbax.
_MIRROR_DTYPES = {"bool": "bool", "int": "int64", "float": "float64"}
#: Top-level members a zarr.json may have; anything else could change how the data is read.
_ZARR_KEYS = frozenset({"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                        "fill_value", "codecs", "attributes", "dimension_names", "storage_transformers"})


@dataclass
class Finding:
    """One problem found: a stable code, a message, and the file and leaf concerned."""

    code: str
    message: str
    file: str | None = None
    leaf: str | None = None
    severity: str = "error"

    def __str__(self) -> str:
        where = ", ".join(x for x in (f"leaf {self.leaf}" if self.leaf else "", self.file or "") if x)
        return f"{self.severity.upper()} {self.code}: {self.message}" + (f" [{where}]" if where else "")


@dataclass
class Report:
    """The outcome of a validation."""

    path: str
    deep: bool
    findings: list[Finding] = field(default_factory=list)
    arrays: int = 0
    chunks: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        """True when no finding is an error (warnings allowed)."""
        return not any(f.severity == "error" for f in self.findings)

    def codes(self) -> list[str]:
        """The codes of all findings, in order."""
        return [f.code for f in self.findings]

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form, for ``xckpt validate --json``."""
        return {"path": self.path, "ok": self.ok, "deep": self.deep, "arrays": self.arrays,
                "chunks": self.chunks, "bytes_checked": self.bytes_checked,
                "findings": [asdict(f) for f in self.findings]}


def validate(path: Any, deep: bool = False) -> Report:
    """Check a checkpoint against the spec; see :class:`Report`."""
    loc = Location.of(path)
    report = Report(str(loc), deep)
    add = report.findings.append
    try:
        m = read_manifest(loc)
    except XckptError as exc:
        add(Finding(exc.code, exc.message, exc.file, exc.leaf))
        return report
    if loc.is_local:
        _check_files(loc, m, report)
    if not storage.exists(loc, naming.COMMIT):
        add(Finding("commit.missing", f"{naming.COMMIT} is missing (Orbax will treat the checkpoint as unfinished)",
                    str(loc.child(naming.COMMIT)), severity="warning"))
    _check_names(loc, m, report)
    vals: dict[int, Any] | None = None
    try:
        vals = read_values(loc, m)
    except XckptError as exc:
        add(Finding(exc.code, exc.message, exc.file, exc.leaf))
    for e in m.arrays():
        report.arrays += 1
        _check_array(loc, e, deep, report)
    _check_orbax(loc, m, vals, report, deep)
    return report


def _check_files(loc: Location, m: Manifest, report: Report) -> None:
    """Plain files and directories only, all inside; warn about top-level names nothing refers to."""
    add = report.findings.append
    root = os.path.realpath(loc.local_path)
    for dirpath, dirnames, filenames in os.walk(loc.local_path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                add(Finding("path.link", f"symbolic link to {os.readlink(full)!r}; a checkpoint must hold plain "
                            "files only", full))
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                add(Finding("path.special", "not a regular file or directory", full))
            elif not os.path.realpath(full).startswith(root + os.sep):
                add(Finding("path.unsafe", "path resolves outside the checkpoint", full))
    known = set(naming.RESERVED) | {e.path for e in m.arrays()} | \
        {e.orbax_path for e in m.leaves if isinstance(e, ValueEntry) and e.orbax_path}
    for name in sorted(os.listdir(loc.local_path)):
        if name not in known:
            add(Finding("path.unexpected", "no leaf of the manifest refers to this name",
                        os.path.join(loc.local_path, name), severity="warning"))


def _check_names(loc: Location, m: Manifest, report: Report) -> None:
    """Array and mirror paths are the keys joined with '.'; Orbax names (strings too) are unique."""
    add = report.findings.append
    file = str(loc.child(naming.MANIFEST))
    seen: dict[str, str] = {}
    for e in m.leaves:
        stored = e.path if isinstance(e, ArrayEntry) else e.orbax_path
        if stored is None and not (isinstance(e, ValueEntry) and e.type == "str"):
            continue
        try:
            name = naming.storage_name(e.key)
        except XckptError as exc:
            add(Finding("manifest.path_name", f"the key cannot be stored under a name: {exc.message}", file,
                        key_str(e.key)))
            continue
        if stored is not None and stored != name:
            add(Finding("manifest.path_name", f"stored as {stored!r}, but the format names it {name!r} (its key "
                        "joined with '.'), the name Orbax looks for", file, key_str(e.key)))
        if name in seen:
            add(Finding("manifest.path_collision", f"leaves {seen[name]!r} and {key_str(e.key)!r} share the "
                        f"Orbax name {name!r}", file, key_str(e.key)))
        seen.setdefault(name, key_str(e.key))


def _expected_chunk_names(e: ArrayEntry) -> Iterator[tuple[tuple[int, ...], str]]:
    if any(s == 0 for s in e.shape):
        return
    if not e.shape:
        yield (), "c"
        return
    for idx in product(*(range(n) for n in grid_shape(e.shape, e.chunk_shape))):
        yield idx, "c/" + "/".join(str(i) for i in idx)


def _check_array(loc: Location, e: ArrayEntry, deep: bool, report: Report) -> None:
    add = report.findings.append
    leaf = key_str(e.key)
    meta_file = str(loc.child(e.path).child("zarr.json"))
    raw = storage.read_bytes(loc, e.path + "/zarr.json")
    if raw is None:
        add(Finding("array.metadata_missing", "zarr.json is missing", meta_file, leaf))
        return
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        add(Finding("array.metadata_json", f"zarr.json is not valid JSON: {exc}", meta_file, leaf))
        return
    if not isinstance(meta, dict):
        add(Finding("array.metadata_json", "zarr.json is not a JSON object", meta_file, leaf))
        return
    why = _metadata_mismatch(meta, e)
    if why is not None:
        add(Finding("array.metadata_mismatch", why, meta_file, leaf))
        return
    stored = set(storage.list_names(loc, e.path + "/"))
    stored.discard(e.path + "/zarr.json")
    for idx, name in _expected_chunk_names(e):
        full = e.path + "/" + name
        if full not in stored:
            add(Finding("chunk.missing", f"chunk {list(idx)} is missing", str(loc.child(full)), leaf))
            continue
        stored.discard(full)
        report.chunks += 1
        _check_shard(loc, full, e, idx, deep, report)
    for extra in sorted(stored):
        add(Finding("chunk.unexpected", "object is not a chunk of this array's grid", str(loc.child(extra)), leaf))


def _metadata_mismatch(meta: dict[str, Any], e: ArrayEntry) -> str | None:
    """Why ``zarr.json`` disagrees with what the manifest implies, or None."""
    expected = arrays.zarr_metadata(e.shape, e.storage_dtype, e.chunk_shape, e.inner_chunk_shape, e.compression)
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


def _check_shard(loc: Location, name: str, e: ArrayEntry, idx: tuple[int, ...], deep: bool,
                 report: Report) -> None:
    add = report.findings.append
    leaf = key_str(e.key)
    file = str(loc.child(name))
    size = storage.size_of(loc, name)
    index_len = arrays.index_nbytes(e.chunk_shape, e.inner_chunk_shape)
    if size is None or size < index_len:
        add(Finding("chunk.truncated", f"object has {size} bytes, less than its {index_len}-byte shard index",
                    file, leaf))
        return
    index = storage.read_bytes(loc, name, slice(size - index_len, size)) or b""
    body, crc = index[:-4], int.from_bytes(index[-4:], "little")
    if len(index) != index_len or google_crc32c.value(body) != crc:
        add(Finding("chunk.crc32c", "shard index crc32c does not match", file, leaf))
        return
    pairs = np.frombuffer(body, dtype="<u8").reshape(-1, 2)
    inner_grid = [c // i for c, i in zip(e.chunk_shape, e.inner_chunk_shape)]
    itemsize = dtypes.numpy_dtype(e.storage_dtype).itemsize
    raw_len = math.prod(e.inner_chunk_shape) * itemsize + 4
    data_end = size - index_len
    spans = []
    for n, inner in enumerate(product(*(range(g) for g in inner_grid))):
        start = [ci * c + ii * i for ci, c, ii, i in zip(idx, e.chunk_shape, inner, e.inner_chunk_shape)]
        inside = all(s < dim for s, dim in zip(start, e.shape))
        off, nbytes = int(pairs[n][0]), int(pairs[n][1])
        if off == _MISSING and nbytes == _MISSING:
            if inside:
                add(Finding("chunk.missing", f"inner chunk {list(inner)} is missing from the shard", file, leaf))
                return
            continue
        if off + nbytes > data_end or nbytes < 4:
            add(Finding("chunk.truncated", f"inner chunk {list(inner)} at bytes [{off}, {off + nbytes}) lies "
                        f"outside the {data_end} data bytes", file, leaf))
            return
        if e.compression == "none" and nbytes != raw_len:
            why = f"inner chunk {list(inner)} has {nbytes} bytes, an uncompressed one has {raw_len}"
            add(Finding("chunk.truncated", why, file, leaf) if nbytes < raw_len else
                Finding("chunk.size", why, file, leaf))
            return
        spans.append((off, nbytes, inner))
    spans.sort()
    for (a_off, a_len, a_idx), (b_off, _, b_idx) in zip(spans, spans[1:]):
        if a_off + a_len > b_off:
            add(Finding("chunk.overlap", f"inner chunks {list(a_idx)} and {list(b_idx)} overlap", file, leaf))
            return
    if deep:
        for off, nbytes, inner in spans:
            data = storage.read_bytes(loc, name, slice(off, off + nbytes)) or b""
            report.bytes_checked += len(data)
            if len(data) != nbytes or google_crc32c.value(data[:-4]) != int.from_bytes(data[-4:], "little"):
                add(Finding("chunk.crc32c", f"inner chunk {list(inner)} crc32c does not match", file, leaf))
                return


def _check_orbax(loc: Location, m: Manifest, vals: dict[int, Any] | None, report: Report, deep: bool) -> None:
    """The Orbax view: _METADATA, _strings.json and the 0-d mirrors agree with the manifest and values."""
    add = report.findings.append
    file = str(loc.child(naming.ORBAX_METADATA))
    raw = storage.read_bytes(loc, naming.ORBAX_METADATA)
    if raw is None:
        add(Finding("orbax.missing", "_METADATA is missing; Orbax cannot restore this checkpoint", file))
        return
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        add(Finding("orbax.invalid", f"_METADATA is not valid JSON: {exc}", file))
        return
    strings = [e for e in m.leaves if isinstance(e, ValueEntry) and e.type == "str"]
    expected = json.loads(orbax_files.files(m, {e.key: "" for e in strings})[naming.ORBAX_METADATA])
    if not isinstance(meta, dict) or meta.get("use_zarr3") is not True or meta.get("use_ocdbt") is True:
        add(Finding("orbax.mismatch", "_METADATA must be an object with use_zarr3: true and use_ocdbt unset or "
                    "false", file))
        return
    got_tree = meta.get("tree_metadata")
    got_tree = got_tree if isinstance(got_tree, dict) else {}
    for k in sorted(set(expected["tree_metadata"]) | set(got_tree)):
        if got_tree.get(k) != expected["tree_metadata"].get(k):
            add(Finding("orbax.mismatch", f"_METADATA entry {k} does not agree with the manifest", file))
            return
    if vals is None:
        return  # values unreadable (already reported): nothing to compare the strings and mirrors with
    if strings:
        _check_strings(loc, {".".join(str(p) for p in e.key): vals[i] for i, e in enumerate(m.leaves)
                             if isinstance(e, ValueEntry) and e.type == "str"}, report)
    for i, e in enumerate(m.leaves):
        if isinstance(e, ValueEntry):
            _check_mirror(loc, e, vals[i], deep, report)


def _check_strings(loc: Location, expected: dict[str, str], report: Report) -> None:
    file = str(loc.child("_strings.json"))
    raw = storage.read_bytes(loc, "_strings.json")
    if raw is None:
        report.findings.append(Finding("orbax.strings_missing", "_strings.json is missing; Orbax cannot restore "
                                       "the string values", file))
        return
    try:
        got = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        report.findings.append(Finding("orbax.strings_invalid", f"_strings.json is not valid JSON: {exc}", file))
        return
    if got != expected:
        report.findings.append(Finding("orbax.mismatch", "_strings.json does not hold the string values", file))


def _check_mirror(loc: Location, e: ValueEntry, value: Any, deep: bool, report: Report) -> None:
    """A numeric value that fits Orbax's scalar must have a 0-d mirror array holding exactly it."""
    add = report.findings.append
    leaf = key_str(e.key)
    if orbax_files.mirrors(value) != (e.orbax_path is not None):
        add(Finding("orbax.mismatch", f"a {e.type} value must {'' if e.orbax_path is None else 'not '}have a 0-d "
                    "mirror array (orbax_path)", str(loc.child(naming.MANIFEST)), leaf))
        return
    if e.orbax_path is None:
        return
    dtype = _MIRROR_DTYPES[e.type]
    before = len(report.findings)
    _check_array(loc, ArrayEntry(e.key, e.orbax_path, (), dtype, dtype, (), ()), deep, report)
    if len(report.findings) > before:
        return
    file = str(loc.child(e.orbax_path))
    try:
        spec = arrays.spec(loc, e.orbax_path)
        spec["fill_missing_data_reads"] = False
        got = ts.open(spec, open=True, read=True, context=arrays.context()).result().read().result()
    except Exception as exc:  # noqa: BLE001 - any failure to read is a finding
        add(Finding("orbax.mismatch", f"scalar mirror cannot be read: {str(exc)[:300]}", file, leaf))
        return
    want = np.asarray(value, dtype=dtype)
    if got.shape != () or got.dtype != want.dtype or got.tobytes() != want.tobytes():
        add(Finding("orbax.mismatch", f"scalar mirror holds {got!r}, the value is {value!r}", file, leaf))
