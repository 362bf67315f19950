"""Converting between stock DCP checkpoints (``FileSystemWriter`` output) and xckpt.

``dcp -> xckpt``: the checkpoint is opened as a :class:`.dcp_source.DcpCheckpoint` (read without
trusting it) and its tree saved; each stored DCP chunk becomes one region of the xckpt array, read
when the writer gets to it, so memory stays near one chunk.

``xckpt -> dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter``
and a planner that reads each array from xckpt only when DCP writes it (the state
dict holds ``meta`` tensors), one file per tensor.

Neither direction unpickles anything from an xckpt checkpoint.
"""

from __future__ import annotations

import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from xckpt.engine.collective import LocalCoordinator
from xckpt.engine.claims import new_generation
from xckpt.engine.commit import Hold, SaveOptions, check_target, publish
from xckpt.engine.copy import read_region
from xckpt.engine.protocol import save
from xckpt.engine.storage import Location
from xckpt.errors import UnsupportedError, XckptError
from xckpt.format.manifest import ArrayEntry
from xckpt.format.regions import Region
from xckpt.format.tree import is_namedtuple, unflatten
from xckpt.sources.detect import open_checkpoint

from . import dcp_numpy
from .dcp_source import DcpCheckpoint
from .tensors import from_numpy, torch_dtype


def dcp_to_xckpt(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Convert the DCP checkpoint directory ``src`` into an xckpt checkpoint at ``dst``.

    Nothing in ``src`` is trusted (:class:`.dcp_source.DcpCheckpoint`): the metadata and every
    stored range are checked before the destination is touched; each DCP chunk is read when the
    writer gets to it.
    """
    with DcpCheckpoint(Location.of(src)) as ckpt:
        try:
            save(ckpt.tree, dst, coordinator=LocalCoordinator(),
                 options=SaveOptions(overwrite=overwrite, metadata={"converted_from": "torch.distributed.checkpoint"}))
        except XckptError as exc:  # a leaf's chunks that do not tile it, say: the DCP metadata describes it
            raise (exc.at(file=ckpt.metadata_file) if exc.leaf is not None else exc) from None


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
        if isinstance(e, ArrayEntry) and dcp_numpy.is_value_array(e.sharding):  # DCP pickled it: numpy again
            leaves[i] = dcp_numpy.as_dcp_value(read_region(ckpt, e, Region.full(e.shape)), e.sharding)
        elif isinstance(e, ArrayEntry):
            t = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device="meta")
            entries[id(t)] = e
            leaves[i] = t
        else:
            leaves[i] = vals[i]
    def read(e: ArrayEntry) -> torch.Tensor:
        return from_numpy(read_region(ckpt, e, Region.full(e.shape)), e.dtype)

    state = _for_dcp(unflatten(m.tree, leaves), entries, read)  # type: ignore[arg-type]
    if not isinstance(state, dict):
        state = {"state": state}

    hold = Hold(target, new_generation(), opts.stale_after())
    try:
        try:
            dcp.save(state, storage_writer=FileSystemWriter(hold.tmp.local_path, single_file_per_rank=False),
                     planner=_LazyXckptPlanner(entries, read), no_dist=True)
        except CheckpointException as exc:  # DCP wraps what reading the source raised: raise that
            cause = next((e for e, _ in exc.failures.values() if isinstance(e, XckptError)), None)
            if cause is None:
                raise
            raise cause from None
        publish(hold.tmp, target, hold.generation, hold=hold)
    except BaseException:
        if not hold.committed:  # (after the move into place, the directory there is the replaced checkpoint)
            shutil.rmtree(hold.tmp.local_path, ignore_errors=True)
        raise
    finally:
        hold.end()


def _for_dcp(obj: Any, entries: dict[int, ArrayEntry], read: Any, whole: bool = False) -> Any:
    """The state as DCP can store it. DCP writes the tensors of dicts and lists one by one (``entries``:
    the placeholders it reads lazily) but pickles anything else whole, tuples included: the arrays inside a
    tuple are read now (``whole``), and a namedtuple becomes the dict of its fields (its class, rebuilt from
    the manifest, exists in no reader's program)."""
    if is_namedtuple(obj):
        return {f: _for_dcp(v, entries, read, whole) for f, v in zip(obj._fields, obj)}
    if isinstance(obj, dict):
        return {k: _for_dcp(v, entries, read, whole) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_for_dcp(v, entries, read, whole) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_for_dcp(v, entries, read, True) for v in obj)
    if whole and isinstance(obj, torch.Tensor) and id(obj) in entries:
        return read(entries.pop(id(obj)))
    return obj


#: The converters this module offers (entry point ``xckpt.converters``: ``dcp``).
CONVERTERS = {("dcp", "xckpt"): dcp_to_xckpt, ("xckpt", "dcp"): xckpt_to_dcp}
