"""``XckptStorageWriter``: torch DCP writes an xckpt checkpoint.

DCP plans and deduplicates; the coordinator's global planning step picks each
array's chunk grid from all ranks' chunks and a temporary directory; each rank
writes its chunks straight into the Zarr arrays (zero-copy from CPU tensors,
staged from CUDA); values are msgpack-encoded on the rank that holds them;
``finish`` writes zarr.json files, values, Orbax files and the manifest through the
core and commits by rename.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from xckpt import registry
from xckpt.engine import collective, failpoints
from xckpt.engine.claims import new_generation
from xckpt.engine.commit import Hold, SaveOptions, check_target, discard, publish, write_commit_files
from xckpt.engine.plan import INNER_CHUNK_BYTES, Descriptors, LeafDesc, local_plan, plan_save
from xckpt.engine.protocol import plan_chunks, zarr_files
from xckpt.engine.storage import Location
from xckpt.engine.write import MAX_INFLIGHT_BYTES, ChunkWriter
from xckpt.errors import SaveError, UnsupportedError, XckptError
from xckpt.format import values
from xckpt.format.regions import Region
from xckpt.format.tree import Value, flatten

from .dcp_planners import plain_value, raw_object
from .dcp_tree import as_leaf, insert, key_of, listify
from .staging import to_host
from .tensors import logical_dtype


def _region(item: Any) -> Region:
    td = item.tensor_data
    return Region(tuple(int(o) for o in td.chunk.offsets), tuple(int(n) for n in td.chunk.sizes))


def _array_descs(plan: SavePlan, mappings: dict[str, Any]) -> tuple[Descriptors, list[str]]:
    """The arrays one rank's DCP plan writes, as xckpt descriptors (regions it holds), and their DCP names."""
    found: dict[str, LeafDesc] = {}
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            continue
        td = item.tensor_data
        d = found.get(item.index.fqn)
        if d is None:
            d = found[item.index.fqn] = LeafDesc(key_of(item.index.fqn, mappings), "array",
                                                 tuple(int(n) for n in td.size), logical_dtype(td.properties.dtype),
                                                 (), sharding={"framework": "torch",
                                                               "via": "torch.distributed.checkpoint"})
        d.regions = d.regions + (_region(item),)
    tree: dict[Any, Any] = {}
    for d in found.values():
        insert(tree, d.key, 0)
    structure, leaves = flatten(listify(tree))
    order = {key: i for i, (key, _) in enumerate(leaves)}
    fqns = sorted(found, key=lambda f: order[found[f].key])
    return Descriptors(structure, [found[f] for f in fqns]), fqns


class XckptStorageWriter(StorageWriter):
    """DCP ``StorageWriter`` producing an xckpt checkpoint at ``path``."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, overwrite: bool = False,
                 compression: str = "none", inner_chunk_bytes: int = INNER_CHUNK_BYTES,
                 max_inflight_bytes: int = MAX_INFLIGHT_BYTES, metadata: dict[str, Any] | None = None) -> None:
        self.path = path
        self.options = SaveOptions(overwrite=overwrite, compression=compression,
                                   inner_chunk_bytes=inner_chunk_bytes, max_inflight_bytes=max_inflight_bytes,
                                   metadata=dict(metadata or {}),
                                   producer={"framework": "torch", "framework_version": torch.__version__,
                                             "via": "torch.distributed.checkpoint"})
        self.is_coordinator = False
        self._tmp: Location | None = None
        self._hold: Hold | None = None  # the coordinator's hold on the destination, from planning to the commit

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new checkpoint (``checkpoint_id`` is its path)."""
        if checkpoint_id is not None:
            self.path = checkpoint_id
        if self._hold is not None:  # the last save through this writer failed before finish()
            discard(self._hold.tmp, [], hold=self._hold)
        self._tmp = None
        self._hold = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember whether this rank coordinates."""
        self.is_coordinator = is_coordinator
        if self.path is None:
            raise SaveError("XckptStorageWriter has no path: pass one or a checkpoint_id")
        if kwargs.get("use_collectives") is False and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise UnsupportedError("XckptStorageWriter needs DCP's collectives (use_collectives=True): the "
                                   "coordinator plans every rank's chunks and commits once", code="dcp.collectives")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add locally."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: plan every array's chunk objects from every rank's chunks, and a temporary directory."""
        final = Location.of(self.path)  # type: ignore[arg-type]
        target = check_target(final, self.options)
        mappings: dict[str, Any] = {}
        for p in plans:
            mappings.update(p.planner_data or {})
        described = [_array_descs(p, mappings) for p in plans]
        _, answers = plan_save([([r], d) for r, (d, _) in enumerate(described)], len(plans),
                               inner_chunk_bytes=self.options.inner_chunk_bytes)
        self._hold = Hold(target, new_generation(), self.options.stale_after())
        self._tmp = self._hold.tmp
        return [dataclasses.replace(p, storage_data={"tmp": self._tmp.url, "descs": d.to_wire(), "fqns": fqns,
                                                     "answer": a, "generation": self._hold.generation})
                for p, (d, fqns), a in zip(plans, described, answers)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's chunk objects (and the zarr.json of arrays it starts); encode its values.

        The ranks then agree (a collective step) that every one succeeded; if any failed, each
        removes what it wrote and the coordinator the temporary directory, since DCP does not
        call :meth:`finish` after a failed write.
        """
        written: list[str] = []
        tmp = Location(plan.storage_data["tmp"])
        coord = registry.default_coordinator() or collective.LocalCoordinator()
        result, error = None, None
        try:
            result = self._write(plan, planner, written)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement
            error = exc
        try:
            collective.agree_step(coord, f"save to {self.path}", lambda: _reraise(error))
        except BaseException:
            discard(tmp, written, hold=self._hold if self.is_coordinator else None)
            if self.is_coordinator:
                self._hold = None
            raise
        assert result is not None
        done: Future[list[WriteResult]] = Future()
        done.set_result(result)
        return done

    def _write(self, plan: SavePlan, planner: SavePlanner, written: list[str]) -> list[WriteResult]:
        data = plan.storage_data
        tmp = Location(data["tmp"])
        descs = Descriptors.from_wire(data["descs"])
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        local = local_plan(descs, data["answer"], rank)
        items = {(item.index.fqn, _region(item)): item for item in plan.items
                 if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None}
        results: list[WriteResult] = []
        fqns = data["fqns"]
        jobs = plan_chunks(local, descs, lambda pos, piece: to_host(planner.resolve_data(items[(fqns[pos], piece)])),
                           self.options.compression)
        store = tmp.store(create=True)
        w = ChunkWriter(store, data["generation"], self.options.max_inflight_bytes)
        try:
            with w:
                for name, meta in zarr_files(local, descs, self.options.compression):
                    w.file(name, meta)
                for name, geom, chunk, leaf in jobs:
                    w.chunk(name, geom, chunk, leaf)
            w.sync()
        finally:
            written.extend(w.names)
            store.close()
        failpoints.hit("after_write", rank)
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                try:
                    blob = values.encode(plain_value(raw_object(planner, item)))
                except XckptError as exc:
                    raise UnsupportedError(f"cannot store this value without pickle: {exc.message}",
                                           code="value.unsupported", leaf=item.index.fqn) from exc
                results.append(WriteResult(index=item.index, size_in_bytes=len(blob), storage_data={"value": blob}))
            else:
                results.append(WriteResult(index=item.index, size_in_bytes=_region(item).numel, storage_data=None))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write values, the Orbax view and the manifest through the core, then commit."""
        assert self._tmp is not None and self._hold is not None, "finish() called before prepare_global_plan()"
        hold, self._hold = self._hold, None
        try:
            plan, vals = self._final_plan(metadata, results)
            store = self._tmp.store(create=True)
            try:
                write_commit_files(store, plan, vals, self.options, hold.generation, hold=hold)
            finally:
                store.close()
            publish(self._tmp, hold.target, hold.generation)
        except BaseException:
            discard(self._tmp, [], hold=hold)
            raise
        hold.end()

    def _final_plan(self, metadata: Metadata, results: list[list[WriteResult]]) -> tuple[Any, dict[int, Any]]:
        """The plan of the whole checkpoint (arrays as the ranks wrote them, and the values), for the commit."""
        mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        decoded: dict[str, Any] = {}
        for rs in results:
            for r in rs:
                if isinstance(r.storage_data, dict) and "value" in r.storage_data:
                    decoded[r.index.fqn] = values.decode(r.storage_data["value"])
        tree: dict[Any, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                if fqn not in decoded:
                    raise SaveError("no rank wrote this value", leaf=fqn)
                insert(tree, key_of(fqn, mappings), as_leaf(decoded[fqn]))
            else:
                insert(tree, key_of(fqn, mappings), _Stored(fqn))
        structure, leaves = flatten(listify(tree))
        descs, vals = [], {}
        for i, (key, leaf) in enumerate(leaves):
            if isinstance(leaf, _Stored):
                md = metadata.state_dict_metadata[leaf.fqn]
                regions = tuple(Region(tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes))
                                for c in md.chunks)
                descs.append(LeafDesc(key, "array", tuple(int(n) for n in md.size),
                                      logical_dtype(md.properties.dtype), regions,
                                      sharding={"framework": "torch", "via": "torch.distributed.checkpoint"}))
            else:
                value = leaf.value if isinstance(leaf, Value) else leaf
                descs.append(LeafDesc(key, "value", value_type=values.value_type(value)))
                vals[i] = value
        plan, _ = plan_save([([0], Descriptors(structure, descs))], 1,
                            inner_chunk_bytes=self.options.inner_chunk_bytes)
        return plan, vals

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any path or URL."""
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint path, for DCP's logging."""
        return StorageMeta(checkpoint_id=self.path)


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Placeholder leaf for an array whose chunks the ranks already wrote."""

    fqn: str
