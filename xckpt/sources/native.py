"""Opening a stored checkpoint for reading: its manifest, its values, its arrays.

:func:`open_checkpoint` returns a :class:`Checkpoint` whatever wrote it: xckpt, or
Orbax (zarr v2, zarr v3, OCDBT; see :mod:`xckpt.interop.orbax`).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import google_crc32c
import tensorstore as ts

from xckpt.format import zarr as arrays, manifest as manifest_mod, names as naming, values as values_mod
from xckpt.engine import storage
from xckpt.errors import DataError, IntegrityError, ManifestError, NotACheckpointError, UnsafePathError, XckptError
from xckpt.format.manifest import ArrayEntry, Manifest, ValueEntry
from xckpt.engine.regions import Region, chunks_of
from xckpt.engine.storage import Location
from xckpt.format.tree import key_str


class Checkpoint:
    """A committed xckpt checkpoint, opened for reading."""

    format = "xckpt"

    def __init__(self, loc: Location, manifest: Manifest) -> None:
        self.loc = loc
        self.manifest = manifest
        self._values: dict[int, Any] | None = None

    def values(self) -> dict[int, Any]:
        """Value leaves by leaf index, checked against the manifest's size and crc32c."""
        if self._values is None:
            self._values = read_values(self.loc, self.manifest)
        return self._values

    def array_spec(self, entry: ArrayEntry) -> dict[str, Any]:
        """The TensorStore spec that opens ``entry``, checked against its ``zarr.json``."""
        meta = arrays.zarr_metadata(entry.shape, entry.storage_dtype, entry.chunk_shape,
                                    entry.inner_chunk_shape, entry.compression)
        spec = arrays.spec(self.loc, entry.path, meta)
        spec["fill_missing_data_reads"] = False
        return spec

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """Start opening an array leaf."""
        return ts.open(self.array_spec(entry), open=True, read=True, context=arrays.context())

    def refuse_links(self, entry: ArrayEntry, regions: Sequence[Region]) -> None:
        """A reader does not follow links: refuse one on the path to any chunk these regions read.

        Only the objects the read touches are checked (xckpt layout on local file systems).
        """
        if not self.loc.is_local or self.format != "xckpt":
            return
        base = os.path.join(self.loc.local_path, entry.path)
        paths = {base, os.path.join(base, "zarr.json"), os.path.join(base, "c")}
        for region in regions:
            for idx in chunks_of(region, entry.chunk_shape) if entry.shape else [()]:
                parts = [str(i) for i in idx]
                paths.update(os.path.join(base, "c", *parts[:n]) for n in range(1, len(parts) + 1))
        for path in sorted(paths):
            if os.path.islink(path):
                raise UnsafePathError(f"{path} is a symbolic link; a checkpoint holds plain files only",
                                      code="path.link", file=path, leaf=key_str(entry.key))


def read_manifest(loc: Location) -> Manifest:
    """Read and check the manifest at ``loc``."""
    data = storage.read_bytes(loc, naming.MANIFEST)
    if data is None:
        raise NotACheckpointError(f"{loc} holds no committed xckpt checkpoint (no {naming.MANIFEST})",
                                  file=str(loc.child(naming.MANIFEST)))
    return manifest_mod.parse(data, file=str(loc.child(naming.MANIFEST)))


def read_values(loc: Location, m: Manifest) -> dict[int, Any]:
    """Read, verify and decode ``values.msgpack``."""
    if m.values is None:
        return {}
    file = str(loc.child(naming.VALUES))
    blob = storage.read_bytes(loc, naming.VALUES)
    if blob is None:
        raise DataError("values file is missing", code="values.missing", file=file)
    if len(blob) != m.values["size"]:
        raise DataError(f"values file has {len(blob)} bytes, the manifest says {m.values['size']}",
                        code="values.size", file=file)
    if google_crc32c.value(blob) != m.values["crc32c"]:
        raise IntegrityError("values file crc32c does not match the manifest", code="values.crc32c", file=file)
    try:
        decoded = values_mod.decode(blob)
    except (ValueError, XckptError, Exception) as exc:  # msgpack raises several types
        raise ManifestError(f"values file cannot be decoded: {exc}", code="values.invalid", file=file) from exc
    if not isinstance(decoded, dict):
        raise ManifestError("values file is not a map", code="values.invalid", file=file)
    out: dict[int, Any] = {}
    for i, e in enumerate(m.leaves):
        if isinstance(e, ValueEntry):
            if i not in decoded:
                raise DataError("value is missing from the values file", code="values.missing", file=file,
                                leaf=key_str(e.key))
            v = decoded[i]
            if values_mod.value_type(v) != e.type:
                raise ManifestError(f"value has type {values_mod.value_type(v)}, the manifest says {e.type}",
                                    code="values.type", file=file, leaf=key_str(e.key))
            out[i] = v
    return out


def _has(loc: Location, name: str) -> bool:
    return storage.read_bytes(loc, name, slice(0, 0)) is not None


def open_checkpoint(path: Any) -> Checkpoint:
    """Open the checkpoint at ``path``: xckpt, or one written by Orbax.

    An Orbax ``CheckpointManager`` step directory (``<root>/<step>/default/``) is
    opened through its single ``default`` item.
    """
    loc = Location.of(path)
    if not _has(loc, naming.MANIFEST) and not _has(loc, naming.ORBAX_METADATA):
        item = loc.child("default")
        if _has(item, naming.MANIFEST) or _has(item, naming.ORBAX_METADATA):
            loc = item
    if not _has(loc, naming.MANIFEST) and _has(loc, naming.ORBAX_METADATA):
        from xckpt.interop.orbax.checkpoint import open_orbax
        return open_orbax(loc)
    return Checkpoint(loc, read_manifest(loc))


def translate(exc: BaseException, entry: ArrayEntry, file: str) -> XckptError:
    """Turn a TensorStore error about an array into a specific xckpt error (the validator's codes)."""
    if isinstance(exc, XckptError):
        return exc
    text = str(exc)
    leaf = key_str(entry.key)
    if "Error opening" in text:  # the array's metadata (zarr.json), before any chunk is read
        if "does not exist" in text or "NOT_FOUND" in text:
            return DataError(f"array metadata is missing: {text[:400]}", code="array.metadata_missing",
                             file=file, leaf=leaf)
        if "Invalid JSON" in text or "JSON" in text and "DATA_LOSS" in text:
            return DataError(f"array metadata is not valid JSON: {text[:400]}", code="array.metadata_json",
                             file=file, leaf=leaf)
        return DataError(f"array metadata does not match the manifest: {text[:400]}",
                         code="array.metadata_mismatch", file=file, leaf=leaf)
    if "Digest mismatch" in text or "checksum" in text.lower():
        return IntegrityError(f"crc32c mismatch: {text[:400]}", code="chunk.crc32c", file=file, leaf=leaf)
    if "is missing" in text or "NOT_FOUND" in text:
        return DataError(f"array data is missing: {text[:400]}", code="chunk.missing", file=file, leaf=leaf)
    if "size of" in text or "DATA_LOSS" in text or "OUT_OF_RANGE" in text:
        return DataError(f"array data is truncated or corrupt: {text[:400]}", code="chunk.truncated",
                         file=file, leaf=leaf)
    if "FAILED_PRECONDITION" in text or "does not match" in text:
        return DataError(f"array metadata does not match the manifest: {text[:400]}",
                         code="array.metadata_mismatch", file=file, leaf=leaf)
    return DataError(f"cannot read array: {text[:400]}", code="array.read", file=file, leaf=leaf)
