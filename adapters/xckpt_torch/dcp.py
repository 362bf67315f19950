"""A storage layer for PyTorch Distributed Checkpoint (DCP) that writes and reads xckpt.

``torch.distributed.checkpoint.save(state, storage_writer=XckptStorageWriter(path))``
writes an xckpt checkpoint (Zarr v3 arrays, JSON manifest, crc32c, atomic commit);
``torch.distributed.checkpoint.load(state, storage_reader=XckptStorageReader(path))``
reads one, also one written by ``xckpt.save`` or by Orbax. Non-tensor values are
msgpack, never ``torch.save``; the reader never unpickles anything.
"""

from __future__ import annotations

from .dcp_planners import XckptLoadPlanner, XckptSavePlanner
from .dcp_reader import XckptStorageReader
from .dcp_writer import XckptStorageWriter

__all__ = ["XckptStorageWriter", "XckptStorageReader", "XckptSavePlanner", "XckptLoadPlanner"]
