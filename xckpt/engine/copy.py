"""Copying a stored checkpoint into a new xckpt checkpoint, never holding more than a few pieces of one array.

The copy is a tree whose array leaves are :class:`LazySource` objects that read the
source region by region, saved by the ordinary save protocol.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from xckpt.engine.collective import LocalCoordinator
from xckpt.engine.commit import SaveOptions
from xckpt.engine.protocol import save
from xckpt.engine.read import ReadRequest
from xckpt.format import dtypes
from xckpt.format.manifest import ArrayEntry, Manifest
from xckpt.format.regions import Region
from xckpt.format.tree import Value, unflatten
from xckpt.registry import ArraySource, Shard
from xckpt.sources.base import Source

#: Bytes per piece when a lazily read array is split for conversion.
PIECE_BYTES = 64 << 20


class LazySource(ArraySource):
    """An array read region by region from somewhere else (another checkpoint)."""


def lazy_array(shape: tuple[int, ...], dtype: str, read: Callable[[Region], np.ndarray],
               piece_bytes: int = PIECE_BYTES, sharding: dict[str, Any] | None = None) -> LazySource:
    """An array leaf to save whose data is read by ``read(region)`` in pieces along dimension 0."""
    shape = tuple(int(s) for s in shape)
    if not shape or shape[0] == 0:
        return LazySource(shape, dtype, [Shard(Region.full(shape), lambda: read(Region.full(shape)))], sharding)
    row_bytes = math.prod(shape[1:]) * dtypes.itemsize(dtype)
    rows = max(1, piece_bytes // max(1, row_bytes))
    shards = []
    for start in range(0, shape[0], rows):
        r = Region((start,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - start),) + shape[1:])
        shards.append(Shard(r, lambda r=r: read(r)))
    return LazySource(shape, dtype, shards, sharding)


def piece_bytes_for(entry: ArrayEntry, itemsize: int, piece_bytes: int) -> int:
    """The bytes per piece to read ``entry`` in, cut along its first dimension (``itemsize``: the bytes per
    element the pieces are sized by): ``piece_bytes``, or, for a compressed array whose read chunks are larger,
    bands of whole chunk rows. Reading part of a compressed chunk decodes all of it, so pieces smaller than
    a chunk would decode each chunk once per piece (a 128 MiB zstd chunk read in 16 MiB pieces: 8 times);
    a band of whole chunks decodes each once, for memory of about one chunk band."""
    chunk = entry.inner_chunk_shape
    if entry.compression == "none" or entry.segments is not None or not chunk or len(chunk) != len(entry.shape):
        return piece_bytes
    band = min(chunk[0], entry.shape[0]) * math.prod(entry.shape[1:]) * itemsize
    return max(piece_bytes, band)


def read_region(source: Source, entry: ArrayEntry, region: Region) -> np.ndarray:
    """One region of a stored array, in its logical dtype."""
    out = np.empty(region.sizes, dtype=dtypes.numpy_dtype(entry.storage_dtype))
    source.read([ReadRequest(entry, region, out)])
    return out.view(dtypes.numpy_dtype(entry.dtype)) if dtypes.is_raw(entry.dtype) else out


def copy_checkpoint(ckpt: Source, dst: str, *, overwrite: bool = False) -> Manifest | None:
    """Save any opened checkpoint (:func:`xckpt.sources.detect.open_checkpoint`) as xckpt at ``dst``.

    Arrays are streamed region by region (:func:`lazy_array`); values are copied as they
    are. Returns the manifest written.
    """
    m = ckpt.manifest
    vals = ckpt.values()
    leaves: list[Any] = []
    for i, e in enumerate(m.leaves):
        if isinstance(e, ArrayEntry):
            # the source's own shard layout does not describe the copy's; the mesh description does
            sharding = {k: v for k, v in (e.sharding or {}).items() if k not in ("shard_shape", "num_shards")}
            leaves.append(lazy_array(e.shape, e.dtype, lambda r, e=e: read_region(ckpt, e, r),
                                     piece_bytes_for(e, dtypes.itemsize(e.dtype), PIECE_BYTES),
                                     sharding=sharding or None))
        else:
            v = vals[i]
            leaves.append(Value(v) if isinstance(v, (list, tuple, dict)) else v)
    metadata = dict(m.metadata)
    metadata["converted_from"] = {"format": ckpt.format, "path": str(ckpt.loc), "producer": m.producer}
    return save(unflatten(m.tree, leaves), dst, coordinator=LocalCoordinator(),
                options=SaveOptions(overwrite=overwrite, metadata=metadata))
