"""Committing a save: where it is written first, the files the coordinating process adds, the move into place.

On a local file system every process writes into a hidden temporary directory beside
the target; once every chunk is written and synced, the coordinating process writes the
values, the Orbax view, the manifest and ``commit_success.txt``, syncs them and renames
the directory into place (then syncs the parent). On an object store there is no
rename: the prefix is written in place and the manifest, written last, is the commit.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import tensorstore as ts

from xckpt._version import __version__
from xckpt.engine.plan import ArrayPlan, GlobalPlan, LeafLayout
from xckpt.engine.storage import Location, Store
from xckpt.engine.write import ChunkWriter
from xckpt.errors import CollectiveError, SaveError, XckptError
from xckpt.format import dtypes, names, orbax_view, values as values_format, zarr
from xckpt.format.manifest import ArrayEntry, Entry, Manifest, StoredArray, ValueEntry
from xckpt.format.tree import Key

COMMIT_TEXT = b"xckpt checkpoint committed\n"


@dataclass
class SaveOptions:
    """Options of one save."""

    overwrite: bool = False
    compression: str = "none"
    inner_chunk_bytes: int = 4 << 20
    max_inflight_bytes: int = 256 << 20
    metadata: dict[str, Any] = field(default_factory=dict)
    producer: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Refuse options the format does not know."""
        if self.compression not in zarr.COMPRESSIONS:
            raise SaveError(f"compression must be one of {zarr.COMPRESSIONS}, not {self.compression!r}")


def temporary_sibling(final: Location) -> Location:
    """Where a save writes before it commits: a fresh hidden directory beside ``final`` (local), else ``final``."""
    if not final.is_local:
        return final
    parent, name = os.path.split(final.local_path.rstrip("/"))
    return Location(os.path.join(parent, f".{name}.xckpt-tmp-{uuid.uuid4().hex[:12]}"))


def check_target(final: Location, opts: SaveOptions) -> None:
    """Refuse to replace a checkpoint unless asked; on object stores, clear an uncommitted prefix.

    Object stores have no atomic rename, so the manifest written last is the commit and
    an existing committed checkpoint is never overwritten in place.
    """
    if final.is_local:
        if os.path.lexists(final.local_path) and not opts.overwrite:
            raise SaveError(f"{final.local_path} already exists; pass overwrite=True to replace it",
                            code="save.exists", file=final.local_path)
        return
    store = final.store()
    if store.exists(names.MANIFEST):
        raise SaveError(f"{final} holds a committed checkpoint; object stores cannot replace one atomically, "
                        "so save to a new prefix", code="save.exists", file=str(final))
    remove(final)  # leftovers of a save that never committed


def publish(tmp: Location, final: Location, *, overwrite: bool) -> None:
    """Move a completely written checkpoint from ``tmp`` to ``final`` (local file systems).

    With ``overwrite``, an existing checkpoint at ``final`` is moved aside first and removed
    only after the new one is in place, so a crash leaves one of them whole. The parent
    directory is synced afterwards, so the rename itself is durable.
    """
    if tmp == final:
        return
    target = final.local_path
    old = None
    if os.path.lexists(target):
        if not overwrite:
            raise SaveError(f"{target} already exists; pass overwrite=True to replace it",
                            code="save.exists", file=target)
        old = tmp.local_path + ".old"
        os.rename(target, old)
    try:
        os.rename(tmp.local_path, target)
    except OSError:
        if old is not None:
            os.rename(old, target)
        raise
    _sync_dir(os.path.dirname(target) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(loc: Location) -> None:
    """Delete everything under ``loc`` (best effort; used to clean up a failed save)."""
    if loc.is_local:
        shutil.rmtree(loc.local_path, ignore_errors=True)
        return
    try:
        ts.KvStore.open(loc.kvstore()).result().delete_range(ts.KvStore.KeyRange()).result()
    except Exception:  # noqa: BLE001 - cleanup is best effort
        pass


def stored_arrays(a: ArrayPlan | LeafLayout) -> list[tuple[str, StoredArray]]:
    """``(path from the checkpoint root, array)`` of each Zarr array a leaf is stored as (segment paths in
    the array are relative to the leaf's group)."""
    if len(a.segments) == 1:
        s, inner = a.segments[0]
        return [(a.name, StoredArray(a.name, s.offset, s.shape, s.chunk, inner))]
    return [(f"{a.name}/{n}", StoredArray(str(n), s.offset, s.shape, s.chunk, inner))
            for n, (s, inner) in enumerate(a.segments)]


def array_metadata(a: ArrayPlan | LeafLayout, dtype: str, segment: int, compression: str) -> tuple[str, bytes]:
    """``(object name, bytes)`` of the ``zarr.json`` of one segment (-1: the group of a segmented leaf)."""
    arrays = stored_arrays(a)
    if segment < 0:
        meta = zarr.group_metadata([{"path": s.path, "offset": list(s.offset), "shape": list(s.shape)}
                                    for _, s in arrays])
        return f"{a.name}/{zarr.METADATA}", zarr.encode_metadata(meta)
    path, s = arrays[segment]
    meta = zarr.zarr_metadata(s.shape, dtypes.storage_name(dtype), s.chunk_shape, s.inner_chunk_shape, compression)
    return f"{path}/{zarr.METADATA}", zarr.encode_metadata(meta)


def array_entry(a: ArrayPlan, compression: str) -> ArrayEntry:
    """The manifest entry of a planned array leaf."""
    arrays = stored_arrays(a)
    sharding = dict(a.sharding or {})
    sharding.setdefault("shard_shape", list(arrays[0][1].chunk_shape))
    sharding.setdefault("num_shards", a.n_pieces)
    if a.segmented:
        return ArrayEntry(a.key, a.name, a.shape, a.dtype, dtypes.storage_name(a.dtype), (), (), compression,
                          sharding, tuple(s for _, s in arrays))
    s = arrays[0][1]
    return ArrayEntry(a.key, a.name, a.shape, a.dtype, dtypes.storage_name(a.dtype), s.chunk_shape,
                      s.inner_chunk_shape, compression, sharding)


def build_manifest(plan: GlobalPlan, values: dict[int, Any], opts: SaveOptions, producer: dict[str, Any],
                   values_info: dict[str, Any] | None) -> Manifest:
    """The manifest of a planned save whose value leaves are ``values`` (by leaf index)."""
    entries: list[Entry] = []
    for i, key in enumerate(plan.keys):
        a = plan.arrays.get(i)
        if a is not None:
            entries.append(array_entry(a, opts.compression))
        else:
            mirror = names.storage_name(key) if orbax_view.mirrors(values[i]) else None
            entries.append(ValueEntry(key, plan.kinds[i], mirror))
    meta = dict(opts.metadata)
    return Manifest(tree=plan.tree, leaves=entries, producer=producer, values=values_info, metadata=meta)


def producer_of(plan: GlobalPlan, opts: SaveOptions) -> dict[str, Any]:
    """Who wrote the checkpoint: xckpt, and the framework the adapters recorded in each leaf's sharding."""
    out: dict[str, Any] = {"library": "xckpt", "library_version": __version__}
    for a in plan.arrays.values():
        info = a.sharding or {}
        if info.get("framework"):
            out["framework"] = str(info["framework"])
            if info.get("framework_version"):
                out["framework_version"] = str(info["framework_version"])
            break
    else:
        out.update(framework="numpy", framework_version=np.__version__)
    out.update(opts.producer)
    return out


def write_commit_files(store: Store, plan: GlobalPlan, values: dict[int, Any], opts: SaveOptions) -> Manifest:
    """The coordinating process's part of the commit, into the (temporary) checkpoint; returns the manifest.

    Writes the ``zarr.json`` of arrays with no element (no process wrote a chunk of them), the
    values file, the Orbax view (0-d mirrors of numeric values, ``_METADATA``,
    ``_CHECKPOINT_METADATA``, ``_strings.json``), the manifest and the commit marker, in that
    order, and syncs them.
    """
    with ChunkWriter(store, opts.max_inflight_bytes) as w:
        for i, a in plan.arrays.items():
            if math.prod(a.shape) == 0:
                for seg in range(-1 if a.segmented else 0, len(a.segments)):
                    w.file(*array_metadata(a, a.dtype, seg, opts.compression))
        values_info = None
        if values:
            blob = values_format.encode({i: values[i] for i in sorted(values)})
            w.file(names.VALUES, blob)
            values_info = {"path": names.VALUES, "size": len(blob), "crc32c": crc32c.crc32c(blob)}
        manifest = build_manifest(plan, values, opts, producer_of(plan, opts), values_info)
        strings: dict[Key, str] = {}
        for i, e in enumerate(manifest.leaves):
            if isinstance(e, ValueEntry) and e.orbax_path:
                meta, data = orbax_view.scalar_array(values[i])
                w.file(f"{e.orbax_path}/{zarr.METADATA}", zarr.encode_metadata(meta))
                w.chunk(f"{e.orbax_path}/{zarr.chunk_key(())}", zarr.geometry(meta["data_type"], (), (), "none"),
                        data, e.orbax_path)
            elif isinstance(e, ValueEntry) and e.type == "str":
                strings[e.key] = values[i]
        for name, data in orbax_view.files(manifest, strings).items():
            w.file(name, data)
    store.write(names.MANIFEST, manifest.dumps())
    store.write(names.COMMIT, COMMIT_TEXT)
    store.sync()
    return manifest


def commit_failed(final: Location, error: BaseException) -> XckptError:
    """The error a failed save raises: nothing was committed at ``final``."""
    if isinstance(error, CollectiveError) or (isinstance(error, SaveError)
                                              and error.message.startswith(f"save to {final} failed")):
        return error
    err = SaveError(f"save to {final} failed; nothing was committed: {error}", file=str(final))
    err.__cause__ = error
    return err
