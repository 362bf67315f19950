"""The validator: does a directory conform to the xckpt spec (``spec/xckpt-1.4.md``)?

Every finding has a stable code (listed in the spec) and names the file and leaf.
Without ``deep``, only metadata and shard indexes are read: every offset in every
shard index is checked against the object's size before it is trusted
(:func:`xckpt.format.shard.parse_index`). With ``deep``, the crc32c of every stored inner
chunk (those wholly outside the array too) is recomputed, an uncompressed one in pieces of at most
:data:`CRC_PIECE_BYTES`, so that memory stays bounded. Nothing is read through a link or from a special file:
every read goes through the checkpoint's store, and so does the directory walk
(:meth:`~xckpt.engine.storage.LocalStore.walk`). A PyTorch DCP directory is checked by its reader (spec 8.1).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np

from xckpt.engine.hostcopy import page_buffer, page_view
from xckpt.engine.read import ReadRequest, read_regions
from xckpt.engine.storage import LocalStore, Location, Store, entry_kind
from xckpt.errors import IntegrityError, XckptError, XckptWarning
from xckpt.format import dtypes, names as naming, orbax_view as orbax_files, shard, zarr
from xckpt.format.manifest import ArrayEntry, Manifest, StoredArray, ValueEntry
from xckpt.format.regions import Region, chunk_box, chunk_indices, grid_shape
from xckpt.format.tree import key_str
from xckpt.sources.native import read_manifest, read_values

_MISSING = 2**64 - 1
#: Missing chunks of one array listed one by one; the rest are counted in one finding.
MAX_MISSING_LISTED = 16
#: Bytes of a PyTorch DCP checkpoint's array a deep validation reads at a time (:func:`_validate_dcp`).
DCP_PIECE_BYTES = 64 << 20
#: zarr data type of the 0-d array mirroring a value of each type, for Orbax.
_MIRROR_DTYPES = {"bool": "bool", "int": "int64", "float": "float64"}

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
    format: str = "xckpt"  # or "dcp": a PyTorch DCP directory, checked by its reader (no checksums to check)

    @property
    def ok(self) -> bool:
        """True when no finding is an error (warnings allowed)."""
        return not any(f.severity == "error" for f in self.findings)

    def codes(self) -> list[str]:
        """The codes of all findings, in order."""
        return [f.code for f in self.findings]

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form, for ``xckpt validate --json``."""
        return {"path": self.path, "format": self.format, "ok": self.ok, "deep": self.deep, "arrays": self.arrays,
                "chunks": self.chunks, "bytes_checked": self.bytes_checked,
                "findings": [asdict(f) for f in self.findings]}


def validate(path: Any, deep: bool = False) -> Report:
    """Check a checkpoint against the spec; see :class:`Report`. A checkpoint manager's step directory is
    checked through its ``default/`` item, the xckpt checkpoint it holds (spec 6.8); a PyTorch DCP directory
    by its reader (:func:`_validate_dcp`)."""
    loc = Location.of(path)
    dcp = _validate_dcp(loc, deep)
    if dcp is not None:
        return dcp
    if loc.is_local and not os.path.lexists(os.path.join(loc.local_path, naming.MANIFEST)) \
            and os.path.isfile(os.path.join(loc.local_path, naming.DEFAULT_ITEM, naming.MANIFEST)) \
            and not os.path.islink(os.path.join(loc.local_path, naming.DEFAULT_ITEM)):
        loc = loc.child(naming.DEFAULT_ITEM)
    report = Report(str(loc), deep)
    add = report.findings.append
    store = loc.store()
    try:
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always", XckptWarning)
                m = read_manifest(loc, store)
        except XckptError as exc:
            add(Finding(exc.code, exc.message, exc.file, exc.leaf))
            return report
        for w in said:  # what a reader admits with a warning (NaN in metadata, as older xckpt wrote it)
            if issubclass(w.category, XckptWarning):
                add(Finding("manifest.json", str(w.message), str(loc.child(naming.MANIFEST)), severity="warning"))
        if isinstance(store, LocalStore):
            _check_files(store, m, report)
        if not store.exists(naming.COMMIT):
            add(Finding("commit.missing", f"{naming.COMMIT} is missing (Orbax will treat the checkpoint as "
                        "unfinished)", str(loc.child(naming.COMMIT)), severity="warning"))
        _check_names(loc, m, report)
        vals: dict[int, Any] | None = None
        try:
            vals = read_values(loc, store, m)
        except XckptError as exc:
            add(Finding(exc.code, exc.message, exc.file, exc.leaf))
        gen = m.tag_generation  # every chunk object names its place (format 1.2)
        for e in m.arrays():
            report.arrays += 1
            _check_leaf(loc, store, e, deep, report, gen)
        _check_orbax(loc, store, m, vals, report, deep, gen)
        _check_checkpoint_metadata(loc, store, report)
    finally:
        store.close()
        _dedupe(report)
    return report


def _validate_dcp(loc: Location, deep: bool) -> Report | None:
    """A PyTorch DCP directory (a DCP metadata file, no xckpt manifest) checked by its reader (spec 8.1): its
    metadata, every stored range and every tensor's tiling when it is opened, its values then; with ``deep``,
    every array read back in pieces of at most :data:`DCP_PIECE_BYTES` (:func:`_dcp_pieces`; each DCP chunk
    loaded once and checked as its recorded tensor). None for any other path."""
    if not loc.is_local:
        return None
    root = loc.local_path
    if os.path.lexists(os.path.join(root, naming.MANIFEST)) or not any(
            os.path.lexists(os.path.join(root, n)) for n in naming.DCP_MARKERS):
        return None
    from xckpt.engine.copy import read_region
    from xckpt.sources.detect import open_checkpoint

    report = Report(str(loc), deep, format="dcp")
    add = report.findings.append
    try:
        ckpt = open_checkpoint(loc)
    except XckptError as exc:
        add(Finding(exc.code, exc.message, exc.file, exc.leaf))
        return report
    try:
        for e in ckpt.manifest.arrays():
            report.arrays += 1
            if not deep:
                continue
            try:
                for piece in _dcp_pieces(e):
                    report.bytes_checked += read_region(ckpt, e, piece).nbytes
            except XckptError as exc:
                add(Finding(exc.code, exc.message, exc.file, exc.leaf or key_str(e.key)))
    finally:
        ckpt.close()
    return report


def _dcp_pieces(e: ArrayEntry) -> Iterator[Region]:
    """The regions a deep validation reads a DCP array in: chunk by chunk of its chunk grid (its DCP chunks where
    they are all alike, else the whole array), each cut in pieces of at most :data:`DCP_PIECE_BYTES`
    (:func:`xckpt.diff.pieces`), so that every DCP chunk is loaded once (bands of rows across chunks that
    split the columns would load each chunk once per band)."""
    from xckpt.diff import pieces

    if not e.shape:
        yield Region((), ())
        return
    for index in chunk_indices(e.shape, e.chunk_shape):
        box = chunk_box(index, e.chunk_shape, e.shape)
        for piece in pieces(box.sizes, dtypes.itemsize(e.dtype), DCP_PIECE_BYTES):
            yield piece.placed_in(box)


def _dedupe(report: Report) -> None:
    """One finding per code, file and leaf (a link is found both by the directory walk and by the read refusing
    it); a finding without a leaf is dropped where the same code and file were found with one."""
    with_leaf = {(f.code, f.file) for f in report.findings if f.leaf}
    seen: set[tuple[str, str | None, str | None]] = set()
    kept = []
    for f in report.findings:
        if f.leaf is None and (f.code, f.file) in with_leaf:
            continue
        if (f.code, f.file, f.leaf) not in seen:
            seen.add((f.code, f.file, f.leaf))
            kept.append(f)
    report.findings[:] = kept


def _check_files(store: LocalStore, m: Manifest, report: Report) -> None:
    """Plain files and directories only (found by walks that never follow a link), each finding naming the
    leaf whose stored path holds the file; warn about names nothing refers to: at the top level, and in the
    directories a nested path lies in (format 1.3). A directory that cannot be listed is an ``io.read``
    finding, and the other top-level names are still walked."""
    add = report.findings.append
    owner = {path: key_str(key) for path, key in m.stored_paths()}
    between = {p for path in owner for p in naming.parents(path)}  # directories a nested path lies in

    longest = max(map(len, owner), default=0)

    def owned(name: str) -> str | None:  # the leaf whose stored path holds ``name``
        # only the directories of its first ``longest`` characters can be a stored path: a name nested
        # thousands deep costs no more than a short one
        return owner.get(name) or next((owner[p] for p in reversed(list(naming.parents(name[:longest + 1])))
                                        if p in owner), None)

    try:
        with os.scandir(store.pinned_path()) as it:
            top = sorted((entry.name, entry_kind(entry)) for entry in it)
    except OSError as exc:
        add(Finding("io.read", f"cannot list {store.root}: {exc.strerror}", store.root))
        return
    unexpected = sorted({name for name, _ in top} - m.top_names())
    for first, first_kind in top:
        subtree = [(first, first_kind)]
        if first_kind == "dir":
            try:
                subtree.extend(store.walk(first))
            except XckptError as exc:  # a directory that cannot be listed; what was walked before it still counts
                add(Finding(exc.code, exc.message, exc.file, owned(first)))
        for name, kind in subtree:
            file = str(store.location.child(name))
            leaf = owned(name)
            if kind == "link":
                add(Finding("path.link", f"symbolic link to {_readlink(file)!r}; a checkpoint must hold plain files "
                            "only", file, leaf))
            elif kind not in ("file", "dir"):
                add(Finding("path.special", f"a {kind}, not a regular file or directory", file, leaf))
            if "/" in name and name.rpartition("/")[0] in between and name not in between and name not in owner:
                unexpected.append(name)
    for name in unexpected:
        add(Finding("path.unexpected", "no leaf of the manifest refers to this name", str(store.location.child(name)),
                    severity="warning"))


def _readlink(path: str) -> str:
    """Where a link points (its own text: nothing is followed), for messages."""
    try:
        return os.readlink(path)
    except OSError:
        return "?"


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


def _check_leaf(loc: Location, store: Store, e: ArrayEntry, deep: bool, report: Report,
                gen: str | None) -> None:
    """A leaf's Zarr nodes: one array, or a group whose segment arrays tile it."""
    if e.segments is not None:
        _check_group_objects(loc, store, e, report)
        meta = _read_json(loc, store, f"{e.path}/zarr.json", e, report)
        if meta is None:
            return
        if meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
            report.findings.append(Finding("array.metadata_mismatch", "a segmented leaf's zarr.json must be a "
                                           "Zarr v3 group", str(loc.child(f"{e.path}/zarr.json")), key_str(e.key)))
            return
    for a in e.arrays():
        _check_array(loc, store, e, a, deep, report, gen)


def _check_group_objects(loc: Location, store: Store, e: ArrayEntry, report: Report) -> None:
    """Under a segmented leaf's directory: its group ``zarr.json`` and its segment arrays, nothing else
    (each segment's own objects are checked with its array)."""
    segments = tuple(f"{a.path}/" for a in e.arrays())
    group_json = f"{e.path}/{zarr.METADATA}"
    for name in store.list(e.path + "/"):
        if name != group_json and not name.startswith(segments):
            report.findings.append(Finding("chunk.unexpected", "object under a segmented leaf is neither its group's "
                                           "zarr.json nor in one of its segments", str(loc.child(name)),
                                           key_str(e.key)))


def _read_json(loc: Location, store: Store, name: str, e: ArrayEntry, report: Report) -> dict[str, Any] | None:
    add = report.findings.append
    file, leaf = str(loc.child(name)), key_str(e.key)
    try:
        raw = store.read(name, limit=zarr.MAX_METADATA_BYTES)
    except XckptError as exc:
        add(Finding(exc.code, exc.message, exc.file or file, leaf))
        return None
    if raw is None:
        add(Finding("array.metadata_missing", "zarr.json is missing", file, leaf))
        return None
    meta, why = zarr.parse_metadata(raw)  # the parser a load uses
    if meta is None:
        add(Finding("array.metadata_json", why or "zarr.json cannot be read", file, leaf))
    return meta


def _check_array(loc: Location, store: Store, e: ArrayEntry, a: StoredArray, deep: bool, report: Report,
                 gen: str | None) -> None:
    add = report.findings.append
    leaf = key_str(e.key)
    meta = _read_json(loc, store, f"{a.path}/zarr.json", e, report)
    if meta is None:
        return
    why = zarr.mismatch(meta, zarr.zarr_metadata(a.shape, e.storage_dtype, a.chunk_shape, a.inner_chunk_shape,
                                                 e.compression))
    if why is not None:
        add(Finding("array.metadata_mismatch", why, str(loc.child(f"{a.path}/zarr.json")), leaf))
        return
    try:  # the store's own walk: a directory it cannot list is a finding, not every chunk reported missing
        stored = {n for n, kind in store.walk(a.path) if kind != "dir"} if isinstance(store, LocalStore) else \
            set(store.list(a.path + "/"))
    except XckptError as exc:
        add(Finding(exc.code, exc.message, exc.file, leaf))
        return
    stored.discard(a.path + "/zarr.json")
    geom = zarr.geometry(e.storage_dtype, a.chunk_shape, a.inner_chunk_shape, e.compression)

    def check(idx: tuple[int, ...]) -> None:
        full = f"{a.path}/{zarr.chunk_key(idx)}"
        stored.discard(full)
        report.chunks += 1
        _check_shard(loc, store, full, geom, chunk_box(idx, a.chunk_shape, a.shape).sizes, leaf, deep, report, gen)

    # the chunks stored, by grid index, in grid order: the grid may declare up to 2**24 chunks, far more than
    # are stored, and is walked only as far as the missing chunks listed and the stored ones it passes
    grid = grid_shape(a.shape, a.chunk_shape) if all(a.shape) else None
    prefix = a.path + "/"
    present = [] if grid is None else sorted(
        i for n in stored if n.startswith(prefix) and (i := zarr.parse_chunk_key(n[len(prefix):], grid)) is not None)
    ahead = iter(present)
    upcoming = next(ahead, None)
    listed = 0
    for idx in chunk_indices(a.shape, a.chunk_shape) if grid is not None else []:
        if idx == upcoming:
            check(idx)
            upcoming = next(ahead, None)
        elif listed < MAX_MISSING_LISTED:
            listed += 1
            add(Finding("chunk.missing", f"chunk {list(idx)} is missing",
                        str(loc.child(prefix + zarr.chunk_key(idx))), leaf))
        else:  # every missing chunk to list is listed: check the stored ones left without walking to them
            for rest in ([upcoming] if upcoming is not None else []) + list(ahead):
                check(rest)
            break
    missing = (math.prod(grid) - len(present)) if grid is not None else 0
    if missing > MAX_MISSING_LISTED:
        add(Finding("chunk.missing", f"{missing - MAX_MISSING_LISTED} more chunks of this array are missing",
                    str(loc.child(a.path)), leaf))
    for extra in sorted(stored):
        add(Finding("chunk.unexpected", "object is not a chunk of this array's grid", str(loc.child(extra)), leaf))


def _check_shard(loc: Location, store: Store, name: str, geom: shard.Geometry, valid: tuple[int, ...], leaf: str,
                 deep: bool, report: Report, gen: str | None) -> None:
    add = report.findings.append
    file = str(loc.child(name))
    try:
        blob = store.open(name)
    except XckptError as exc:
        add(Finding(exc.code, exc.message, exc.file or file, leaf))
        return
    if blob is None:
        add(Finding("chunk.missing", "object disappeared", file, leaf))
        return
    try:
        place = None if gen is None else shard.place_of(gen, name)
        n_tail = shard.tail_nbytes(geom, place)
        tail = blob.read_tail(min(n_tail, blob.size)) if blob.size is not None else blob.read_tail(n_tail)
        index = shard.parse_index(geom, tail, blob.size, valid, place=place, file=file, leaf=leaf)
        if deep:  # every stored inner chunk (those outside the array too), in the order of their bytes
            present = (index[:, 0] != _MISSING) | (index[:, 1] != _MISSING)
            for off, nbytes in sorted((int(o), int(n)) for o, n in index[present]):
                if geom.compression == "none":
                    _check_crc_streamed(blob, off, nbytes, file, leaf)
                else:  # decoded whole, as a read does
                    data = np.empty(nbytes, dtype=np.uint8)
                    blob.read_into(off, data)
                    shard.open_inner(geom, data, file=file, leaf=leaf)
                report.bytes_checked += nbytes
    except XckptError as exc:
        add(Finding(exc.code, exc.message, exc.file or file, exc.leaf or leaf))
    finally:
        blob.close()


#: Bytes of an uncompressed inner chunk deep validation reads at a time (its crc32c is computed piece by piece).
CRC_PIECE_BYTES = 16 << 20


def _check_crc_streamed(blob: Any, off: int, nbytes: int, file: str, leaf: str) -> None:
    """Check the crc32c of the uncompressed inner chunk of ``nbytes`` bytes (its crc32c last) at ``off`` of
    ``blob``, reading it in pieces of at most :data:`CRC_PIECE_BYTES`: memory stays bounded whatever its size."""
    end = off + nbytes - 4
    most = min(CRC_PIECE_BYTES, max(0, end - off))
    buf = page_buffer(most)  # each piece placed within a page as its file position: the kernel copies it faster
    crc, pos = 0, off
    while pos < end:
        piece = page_view(buf, min(most, end - pos), pos)
        blob.read_into(pos, piece)
        crc = shard.checksum(piece, crc)
        pos += piece.size
    stored = np.empty(4, dtype=np.uint8)
    blob.read_into(end, stored)
    if crc != int.from_bytes(stored.tobytes(), "little"):
        raise IntegrityError("inner chunk crc32c does not match", code="chunk.crc32c", file=file, leaf=leaf)


def _json(raw: bytes) -> Any:
    """A JSON document; any defect (not UTF-8, not JSON, a number beyond 4300 digits, too deep) is a ValueError."""
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("nests too deeply to be parsed") from None


#: What :func:`_read_json_file` returns when the file is missing, unreadable or not JSON (a finding is added).
_UNUSABLE = object()


def _read_json_file(loc: Location, store: Store, name: str, report: Report, *, missing: tuple[str, str],
                    invalid: str) -> Any:
    """A top-level JSON file's document, or :data:`_UNUSABLE` after adding a finding: the read's own error
    (a link, a special file), ``missing`` (code, message) when it is absent, ``invalid`` (code) when it is
    not JSON."""
    file = str(loc.child(name))
    try:
        raw = store.read(name)
    except XckptError as exc:
        report.findings.append(Finding(exc.code, exc.message, exc.file or file))
        return _UNUSABLE
    if raw is None:
        report.findings.append(Finding(missing[0], missing[1], file))
        return _UNUSABLE
    try:
        return _json(raw)
    except ValueError as exc:
        report.findings.append(Finding(invalid, f"{name} is not valid JSON: {exc}", file))
        return _UNUSABLE


def _check_orbax(loc: Location, store: Store, m: Manifest, vals: dict[int, Any] | None, report: Report,
                 deep: bool, gen: str | None) -> None:
    """The Orbax view: _METADATA, _strings.json and the 0-d mirrors agree with the manifest and values."""
    add = report.findings.append
    file = str(loc.child(naming.ORBAX_METADATA))
    meta = _read_json_file(loc, store, naming.ORBAX_METADATA, report, invalid="orbax.invalid",
                           missing=("orbax.missing", "_METADATA is missing; Orbax cannot restore this checkpoint"))
    if meta is _UNUSABLE:
        return
    strings = [e for e in m.leaves if orbax_files.in_strings(e)]
    expected = json.loads(orbax_files.metadata_json(m, [e.key for e in strings]))
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
        _check_strings(loc, store, orbax_files.strings_object({e.key: vals[i] for i, e in enumerate(m.leaves)
                                                               if orbax_files.in_strings(e)}), report)
    for i, e in enumerate(m.leaves):
        if isinstance(e, ValueEntry):
            _check_mirror(loc, store, e, vals[i], deep, report, gen)


#: Members of Orbax's ``_CHECKPOINT_METADATA`` and the JSON types they must have when present.
_CHECKPOINT_METADATA_TYPES: dict[str, tuple[type, ...]] = {
    "item_handlers": (str, dict, type(None)), "metrics": (dict,), "performance_metrics": (dict,),
    "init_timestamp_nsecs": (int, type(None)), "commit_timestamp_nsecs": (int, type(None)),
    "custom_metadata": (dict, type(None))}


def _check_checkpoint_metadata(loc: Location, store: Store, report: Report) -> None:
    """``_CHECKPOINT_METADATA`` (what Orbax's ``CheckpointManager`` reads of a step) is a JSON object whose
    known members have their types."""
    name = naming.ORBAX_CHECKPOINT_METADATA
    file = str(loc.child(name))
    meta = _read_json_file(loc, store, name, report, invalid="orbax.checkpoint_metadata",
                           missing=("orbax.checkpoint_metadata", f"{name} is missing (Orbax's CheckpointManager "
                                    "reads it)"))
    if meta is _UNUSABLE:
        return
    wrong = [k for k, types in _CHECKPOINT_METADATA_TYPES.items()
             if isinstance(meta, dict) and k in meta and (not isinstance(meta[k], types) or isinstance(meta[k], bool))]
    if not isinstance(meta, dict) or wrong:
        what = f"member {wrong[0]!r} has the wrong type" if wrong else "it is not a JSON object"
        report.findings.append(Finding("orbax.checkpoint_metadata", f"{name}: {what}", file))


def _check_strings(loc: Location, store: Store, expected: dict[str, Any], report: Report) -> None:
    file = str(loc.child("_strings.json"))
    got = _read_json_file(loc, store, "_strings.json", report, invalid="orbax.strings_invalid",
                          missing=("orbax.strings_missing", "_strings.json is missing; Orbax cannot restore the "
                                   "string values"))
    if got is _UNUSABLE:
        return
    if got != expected:
        report.findings.append(Finding("orbax.mismatch", "_strings.json does not hold the string values", file))


def _check_mirror(loc: Location, store: Store, e: ValueEntry, value: Any, deep: bool, report: Report,
                  gen: str | None) -> None:
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
    entry = ArrayEntry(e.key, e.orbax_path, (), dtype, dtype, (), ())
    _check_array(loc, store, entry, entry.arrays()[0], deep, report, gen)
    if len(report.findings) > before:
        return
    file = str(loc.child(e.orbax_path))
    got = np.empty((), dtype=dtype)
    try:
        read_regions(store, [ReadRequest(entry, Region((), ()), got)], lambda n: str(loc.child(n)), generation=gen)
    except XckptError as exc:
        add(Finding("orbax.mismatch", f"scalar mirror cannot be read: {exc.message}", file, leaf))
        return
    want = np.asarray(value, dtype=dtype)
    if got.shape != () or got.dtype != want.dtype or got.tobytes() != want.tobytes():
        add(Finding("orbax.mismatch", f"scalar mirror holds {got!r}, the value is {value!r}", file, leaf))
