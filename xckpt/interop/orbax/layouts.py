"""The directory layouts Orbax writes around its items, found (:func:`find_layout`) and opened
(:func:`open_layout`) as one :class:`~xckpt.sources.base.Source`.

An Orbax *item* is a directory holding ``_METADATA`` (read by
:func:`~xckpt.interop.orbax.checkpoint.open_orbax`). The layouts around items:

``item``
    The path itself holds ``_METADATA``: a ``StandardCheckpointer`` / ``PyTreeCheckpointer``
    save, or one item of the layouts below opened on its own.
``v1``
    An Orbax v1 checkpoint (``ocp.v1.save``, ``ocp.v1.save_checkpointables``): an empty
    ``orbax.checkpoint`` marker file, ``_CHECKPOINT_METADATA`` and ``commit_success.txt`` at
    the top, and one directory per *checkpointable*: ``state/`` for the pytree of
    ``ocp.v1.save(path, tree)``, one per name for ``save_checkpointables(path, {name: ...})``.
``step``
    A ``CheckpointManager`` step directory (``<root>/<step>/``, also what
    ``ocp.v1.training.Checkpointer`` writes per step): ``_CHECKPOINT_METADATA`` whose
    ``item_handlers`` maps each item name to its handler, ``commit_success.txt``, and one
    directory per item (``default/`` for a single unnamed item). A bare ``<step>/default/``
    (no file beside it) is one too.

The items of a ``v1`` or ``step`` layout are named by ``item_handlers`` (else by the
subdirectories there). Each is read when it holds ``_METADATA`` (a pytree), ``xckpt.json`` (an
xckpt checkpoint saved as an item) or a JSON document (``JsonCheckpointHandler``'s ``metadata``,
v1 ``JsonHandler``'s ``data.json``); other items (protos, custom handlers) are left out with a
warning. ``metrics`` (reserved by Orbax, never loaded by ``ocp.v1.load_checkpointables``) and a
checkpointable whose deletion is pending (``_CHECKPOINT_DELETION``) are left out too.

What a load gives: the tree of the only item when the layout holds exactly one (counting those
left out), named ``state``
(v1) or ``default`` (``CheckpointManager``), as ``ocp.v1.load(path)`` and
``CheckpointManager.restore`` do; otherwise a dict keyed by item name (``{"state": ...,
"extra": ...}``), as ``ocp.v1.load_checkpointables(path)`` does. A JSON item reads as its
document (dicts, lists and plain values). One item can also be read alone by passing its
directory (``path/"state"``).

Wiring into :mod:`xckpt.sources.detect` (one entry of its table, right after the ``orbax`` kind)::

    Kind("orbax-layout", orbax_layouts.holds,
         lambda loc, store: orbax_layouts.open_kind(loc, store, _open_native)),
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import tensorstore as ts

from xckpt.engine.copy import copy_checkpoint
from xckpt.engine.read import ReadRequest
from xckpt.engine.storage import LocalStore, Location, Store
from xckpt.errors import ManifestError, NotACheckpointError, UnsafePathError, UnsupportedError, XckptWarning
from xckpt.format import names as naming
from xckpt.format.manifest import ArrayEntry, Entry, Manifest, ValueEntry
from xckpt.format.tree import Key, Node, key_str
from xckpt.format.values import value_type
from xckpt.interop.orbax.checkpoint import open_orbax
from xckpt.format.jsonobj import parse_json
from xckpt.interop.orbax.ocdbt import top_directories
from xckpt.sources.base import Source

#: The empty file that marks an Orbax v1 checkpoint.
V1_MARKER = "orbax.checkpoint"
#: Orbax v1's record of a checkpointable whose deletion started but did not finish.
DELETION_RECORD = "_CHECKPOINT_DELETION"
#: Checkpointable names Orbax reserves and never loads as checkpointables.
RESERVED_ITEMS = frozenset({"metrics", "AUTO", DELETION_RECORD})
#: The item whose tree a load gives alone when it is the only one: v1's pytree, ``CheckpointManager``'s unnamed item.
SINGLE_NAMES = ("state", "default")
#: The file a JSON item is stored in: v1 ``JsonHandler`` (``data.json``), v0 ``JsonCheckpointHandler`` (``metadata``).
JSON_FILES = ("data.json", "metadata")
#: How deep a JSON item may nest (the tree depth limit of the format).
_MAX_DEPTH = 64


@dataclass(frozen=True)
class Item:
    """One item of a layout."""

    #: Its name (the checkpointable or item name; '' for the ``item`` layout).
    name: str
    #: Its directory.
    loc: Location
    #: ``orbax`` (holds ``_METADATA``), ``xckpt`` (holds ``xckpt.json``) or ``json`` (a JSON document).
    kind: str
    #: For ``json``: the file name in the item's directory.
    file: str | None = None


@dataclass(frozen=True)
class OrbaxLayout:
    """An Orbax layout found at :attr:`loc` (see the module documentation)."""

    #: ``item``, ``v1`` or ``step``.
    kind: str
    loc: Location
    items: tuple[Item, ...]
    #: Whether the top has ``commit_success.txt``; None where nothing is there to say (a bare ``<step>/default/``).
    committed: bool | None
    #: Items left out, with why: ``(name, reason)``.
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def single(self) -> Item | None:
        """The item whose tree a load gives alone (see the module documentation), or None: a dict of items."""
        if self.kind == "item":
            return self.items[0]
        if len(self.items) == 1 and not self.skipped and self.items[0].name in SINGLE_NAMES and \
                self.items[0].kind != "json":
            return self.items[0]
        return None


def _present(store: Store, name: str) -> bool:
    """Whether ``name`` is there; a link or a special file in its place raises (``path.link``, ``path.special``)."""
    blob = store.open(name)
    if blob is None:
        return False
    blob.close()
    return True


def _json_object(store: Store, name: str) -> dict[str, Any] | None:
    """A small JSON object file of the layout (None when missing or not a JSON object)."""
    raw = store.read(name)
    if raw is None:
        return None
    try:
        obj = parse_json(raw, name, code="orbax.invalid", file=name)
    except ManifestError:
        return None
    return obj if isinstance(obj, dict) else None


def _subdirectories(loc: Location, store: Store) -> list[str]:
    """The names of the directories at the top of ``loc`` (links to directories too: reading refuses them)."""
    if isinstance(store, LocalStore):
        try:
            with os.scandir(loc.local_path) as it:
                return sorted(e.name for e in it if e.is_dir(follow_symlinks=False) or e.is_symlink())
        except OSError:
            return []
    return sorted(top_directories(store))


def _check_name(name: Any, file: str) -> str:
    """An item name must be one plain directory name inside the checkpoint."""
    if not isinstance(name, str):
        raise ManifestError(f"item name {name!r} is not a string", code="orbax.invalid", file=file)
    naming.check_relative(name, file=file, bounded=False)
    if "/" in name:
        raise UnsafePathError(f"item name {name!r} must be one plain name", file=file)
    return name


def _deleted(store: Store, loc: Location) -> str | None:
    """The checkpointable whose deletion is pending (Orbax v1's ``_CHECKPOINT_DELETION``), if any."""
    raw = store.read(DELETION_RECORD)
    if raw is None:
        return None
    file = str(loc.child(DELETION_RECORD))
    record = parse_json(raw, DELETION_RECORD, code="orbax.invalid", file=file)
    name = record.get("checkpointable_name") if isinstance(record, dict) else None
    if not isinstance(name, str):
        raise ManifestError(f"{DELETION_RECORD} names no checkpointable_name", code="orbax.invalid", file=file)
    return name


def _is_pytree_handler(handler: Any) -> bool:
    return isinstance(handler, str) and any(h in handler for h in ("PyTree", "StandardCheckpointHandler"))


def _item(store: Store, loc: Location, name: str, handler: Any) -> Item | str:
    """The item ``name``, or why it is left out."""
    if _present(store, f"{name}/{naming.MANIFEST}"):
        return Item(name, loc.child(name), "xckpt")
    if _present(store, f"{name}/{naming.ORBAX_METADATA}"):
        return Item(name, loc.child(name), "orbax")
    if handler is None or (isinstance(handler, str) and "Json" in handler):
        for file in JSON_FILES:
            if _present(store, f"{name}/{file}"):
                return Item(name, loc.child(name), "json", file)
    if _is_pytree_handler(handler):
        raise NotACheckpointError(f"item {name!r} is a pytree ({handler}) but has no {naming.ORBAX_METADATA}",
                                  code="orbax.missing", file=str(loc.child(f"{name}/{naming.ORBAX_METADATA}")))
    what = f"its handler {handler} writes" if handler is not None else "its directory holds"
    return f"{what} no _METADATA, xckpt.json or JSON document, which is what xckpt reads"


def find_layout(loc: Any, store: Store | None = None) -> OrbaxLayout | None:
    """The Orbax layout at ``loc`` (see the module documentation), or None when it holds none.

    ``store`` is a store over ``loc`` the caller already has (it is not closed). An xckpt
    checkpoint (``xckpt.json``) is no Orbax layout. Hostile names are refused: an item name
    that is not one plain name raises ``path.unsafe``, a link in place of a marker ``path.link``.
    """
    loc = Location.of(loc)
    own = store is None
    store = store if store is not None else loc.store()
    try:
        return _find(loc, store)
    finally:
        if own:
            store.close()


def _find(loc: Location, store: Store) -> OrbaxLayout | None:
    if _present(store, naming.MANIFEST):
        return None
    if _present(store, naming.ORBAX_METADATA):
        return OrbaxLayout("item", loc, (Item("", loc, "orbax"),), None)
    v1 = _present(store, V1_MARKER)
    has_meta = _present(store, naming.ORBAX_CHECKPOINT_METADATA)
    meta = _json_object(store, naming.ORBAX_CHECKPOINT_METADATA) if has_meta else None
    handlers = meta.get("item_handlers") if meta is not None else None
    meta_file = str(loc.child(naming.ORBAX_CHECKPOINT_METADATA))
    listed = isinstance(handlers, dict)  # items named by item_handlers: one that cannot be read is warned about
    if isinstance(handlers, dict):
        names = [_check_name(n, meta_file) for n in handlers]
    elif v1 or has_meta:  # no item_handlers: every subdirectory that holds an item
        names = _subdirectories(loc, store)
        handlers = {}
    else:  # a bare step directory: only CheckpointManager's unnamed item
        names, handlers = ["default"], {}
    skipped: list[tuple[str, str]] = []
    deleted = _deleted(store, loc) if v1 else None
    items: list[Item] = []
    for name in sorted(names, key=lambda n: (n != "state", n)):
        if name in RESERVED_ITEMS:
            continue
        if name == deleted:
            skipped.append((name, f"its deletion is pending ({DELETION_RECORD})"))
            continue
        found = _item(store, loc, name, handlers.get(name))
        if isinstance(found, Item):
            items.append(found)
        elif listed:
            skipped.append((name, found))
    if not items and not skipped:
        return None
    committed = store.exists(naming.COMMIT) if (v1 or has_meta) else None
    return OrbaxLayout("v1" if v1 else "step", loc, tuple(items), committed, tuple(skipped))


def holds(store: Store) -> bool:
    """Whether the directory of ``store`` holds an Orbax layout (for :mod:`xckpt.sources.detect`'s table)."""
    return find_layout(store.location, store) is not None


def orbax_item(loc: Any) -> Location | None:
    """The directory holding the ``_METADATA`` of the one Orbax item a load of ``loc`` reads, or None (no
    Orbax layout, an xckpt item, or several items: see :func:`open_layout`)."""
    layout = find_layout(loc)
    item = layout.single if layout is not None else None
    return item.loc if item is not None and item.kind == "orbax" else None


#: Opens an xckpt checkpoint from ``(loc, store)``, taking over ``store`` (as a ``Kind.open`` of detect.py).
OpenXckpt = Callable[[Location, Store], Source]


def _open_native(loc: Location, store: Store) -> Source:
    from xckpt.sources.native import open_native  # sources import this package

    try:
        return open_native(loc, store)
    except BaseException:
        store.close()
        raise


def open_layout(layout: OrbaxLayout, open_xckpt: OpenXckpt | None = None) -> Source:
    """Open what a load of ``layout`` reads: its single item, or all its items as one dict-keyed source.

    ``open_xckpt(loc, store)`` opens an item that is an xckpt checkpoint (default: the native
    reader; detect.py passes its own, which reports a replaced checkpoint as ``load.replaced``).
    Items left out are named in an :class:`~xckpt.errors.XckptWarning`; a layout with nothing
    left to read is ``orbax.unsupported``.
    """
    opener = open_xckpt or _open_native
    for name, why in layout.skipped:
        warnings.warn(f"{layout.loc}: item {name!r} is left out: {why}", XckptWarning, stacklevel=3)
    if not layout.items:
        raise UnsupportedError(f"{layout.loc} holds no item xckpt can read "
                               f"({', '.join(f'{n}: {w}' for n, w in layout.skipped)})",
                               code="orbax.unsupported", file=str(layout.loc))
    if layout.committed is False:
        warnings.warn(f"{layout.loc}: {naming.COMMIT} is missing; Orbax treats this checkpoint as unfinished",
                      XckptWarning, stacklevel=3)
    vouched = None if layout.committed is None else True  # the top's marker (or its warning) speaks for the items

    def open_item(item: Item) -> Source:
        if item.kind == "xckpt":
            return opener(item.loc, item.loc.store())
        if item.kind == "json":
            return JsonItem.open(item)
        return open_orbax(item.loc, committed=vouched)

    single = layout.single
    if single is not None:
        return open_item(single)
    parts: dict[str, Source] = {}
    try:
        for item in layout.items:
            parts[item.name] = open_item(item)
    except BaseException:
        for p in parts.values():
            p.close()
        raise
    return OrbaxComposite(layout, parts)


def open_layout_at(path: Any) -> Source:
    """Open the Orbax layout at ``path`` (:func:`find_layout`, then :func:`open_layout`); an xckpt
    checkpoint there is opened as one, and no layout is ``orbax.missing``."""
    loc = Location.of(path)
    layout = find_layout(loc)
    if layout is None:
        store = loc.store()
        try:
            is_xckpt = _present(store, naming.MANIFEST)
        finally:
            store.close()
        if is_xckpt:
            return _open_native(loc, loc.store())
        raise NotACheckpointError(f"{loc} holds no Orbax checkpoint (no {naming.ORBAX_METADATA}, no Orbax v1 "
                                  "checkpoint, no CheckpointManager step)", code="orbax.missing",
                                  file=str(loc.child(naming.ORBAX_METADATA)))
    return open_layout(layout)


def open_kind(loc: Location, store: Store, open_xckpt: OpenXckpt | None = None) -> Source:
    """Open the Orbax layout at ``loc`` for :mod:`xckpt.sources.detect`'s table: takes over ``store``;
    ``open_xckpt`` as for :func:`open_layout`."""
    try:
        layout = find_layout(loc, store)
    finally:
        store.close()
    if layout is None:
        raise NotACheckpointError(f"{loc} holds no Orbax checkpoint", code="orbax.missing",
                                  file=str(loc.child(naming.ORBAX_METADATA)))
    return open_layout(layout, open_xckpt)


# -- JSON items ------------------------------------------------------------------------------------


def _json_tree(obj: Any, key: Key, leaves: list[Entry], values: list[Any], file: str) -> Node:
    """The tree of a JSON document: objects are dicts, arrays lists, the rest value leaves."""
    if len(key) > _MAX_DEPTH:
        raise ManifestError(f"JSON document nests deeper than {_MAX_DEPTH} levels", code="orbax.tree", file=file,
                            leaf=key_str(key[:_MAX_DEPTH]))
    if isinstance(obj, dict):
        return {"kind": "dict", "items": [[k, _json_tree(v, key + (k,), leaves, values, file)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"kind": "list", "items": [_json_tree(v, key + (i,), leaves, values, file) for i, v in enumerate(obj)]}
    leaves.append(ValueEntry(key, value_type(obj)))
    values.append(obj)
    return {"kind": "leaf", "index": len(leaves) - 1}


class JsonItem:
    """A JSON item (``JsonCheckpointHandler``, v1 ``JsonHandler``) read as a tree of plain values; always
    one item of an :class:`OrbaxComposite` (a document that is a bare value is the item's value)."""

    format = "orbax"

    def __init__(self, loc: Location, manifest: Manifest, values: list[Any]) -> None:
        self.loc = loc
        self.manifest = manifest
        self._values = dict(enumerate(values))

    @classmethod
    def open(cls, item: Item) -> JsonItem:
        """Read and parse the item's document (``orbax.invalid`` when it is not JSON)."""
        assert item.file is not None
        store = item.loc.store()
        try:
            raw = store.read(item.file)
        finally:
            store.close()
        file = str(item.loc.child(item.file))
        if raw is None:
            raise NotACheckpointError(f"JSON item {item.name!r} has no {item.file}", code="orbax.missing", file=file)
        doc = parse_json(raw, item.file, code="orbax.invalid", file=file)
        leaves: list[Entry] = []
        values: list[Any] = []
        tree = _json_tree(doc, (), leaves, values, file)  # a bare value is a leaf: only ever an item of a dict
        producer = {"library": "orbax-checkpoint", "framework": "jax"}
        m = Manifest(tree=tree, leaves=leaves, producer=producer, values={"path": item.file} if leaves else None,
                     metadata={"orbax": {"json": item.file}})
        return cls(item.loc, m, values)

    def values(self) -> dict[int, Any]:
        """The document's values, by leaf index."""
        return dict(self._values)

    def read(self, requests: Sequence[ReadRequest], *, precheck: bool = False) -> int:
        """A JSON item has no arrays."""
        if requests:
            raise UnsupportedError("a JSON item has no array leaves", file=str(self.loc))
        return 0

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Nothing to check."""

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """A JSON item has no arrays."""
        raise UnsupportedError("a JSON item has no array leaves", file=str(self.loc), leaf=key_str(entry.key))

    def replaced(self) -> bool:
        """Never replaced in place."""
        return False

    def close(self) -> None:
        """Nothing held."""


# -- several items as one source -------------------------------------------------------------------


def _shift(node: Node, offset: int) -> Node:
    """A copy of a tree whose leaf indices are moved by ``offset``."""
    if node["kind"] == "leaf":
        return {"kind": "leaf", "index": node["index"] + offset}
    out = {k: v for k, v in node.items() if k != "items"}
    if node["kind"] == "dict":
        out["items"] = [[k, _shift(v, offset)] for k, v in node["items"]]
    else:
        out["items"] = [_shift(v, offset) for v in node["items"]]
    return out


class OrbaxComposite:
    """The items of an Orbax v1 checkpoint or ``CheckpointManager`` step as one source: a dict keyed by
    item name. Each leaf's key starts with its item's name and its path with ``<item>/``; reads go to the
    item's own source."""

    format = "orbax"

    def __init__(self, layout: OrbaxLayout, parts: dict[str, Source]) -> None:
        self.loc = layout.loc
        self.parts = parts
        leaves: list[Entry] = []
        items: list[list[Any]] = []
        #: key in this source -> (the item's source, the item's own entry)
        self._route: dict[Key, tuple[Source, Entry]] = {}
        self._offsets: list[tuple[Source, int]] = []
        for name, src in parts.items():
            m = src.manifest
            offset = len(leaves)
            self._offsets.append((src, offset))
            items.append([name, _shift(m.tree, offset)])
            for e in m.leaves:
                if isinstance(e, ArrayEntry):
                    mine: Entry = replace(e, key=(name,) + e.key, path=f"{name}/{e.path}")
                else:
                    mine = replace(e, key=(name,) + e.key,
                                   orbax_path=f"{name}/{e.orbax_path}" if e.orbax_path else None)
                self._route[mine.key] = (src, e)
                leaves.append(mine)
        info = {"layout": layout.kind, "items": {name: src.manifest.metadata.get("orbax", src.format)
                                                 for name, src in parts.items()}}
        self.manifest = Manifest(tree={"kind": "dict", "items": items}, leaves=leaves,
                                 producer={"library": "orbax-checkpoint", "framework": "jax"},
                                 values={"path": naming.ORBAX_METADATA}
                                 if any(isinstance(e, ValueEntry) for e in leaves) else None,
                                 metadata={"orbax": info})

    def _split(self, requests: Sequence[ReadRequest]) -> list[tuple[Source, list[ReadRequest]]]:
        groups: dict[int, tuple[Source, list[ReadRequest]]] = {}
        for r in requests:
            src, e = self._route[r.entry.key]
            assert isinstance(e, ArrayEntry)
            groups.setdefault(id(src), (src, []))[1].append(ReadRequest(e, r.region, r.out))
        return list(groups.values())

    def values(self) -> dict[int, Any]:
        """Every item's value leaves, by leaf index in this source."""
        out: dict[int, Any] = {}
        for src, offset in self._offsets:
            for i, v in src.values().items():
                out[offset + i] = v
        return out

    def read(self, requests: Sequence[ReadRequest], *, precheck: bool = False) -> int:
        """Fill each request from its item."""
        return sum(src.read(reqs, precheck=precheck) for src, reqs in self._split(requests))

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Check each request in its item."""
        for src, reqs in self._split(requests):
            src.check(reqs)

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """The item's TensorStore view of the array."""
        src, e = self._route[entry.key]
        assert isinstance(e, ArrayEntry)
        return src.open_array(e)

    def replaced(self) -> bool:
        """Whether any item was replaced."""
        return any(src.replaced() for src in self.parts.values())

    def close(self) -> None:
        """Close every item."""
        errors = []
        for src in self.parts.values():
            try:
                src.close()
            except Exception as exc:  # noqa: BLE001 - close the others, then raise the first
                errors.append(exc)
        if errors:
            raise errors[0]


def orbax_to_xckpt(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Convert the Orbax checkpoint at ``src`` into an xckpt checkpoint at ``dst``, leaf by leaf.

    ``src`` is any layout :func:`~xckpt.interop.orbax.layouts.find_layout` recognises: an item
    (``_METADATA``), an Orbax v1 checkpoint, a ``CheckpointManager`` step directory.
    """
    ckpt = open_layout_at(src)
    try:
        copy_checkpoint(ckpt, dst, overwrite=overwrite)
    finally:
        ckpt.close()


#: The converters this module offers (entry point ``xckpt.converters``: ``orbax``).
CONVERTERS = {("orbax", "xckpt"): orbax_to_xckpt}
