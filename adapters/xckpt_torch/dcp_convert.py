"""Converting between stock DCP checkpoints (``FileSystemWriter`` output) and xckpt.

``dcp -> xckpt``: DCP's ``.metadata`` is a pickle and its chunks are ``torch.save``
blobs; reading them is what converting a DCP checkpoint means, so this direction
uses DCP's own ``FileSystemReader`` (tensors and values through ``torch.load`` with
``weights_only=True``). Each stored DCP chunk becomes one region of the xckpt
array, read when the writer gets to it, so memory stays near one chunk.

``xckpt -> dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter``
and a planner that reads each array from xckpt only when DCP writes it (the state
dict holds ``meta`` tensors), one file per tensor.

Neither direction unpickles anything from an xckpt checkpoint.
"""

from __future__ import annotations

import io
import os
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem, WriteItem

from xckpt.engine.collective import LocalCoordinator
from xckpt.engine.claims import new_generation
from xckpt.engine.commit import Hold, SaveOptions, check_target, publish
from xckpt.engine.copy import LazySource, read_region
from xckpt.engine.protocol import save
from xckpt.engine.storage import Location
from xckpt.errors import UnsupportedError, XckptError
from xckpt.format.manifest import ArrayEntry
from xckpt.format.regions import Region
from xckpt.format.tree import unflatten
from xckpt.registry import Shard
from xckpt.sources.detect import open_checkpoint

from .dcp_tree import as_leaf, insert, key_of, listify
from .tensors import from_numpy, logical_dtype, to_host, torch_dtype


class _Sink:
    """The minimal load planner ``FileSystemReader.read_data`` needs to read one item."""

    def __init__(self, target: torch.Tensor | None = None) -> None:
        self.target = target
        self.value: Any = None

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        """The tensor to read into."""
        assert self.target is not None
        return self.target

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: the data is already in place."""

    def load_bytes(self, item: ReadItem, stream: io.BytesIO) -> None:
        """A DCP value: ``torch.load`` restricted to plain data (``weights_only=True``)."""
        try:
            self.value = torch.load(stream, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - reported as an xckpt error
            raise UnsupportedError(f"DCP value {item.storage_index.fqn!r} is not plain data "
                                   f"(weights_only load failed: {exc})", code="convert.dcp_value") from exc


def _read_chunk(reader: FileSystemReader, fqn: str, region: Region, dtype: torch.dtype) -> np.ndarray:
    target = torch.empty(region.sizes, dtype=dtype)
    offsets = torch.Size(region.offsets)
    zeros = torch.Size([0] * len(region.offsets))
    item = ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, offsets), zeros, MetadataIndex(fqn, offsets), zeros,
                    torch.Size(region.sizes))
    reader.read_data(LoadPlan([item]), _Sink(target)).wait()  # type: ignore[arg-type]
    return to_host(target)


def _read_value(reader: FileSystemReader, fqn: str) -> Any:
    sink = _Sink()
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), torch.Size([0]), MetadataIndex(fqn),
                    torch.Size([0]), torch.Size([0]))
    reader.read_data(LoadPlan([item]), sink).wait()  # type: ignore[arg-type]
    return sink.value


def dcp_to_xckpt(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Convert the DCP checkpoint directory ``src`` into an xckpt checkpoint at ``dst``."""
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise XckptError(f"{src} is not a DCP checkpoint (no .metadata)", code="convert.not_dcp", file=src)
    reader = FileSystemReader(src)
    md = reader.read_metadata()  # DCP's own format: a pickle (this is the conversion the user asked for)
    reader.set_up_storage_reader(md, True)
    mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
    tree: dict[Any, Any] = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            dt = smd.properties.dtype
            shape = tuple(int(s) for s in smd.size)
            shards = []
            for c in smd.chunks:
                region = Region(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                shards.append(Shard(region, lambda f=fqn, r=region, d=dt: _read_chunk(reader, f, r, d)))
            leaf: Any = LazySource(shape, logical_dtype(dt), shards, {"framework": "torch", "via": "dcp"})
        elif isinstance(smd, BytesStorageMetadata):
            leaf = as_leaf(_read_value(reader, fqn))
        else:
            raise UnsupportedError(f"unknown DCP storage metadata {type(smd).__name__}", leaf=fqn)
        insert(tree, key_of(fqn, mappings), leaf)
    save(listify(tree), dst, coordinator=LocalCoordinator(),
         options=SaveOptions(overwrite=overwrite, metadata={"converted_from": "torch.distributed.checkpoint"}))


class _LazyXckptPlanner(DefaultSavePlanner):
    """Resolves each ``meta`` placeholder by reading its array from xckpt when DCP writes it."""

    def __init__(self, entries: dict[int, ArrayEntry], read: Any) -> None:
        super().__init__()
        self.entries = entries
        self.read = read

    def resolve_data(self, write_item: WriteItem) -> Any:
        """Read the array behind a placeholder; values go through DCP's own encoding."""
        obj = self.lookup_object(write_item.index)
        if isinstance(obj, torch.Tensor) and id(obj) in self.entries:
            return self.read(self.entries[id(obj)])
        return super().resolve_data(write_item)


def xckpt_to_dcp(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Convert the xckpt (or Orbax) checkpoint at ``src`` into a DCP checkpoint directory ``dst``."""
    ckpt = open_checkpoint(src)
    try:
        _to_dcp(ckpt, dst, overwrite)
    finally:
        ckpt.close()


def _to_dcp(ckpt: Any, dst: str, overwrite: bool) -> None:
    m = ckpt.manifest
    final = Location.of(dst)
    if not final.is_local:
        raise UnsupportedError("DCP checkpoints are written to local directories only", code="convert.dcp_remote")
    opts = SaveOptions(overwrite=overwrite)
    target = check_target(final, opts, kind="dcp")
    vals = ckpt.values()
    leaves: dict[int, Any] = {}
    entries: dict[int, ArrayEntry] = {}
    for i, e in enumerate(m.leaves):
        if isinstance(e, ArrayEntry):
            t = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device="meta")
            entries[id(t)] = e
            leaves[i] = t
        else:
            leaves[i] = vals[i]
    state = unflatten(m.tree, leaves)  # type: ignore[arg-type]
    if not isinstance(state, dict):
        state = {"state": state}

    def read(e: ArrayEntry) -> torch.Tensor:
        return from_numpy(read_region(ckpt, e, Region.full(e.shape)), e.dtype)

    hold = Hold(target, new_generation(), opts.stale_after())
    try:
        dcp.save(state, storage_writer=FileSystemWriter(hold.tmp.local_path, single_file_per_rank=False),
                 planner=_LazyXckptPlanner(entries, read), no_dist=True)
        publish(hold.tmp, target, hold.generation)
    except BaseException:
        shutil.rmtree(hold.tmp.local_path, ignore_errors=True)
        raise
    finally:
        hold.end()


#: The converters this module offers (entry point ``xckpt.converters``: ``dcp``).
CONVERTERS = {("dcp", "xckpt"): dcp_to_xckpt, ("xckpt", "dcp"): xckpt_to_dcp}
