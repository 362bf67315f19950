"""A storage layer for PyTorch Distributed Checkpoint (DCP) that writes and reads xckpt.

``torch.distributed.checkpoint.save(state, storage_writer=XckptStorageWriter(path))``
writes an xckpt checkpoint (Zarr v3 arrays, JSON manifest, crc32c, atomic commit),
and ``torch.distributed.checkpoint.load(state, storage_reader=XckptStorageReader(path))``
reads one (also one written by ``xckpt.save`` or by Orbax).

DCP plans and deduplicates; the coordinator's global planning step picks each
array's chunk grid from all ranks' chunks and a temporary directory; each rank
writes its chunks straight into the Zarr arrays; ``finish`` writes the metadata
through the core and commits by rename. Non-tensor values never go through
``torch.save``/``torch.load``: they are msgpack-encoded (:mod:`xckpt.values`) on
the writing rank and stored in ``values.msgpack``; the reader hands them to the
planner already decoded.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections import deque
from typing import Any, Iterable

import numpy as np
import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from xckpt import arrays, dtypes as xdtypes, naming, orbax_files, storage, values
from xckpt.coord import LocalCoordinator
from xckpt.errors import KeyMismatchError, SaveError, ShapeError, TreeError, UnsupportedError, XckptError
from xckpt.manifest import ArrayEntry, ValueEntry
from xckpt.plan import INNER_CHUNK_BYTES, LeafDesc, LeafPlan, SavePlan as XSavePlan
from xckpt.reader import Checkpoint, open_checkpoint, translate
from xckpt.regions import Region, check_tiling, chunk_shape_for, inner_chunk_shape_for
from xckpt.save import MAX_INFLIGHT_BYTES, PreparedSave, SaveOptions, _write_metadata
from xckpt.storage import Location
from xckpt.tree import Key, Value, flatten, iter_nodes, key_str, unflatten

from .tensors import copy_into, logical_dtype, to_host, torch_dtype


def _key_of(fqn: str, mappings: dict[str, Any] | None) -> Key:
    path = (mappings or {}).get(fqn)
    return tuple(path) if path else (fqn,)


def _fqn(key: Key) -> str:
    return ".".join(str(k) for k in key)


class XckptSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose non-tensor items resolve to msgpack bytes, not ``torch.save``."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        """Tensors unchanged; values msgpack-encoded."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(values.encode(object))
        return object


class XckptLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that takes decoded values (and msgpack bytes), never ``torch.load``."""

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Put an already decoded value into the state dict being loaded."""
        _set_value(self, read_item, value)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode msgpack bytes (the only encoding xckpt uses) and store the value."""
        _set_value(self, read_item, values.decode(value.read()))


def _set_value(planner: DefaultLoadPlanner, item: ReadItem, value: Any) -> None:
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[item.dest_index.fqn], value)
    else:
        planner.state_dict[item.dest_index.fqn] = value


def _deliver(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    if hasattr(planner, "load_value"):
        planner.load_value(item, value)
    elif isinstance(planner, DefaultLoadPlanner):
        _set_value(planner, item, value)
    else:
        raise UnsupportedError(f"cannot hand the value {item.dest_index.fqn!r} to a {type(planner).__name__}: "
                               "xckpt never unpickles, so use DefaultLoadPlanner or XckptLoadPlanner",
                               code="dcp.planner")


def _raw_object(planner: SavePlanner, item: WriteItem) -> Any:
    if hasattr(planner, "lookup_object"):
        return planner.lookup_object(item.index)
    raise UnsupportedError(f"cannot get the value {item.index.fqn!r} from a {type(planner).__name__} without "
                           "torch.save; use DefaultSavePlanner or XckptSavePlanner", code="dcp.planner")


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

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add locally."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: pick each array's chunk grid from every rank's chunks, and a temporary directory."""
        final = Location.of(self.path)  # type: ignore[arg-type]
        if final.is_local and os.path.lexists(final.local_path) and not self.options.overwrite:
            raise SaveError(f"{final.local_path} already exists; pass overwrite=True to replace it",
                            code="save.exists", file=final.local_path)
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
                    "key": _key_of(item.index.fqn, mappings), "shape": tuple(int(s) for s in td.size),
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
        opened: dict[str, Any] = {}
        inflight: deque[tuple[int, Any]] = deque()
        held = 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                blob = values.encode(_raw_object(planner, item))
                results.append(WriteResult(index=item.index, size_in_bytes=len(blob), storage_data={"value": blob}))
                continue
            spec = layout[item.index.fqn]
            td = item.tensor_data
            region = Region(tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
            if region.is_empty():
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
                continue
            arr = to_host(planner.resolve_data(item))
            if tuple(arr.shape) != region.sizes or xdtypes.logical_name(arr.dtype) != spec["dtype"]:
                raise SaveError(f"chunk data has shape {arr.shape} {arr.dtype}, expected {region.sizes} "
                                f"{spec['dtype']}", leaf=item.index.fqn)
            if item.index.fqn not in opened:
                opened[item.index.fqn] = arrays.open_for_write(tmp, spec["name"], self._zarr(spec))
            raw = arr.view(np.uint8) if xdtypes.is_raw(spec["dtype"]) else arr
            fut = opened[item.index.fqn][region.slices()].write(raw, can_reference_source_data_indefinitely=True)
            inflight.append((arr.nbytes, fut))
            held += arr.nbytes
            while held > self.options.max_inflight_bytes and len(inflight) > 1:
                n, f = inflight.popleft()
                f.result()
                held -= n
            results.append(WriteResult(index=item.index, size_in_bytes=arr.nbytes, storage_data=None))
        for _, f in inflight:
            f.result()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write zarr.json files, values, Orbax files and the manifest, then commit."""
        assert self._tmp is not None, "finish() called before prepare_global_plan()"
        final = Location.of(self.path)  # type: ignore[arg-type]
        try:
            p = self._prepared(final, metadata, results)
            _write_metadata(p)
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
                leaf = _as_leaf(decoded[fqn])
            else:
                leaf = _Stored(fqn)
            _insert(tree, _key_of(fqn, mappings), leaf)
        structure, leaves = flatten(_listify(tree))
        keys, sources, descs, plans = [], [], [], []
        for key, leaf in leaves:
            keys.append(key)
            if isinstance(leaf, _Stored):
                spec = self._layout[leaf.fqn]
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
        naming.check_unique([d.key for d, s in zip(descs, sources)
                             if d.kind == "array" or orbax_files.mirrors(s) or isinstance(s, str)])
        names = naming.check_unique(d.key for d in descs if d.kind == "array")
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


def _as_leaf(value: Any) -> Any:
    """A DCP value as tree material: plain containers are spread like ``xckpt.save`` does."""
    if isinstance(value, (dict, list, tuple)):
        try:
            flatten(value)
        except XckptError:
            return Value(value)
    return value


def _insert(tree: dict[Any, Any], key: Key, leaf: Any) -> None:
    node = tree
    for part in key[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise TreeError(f"key {list(key)} lies below a leaf", leaf=key_str(key))
    node[key[-1]] = leaf


def _listify(node: Any) -> Any:
    """Dicts built from DCP paths whose keys are exactly 0..n-1 (list indices) become lists."""
    if not isinstance(node, dict) or isinstance(node, _Stored):
        return node
    out = {k: _listify(v) for k, v in node.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


class XckptStorageReader(StorageReader):
    """DCP ``StorageReader`` over an xckpt (or Orbax) checkpoint; never unpickles anything.

    Each array is offered to DCP as one chunk covering the whole tensor, so each rank's
    read items are exactly the boxes it needs, read through TensorStore inner chunks.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> None:
        self.path = path
        self.max_inflight_bytes = max_inflight_bytes
        self._ckpt: Checkpoint | None = None
        self._fqns: dict[str, tuple[Any, ...]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start reading a (new) checkpoint."""
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._ckpt = None
        self._fqns = {}

    def _open(self) -> Checkpoint:
        if self._ckpt is None:
            if self.path is None:
                raise XckptError("XckptStorageReader has no path: pass one or a checkpoint_id")
            self._ckpt = open_checkpoint(self.path)
            self._index()
        return self._ckpt

    def _index(self) -> None:
        assert self._ckpt is not None
        m = self._ckpt.manifest
        fqns: dict[str, tuple[Any, ...]] = {}
        for i, e in enumerate(m.leaves):
            fqns[_fqn(e.key)] = ("leaf", i)
        for key, node in iter_nodes(m.tree):
            if not key or node["kind"] == "leaf" or _fqn(key) in fqns:
                continue
            if all(isinstance(m.leaves[n["index"]], ValueEntry)
                   for _, n in iter_nodes(node) if n["kind"] == "leaf"):
                fqns[_fqn(key)] = ("node", key, node)
        self._fqns = fqns

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata built from the manifest: one whole-tensor chunk per array, values as bytes."""
        ckpt = self._open()
        m = ckpt.manifest
        sdm: dict[str, Any] = {}
        mappings: dict[str, Any] = {}
        for fqn, what in self._fqns.items():
            if what[0] == "leaf":
                e = m.leaves[what[1]]
                key = e.key
                if isinstance(e, ArrayEntry):
                    try:
                        dt = torch_dtype(e.dtype)
                    except UnsupportedError:
                        continue
                    size = torch.Size(e.shape)
                    sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dt), size,
                                                     [ChunkStorageMetadata(torch.Size([0] * len(e.shape)), size)])
                else:
                    sdm[fqn] = BytesStorageMetadata()
            else:
                key = what[1]
                sdm[fqn] = BytesStorageMetadata()
            mappings[fqn] = tuple(key)
        return Metadata(state_dict_metadata=sdm, planner_data=mappings,
                        storage_meta=StorageMeta(checkpoint_id=self.path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Open the checkpoint on this rank."""
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to add."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to add."""
        return plans

    def _value(self, what: tuple[Any, ...]) -> Any:
        vals = self._open().values()
        if what[0] == "leaf":
            return vals[what[1]]
        return unflatten(what[2], vals)  # type: ignore[arg-type]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read exactly the boxes in ``plan`` and copy them into the planner's tensors."""
        ckpt = self._open()
        m = ckpt.manifest
        tensor_items: list[tuple[ReadItem, ArrayEntry]] = []
        for item in plan.items:
            what = self._fqns.get(item.storage_index.fqn)
            if what is None:
                raise KeyMismatchError(f"{item.storage_index.fqn!r} is not in the checkpoint",
                                       missing=[item.storage_index.fqn], file=str(ckpt.loc))
            if item.type == LoadItemType.BYTE_IO:
                _deliver(planner, item, self._value(what))
            else:
                tensor_items.append((item, m.leaves[what[1]]))  # type: ignore[arg-type]
        self._read_tensors(ckpt, tensor_items, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_tensors(self, ckpt: Checkpoint, items: Iterable[tuple[ReadItem, ArrayEntry]],
                      planner: LoadPlanner) -> None:
        opened: dict[str, Any] = {}
        pending: deque[tuple[ReadItem, ArrayEntry, Region, Any]] = deque()
        held = 0

        def complete(item: ReadItem, e: ArrayEntry, region: Region, fut: Any) -> None:
            try:
                raw = np.empty(region.sizes, xdtypes.numpy_dtype(e.storage_dtype)) if fut is None else fut.result()
            except Exception as exc:  # noqa: BLE001 - translated to a specific xckpt error
                raise translate(exc, e, str(ckpt.loc.child(e.path))) from exc
            arr = raw.view(xdtypes.numpy_dtype(e.dtype)) if xdtypes.is_raw(e.dtype) else raw
            target = planner.resolve_tensor(item).detach()
            copy_into(target, arr)
            planner.commit_tensor(item, target)

        for item, e in items:
            region = Region(tuple(int(o) for o in item.storage_offsets), tuple(int(n) for n in item.lengths))
            if not region.within(e.shape):
                raise ShapeError(f"read of {region.offsets}+{region.sizes} lies outside shape {list(e.shape)}",
                                 leaf=key_str(e.key))
            fut = None
            if not region.is_empty():
                try:
                    if e.path not in opened:
                        opened[e.path] = ckpt.open_array(e).result()
                    fut = opened[e.path][region.slices()].read()
                except Exception as exc:  # noqa: BLE001
                    raise translate(exc, e, str(ckpt.loc.child(e.path))) from exc
            pending.append((item, e, region, fut))
            held += region.numel * xdtypes.itemsize(e.dtype)
            while held > self.max_inflight_bytes and len(pending) > 1:
                done = pending.popleft()
                held -= done[2].numel * xdtypes.itemsize(done[1].dtype)
                complete(*done)
        for done in pending:
            complete(*done)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any path or URL."""
        return isinstance(checkpoint_id, (str, os.PathLike))
