"""Saving: flatten, plan collectively, write every assigned region concurrently, commit.

The steps are kept apart so that an asynchronous save can run the writing and
the commit in the background (:mod:`xckpt.save_async`):

1. :func:`prepare` (collective): flatten the tree, gather every process's shard
   descriptors, plan who writes which region.
2. :func:`write_local` (no collective): this process writes its regions, with a
   bounded number of bytes in flight.
3. :func:`commit` (collective): gather success, then the coordinating process writes
   ``zarr.json`` files, values, the Orbax files, the manifest and ``commit_success.txt``,
   and moves the checkpoint into place.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import numpy as np

from xckpt import __version__, registry
from xckpt.format import zarr as arrays, dtypes, names as naming, values
from xckpt.engine import storage
from xckpt.engine import collective as coordmod
from xckpt.engine.collective import Coordinator, LocalCoordinator
from xckpt.errors import CoordinationError, SaveError, TreeError, XckptError
from xckpt.format.manifest import ArrayEntry, Manifest, ValueEntry
from xckpt.interop.orbax import files as orbax_files
from xckpt.engine.plan import INNER_CHUNK_BYTES, LeafDesc, SavePlan, plan_save
from xckpt.registry import ArraySource, Shard
from xckpt.engine.storage import Location
from xckpt.format.tree import Key, Node, Value, flatten, key_str
from xckpt.engine.write import RegionWriter

#: Default bound on host bytes handed to TensorStore and not yet written, per process.
MAX_INFLIGHT_BYTES = 256 << 20
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


@dataclass
class SaveOptions:
    """Options of one save."""

    overwrite: bool = False
    compression: str = "none"
    inner_chunk_bytes: int = INNER_CHUNK_BYTES
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES
    metadata: dict[str, Any] = field(default_factory=dict)
    producer: dict[str, Any] = field(default_factory=dict)


@dataclass
class PreparedSave:
    """The state carried from :func:`prepare` to :func:`write_local` and :func:`commit`."""

    final: Location
    tmp: Location
    coord: Coordinator
    structure: Node
    keys: list[Key]
    sources: list[ArraySource | Any]
    descs: list[LeafDesc]
    plan: SavePlan
    names: dict[Key, str]
    options: SaveOptions
    bytes_written: int = 0
    stats: dict[str, float] = field(default_factory=dict)


def _source(key: Key, obj: Any) -> tuple[ArraySource | Any, LeafDesc]:
    if isinstance(obj, Value):
        return obj.value, LeafDesc(key, "value", value_type=values.value_type(obj.value))
    if isinstance(obj, _SCALARS) and not isinstance(obj, np.generic):  # np.float64 subclasses float
        return obj, LeafDesc(key, "value", value_type=values.value_type(obj))
    make = registry.source_for(obj)
    if make is None:
        raise TreeError(f"cannot save a leaf of type {type(obj).__module__}.{type(obj).__qualname__}",
                        code="tree.unsupported_leaf", leaf=key_str(key))
    src = make(obj)
    dtypes.numpy_dtype(src.dtype)
    return src, LeafDesc(key, "array", tuple(int(s) for s in src.shape), src.dtype,
                         tuple(s.region for s in src.shards), sharding=src.sharding)


def prepare(tree: Any, path: Any, *, coordinator: Coordinator | None = None,
            options: SaveOptions | None = None) -> PreparedSave:
    """Collective step 1: flatten, gather descriptors, plan. Every process calls it."""
    registry.autoload()
    coord = coordinator or registry.default_coordinator() or LocalCoordinator()
    opts = options or SaveOptions()
    if opts.compression not in arrays.COMPRESSIONS:
        raise SaveError(f"compression must be one of {arrays.COMPRESSIONS}, not {opts.compression!r}")
    final = Location.of(path)
    error = None
    structure: Node = {}
    keys: list[Key] = []
    sources: list[Any] = []
    descs: list[LeafDesc] = []
    names: dict[Key, str] = {}
    tmp_url = ""
    try:
        structure, leaves = flatten(tree, registry.save_view)
        for key, obj in leaves:
            src, desc = _source(key, obj)
            keys.append(key)
            sources.append(src)
            descs.append(desc)
        names = storage_names(descs, sources)
        if coord.rank == 0:
            check_target(final, opts)
            tmp_url = storage.temporary_sibling(final).url
    except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
        raised: XckptError | None = exc if isinstance(exc, XckptError) else SaveError(
            f"cannot prepare the save: {type(exc).__name__}: {exc}")
        error = str(raised)
    else:
        raised = None
    gathered = coordmod.all_gather(coord, {"error": error, "tmp": tmp_url,
                                           "descs": [d.to_wire() for d in descs] if error is None else []})
    failures = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if failures:
        if raised is not None:
            raise raised
        raise CoordinationError(f"rank {failures[0][0]} failed to prepare the save: {failures[0][1]}")
    per_rank = [[LeafDesc.from_wire(w) for w in g["descs"]] for g in gathered]
    plan = plan_save(per_rank, inner_chunk_bytes=opts.inner_chunk_bytes)
    return PreparedSave(final, Location(gathered[0]["tmp"]), coord, structure, keys, sources, descs, plan,
                        names, opts)


def storage_names(descs: list[LeafDesc], sources: list[Any]) -> dict[Key, str]:
    """Storage names of the array leaves; refuses two leaves that Orbax would store under one name
    (arrays, scalar values mirrored as 0-d arrays, and strings share Orbax's namespace)."""
    naming.check_unique([d.key for d, s in zip(descs, sources)
                         if d.kind == "array" or orbax_files.mirrors(s) or isinstance(s, str)])
    return naming.check_unique(d.key for d in descs if d.kind == "array")


def assigned_shards(p: PreparedSave) -> list[tuple[int, Shard]]:
    """``(leaf index, shard)`` of every region this process writes, in plan order.

    Starts every shard's ``prefetch`` (its device-to-host copy) before returning, so no
    copy waits for another to be fetched first.
    """
    out = []
    for i, region in p.plan.assigned(p.coord.rank):
        shard = next((s for s in p.sources[i].shards if s.region == region), None)
        if shard is None:
            raise SaveError("planned region is not held by this process", leaf=key_str(p.keys[i]))
        out.append((i, shard))
    for _, shard in out:
        if shard.prefetch is not None:
            shard.prefetch()
    return out


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
    if storage.exists(final, naming.MANIFEST):
        raise SaveError(f"{final} holds a committed checkpoint; object stores cannot replace one atomically, "
                        "so save to a new prefix", code="save.exists", file=str(final))
    storage.remove(final)  # leftovers of a save that never committed


def write_local(p: PreparedSave) -> int:
    """Step 2: write every region assigned to this process. Returns the bytes written.

    At most ``max_inflight_bytes`` of fetched host data is held at once (see
    :class:`~xckpt.engine.write.RegionWriter`).
    """
    started = time.perf_counter()
    with RegionWriter(p.tmp, p.options.max_inflight_bytes) as w:
        for i, shard in assigned_shards(p):
            lp = p.plan.leaves[i]
            assert lp is not None
            w.write(p.names[lp.key], _metadata(lp, p.options), shard.region, shard.fetch(), lp.dtype,
                    key_str(lp.key))
    p.bytes_written = w.bytes_written
    p.stats["write_s"] = time.perf_counter() - started
    return w.bytes_written


def _metadata(lp: Any, opts: SaveOptions) -> dict[str, Any]:
    return arrays.zarr_metadata(lp.shape, dtypes.storage_name(lp.dtype), lp.chunk_shape, lp.inner_chunk_shape,
                                opts.compression)


def build_manifest(p: PreparedSave, values_info: dict[str, Any] | None) -> Manifest:
    """The manifest of a prepared save."""
    entries: list[ArrayEntry | ValueEntry] = []
    for i, d in enumerate(p.descs):
        lp = p.plan.leaves[i]
        if lp is None:
            orbax = naming.storage_name(d.key) if orbax_files.mirrors(p.sources[i]) else None
            entries.append(ValueEntry(d.key, d.value_type, orbax))
            continue
        sharding = dict(lp.sharding or {})
        sharding.setdefault("shard_shape", list(lp.chunk_shape))
        sharding.setdefault("num_shards", len(lp.writers))
        entries.append(ArrayEntry(d.key, p.names[d.key], lp.shape, lp.dtype, dtypes.storage_name(lp.dtype),
                                  lp.chunk_shape, lp.inner_chunk_shape, p.options.compression, sharding))
    producer = {"library": "xckpt", "library_version": __version__, **_framework(p)}
    producer.update(p.options.producer)
    return Manifest(tree=p.structure, leaves=entries, producer=producer, values=values_info,
                    metadata=dict(p.options.metadata))


def _framework(p: PreparedSave) -> dict[str, str]:
    """The framework that produced the arrays, as the adapters record it in each leaf's sharding."""
    for lp in p.plan.leaves:
        info = lp.sharding if lp is not None else None
        if info and info.get("framework"):
            out = {"framework": str(info["framework"])}
            if info.get("framework_version"):
                out["framework_version"] = str(info["framework_version"])
            return out
    return {"framework": "numpy", "framework_version": np.__version__}


def commit(p: PreparedSave, local_error: BaseException | None = None) -> Manifest:
    """Collective step 3: agree that every write succeeded, then write the metadata and commit."""
    statuses = coordmod.all_gather(p.coord, {"error": None if local_error is None else repr(local_error),
                                             "bytes": p.bytes_written})
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
    p.stats["bytes_per_rank"] = [s["bytes"] for s in statuses]  # type: ignore[assignment]
    outcome: dict[str, Any] = {"error": None}
    manifest: Manifest | None = None
    if p.coord.rank == 0:
        try:
            if failed:
                raise SaveError(f"rank {failed[0][0]} failed while writing: {failed[0][1]}")
            manifest = write_metadata(p)
            storage.publish(p.tmp, p.final, overwrite=p.options.overwrite)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
            storage.remove(p.tmp)  # a temp dir, or an object-store prefix holding no committed checkpoint
            outcome = {"error": str(exc)}
            if p.coord.world_size == 1:
                raise exc if isinstance(exc, XckptError) else SaveError(str(exc)) from exc
    outcome = coordmod.broadcast(p.coord, outcome)
    if outcome["error"]:
        raise SaveError(f"save to {p.final} failed; nothing was committed: {outcome['error']}",
                        file=str(p.final))
    return manifest if manifest is not None else build_manifest(p, None)


def write_metadata(p: PreparedSave) -> Manifest:
    """The coordinating process's commit work: zarr.json files, values, Orbax files, manifest, marker."""
    value_leaves = {i: p.sources[i] for i, d in enumerate(p.descs) if d.kind == "value"}
    for i, lp in enumerate(p.plan.leaves):
        if lp is not None:
            arrays.create(p.tmp, p.names[lp.key], _metadata(lp, p.options))
    values_info = None
    if value_leaves:
        blob = values.encode({i: v for i, v in value_leaves.items()})
        storage.write_bytes(p.tmp, naming.VALUES, blob)
        values_info = {"path": naming.VALUES, "size": len(blob), "crc32c": google_crc32c.value(blob)}
    manifest = build_manifest(p, values_info)
    for i, e in enumerate(manifest.leaves):
        if isinstance(e, ValueEntry) and e.orbax_path:
            orbax_files.write_scalar(p.tmp, e.orbax_path, value_leaves[i])
    strings = {e.key: value_leaves[i] for i, e in enumerate(manifest.leaves)
               if isinstance(e, ValueEntry) and e.type == "str"}
    for name, data in orbax_files.files(manifest, strings).items():
        storage.write_bytes(p.tmp, name, data)
    storage.write_bytes(p.tmp, naming.MANIFEST, manifest.dumps())
    storage.write_bytes(p.tmp, naming.COMMIT, b"xckpt checkpoint committed\n")
    return manifest


def save(tree: Any, path: Any, *, coordinator: Coordinator | None = None, overwrite: bool = False,
         compression: str = "none", metadata: dict[str, Any] | None = None,
         max_inflight_bytes: int = MAX_INFLIGHT_BYTES, inner_chunk_bytes: int = INNER_CHUNK_BYTES) -> Manifest:
    """Save ``tree`` to ``path``; in a distributed job every process calls it.

    Each process writes only the regions the plan assigns it; the checkpoint appears
    at ``path`` only once complete. Returns the manifest written.
    """
    from xckpt.save_async import wait_pending  # a pending asynchronous save finishes first
    wait_pending()
    opts = SaveOptions(overwrite=overwrite, compression=compression, metadata=dict(metadata or {}),
                       max_inflight_bytes=max_inflight_bytes, inner_chunk_bytes=inner_chunk_bytes)
    p = prepare(tree, path, coordinator=coordinator, options=opts)
    error: BaseException | None = None
    try:
        write_local(p)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the commit collective
        error = exc
    if error is not None and p.coord.world_size == 1:
        storage.remove(p.tmp)
        raise SaveError(f"save to {p.final} failed; nothing was committed: {error}", file=str(p.final)) from error
    return commit(p, error)
