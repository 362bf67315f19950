"""Converting checkpoints of other formats into xckpt (and back), leaf by leaf.

A converter turns the source into a tree whose array leaves are
:class:`~xckpt.registry.ArraySource` objects that read lazily, region by region,
so a conversion never holds more than a few pieces of one array in memory.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from xckpt.format import dtypes
from xckpt.errors import UnsupportedError
from xckpt.engine.regions import Region
from xckpt.registry import ArraySource, Shard

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


_converters: dict[tuple[str, str], Callable[..., None]] = {}


def register_converter(source: str, target: str, fn: Callable[..., None]) -> None:
    """Register ``fn(src, dst, overwrite=...)`` converting format ``source`` to ``target``."""
    _converters[(source, target)] = fn


def _read_region(ckpt: Any, entry: Any) -> Callable[[Region], np.ndarray]:
    """A function reading regions of one stored array of ``ckpt`` in its logical dtype (opened once)."""
    from xckpt.sources.native import translate
    state: dict[str, Any] = {}
    want = dtypes.numpy_dtype(entry.dtype)

    def read(region: Region) -> np.ndarray:
        try:
            if "store" not in state:
                state["store"] = ckpt.open_array(entry).result()
            raw = np.asarray(state["store"][region.slices()].read().result())
        except Exception as exc:  # noqa: BLE001 - translated to a specific xckpt error
            raise translate(exc, entry, str(ckpt.loc.child(entry.path))) from exc
        return raw.view(want) if raw.dtype != want and dtypes.is_raw(entry.dtype) else raw

    return read


def copy_checkpoint(ckpt: Any, dst: str, *, overwrite: bool = False) -> Any:
    """Save any opened checkpoint (:func:`xckpt.sources.native.open_checkpoint`) as xckpt at ``dst``.

    Arrays are streamed region by region (:func:`lazy_array`); values are copied as they
    are. Returns the manifest written.
    """
    from xckpt.engine.collective import LocalCoordinator
    from xckpt.format.manifest import ArrayEntry
    from xckpt.save import save
    from xckpt.format.tree import Value, unflatten
    m = ckpt.manifest
    vals = ckpt.values()
    leaves: list[Any] = []
    for i, e in enumerate(m.leaves):
        if isinstance(e, ArrayEntry):
            # the source's own shard layout does not describe the copy's; the mesh description does
            sharding = {k: v for k, v in (e.sharding or {}).items() if k not in ("shard_shape", "num_shards")}
            leaves.append(lazy_array(e.shape, e.dtype, _read_region(ckpt, e), sharding=sharding or None))
        else:
            v = vals[i]
            leaves.append(Value(v) if isinstance(v, (list, tuple, dict)) else v)
    metadata = dict(m.metadata)
    metadata["converted_from"] = {"format": ckpt.format, "path": str(ckpt.loc), "producer": m.producer}
    return save(unflatten(m.tree, leaves), dst, coordinator=LocalCoordinator(), overwrite=overwrite,
                metadata=metadata)


def _xckpt_to_xckpt(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Re-save a checkpoint as xckpt (a verified copy: every chunk is read and rewritten)."""
    from xckpt.sources.native import open_checkpoint
    copy_checkpoint(open_checkpoint(src), dst, overwrite=overwrite)


register_converter("xckpt", "xckpt", _xckpt_to_xckpt)


def convert(src: str, dst: str, *, source: str = "xckpt", target: str = "xckpt", overwrite: bool = False) -> None:
    """Convert the checkpoint at ``src`` (format ``source``) to ``dst`` (format ``target``)."""
    if (source, target) not in _converters:
        if source == "dcp" or target == "dcp":
            import xckpt_torch  # noqa: F401 - registers the DCP converters
        if source == "orbax":
            from xckpt.interop.orbax import checkpoint  # noqa: F401 - registers the Orbax converter
    fn = _converters.get((source, target))
    if fn is None:
        raise UnsupportedError(f"no converter from {source} to {target}", code="convert.unsupported")
    fn(src, dst, overwrite=overwrite)
