"""``XckptStorageReader``: torch DCP reads an xckpt (or Orbax) checkpoint; nothing is unpickled.

The DCP metadata is built from the JSON manifest. Each array is offered as one
chunk covering the whole tensor, so each rank's read items are exactly the boxes
it needs, read through TensorStore's inner chunks. What DCP asks for whole (tuples
such as ``betas``, and lists holding no tensor, dict or list it walks into, such as
``params``) is offered whole, exactly the names DCP's own flattening gives.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable

import numpy as np
import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from xckpt.engine.read import ReadRequest, empty
from xckpt.engine.write import MAX_INFLIGHT_BYTES
from xckpt.errors import KeyMismatchError, ShapeError, UnsupportedError, XckptError, XckptWarning
from xckpt.format import dtypes as xdtypes
from xckpt.format.manifest import ArrayEntry
from xckpt.format.regions import Region
from xckpt.format.tree import iter_nodes, key_str, unflatten
from xckpt.sources.base import Source
from xckpt.sources.detect import open_checkpoint

from . import dcp_numpy
from .dcp_planners import deliver_value
from .dcp_tree import dcp_names, fqn_of
from .tensors import copy_into, cpu_view, from_numpy, logical_dtype, torch_dtype


def _is_tensor(entry: Any) -> bool:
    """Whether DCP sees a manifest leaf as a tensor: an array, unless it was numpy data inside a DCP value
    (DCP pickles numpy data, so a DCP load asks for it as a value)."""
    return isinstance(entry, ArrayEntry) and not dcp_numpy.is_value_array(entry.sharding)


class XckptStorageReader(StorageReader):
    """DCP ``StorageReader`` over an xckpt (or Orbax) checkpoint; never unpickles anything.

    Each array is offered to DCP as one chunk covering the whole tensor, so each rank's
    read items are exactly the boxes it needs, read through TensorStore inner chunks.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> None:
        self.path = path
        self.max_inflight_bytes = max_inflight_bytes
        self._ckpt: Source | None = None
        self._fqns: dict[str, tuple[Any, ...]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start reading a (new) checkpoint."""
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._ckpt = None
        self._fqns = {}

    def _open(self) -> Source:
        if self._ckpt is None:
            if self.path is None:
                raise XckptError("XckptStorageReader has no path: pass one or a checkpoint_id")
            self._ckpt = open_checkpoint(self.path)
            self._index()
        return self._ckpt

    def _index(self) -> None:
        """The names DCP's flattening of the checkpoint's tree gives (arrays as tensors), exactly: a name
        more could make DCP take the state dict for a torch 2.3 one and flatten it the old way."""
        assert self._ckpt is not None
        m = self._ckpt.manifest
        fqns: dict[str, tuple[Any, ...]] = {}
        for key, node in dcp_names(m.tree, lambda i: _is_tensor(m.leaves[i])):
            fqns.setdefault(fqn_of(key), ("leaf", node["index"]) if node["kind"] == "leaf" else ("node", key, node))
        self._fqns = fqns

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata built from the manifest: one whole-tensor chunk per array, values as bytes."""
        ckpt = self._open()
        m = ckpt.manifest
        sdm: dict[str, Any] = {}
        mappings: dict[str, Any] = {}
        left_out: list[str] = []
        for fqn, what in self._fqns.items():
            if what[0] == "leaf":
                e = m.leaves[what[1]]
                key = e.key
                if _is_tensor(e):
                    try:
                        dt = torch_dtype(e.dtype)
                    except UnsupportedError:
                        left_out.append(f"{fqn} ({e.dtype})")
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
        if left_out:  # DCP would only say "missing key"
            warnings.warn(XckptWarning(f"{ckpt.loc}: arrays whose dtype torch {torch.__version__} lacks are left out "
                                       f"of what DCP sees: {', '.join(left_out[:20])}"), stacklevel=2)
        return Metadata(state_dict_metadata=sdm, planner_data=mappings,
                        storage_meta=StorageMeta(checkpoint_id=self.path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Open the checkpoint on this rank."""
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Refuse, before anything is read, a subtree asked for whole that holds an array torch cannot hold."""
        for item in plan.items:
            what = self._fqns.get(item.storage_index.fqn)
            if item.type == LoadItemType.BYTE_IO and what is not None:
                self._check_whole(what)
        return plan

    def _check_whole(self, what: tuple[Any, ...]) -> None:
        """``dtype.unsupported`` naming the first array in a subtree DCP asks for whole whose dtype torch lacks
        (an array of its own is left out of what DCP sees instead, with a warning)."""
        if what[0] != "node":
            return
        ckpt = self._open()
        for _, n in iter_nodes(what[2]):
            e = ckpt.manifest.leaves[n["index"]] if n["kind"] == "leaf" else None
            if isinstance(e, ArrayEntry):
                try:
                    torch_dtype(e.dtype)
                except UnsupportedError as exc:
                    raise UnsupportedError(f"DCP asks for {fqn_of(what[1])!r} whole, and it holds an array of "
                                           f"dtype {e.dtype}: {exc.message}", code="dtype.unsupported",
                                           leaf=key_str(e.key), file=str(ckpt.loc)) from None

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to add."""
        return plans

    def _value(self, what: tuple[Any, ...]) -> Any:
        """A value leaf, or what DCP asks for whole: a subtree, or numpy data that was inside a DCP value.
        Arrays are read whole (:meth:`_whole`)."""
        ckpt = self._open()
        vals = ckpt.values()
        if what[0] == "leaf":
            e = ckpt.manifest.leaves[what[1]]
            return self._whole(ckpt, e) if isinstance(e, ArrayEntry) else vals[what[1]]
        self._check_whole(what)
        leaves: dict[int, Any] = dict(vals)
        for _, n in iter_nodes(what[2]):
            e = ckpt.manifest.leaves[n["index"]] if n["kind"] == "leaf" else None
            if isinstance(e, ArrayEntry):
                leaves[n["index"]] = self._whole(ckpt, e)
        return unflatten(what[2], leaves)  # type: ignore[arg-type]

    @staticmethod
    def _whole(ckpt: Source, e: ArrayEntry) -> Any:
        """An array read whole: numpy where it was numpy data inside a DCP value (a scalar as a scalar:
        :func:`.dcp_numpy.as_dcp_value`), else a CPU tensor."""
        try:  # a size the manifest declares: memory the system refuses is resource.too_large naming the leaf
            out = empty(e.shape, xdtypes.numpy_dtype(e.storage_dtype))
        except XckptError as exc:
            raise exc.at(leaf=key_str(e.key), file=str(ckpt.loc)) from None
        ckpt.read([ReadRequest(e, Region.full(e.shape), out)])
        arr = out.view(xdtypes.numpy_dtype(e.dtype)) if xdtypes.is_raw(e.dtype) else out
        return from_numpy(arr, e.dtype) if _is_tensor(e) else dcp_numpy.as_dcp_value(arr, e.sharding)

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
                deliver_value(planner, item, self._value(what))
            else:
                tensor_items.append((item, m.leaves[what[1]]))  # type: ignore[arg-type]
        self._read_tensors(ckpt, tensor_items, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_tensors(self, ckpt: Source, items: Iterable[tuple[ReadItem, ArrayEntry]],
                      planner: LoadPlanner) -> None:
        """Read each item's box straight into its CPU tensor; others through host buffers, a bounded
        number of bytes at a time."""
        batch: list[tuple[ReadItem, ArrayEntry, Region, torch.Tensor, np.ndarray, bool]] = []
        held = 0

        def flush() -> None:
            ckpt.read([ReadRequest(e, r, out) for _, e, r, _, out, _ in batch])
            for item, e, _, target, out, direct in batch:
                if not direct:
                    arr = out.view(xdtypes.numpy_dtype(e.dtype)) if xdtypes.is_raw(e.dtype) else out
                    copy_into(target, arr)
                planner.commit_tensor(item, target)
            batch.clear()

        for item, e in items:
            region = Region(tuple(int(o) for o in item.storage_offsets), tuple(int(n) for n in item.lengths))
            if not region.within(e.shape):
                raise ShapeError(f"read of {region.offsets}+{region.sizes} lies outside shape {list(e.shape)}",
                                 leaf=key_str(e.key))
            target = planner.resolve_tensor(item).detach()
            direct = target.device.type == "cpu" and tuple(target.shape) == region.sizes and \
                logical_dtype(target.dtype) == e.dtype
            if direct:
                view = cpu_view(target)
                out = view.view(xdtypes.numpy_dtype(e.storage_dtype)) if xdtypes.is_raw(e.dtype) else view
            else:
                out = np.empty(region.sizes, dtype=xdtypes.numpy_dtype(e.storage_dtype))
                held += out.nbytes
            batch.append((item, e, region, target, out, direct))
            if held > self.max_inflight_bytes:
                flush()
                held = 0
        flush()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any path or URL."""
        return isinstance(checkpoint_id, (str, os.PathLike))
