"""How bytes move on save: region writes into Zarr arrays, many in flight, bounded in host memory."""

from __future__ import annotations

from collections import deque
from types import TracebackType
from typing import Any

import numpy as np

from xckpt.format import zarr as arrays, dtypes
from xckpt.errors import SaveError
from xckpt.engine.regions import Region
from xckpt.engine.storage import Location


def host_data(data: Any, region: Region, dtype: str, leaf: str) -> np.ndarray:
    """Check fetched shard data against its region and logical dtype; give C-contiguous storage bytes."""
    data = np.asarray(data)
    if tuple(data.shape) != region.sizes or dtypes.logical_name(data.dtype) != dtype:
        raise SaveError(f"shard data has shape {data.shape} and dtype {data.dtype}, expected "
                        f"{region.sizes} {dtype}", leaf=leaf)
    if not data.flags.c_contiguous:
        data = data.copy(order="C")
    return data.view(np.uint8) if dtypes.is_raw(dtype) else data


class RegionWriter:
    """Writes regions of the arrays under ``root`` with at most ``max_inflight_bytes`` pending.

    Used as a context manager: leaving it normally waits for every write and raises the
    first error; leaving it on an exception still waits for every write already started,
    so nothing writes into a directory that is about to be cleaned up.
    """

    def __init__(self, root: Location, max_inflight_bytes: int) -> None:
        self.root = root
        self.max_inflight_bytes = max_inflight_bytes
        self.bytes_written = 0
        self._opened: dict[str, Any] = {}
        self._inflight: deque[tuple[int, Any]] = deque()
        self._held = 0

    def write(self, name: str, metadata: dict[str, Any], region: Region, data: Any, dtype: str,
              leaf: str) -> int:
        """Start writing ``data`` (logical ``dtype``) to ``region`` of array ``name``; returns its bytes."""
        raw = host_data(data, region, dtype, leaf)
        store = self._opened.get(name)
        if store is None:
            store = self._opened[name] = arrays.open_for_write(self.root, name, metadata)
        fut = store[region.slices()].write(raw, can_reference_source_data_indefinitely=True)
        self._inflight.append((raw.nbytes, fut))
        self._held += raw.nbytes
        self.bytes_written += raw.nbytes
        while self._held > self.max_inflight_bytes and len(self._inflight) > 1:
            n, f = self._inflight.popleft()
            f.result()
            self._held -= n
        return raw.nbytes

    def __enter__(self) -> "RegionWriter":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            while self._inflight:
                n, f = self._inflight.popleft()
                self._held -= n
                if kind is None:
                    f.result()
                else:
                    try:
                        f.result()
                    except Exception:  # noqa: BLE001 - the first error is already propagating
                        pass
        finally:
            for _, f in self._inflight:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - only reached when another write already failed
                    pass
