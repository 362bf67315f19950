"""Converting between stock DCP checkpoints (``FileSystemWriter`` output) and xckpt.

``dcp -> xckpt``: the checkpoint is read without trusting it (:mod:`.dcp_metadata`):
DCP's ``.metadata`` pickle through an unpickler that builds only the classes DCP
metadata is made of, ``.metadata`` and the ``.distcp`` data files opened relative to
the checkpoint directory without following links or blocking, each stored range
checked against its file before it is read. Each stored item is a ``torch.save``
blob, loaded with ``torch.load(weights_only=True)`` (torch's own restricted
unpickler); numpy data inside a value is parsed by :mod:`.dcp_numpy`. Each stored
DCP chunk becomes one region of the xckpt array, read when the writer gets to it, so
memory stays near one chunk.

``xckpt -> dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter``
and a planner that reads each array from xckpt only when DCP writes it (the state
dict holds ``meta`` tensors), one file per tensor.

Neither direction unpickles anything from an xckpt checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import zipfile
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem

from xckpt.engine.collective import LocalCoordinator
from xckpt.engine.claims import new_generation
from xckpt.engine.commit import Hold, SaveOptions, check_target, publish
from xckpt.engine.copy import LazySource, read_region
from xckpt.engine.protocol import save
from xckpt.engine.storage import Location
from xckpt.errors import UnsupportedError, XckptError
from xckpt.format.codecs import zstd_stream_decompress
from xckpt.format.manifest import ArrayEntry
from xckpt.format.regions import Region
from xckpt.format.tree import is_namedtuple, unflatten
from xckpt.registry import Shard
from xckpt.sources.detect import open_checkpoint

from . import dcp_numpy
from .dcp_metadata import DcpDirectory, zstd_compressed
from .dcp_planners import plain_value
from .dcp_tree import as_leaf, insert, key_of, listify
from .staging import to_host
from .tensors import from_numpy, logical_dtype, torch_dtype


#: The most bytes a stored value compressed by DCP's ZStandard extension may expand to.
MAX_VALUE_BYTES = 1 << 30
#: Bytes a torch.save archive of one tensor holds besides the tensor's own (its pickle, records, directory).
ARCHIVE_OVERHEAD = 1 << 20


@contextlib.contextmanager
def _item(d: DcpDirectory, info: _StorageInfo, limit: int) -> Iterator[Any]:
    """One stored item as a file of its torch.save bytes: read on demand, or, written through DCP's ZStandard
    extension, decompressed into memory up to ``limit`` bytes (``resource.too_large`` past it)."""
    with d.item(info) as f:
        if not zstd_compressed(info):
            yield f
            return
        try:
            data = zstd_stream_decompress(f.read(), limit)
        except XckptError as exc:
            raise (f.truncated or exc.at(file=f.path)) from None
        plain = io.BytesIO(data)
        plain.truncated = None  # type: ignore[attr-defined]
        plain.path = f.path  # type: ignore[attr-defined]
        yield plain


def _torch_load(d: DcpDirectory, info: _StorageInfo, what: str, code: str, limit: int) -> Any:
    """``torch.load(weights_only=True)`` of one stored item, read through a file of its bytes (each tensor
    read straight into its own memory; decompressed first when DCP's ZStandard extension wrote it, at most
    ``limit`` bytes), refusing zip members that are not stored uncompressed (``torch.save`` never compresses;
    a compressed member could expand without bound)."""
    with _item(d, info, limit) as f:
        try:
            with zipfile.ZipFile(f) as z:
                packed = [i.filename for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED]
        except (zipfile.BadZipFile, ValueError, OSError) as exc:
            if f.truncated is not None:
                raise f.truncated from None
            raise UnsupportedError(f"{what} is not torch.save data ({exc})", code=code, file=f.path) from None
        if packed:
            raise UnsupportedError(f"{what} holds compressed members {packed[:3]}; torch.save writes none",
                                   code=code, file=f.path)
        f.seek(0)
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except XckptError as exc:  # refused by a parser of .dcp_numpy: say where
            raise exc.naming(f.path, message=f"{what} holds {exc.message}") from None
        except Exception as exc:  # noqa: BLE001 - reported as an xckpt error
            if f.truncated is not None:
                raise f.truncated from None
            raise UnsupportedError(f"{what} is not plain data (weights_only load failed: {exc})", code=code,
                                   file=f.path) from exc


def _read_chunk(d: DcpDirectory, info: _StorageInfo, fqn: str, region: Region, dtype: torch.dtype) -> np.ndarray:
    what = f"DCP chunk at {region.offsets} of {fqn!r}"
    t = _torch_load(d, info, what, "convert.dcp_chunk", region.numel * dtype.itemsize + ARCHIVE_OVERHEAD)
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != dtype \
            or tuple(t.shape) != tuple(region.sizes):
        desc = (f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                else f"a {type(t).__name__}")
        raise UnsupportedError(f"{what} holds {desc}, not the {dtype} chunk of shape {tuple(region.sizes)} "
                               "its metadata records", code="convert.dcp_chunk", file=d.path(info.relative_path))
    return to_host(t.detach().contiguous())


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()``, as a pickle of empty bytes calls it (protocol 2); any argument (``bytes(2**40)`` would
    allocate that much) is refused."""
    if args:
        raise ValueError("a pickled bytes() call with arguments")
    return b""


def _read_value(d: DcpDirectory, info: _StorageInfo, fqn: str) -> Any:
    """A stored value; besides what a weights-only load admits, an ``io.BytesIO`` (a DCP leaf type, saved
    as a pickled file object, ``bytes()`` for an empty one), given as its bytes, and numpy arrays, scalars
    (as 0-d arrays) and dtypes, parsed by :mod:`.dcp_numpy`."""
    with torch.serialization.safe_globals([io.BytesIO, (_empty_bytes, "builtins.bytes"), *dcp_numpy.GLOBALS]):
        what = f"DCP value {fqn!r}"
        loaded = _torch_load(d, info, what, "convert.dcp_value", MAX_VALUE_BYTES)
    try:
        return plain_value(loaded)
    except XckptError as exc:  # an array the pickle left unbuilt
        raise exc.naming(d.path(info.relative_path), message=f"{what} holds {exc.message}") from None


def dcp_to_xckpt(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Convert the DCP checkpoint directory ``src`` into an xckpt checkpoint at ``dst``.

    Nothing in ``src`` is trusted (:mod:`.dcp_metadata`): the metadata and every stored
    range are checked before the destination is touched.
    """
    with DcpDirectory(src) as d:
        md = d.read_metadata()  # restricted unpickler; checked
        storage: dict[MetadataIndex, _StorageInfo] = md.storage_data
        mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
        wanted: list[tuple[str, _StorageInfo]] = []
        for fqn, smd in md.state_dict_metadata.items():
            if isinstance(smd, TensorStorageMetadata):
                wanted.extend((fqn, storage[MetadataIndex(fqn, c.offsets)]) for c in smd.chunks)
            else:
                wanted.append((fqn, storage[MetadataIndex(fqn)]))
        d.check_ranges(wanted)  # every data file a regular file, every range within it, before reading
        tree: dict[Any, Any] = {}
        for fqn, smd in md.state_dict_metadata.items():
            try:
                leaf = _leaf(d, storage, fqn, smd)
            except XckptError as exc:  # a dtype xckpt lacks, a value it cannot hold: name the leaf and file
                raise exc.at(file=d.metadata_file, leaf=fqn) from None
            insert(tree, key_of(fqn, mappings), leaf, file=d.metadata_file)
        try:
            save(listify(tree), dst, coordinator=LocalCoordinator(),
                 options=SaveOptions(overwrite=overwrite, metadata={"converted_from": "torch.distributed.checkpoint"}))
        except XckptError as exc:  # a leaf's chunks that do not tile it, say: the DCP metadata describes it
            raise (exc.at(file=d.metadata_file) if exc.leaf is not None else exc) from None


def _leaf(d: DcpDirectory, storage: dict[MetadataIndex, _StorageInfo], fqn: str, smd: Any) -> Any:
    """The tree leaf of one DCP entry: a lazily read array, or the value read now."""
    if isinstance(smd, TensorStorageMetadata):
        dt = smd.properties.dtype
        shape = tuple(int(s) for s in smd.size)
        shards = []
        for c in smd.chunks:
            region = Region(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
            info = storage[MetadataIndex(fqn, c.offsets)]
            shards.append(Shard(region, lambda i=info, f=fqn, r=region, t=dt: _read_chunk(d, i, f, r, t)))
        return LazySource(shape, logical_dtype(dt), shards, {"framework": "torch", "via": "dcp"})
    if isinstance(smd, BytesStorageMetadata):
        return as_leaf(_read_value(d, storage[MetadataIndex(fqn)], fqn))
    # check_metadata admits no other kind
    raise UnsupportedError(f"unknown DCP storage metadata {type(smd).__name__}", leaf=fqn)


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
        publish(hold.tmp, target, hold.generation)
    except BaseException:
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
