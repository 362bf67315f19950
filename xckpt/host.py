"""numpy leaves: how the core saves and loads plain host arrays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xckpt.format import dtypes
from xckpt.errors import ShapeError
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, ArrayTarget, Shard, register_source, register_target


@dataclass(frozen=True)
class ReadSpec:
    """A numpy load target: read ``region`` (default: all) of a stored array as ``dtype``.

    ``region`` is a :class:`Region` or a tuple of slices with explicit bounds.
    """

    region: Region | tuple[slice, ...] | None = None
    dtype: Any = None


def array_source(arr: np.ndarray | np.generic) -> ArraySource:
    """A numpy array held whole by this process (a replica on every process that has it)."""
    a = np.asarray(arr)
    return ArraySource(tuple(a.shape), dtypes.logical_name(a.dtype),
                       [Shard(Region.full(a.shape), lambda a=a: a)])


def full_target(shape: tuple[int, ...], dtype: str | None = None) -> ArrayTarget:
    """Read a whole array of ``shape`` as one numpy array (``dtype`` None: as stored)."""
    return ArrayTarget(shape, dtype, [Region.full(shape)], lambda parts: parts[0])


def ndarray_target(like: np.ndarray, entry: Any) -> ArrayTarget:
    """Load a whole array as a new numpy array with ``like``'s dtype."""
    return full_target(tuple(like.shape), dtypes.logical_name(like.dtype))


def scalar_target(like: np.generic, entry: Any) -> ArrayTarget:
    """Load a stored 0-d array as a numpy scalar of ``like``'s dtype (``np.float32(0)`` gives an ``np.float32``)."""
    return ArrayTarget((), dtypes.logical_name(like.dtype), [Region.full(())], lambda parts: parts[0][()])


def readspec_target(like: ReadSpec, entry: Any) -> ArrayTarget:
    """Load a region of an array, optionally cast."""
    dtype = None if like.dtype is None else dtypes.logical_name(like.dtype)
    region = like.region
    if region is None:
        return full_target(tuple(entry.shape), dtype)
    if not isinstance(region, Region):
        if len(region) != len(entry.shape):
            raise ShapeError(f"{len(region)} slices given for an array of rank {len(entry.shape)}")
        offs, sizes = [], []
        for s, n in zip(region, entry.shape):
            if not isinstance(s, slice):  # an index (2, -1) or an Ellipsis would drop or add dimensions
                raise ShapeError(f"a region is a tuple of slices, one per dimension; got {s!r}")
            beyond = [b for b in (s.start, s.stop) if isinstance(b, (int, np.integer)) and not -n <= b <= n]
            if beyond:  # a slice would silently stop at the end: refused as a Region past it is
                raise ShapeError(f"the slice {s!r} reaches past the end of a dimension of length {n}")
            start, stop, step = s.indices(n)
            if step != 1:
                raise ShapeError("strided regions are not supported")
            offs.append(start)
            sizes.append(max(0, stop - start))
        region = Region(tuple(offs), tuple(sizes))
    return ArrayTarget(tuple(entry.shape), dtype, [region], lambda parts: parts[0])


register_source(lambda x: isinstance(x, ArraySource), lambda x: x)
register_source(lambda x: isinstance(x, (np.ndarray, np.generic)), array_source)
register_target(lambda x: isinstance(x, np.ndarray), ndarray_target)
register_target(lambda x: isinstance(x, np.generic), scalar_target)
register_target(lambda x: isinstance(x, ReadSpec), readspec_target)
