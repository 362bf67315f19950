"""A committed xckpt checkpoint, opened for reading: its manifest, its values, its arrays.

Every byte is read through the checkpoint's :class:`~xckpt.engine.storage.Store`: no
link is followed and nothing but a regular file is opened. Arrays are read by the engine
(:func:`xckpt.engine.read.read_regions`), straight into the caller's buffers;
:meth:`NativeCheckpoint.open_array` also offers each leaf as a TensorStore view, for
mappings that transform arrays lazily.
"""

from __future__ import annotations

from typing import Any, Sequence

import crc32c
import tensorstore as ts

from xckpt.engine.read import ReadMemo, ReadRequest, placeholder, read_regions
from xckpt.engine.storage import Location, Store
from xckpt.errors import DataError, IntegrityError, ManifestError, NotACheckpointError, ResourceError
from xckpt.format import dtypes, manifest as manifest_format, names, values as values_format, zarr
from xckpt.format.regions import Region
from xckpt.format.manifest import ArrayEntry, Manifest, ValueEntry
from xckpt.format.tree import key_str
from xckpt.engine.views import context


class NativeCheckpoint:
    """A committed xckpt checkpoint, opened for reading."""

    format = "xckpt"

    def __init__(self, loc: Location, store: Store, manifest: Manifest) -> None:
        self.loc = loc
        self.store = store
        self.manifest = manifest
        self._values: dict[int, Any] | None = None
        self._memo = ReadMemo()  # what its reads checked already (zarr.json; small objects a check kept)

    def values(self) -> dict[int, Any]:
        """Value leaves by leaf index, checked against the manifest's size and crc32c."""
        if self._values is None:
            self._values = read_values(self.loc, self.store, self.manifest)
        return self._values

    def read(self, requests: Sequence[ReadRequest], *, precheck: bool = False) -> int:
        """Fill each request's output (storage dtype) from the stored arrays; returns the bytes read.

        ``precheck`` opens every object and checks its index before any output is written.
        """
        return self._regions(requests, self._memo, precheck=precheck)

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Check every object the requests would read (a regular file, its index and place tag), and the
        arrays' ``zarr.json``, without filling any output. The small objects it reads whole are kept, checked,
        for the :meth:`read` that follows (at most :data:`~xckpt.engine.read.MAX_KEPT_BYTES`), which then
        reads neither them nor a ``zarr.json`` again."""
        self._regions(requests, self._memo, fill=False)

    def _regions(self, requests: Sequence[ReadRequest], memo: ReadMemo, **how: bool) -> int:
        """:func:`~xckpt.engine.read.read_regions` of this checkpoint (``how``: ``precheck``, ``fill``), files
        named by their path in it; the bytes read."""
        return read_regions(self.store, requests, lambda name: str(self.loc.child(name)),
                            generation=self.manifest.tag_generation, memo=memo, **how)

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """A TensorStore view of an array leaf (segments concatenated), after checking that every object
        it may read is a regular file inside the checkpoint, and every chunk object's index and place tag
        (TensorStore checks the crc32c of what it decodes, not where an object belongs)."""
        self._regions([ReadRequest(entry, Region.full(entry.shape),
                                   placeholder(entry.shape, dtypes.numpy_dtype(entry.storage_dtype)))],
                      ReadMemo(self._memo.arrays), fill=False)  # (no small object kept: TensorStore reads them)
        parts = []
        for a in entry.arrays():
            meta = zarr.zarr_metadata(a.shape, entry.storage_dtype, a.chunk_shape, a.inner_chunk_shape,
                                      entry.compression)
            spec = {"driver": "zarr3", "kvstore": self.store.kvstore(a.path), "fill_missing_data_reads": False,
                    "metadata": {k: v for k, v in meta.items() if k not in ("zarr_format", "node_type")}}
            parts.append((a, ts.open(spec, open=True, read=True, context=context())))
        if len(parts) == 1:
            return parts[0][1]
        return _concat(entry, parts)

    def replaced(self) -> bool:
        """Whether the checkpoint at its path was replaced or removed since it was opened."""
        return self.store.replaced()

    def close(self) -> None:
        """Release the store's open directories (and the small objects a check kept)."""
        self._memo = ReadMemo()
        self.store.close()


def _concat(entry: ArrayEntry, parts: list[tuple[Any, Any]]) -> "ts.Future[ts.TensorStore]":
    """The segments of a leaf joined into one view (along each dimension in turn)."""
    promise, future = ts.Promise.new()

    def done() -> None:
        try:
            stores = {a.offset: f.result()[ts.d[:].translate_to[a.offset]] for a, f in parts}
            promise.set_result(_join(stores, len(entry.shape)))
        except Exception as exc:  # noqa: BLE001 - handed to the future
            promise.set_exception(exc)

    remaining = [len(parts)]
    for _, f in parts:
        def one(_: Any) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                done()
        f.add_done_callback(one)
    return future


def _join(stores: dict[tuple[int, ...], Any], rank: int, dim: int = 0) -> Any:
    """Concatenate boxes that tile a grid: group by the offset along ``dim``, join the rest, then along ``dim``."""
    if dim == rank or len(stores) == 1:
        return next(iter(stores.values()))
    rows: dict[int, dict[tuple[int, ...], Any]] = {}
    for off, s in stores.items():
        rows.setdefault(off[dim], {})[off] = s
    joined = [_join(rows[o], rank, dim + 1) for o in sorted(rows)]
    return joined[0] if len(joined) == 1 else ts.concat(joined, axis=dim)


def read_manifest(loc: Location, store: Store) -> Manifest:
    """Read and check the manifest at ``loc``."""
    data = store.read(names.MANIFEST)
    if data is None:
        raise NotACheckpointError(f"{loc} holds no committed xckpt checkpoint (no {names.MANIFEST})",
                                  file=str(loc.child(names.MANIFEST)))
    return manifest_format.parse(data, file=str(loc.child(names.MANIFEST)))


def read_values(loc: Location, store: Store, m: Manifest) -> dict[int, Any]:
    """Read, verify and decode ``values.msgpack``."""
    if m.values is None:
        return {}
    file = str(loc.child(names.VALUES))
    try:
        blob = store.read(names.VALUES, limit=m.values["size"])
    except ResourceError as exc:
        raise DataError(f"values file is larger than the manifest says ({m.values['size']} bytes): {exc.message}",
                        code="values.size", file=file) from None
    if blob is None:
        raise DataError("values file is missing", code="values.missing", file=file)
    if len(blob) != m.values["size"]:
        raise DataError(f"values file has {len(blob)} bytes, the manifest says {m.values['size']}",
                        code="values.size", file=file)
    if crc32c.crc32c(blob) != m.values["crc32c"]:
        raise IntegrityError("values file crc32c does not match the manifest", code="values.crc32c", file=file)
    decoded = values_format.decode(blob, file=file)  # anything encode would not write: values.invalid
    if not isinstance(decoded, dict) or any(type(k) is not int for k in decoded):
        raise ManifestError("values file is not a map from leaf indexes (integers) to values",
                            code="values.invalid", file=file)
    value_leaves = {i for i, e in enumerate(m.leaves) if isinstance(e, ValueEntry)}
    stray = sorted(k for k in decoded if k not in value_leaves)
    if stray:  # the file maps each value leaf's index to its value, nothing else (spec 5)
        what = "no leaf has it" if stray[0] < 0 or stray[0] >= len(m.leaves) else \
            f"it is the array leaf {key_str(m.leaves[stray[0]].key)!r}"
        more = f"; {len(stray) - 1} more such entries" if len(stray) > 1 else ""
        raise ManifestError(f"values file holds an entry for index {stray[0]} ({what}{more}); only value leaves "
                            "have entries", code="values.invalid", file=file)
    out: dict[int, Any] = {}
    for i, e in enumerate(m.leaves):
        if isinstance(e, ValueEntry):
            if i not in decoded:
                raise DataError("value is missing from the values file", code="values.missing", file=file,
                                leaf=key_str(e.key))
            v = decoded[i]
            if values_format.value_type(v) != e.type:
                raise ManifestError(f"value has type {values_format.value_type(v)}, the manifest says {e.type}",
                                    code="values.type", file=file, leaf=key_str(e.key))
            out[i] = v
    return out


def open_native(loc: Location, store: Store) -> NativeCheckpoint:
    """Open the xckpt checkpoint at ``loc``."""
    return NativeCheckpoint(loc, store, read_manifest(loc, store))
