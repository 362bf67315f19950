"""The array leaves of an Orbax checkpoint: their zarr v2/v3 metadata, dtypes and saved shardings."""

from __future__ import annotations

import base64
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from xckpt.format import dtypes, names as naming, zarr
from xckpt.engine.storage import Location, Store
from xckpt.errors import DataError, ManifestError, ResourceError, UnsupportedError, XckptWarning
from xckpt.format.manifest import ArrayEntry, Entry, ValueEntry
from xckpt.format.tree import key_str
from xckpt.format.jsonobj import parse_json
from xckpt.interop.orbax.metadata import NONE_TYPES, OCDBT_MANIFEST, Record

if TYPE_CHECKING:
    from xckpt.interop.orbax.checkpoint import OrbaxCheckpoint


ARRAY_TYPES = ("jax.Array", "np.ndarray")


@dataclass
class ArrayInfo:
    """What an array's zarr metadata says."""

    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    compression: str


def read_array_infos(ckpt: OrbaxCheckpoint, records: list[Record]) -> dict[str, ArrayInfo]:
    """Read every array's zarr metadata concurrently.

    Each is read whole only once known to be at most :data:`~xckpt.format.zarr.MAX_METADATA_BYTES` long (as
    for xckpt's own ``zarr.json``): a larger one is ``resource.too_large``, naming the file and the leaf.
    """
    if not records:
        return {}
    meta_name = "zarr.json" if ckpt.zarr3 else ".zarray"
    try:
        kv = ts.KvStore.open(ckpt.kvstore_spec(), context=ckpt._context).result()
    except Exception as exc:  # noqa: BLE001 - reported as a specific xckpt error
        raise DataError(f"cannot open the checkpoint's key-value store: {str(exc)[:400]}", code="orbax.ocdbt",
                        file=str(ckpt.loc.child(OCDBT_MANIFEST if ckpt.ocdbt else ""))) from exc
    limit = zarr.MAX_METADATA_BYTES
    # the byte just past the bound: there when the metadata is too large, out of range when it is not
    probes = [(rec, kv.read(f"{rec.name}/{meta_name}", byte_range=slice(limit, limit + 1))) for rec in records]
    pending = []
    for rec, probe in probes:
        file = ckpt.metadata_file(rec.name)
        res = _result(probe, file, key_str(rec.key), out_of_range_ok=True)
        if res is None:
            pending.append((rec, kv.read(f"{rec.name}/{meta_name}")))
        elif res.state != "value":
            raise DataError(f"array data named in _METADATA is missing (no {meta_name})",
                            code="array.metadata_missing", file=file, leaf=key_str(rec.key))
        else:
            raise ResourceError(f"the array metadata has more than the {limit} bytes a reader takes whole",
                                file=file, leaf=key_str(rec.key))
    out = {}
    for rec, fut in pending:
        file = ckpt.metadata_file(rec.name)
        res = _result(fut, file, key_str(rec.key))
        if res is None or res.state != "value":
            raise DataError(f"array data named in _METADATA is missing (no {meta_name})",
                            code="array.metadata_missing", file=file, leaf=key_str(rec.key))
        if len(res.value) > limit:  # it grew since it was probed
            raise ResourceError(f"the array metadata has more than the {limit} bytes a reader takes whole",
                                file=file, leaf=key_str(rec.key))
        out[rec.name] = _array_info(bytes(res.value), ckpt.zarr3, file, key_str(rec.key))
    return out


def _result(fut: Any, file: str, leaf: str, *, out_of_range_ok: bool = False) -> Any:
    """The result of a key-value read; None for a byte range past the value's end when ``out_of_range_ok``."""
    try:
        return fut.result()
    except Exception as exc:  # noqa: BLE001 - reported as a specific xckpt error
        if out_of_range_ok and str(exc).startswith("OUT_OF_RANGE"):
            return None
        raise DataError(f"cannot read the array's metadata: {str(exc)[:400]}", code="array.metadata",
                        file=file, leaf=leaf) from exc


def _ints(v: Any, what: str, file: str, leaf: str, *, positive: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and
                                          x >= (1 if positive else 0) for x in v):
        raise ManifestError(f"{what} is {v!r}, not a list of {'positive' if positive else 'non-negative'} "
                            "integers", code="array.metadata", file=file, leaf=leaf)
    return tuple(v)


def _array_info(raw: bytes, zarr3: bool, file: str, leaf: str) -> ArrayInfo:
    """Shape, logical dtype and chunking from ``.zarray`` (zarr v2) or ``zarr.json`` (zarr v3)."""
    meta = parse_json(raw, "array metadata", code="array.metadata_json", file=file, leaf=leaf)
    if not isinstance(meta, dict):
        raise ManifestError("array metadata is not a JSON object", code="array.metadata", file=file, leaf=leaf)
    shape = _ints(meta.get("shape"), "shape", file, leaf)
    if zarr3:
        grid = meta.get("chunk_grid")
        grid_conf = grid.get("configuration") if isinstance(grid, dict) else None
        chunk_raw = grid_conf.get("chunk_shape") if isinstance(grid_conf, dict) else None
        chunk = _ints(chunk_raw, "chunk_grid chunk_shape", file, leaf, positive=True)
        dtype = _zarr3_dtype(meta.get("data_type"), file, leaf)
        inner, compression = chunk, "none"
        codecs = meta.get("codecs") if isinstance(meta.get("codecs"), list) else []
        for c in list(codecs):
            if isinstance(c, dict) and c.get("name") == "sharding_indexed":
                conf = c.get("configuration")
                if not isinstance(conf, dict):
                    raise ManifestError(f"sharding_indexed configuration is {conf!r:.100}, not an object",
                                        code="array.metadata", file=file, leaf=leaf)
                inner = _ints(conf.get("chunk_shape"), "sharding_indexed chunk_shape", file, leaf, positive=True)
                inner_codecs = conf.get("codecs")
                codecs = inner_codecs if isinstance(inner_codecs, list) else []
        names = [c.get("name") for c in codecs if isinstance(c, dict) and c.get("name") not in ("bytes", "crc32c")]
        compression = "+".join(str(n) for n in names) or "none"
    else:
        chunk = _ints(meta.get("chunks"), "chunks", file, leaf, positive=True)
        inner = chunk
        dtype = _zarr2_dtype(meta.get("dtype"), file, leaf)
        comp = meta.get("compressor")
        compression = str(comp.get("id")) if isinstance(comp, dict) else "none"
    if len(chunk) != len(shape) or len(inner) != len(shape):
        raise ManifestError(f"chunk shape {list(chunk)} / {list(inner)} and shape {list(shape)} differ in rank",
                            code="array.metadata", file=file, leaf=leaf)
    return ArrayInfo(shape, dtype, chunk, inner, compression)


#: A zarr v2 ``dtype`` string of one scalar type: byte order, kind, size (``"<f4"``, ``"|b1"``).
_ZARR2_TYPESTR = re.compile(r"[<>|=]?[a-zA-Z][0-9]{0,2}")


def _zarr2_dtype(v: Any, file: str, leaf: str) -> str:
    """The logical dtype of a zarr v2 ``dtype`` (``"<f4"``, ``"|b1"``, ``"bfloat16"``, ...)."""
    if isinstance(v, str):
        if v in dtypes.LOGICAL_DTYPES:  # TensorStore's names for types numpy lacks: bfloat16, float8_*
            return v
        dt = None
        if _ZARR2_TYPESTR.fullmatch(v):  # one scalar type: no subarray or record, whose sizes numpy would work out
            try:
                dt = np.dtype(v)
            except (TypeError, ValueError):
                dt = None
        if dt is not None and dt.fields is None and dt.name in dtypes.LOGICAL_DTYPES:
            return dt.name
    raise UnsupportedError(f"zarr v2 dtype {v!r} is not supported", code="dtype.unsupported",
                           file=file, leaf=leaf)


def _zarr3_dtype(v: Any, file: str, leaf: str) -> str:
    """The logical dtype of a zarr v3 ``data_type`` (the names are the same)."""
    if isinstance(v, str) and v in dtypes.LOGICAL_DTYPES:
        return v
    raise UnsupportedError(f"zarr v3 data_type {v!r} is not supported", code="dtype.unsupported",
                           file=file, leaf=leaf)


def scalar_type(dtype: str) -> str:
    """The manifest value type (bool/int/complex/float) an Orbax scalar of ``dtype`` reads as."""
    kind = dtypes.numpy_dtype(dtype).kind
    return {"b": "bool", "i": "int", "u": "int", "c": "complex"}.get(kind, "float")


def entry_for(ckpt: OrbaxCheckpoint, rec: Record, info: ArrayInfo | None,
           sharding: dict[str, Any] | None) -> Entry:
    """The manifest entry that stands for the Orbax record ``rec`` (array, scalar, string or none)."""
    if rec.value_type in ARRAY_TYPES + ("scalar",) and not rec.skip:
        assert info is not None
        path = ckpt.entry_path(rec.name)
        if rec.value_type == "scalar" and info.shape == ():
            ckpt.scalar_dtypes[path] = info.dtype
            return ValueEntry(rec.key, scalar_type(info.dtype), path)
        detail: dict[str, Any] = {"framework": "jax", "source": "orbax", "value_type": rec.value_type}
        if rec.write_shape is not None:
            detail["write_shape"] = rec.write_shape
        detail.update(sharding or {})
        return ArrayEntry(rec.key, path, info.shape, info.dtype, info.dtype, info.chunk_shape,
                          info.inner_chunk_shape, info.compression, detail)
    if rec.value_type == "string":
        return ValueEntry(rec.key, "str")
    if rec.value_type in NONE_TYPES or rec.skip:
        if rec.value_type not in NONE_TYPES:
            warnings.warn(f"{key_str(rec.key)}: Orbax {rec.value_type} record has no data "
                          "(skip_deserialize); it reads as None", XckptWarning, stacklevel=4)
        return ValueEntry(rec.key, "none")
    raise UnsupportedError(f"Orbax value_type {rec.value_type!r} (a custom TypeHandler?) is not supported",
                           code="orbax.unsupported", file=str(ckpt.loc.child(naming.ORBAX_METADATA)),
                           leaf=key_str(rec.key))


def _names(v: Any) -> list[str] | None:
    """``v`` when it is a list of strings, else None."""
    return list(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else None


def _named_sharding(desc: dict[str, Any]) -> dict[str, Any] | None:
    """Mesh shape, axis names and per-dimension axes of a ``NamedSharding`` record of ``_sharding``, or None
    when it is not well formed (a mesh of positive sizes, one name each, a spec naming only those axes)."""
    shape, axes, spec = desc.get("shape"), _names(desc.get("axis_names")), desc.get("partition_spec") or []
    if not isinstance(shape, list) or axes is None or len(shape) != len(axes) or not isinstance(spec, list) or \
            not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        return None
    dim_axes = [[] if p is None else [p] if isinstance(p, str) else _names(p) for p in spec]
    if any(d is None or not set(d) <= set(axes) for d in dim_axes):
        return None
    return {"mesh_shape": shape, "axis_names": axes, "dim_axes": dim_axes}


def read_shardings(loc: Location, store: Store) -> dict[str, dict[str, Any]]:
    """Mesh shape, axis names and per-dimension axes of each array, from Orbax's ``_sharding`` (best effort).

    Orbax ignores ``_sharding`` when restoring onto a target, so a damaged file, or a damaged record of it,
    is not an error here: what cannot be read is left out.
    """
    raw = store.read(naming.ORBAX_SHARDING)
    if raw is None:
        return {}
    file = str(loc.child(naming.ORBAX_SHARDING))
    try:
        obj = parse_json(raw, naming.ORBAX_SHARDING, code="orbax.invalid", file=file)
    except ManifestError:
        return {}
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(obj, dict):
        return out
    for k, v in obj.items():
        try:
            name = base64.urlsafe_b64decode(k + "=" * (-len(k) % 4)).decode()
            desc = parse_json(v.encode("utf-8"), naming.ORBAX_SHARDING, code="orbax.invalid", file=file)
        except (ValueError, AttributeError, ManifestError):  # not base64 of UTF-8, not a string, not JSON
            continue
        kind = desc.get("sharding_type") if isinstance(desc, dict) else None
        if kind == "NamedSharding":
            named = _named_sharding(desc)
            if named is not None:
                out[name] = named
        elif isinstance(kind, str):
            out[name] = {"orbax_sharding": kind}
    return out
