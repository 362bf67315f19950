"""Reading checkpoints written by Orbax, without jax: zarr v2 or v3, with or without OCDBT (merged, or
the per-process databases of a multi-process save that were never merged: :mod:`xckpt.interop.orbax.ocdbt`).

:func:`open_orbax` turns an Orbax checkpoint directory into a
:class:`~xckpt.sources.base.Source` whose manifest is built from Orbax's ``_METADATA``:

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

This module reads one Orbax *item* (a directory holding ``_METADATA``); the layouts that hold
items (Orbax v1 checkpoints, ``CheckpointManager`` step directories) are found and opened by
:mod:`xckpt.interop.orbax.layouts`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator, Sequence

import numpy as np
import tensorstore as ts

from xckpt.engine.read import ReadRequest, memory_limit
from xckpt.engine.storage import LocalStore, Location, Store
from xckpt.engine.views import read_views, translate
from xckpt.errors import DataError, ManifestError, NotACheckpointError, ResourceError, XckptError, XckptWarning
from xckpt.format import dtypes, manifest as manifest_mod, names as naming
from xckpt.format.manifest import ArrayEntry, Entry, Manifest, ValueEntry
from xckpt.format.tree import key_str

from xckpt.interop.orbax.arrays import ARRAY_TYPES, entry_for, read_array_infos, read_shardings
from xckpt.format.jsonobj import parse_json
from xckpt.interop.orbax.files import check_tree
from xckpt.interop.orbax.metadata import (OCDBT_MANIFEST, apply_rich_types, build_tree, check_names, finish,
                                          parse_flag, parse_metadata, read_records)
from xckpt.interop.orbax.ocdbt import (KeyIndex, index_databases, naming_damaged_file, process_databases,
                                       top_directories)


STRINGS = "_strings.json"
#: How a ``/`` of an Orbax array name is written in its entry's path (``%`` as ``%25``: see
#: :meth:`OrbaxCheckpoint.entry_path`).
NESTED_SEP = "%2F"




#: Bytes of OCDBT B-tree nodes kept in memory while reading (array data itself is not cached).
_OCDBT_CACHE_BYTES = 32 << 20


class OrbaxCheckpoint:
    """A checkpoint written by Orbax, opened for reading as a :class:`~xckpt.sources.base.Source`."""

    format = "orbax"

    def __init__(self, loc: Location, store: Store, manifest: Manifest, *, zarr3: bool, ocdbt: bool,
                 strict_fill: bool, unmerged: KeyIndex | None = None) -> None:
        self.loc = loc
        self.store = store
        self.manifest = manifest
        self._values: dict[int, Any] | None = None
        self.zarr3 = zarr3
        self.ocdbt = ocdbt
        self.strict_fill = strict_fill
        #: Where each key is, when the OCDBT databases of a multi-process save were never merged (else None).
        self.unmerged = unmerged
        #: The stored dtype of each scalar's 0-d array, by its entry's path.
        self.scalar_dtypes: dict[str, str] = {}
        #: Orbax's own name of each array whose name holds ``/`` (stored in nested directories) or ``%``, by entry path.
        self._stored: dict[str, str] = {}
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                                    "cache_pool#ocdbt": {"total_bytes_limit": _OCDBT_CACHE_BYTES}})

    def entry_path(self, name: str) -> str:
        """The path of the entry for the Orbax array ``name``: the name itself, or for a name holding ``/``
        (a key such as Haiku's ``mlp/~/linear_0``, which Orbax stores in nested directories) or ``%`` the
        name with each ``%`` written ``%25`` and each ``/`` ``%2F``, since an entry's path is one plain
        name (and no two arrays' paths can then be the same: ``a/b`` is ``a%2Fb``, ``a%2Fb`` is ``a%252Fb``)."""
        if "/" not in name and "%" not in name:
            return name
        path = name.replace("%", "%25").replace("/", NESTED_SEP)
        self._stored[path] = name
        return path

    def stored_name(self, path: str) -> str:
        """Orbax's name (its directory, or OCDBT key prefix) of the array whose entry path is ``path``."""
        return self._stored.get(path, path)

    def array_dir(self, path: str) -> str:
        """The display path of the directory of the array whose entry path is ``path`` (for errors)."""
        return str(self.loc.child(self.stored_name(path)))

    def values(self) -> dict[int, Any]:
        """Value leaves by leaf index: scalars read from their 0-d arrays, strings, None."""
        if self._values is None:
            self._values = read_values(self)
        return self._values

    def kvstore_spec(self, path: str = "") -> dict[str, Any]:
        """The kvstore spec of ``path`` (a directory) inside the checkpoint, through OCDBT if used (through
        the per-process databases holding its keys when they were never merged)."""
        path = self.stored_name(path)
        if not self.ocdbt:
            return self.store.kvstore(path)
        if self.unmerged is not None:
            return self.unmerged.spec(path, self.ocdbt_spec)
        out = self.ocdbt_spec("")
        if path:
            out["path"] = path.rstrip("/") + "/"
        return out

    def ocdbt_spec(self, directory: str) -> dict[str, Any]:
        """The kvstore spec of the OCDBT database in ``directory`` ('' for the checkpoint's root)."""
        return {"driver": "ocdbt", "base": self.store.kvstore(directory), "cache_pool": "cache_pool#ocdbt"}

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
        """Start opening an array leaf (or the 0-d array of a scalar) for reading.

        TensorStore decodes a whole chunk (an inner chunk of a zarr v3 shard) to read any element of it, and
        aborts the process when it cannot allocate one; so an array whose chunk holds more bytes than this
        machine's memory is refused first (``resource.too_large``, naming the file and the leaf).
        """
        chunk = math.prod(entry.inner_chunk_shape) * dtypes.itemsize(entry.dtype)
        if chunk > memory_limit():
            raise ResourceError(f"a chunk of this array is {chunk} bytes (chunk shape "
                                f"{list(entry.inner_chunk_shape)}), more than this machine's memory: it cannot be "
                                "decoded to read any part of it",
                                file=self.metadata_file(entry.path), leaf=key_str(entry.key))
        return ts.open(self.array_spec(entry), open=True, read=True, context=self._context)

    def read(self, requests: Sequence[ReadRequest], *, precheck: bool = False) -> int:
        """Fill each request's output through TensorStore, as Orbax itself reads (a damaged OCDBT database
        file is named: :meth:`ocdbt_error`)."""
        with self.naming_damaged():
            read_views(requests, self.open_array, lambda e: self.array_dir(e.path))
        return sum(r.out.nbytes for r in requests)

    def ocdbt_error(self, exc: XckptError, cause: BaseException | None = None) -> XckptError:
        """``exc`` naming as its file the OCDBT database file (a ``manifest.ocdbt``, or a data file under ``d/``)
        whose damage the TensorStore error ``cause`` (default: ``exc``'s cause) reported, rather than the array
        it was reading (which stays its leaf); ``exc`` itself when there was none (or the checkpoint does not
        use OCDBT)."""
        if not self.ocdbt:
            return exc
        return naming_damaged_file(exc, self.store.kvstore().get("path", ""), self.loc, cause)

    @contextlib.contextmanager
    def naming_damaged(self) -> Iterator[None]:
        """Raise the :class:`~xckpt.errors.XckptError` that the block raises as :meth:`ocdbt_error` makes it."""
        try:
            yield
        except XckptError as exc:
            err = self.ocdbt_error(exc)
            if err is exc:
                raise
            raise err from exc.__cause__

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Nothing ahead: TensorStore checks what it reads (see :meth:`Source.check`)."""

    def replaced(self) -> bool:
        """Orbax checkpoints are read as they are (their writers replace steps by deleting them)."""
        return False

    def close(self) -> None:
        """Release the store."""
        self.store.close()

    def metadata_file(self, name: str) -> str:
        """The display path of an array's zarr metadata file (inside OCDBT when it is used)."""
        meta = "zarr.json" if self.zarr3 else ".zarray"
        return f"{self.array_dir(name)}/{meta}" + (" (in OCDBT)" if self.ocdbt else "")


def open_orbax(path: Any, *, committed: bool | None = None) -> OrbaxCheckpoint:
    """Open the Orbax checkpoint at ``path`` (a directory holding ``_METADATA``) for reading.

    A local checkpoint is walked once first (:func:`~xckpt.interop.orbax.files.check_tree`):
    a symbolic link (``path.link``) or a FIFO, socket or device (``path.special``) anywhere in it
    is refused before TensorStore opens anything by path.

    ``committed``: whether the checkpoint holding this item was committed, when the caller knows
    (an item of an Orbax v1 checkpoint has no ``commit_success.txt`` of its own). When None, the
    item's own ``commit_success.txt`` decides, or else that of the directory holding it when that
    directory is an Orbax checkpoint (``_CHECKPOINT_METADATA``); a warning says when it is missing.
    """
    loc = Location.of(path)
    store = loc.store()
    try:
        return _open(loc, store, committed)
    except BaseException:
        store.close()
        raise


def _parent_committed(loc: Location) -> bool:
    """Whether the directory holding ``loc`` is a committed Orbax checkpoint (it holds the item ``loc``)."""
    head, sep, _ = loc.url.rstrip("/").rpartition("/")
    if not sep or not head or head.endswith(":/"):
        return False
    parent = Location(head).store()
    try:
        return parent.exists(naming.COMMIT) and parent.exists(naming.ORBAX_CHECKPOINT_METADATA)
    finally:
        parent.close()


def _open(loc: Location, store: Store, committed: bool | None = None) -> OrbaxCheckpoint:
    meta_file = str(loc.child(naming.ORBAX_METADATA))
    raw = store.read(naming.ORBAX_METADATA)  # never through a link, never from a special file
    if raw is None:
        raise NotACheckpointError(f"{loc} holds no Orbax checkpoint (no {naming.ORBAX_METADATA})",
                                  code="orbax.missing", file=meta_file)
    meta = parse_metadata(raw, meta_file)
    records = read_records(meta, meta_file)
    top_dirs: set[str] | None = None
    if isinstance(store, LocalStore):
        arrays_at: dict[str, str] = {}
        for r in records:  # an array named a/b is stored below the top-level directory a
            if r.value_type in ARRAY_TYPES + ("scalar",):
                arrays_at.setdefault(r.name.split("/", 1)[0], key_str(r.key))
        top_dirs = set()
        check_tree(store, arrays_at, top_dirs)
    if committed is None:
        committed = store.exists(naming.COMMIT) or _parent_committed(loc)
    if not committed:
        warnings.warn(f"{loc}: {naming.COMMIT} is missing; Orbax treats this checkpoint as unfinished",
                      XckptWarning, stacklevel=4)
    has_ocdbt = store.exists(OCDBT_MANIFEST)
    databases: list[str] = []
    use_ocdbt = parse_flag(meta, "use_ocdbt", meta_file, unset=None)  # None: _METADATA does not say
    strict_fill = bool(parse_flag(meta, "store_array_data_equal_to_fill_value", meta_file))
    if not has_ocdbt and (use_ocdbt is True or
                          (use_ocdbt is None and store.exists(f"ocdbt.process_0/{OCDBT_MANIFEST}"))):
        tops = top_dirs if top_dirs is not None else top_directories(store)
        # a merge writes the root database (d/, then manifest.ocdbt): d/ without the manifest is a merge
        # that did not finish, or a damaged checkpoint, not one whose databases were never merged
        if "d" not in tops:
            databases = process_databases(store, tops)
    if use_ocdbt is True and not has_ocdbt and not databases:
        raise DataError(f"_METADATA says use_ocdbt but {OCDBT_MANIFEST} is missing (an unfinished save or "
                        "merge?), and no unmerged per-process database (ocdbt.process_<i>/manifest.ocdbt, "
                        "without a root d/) stands in for it", code="orbax.ocdbt_missing",
                        file=str(loc.child(OCDBT_MANIFEST)))
    zarr3 = meta.get("use_zarr3", False)
    if not isinstance(zarr3, bool):
        raise ManifestError(f"use_zarr3 is {zarr3!r}, not a boolean", code="orbax.invalid", file=meta_file)
    root = build_tree(records, meta_file)
    apply_rich_types(root, meta.get("value_metadata_tree"))
    tree, ordered = finish(root, ())
    producer = {"library": "orbax-checkpoint", "framework": "jax"}
    info: dict[str, Any] = {"orbax": {
        "use_ocdbt": has_ocdbt or bool(databases), "use_zarr3": zarr3,
        "store_array_data_equal_to_fill_value": strict_fill,
        "custom_metadata": meta.get("custom_metadata")}}
    if databases:
        info["orbax"]["unmerged_ocdbt"] = list(databases)
    placeholder = Manifest(tree=tree, leaves=[], producer=producer, metadata=info)
    ckpt = OrbaxCheckpoint(loc, store, placeholder, zarr3=zarr3, ocdbt=has_ocdbt or bool(databases),
                           strict_fill=strict_fill)
    # a damaged database file is named, rather than the database or the array being read (ocdbt_error)
    if databases:
        with ckpt.naming_damaged():
            ckpt.unmerged = index_databases(databases, ckpt.ocdbt_spec, ckpt._context,
                                            lambda d: str(loc.child(f"{d}/{OCDBT_MANIFEST}")))
    stored = [r for r in ordered if r.value_type in ARRAY_TYPES + ("scalar",) and not r.skip]
    check_names(stored, meta_file)
    with ckpt.naming_damaged():
        arrays = read_array_infos(ckpt, stored)
    shardings = read_shardings(loc, store)
    leaves: list[Entry] = []
    for rec in ordered:
        leaves.append(entry_for(ckpt, rec, arrays.get(rec.name), shardings.get(rec.name)))
    m = Manifest(tree=tree, leaves=leaves, producer=producer, metadata=info,
                 values={"path": naming.ORBAX_METADATA} if any(isinstance(e, ValueEntry) for e in leaves)
                 else None)
    manifest_mod.check_consistency(m, meta_file, bounded_paths=False)  # Orbax's names: keys of OCDBT, not files
    for e in m.arrays():
        manifest_mod.check_shape(e, ckpt.metadata_file(e.path))
    ckpt.manifest = m
    return ckpt


def read_values(ckpt: OrbaxCheckpoint) -> dict[int, Any]:
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
                strings = _strings(ckpt.loc, ckpt.store)
            out[i] = _string(ckpt.loc, strings, e)
        else:
            out[i] = None
    reads = []
    for i, e, entry, fut in scalars:
        try:
            reads.append((i, e, entry, fut.result().read()))
        except Exception as exc:  # noqa: BLE001
            raise ckpt.ocdbt_error(translate(exc, entry, ckpt.array_dir(entry.path)), exc) from exc
    for i, e, entry, fut in reads:
        try:
            value = np.asarray(fut.result())
        except Exception as exc:  # noqa: BLE001
            raise ckpt.ocdbt_error(translate(exc, entry, ckpt.array_dir(entry.path)), exc) from exc
        out[i] = {"bool": bool, "int": int, "float": float, "complex": complex}[e.type](value.item())
    return out


def _strings(loc: Location, store: Store) -> dict[str, Any]:
    file = str(loc.child(STRINGS))
    raw = store.read(STRINGS)
    if raw is None:
        raise DataError(f"{STRINGS} is missing but _METADATA lists string leaves", code="orbax.strings_missing",
                        file=file)
    obj = parse_json(raw, STRINGS, code="orbax.strings_invalid", file=file)
    if not isinstance(obj, dict):
        raise ManifestError(f"{STRINGS} is not a JSON object", code="orbax.strings_invalid", file=file)
    return obj


def _lookup(strings: dict[str, Any], name: str) -> tuple[bool, Any]:
    """``(found, value)`` of the string ``name`` in ``_strings.json``, looked up as Orbax writes it: at the JSON
    pointer ``/<name>``, so a ``/`` in a key nests (``{"sl": {"ash": ...}}`` for the key ``sl/ash``) and
    ``~1`` / ``~0`` stand for ``/`` / ``~``."""
    node: Any = strings
    for token in name.split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif (isinstance(node, list) and token.isascii() and token.isdigit() and len(token) < 19
              and int(token) < len(node)):
            node = node[int(token)]
        else:
            return False, None
    return True, node


def _string(loc: Location, strings: dict[str, Any], e: ValueEntry) -> str:
    name = ".".join(str(k) for k in e.key)
    file = str(loc.child(STRINGS))
    found, value = (True, strings[name]) if name in strings else _lookup(strings, name)
    if not found:
        raise DataError(f"string {name!r} is missing from {STRINGS}", code="orbax.strings_missing",
                        file=file, leaf=key_str(e.key))
    if not isinstance(value, str):
        raise ManifestError(f"{STRINGS} holds {type(value).__name__} for {name!r}, not a string",
                            code="orbax.strings_invalid", file=file, leaf=key_str(e.key))
    return value
