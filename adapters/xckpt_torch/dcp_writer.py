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

from xckpt.format import zarr as arrays, dtypes as xdtypes, names as naming, values
from xckpt.engine import storage
from xckpt.engine.collective import LocalCoordinator
from xckpt.errors import SaveError, ShapeError, UnsupportedError, XckptError
from xckpt.engine.plan import INNER_CHUNK_BYTES, LeafDesc, LeafPlan, SavePlan as XSavePlan
from xckpt.engine.regions import Region, check_tiling, chunk_shape_for, inner_chunk_shape_for
from xckpt.save import MAX_INFLIGHT_BYTES, PreparedSave, SaveOptions, check_target, storage_names, write_metadata
from xckpt.engine.write import RegionWriter
from xckpt.engine.storage import Location
from xckpt.format.tree import Value, flatten

from .dcp_planners import raw_object
from .dcp_tree import as_leaf, insert, key_of, listify
from .tensors import logical_dtype, to_host


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
        self._layout: dict[str, dict[str, Any]] = {}
        self._tmp: Location | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new checkpoint (``checkpoint_id`` is its path)."""
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._layout = {}
        self._tmp = None

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
        """Coordinator: pick each array's chunk grid from every rank's chunks, and a temporary directory."""
        final = Location.of(self.path)  # type: ignore[arg-type]
        check_target(final, self.options)
        mappings: dict[str, Any] = {}
        for p in plans:
            mappings.update(p.planner_data or {})
        found: dict[str, dict[str, Any]] = {}
        for p in plans:
            for item in p.items:
                if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                    continue
                td = item.tensor_data
                a = found.setdefault(item.index.fqn, {
                    "key": key_of(item.index.fqn, mappings), "shape": tuple(int(s) for s in td.size),
                    "dtype": logical_dtype(td.properties.dtype), "regions": set()})
                a["regions"].add(Region(tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes)))
        names = naming.check_unique(a["key"] for a in found.values())
        layout = {}
        for fqn, a in found.items():
            regions = sorted(a["regions"])
            why = check_tiling(a["shape"], regions)
            if why is not None:
                raise ShapeError(f"the chunks DCP planned do not tile the tensor: {why}", code="shape.tiling",
                                 leaf=fqn)
            chunk = chunk_shape_for(a["shape"], regions)
            inner = inner_chunk_shape_for(chunk, xdtypes.itemsize(a["dtype"]), self.options.inner_chunk_bytes)
            layout[fqn] = {"name": names[a["key"]], "key": list(a["key"]), "shape": list(a["shape"]),
                           "dtype": a["dtype"], "chunk": list(chunk), "inner": list(inner)}
        self._layout = layout
        self._tmp = storage.temporary_sibling(final)
        out = []
        for p in plans:
            mine = {i.index.fqn for i in p.items if i.index.fqn in layout}
            out.append(dataclasses.replace(p, storage_data={"tmp": self._tmp.url,
                                                            "layout": {f: layout[f] for f in mine}}))
        return out

    def _zarr(self, spec: dict[str, Any]) -> dict[str, Any]:
        return arrays.zarr_metadata(spec["shape"], xdtypes.storage_name(spec["dtype"]), spec["chunk"],
                                    spec["inner"], self.options.compression)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's chunks into the arrays; encode its values with msgpack."""
        data = plan.storage_data
        tmp = Location(data["tmp"])
        layout = data["layout"]
        results: list[WriteResult] = []
        with RegionWriter(tmp, self.options.max_inflight_bytes) as writer:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    try:
                        blob = values.encode(raw_object(planner, item))
                    except XckptError as exc:
                        raise UnsupportedError(f"cannot store this value without pickle: {exc.message}",
                                               code="value.unsupported", leaf=item.index.fqn) from exc
                    results.append(WriteResult(index=item.index, size_in_bytes=len(blob),
                                               storage_data={"value": blob}))
                    continue
                spec = layout[item.index.fqn]
                td = item.tensor_data
                region = Region(tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
                nbytes = 0
                if not region.is_empty():
                    nbytes = writer.write(spec["name"], self._zarr(spec), region,
                                          to_host(planner.resolve_data(item)), spec["dtype"], item.index.fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write zarr.json files, values, Orbax files and the manifest, then commit."""
        assert self._tmp is not None, "finish() called before prepare_global_plan()"
        final = Location.of(self.path)  # type: ignore[arg-type]
        try:
            p = self._prepared(final, metadata, results)
            write_metadata(p)
            storage.publish(self._tmp, final, overwrite=self.options.overwrite)
        except BaseException:
            storage.remove(self._tmp)
            raise

    def _prepared(self, final: Location, metadata: Metadata, results: list[list[WriteResult]]) -> PreparedSave:
        mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        decoded: dict[str, Any] = {}
        writers: dict[tuple[str, tuple[int, ...]], int] = {}
        for rank, rs in enumerate(results):
            for r in rs:
                if isinstance(r.storage_data, dict) and "value" in r.storage_data:
                    decoded[r.index.fqn] = values.decode(r.storage_data["value"])
                else:
                    writers[(r.index.fqn, tuple(int(o) for o in (r.index.offset or ())))] = rank
        tree: dict[Any, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                if fqn not in decoded:
                    raise SaveError("no rank wrote this value", leaf=fqn)
                leaf = as_leaf(decoded[fqn])
            else:
                leaf = _Stored(fqn)
            insert(tree, key_of(fqn, mappings), leaf)
        structure, leaves = flatten(listify(tree))
        keys, sources, descs, plans = [], [], [], []
        planned_names: dict[Any, str] = {}
        for key, leaf in leaves:
            keys.append(key)
            if isinstance(leaf, _Stored):
                spec = self._layout[leaf.fqn]
                planned_names[key] = spec["name"]
                md = metadata.state_dict_metadata[leaf.fqn]
                regions = tuple(Region(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                                for c in md.chunks)
                shape = tuple(spec["shape"])
                descs.append(LeafDesc(key, "array", shape, spec["dtype"], regions))
                who = {r: writers.get((leaf.fqn, r.offsets), 0) for r in regions if not r.is_empty()}
                plans.append(LeafPlan(key, shape, spec["dtype"], tuple(spec["chunk"]), tuple(spec["inner"]), who,
                                      {"framework": "torch", "via": "torch.distributed.checkpoint"}))
                sources.append(leaf)
            else:
                value = leaf.value if isinstance(leaf, Value) else leaf
                descs.append(LeafDesc(key, "value", value_type=values.value_type(value)))
                plans.append(None)
                sources.append(value)
        names = storage_names(descs, sources)
        if names != planned_names:  # the ranks already wrote under the planned names
            raise SaveError(f"array names changed between planning and commit: {planned_names} vs {names}")
        return PreparedSave(final, self._tmp, LocalCoordinator(), structure, keys, sources, descs,  # type: ignore[arg-type]
                            XSavePlan(plans), names, self.options)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any path or URL."""
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint path, for DCP's logging."""
        return StorageMeta(checkpoint_id=self.path)


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Placeholder leaf for an array whose chunks the ranks already wrote."""

    fqn: str
