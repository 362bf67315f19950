"""``XckptStorageWriter``: torch DCP writes an xckpt checkpoint.

DCP plans and deduplicates; the coordinator's global planning step picks each
array's chunk grid from all ranks' chunks and a temporary directory; each rank
writes its chunks straight into the Zarr arrays (zero-copy from CPU tensors,
staged from CUDA); values are msgpack-encoded on the rank that holds them, and the
arrays inside a value (numpy data, a tensor in a tuple: DCP pickles such values whole)
sent with it to the coordinator; ``finish`` writes those arrays, zarr.json files,
values, Orbax files and the manifest through the core and commits by rename.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from xckpt import registry
from xckpt.engine import collective, failpoints
from xckpt.engine.claims import new_generation
from xckpt.engine.commit import Hold, SaveOptions, check_target, discard, publish, write_commit_files, \
    write_marker
from xckpt.engine.plan import INNER_CHUNK_BYTES, Descriptors, GlobalPlan, LeafDesc, LocalPlan, local_plan, plan_save
from xckpt.engine.protocol import plan_chunks, zarr_files
from xckpt.engine.storage import Location
from xckpt.engine.write import MAX_INFLIGHT_BYTES, ChunkWriter
from xckpt.errors import SaveError, UnsupportedError, XckptError
from xckpt.format import dtypes as xdtypes
from xckpt.format import values
from xckpt.format.regions import Region
from xckpt.format.tree import Value, flatten, unflatten

from . import dcp_numpy
from .dcp_planners import plain_value, raw_object
from .dcp_tree import as_leaf, insert, key_of, listify
from .staging import to_host
from .tensors import logical_dtype


#: The ``sharding`` recorded for an array DCP saved (the manifest's entries copy it; it is never changed).
_TORCH_ARRAY = {"framework": "torch", "via": "torch.distributed.checkpoint"}


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
                                                 (), sharding=_TORCH_ARRAY)
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
        self._planned: GlobalPlan | None = None  # the coordinator's plan of every rank's array objects

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new checkpoint (``checkpoint_id`` is its path)."""
        if checkpoint_id is not None:
            self.path = checkpoint_id
        if self._hold is not None:  # the last save through this writer failed before finish()
            discard(self._hold.tmp, [], hold=self._hold, plan=self._planned)
        self._tmp = None
        self._hold = None
        self._planned = None

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
        self._planned, answers = plan_save([([r], d) for r, (d, _) in enumerate(described)], len(plans),
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
        created: dict[str, bytes] = {}
        tmp = Location(plan.storage_data["tmp"])
        coord = registry.default_coordinator() or collective.LocalCoordinator()
        result, error = None, None
        try:
            result = self._write(plan, planner, written, created)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement
            error = exc
        try:
            collective.agree_step(coord, f"save to {self.path}", lambda: _reraise(error))
        except BaseException:
            discard(tmp, written, hold=self._hold if self.is_coordinator else None,
                    plan=self._planned if self.is_coordinator else None,
                    generation=plan.storage_data["generation"], created=created)
            if self.is_coordinator:
                self._hold = None
            raise
        assert result is not None
        at = next((i for i, r in enumerate(result) if r.storage_data is None), None)
        if created and at is not None:  # for finish: after a takeover a failed save removes only what it created
            result[at] = dataclasses.replace(result[at], storage_data={"created": created})
        done: Future[list[WriteResult]] = Future()
        done.set_result(result)
        return done

    def _write(self, plan: SavePlan, planner: SavePlanner, written: list[str], created: dict[str, bytes]
               ) -> list[WriteResult]:
        data = plan.storage_data
        tmp = Location(data["tmp"])
        descs = Descriptors.from_wire(data["descs"])
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        failpoints.hit("after_plan", rank)
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
            try:
                store.close()  # the writes in flight land: what they created is known
            finally:
                created.update(store.created)
        failpoints.hit("after_write", rank)
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                sent = _value_data(plain_value(raw_object(planner, item)), item.index.fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=len(sent["value"]) + sum(
                    len(a[2]) for a in sent.get("arrays", {}).values()), storage_data=sent))
            else:
                results.append(WriteResult(index=item.index, size_in_bytes=_region(item).numel, storage_data=None))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write values, the Orbax view and the manifest through the core, then commit."""
        assert self._tmp is not None and self._hold is not None, "finish() called before prepare_global_plan()"
        hold, self._hold = self._hold, None
        written: list[str] = []  # the commit files and value arrays begun here
        created: dict[str, bytes] = {}  # what every rank's writes created, and this finish's (object stores)
        for r in (r for rs in results for r in rs):
            if isinstance(r.storage_data, dict) and "created" in r.storage_data:
                created.update(r.storage_data["created"])
        try:
            plan, vals, arrays = self._final_plan(metadata, results)
            store = self._tmp.store(create=True)
            try:
                if arrays.local.tasks or arrays.local.metadata:
                    self._write_value_arrays(store, arrays, hold.generation, written)
                write_commit_files(store, plan, vals, self.options, hold.generation, hold=hold, written=written)
                write_marker(store, hold)
            finally:
                try:
                    store.close()  # the writes in flight land: what they created is known
                finally:
                    created.update(store.created)
            publish(self._tmp, hold.target, hold.generation, hold=hold)
        except BaseException:
            if hold.committed:  # nothing after the commit undoes it
                hold.end()
            else:
                discard(self._tmp, written, hold=hold, plan=self._planned, generation=hold.generation,
                        created=created)
            raise
        hold.end()

    def _write_value_arrays(self, store: Any, arrays: "_ValueArrays", generation: str, written: list[str]) -> None:
        """Coordinator: write the arrays found inside DCP values (their zarr.json and chunk objects), durably;
        the names begun go to ``written``."""
        w = ChunkWriter(store, generation, self.options.max_inflight_bytes)
        try:
            with w:
                for name, meta in zarr_files(arrays.local, arrays.descs, self.options.compression):
                    w.file(name, meta)
                for name, geom, chunk, leaf in plan_chunks(arrays.local, arrays.descs,
                                                           lambda pos, piece: arrays.data[pos][piece.slices()],
                                                           self.options.compression):
                    w.chunk(name, geom, chunk, leaf)
            w.sync()
        finally:
            written.extend(w.names)

    def _final_plan(self, metadata: Metadata, results: list[list[WriteResult]]
                    ) -> tuple[Any, dict[int, Any], "_ValueArrays"]:
        """The plan of the whole checkpoint (arrays as the ranks wrote them, the values, and the arrays found
        inside values, which the coordinator writes), for the commit."""
        mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        decoded: dict[str, Any] = {}
        for rs in results:
            for r in rs:
                if isinstance(r.storage_data, dict) and "value" in r.storage_data:
                    decoded[r.index.fqn] = _value_from(r.storage_data)
        tree: dict[Any, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                if fqn not in decoded:
                    raise SaveError("no rank wrote this value", leaf=fqn)
                insert(tree, key_of(fqn, mappings), as_leaf(decoded[fqn]))
            else:
                insert(tree, key_of(fqn, mappings), _Stored(fqn))
        structure, leaves = flatten(listify(tree))
        descs, vals, data = [], {}, {}
        for i, (key, leaf) in enumerate(leaves):
            if isinstance(leaf, _ValueArray):
                shape = tuple(int(n) for n in leaf.data.shape)
                descs.append(LeafDesc(key, "array", shape, leaf.dtype, (Region.full(shape),), sharding=leaf.sharding))
                data[i] = leaf.data
            elif isinstance(leaf, _Stored):
                md = metadata.state_dict_metadata[leaf.fqn]
                regions = tuple(Region(tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes))
                                for c in md.chunks)
                descs.append(LeafDesc(key, "array", tuple(int(n) for n in md.size),
                                      logical_dtype(md.properties.dtype), regions,
                                      sharding=_TORCH_ARRAY))
            else:
                value = leaf.value if isinstance(leaf, Value) else leaf
                descs.append(LeafDesc(key, "value", value_type=values.value_type(value)))
                vals[i] = value
        every = Descriptors(structure, descs)
        plan, answers = plan_save([([0], every)], 1, inner_chunk_bytes=self.options.inner_chunk_bytes)
        local = local_plan(every, answers[0], 0)  # as if this process held every array: keep the value arrays'
        local = dataclasses.replace(local, leaves={p: lay for p, lay in local.leaves.items() if p in data},
                                    tasks=[t for t in local.tasks if t.leaf in data],
                                    metadata=[m for m in local.metadata if m[0] in data])
        return plan, vals, _ValueArrays(every, local, data)

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


@dataclasses.dataclass(frozen=True)
class _ValueArray:
    """An array found inside a DCP value (numpy data, or a tensor in a tuple), as the coordinator got it."""

    data: np.ndarray  # in its logical dtype
    dtype: str
    sharding: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _ValueArrays:
    """The arrays inside values that the coordinator writes: the whole save's descriptors, its local plan
    cut down to them, and their data by leaf position."""

    descs: Descriptors
    local: LocalPlan
    data: dict[int, np.ndarray]


def _array_in_value(leaf: Any) -> tuple[np.ndarray, str, dict[str, Any]] | None:
    """An array inside a value, with its logical dtype and the sharding to record, or None: numpy data
    (:func:`.dcp_numpy.value_array_sharding`, a scalar as a 0-d array) or a tensor (read to the host)."""
    if isinstance(leaf, torch.Tensor):
        return to_host(leaf), logical_dtype(leaf.dtype), _TORCH_ARRAY
    if isinstance(leaf, (np.ndarray, np.generic)):
        arr = np.asarray(leaf)
        return arr, xdtypes.logical_name(arr.dtype), dcp_numpy.value_array_sharding(leaf)
    return None


def _value_data(value: Any, fqn: str) -> dict[str, Any]:
    """What a rank sends the coordinator for one DCP value: ``{"value": msgpack bytes}``, and where the value
    holds arrays (numpy data, tensors in a tuple, which msgpack cannot hold and xckpt stores as arrays),
    ``"arrays"``: each by its position among the value's leaves, as (logical dtype, shape, C-order bytes,
    sharding), with None in its place in the encoded value. ``value.unsupported`` when neither works."""
    try:
        return {"value": values.encode(value)}
    except XckptError as exc:
        first = exc
    try:
        structure, leaves = flatten(value)
        found = {i: a for i, (_, leaf) in enumerate(leaves) if (a := _array_in_value(leaf)) is not None}
        if not found:
            raise first
        blob = values.encode(unflatten(structure, [None if i in found else leaf for i, (_, leaf) in enumerate(leaves)]))
    except XckptError as exc:
        raise UnsupportedError(f"cannot store this value without pickle: {exc.message}", code="value.unsupported",
                               leaf=fqn) from exc
    return {"value": blob, "arrays": {i: (name, tuple(arr.shape), np.ascontiguousarray(arr).tobytes(), sharding)
                                      for i, (arr, name, sharding) in found.items()}}


def _value_from(sent: dict[str, Any]) -> Any:
    """The value a rank sent (:func:`_value_data`), its arrays put back in their places as :class:`_ValueArray`."""
    value = values.decode(sent["value"])
    arrays = sent.get("arrays")
    if not arrays:
        return value
    structure, leaves = flatten(value)
    plain = [leaf for _, leaf in leaves]
    for i, (name, shape, raw, sharding) in arrays.items():
        data = np.frombuffer(raw, dtype=xdtypes.numpy_dtype(name)).reshape(shape)
        plain[i] = _ValueArray(data, name, sharding)
    return unflatten(structure, plain)
