"""A stock DCP checkpoint directory (``FileSystemWriter`` output) read in place: :class:`DcpCheckpoint`.

It is read without trusting it (:mod:`.dcp_metadata`): DCP's ``.metadata`` pickle through an
unpickler that builds only the classes DCP metadata is made of, ``.metadata`` and the ``.distcp``
data files opened relative to the checkpoint directory without following links or blocking, every
stored range checked against its file when it is opened. Each stored item is a ``torch.save``
archive, loaded with ``torch.load(weights_only=True)`` (torch's own restricted unpickler); numpy
data inside a value is parsed by :mod:`.dcp_numpy`. Values are read when it is opened; an array is
read DCP chunk by DCP chunk. A chunk of 1 MiB or more whose bytes lie in its archive as one C-ordered
run (found without reading data, by ``torch.load`` onto the meta device) is read from its storage
record (:class:`StoredChunk`): straight into the output of a request that wants it whole into
C-ordered memory (a few such chunks at once, on the checkpoint's own threads), else into new memory;
any other chunk is loaded whole with ``torch.load`` (what DCP itself reads), one at a time. The parts
requests want are copied from the chunk read, and the last one stays in memory for the next read:
reads in pieces take from it again.

``xckpt.load``, ``xckpt.inspect`` and the adapters' loads open it through
:func:`xckpt.sources.detect.open_checkpoint` (entry point ``xckpt.sources``: ``dcp``), and
``convert --from dcp`` saves its tree (:func:`.dcp_convert.dcp_to_xckpt`).
"""

from __future__ import annotations

import contextlib
import io
import struct
import sys
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import tensorstore as ts
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from xckpt import registry
from xckpt.engine import threads
from xckpt.engine.copy import LazySource
from xckpt.engine.read import ReadRequest
from xckpt.engine.storage import Location
from xckpt.engine.views import read_view
from xckpt.errors import DataError, KeyMismatchError, ShapeError, UnsupportedError, XckptError
from xckpt.format import dtypes as xdtypes, manifest as manifest_mod, values as values_format
from xckpt.format.codecs import zstd_stream_decompress
from xckpt.format.manifest import ArrayEntry, Entry, Manifest, ValueEntry
from xckpt.format.regions import Region, check_tiling, intersect
from xckpt.format.tree import Value, flatten, key_str
from xckpt.registry import ArraySource, Shard

from . import dcp_numpy
from .dcp_metadata import DcpDirectory, zstd_compressed
from .dcp_planners import plain_value
from .dcp_tree import as_leaf, fqn_of, insert, key_of, listify
from .staging import to_host
from .tensors import logical_dtype


class DcpCheckpoint:
    """A PyTorch DCP checkpoint directory opened for reading (a :class:`~xckpt.sources.base.Source`; entry point
    ``xckpt.sources``: ``dcp``).

    ``tree`` is its state as ``xckpt.save`` takes it (arrays as lazily read sources, values read),
    ``manifest`` describes it; usable as a context manager.
    """

    format = "dcp"

    def __init__(self, loc: Location) -> None:
        if not loc.is_local:
            raise UnsupportedError(f"{loc}: DCP checkpoints are read from local directories only",
                                   code="convert.dcp_remote", file=str(loc))
        self.loc = loc
        self._lock = threading.Lock()
        self._last: tuple[Shard, np.ndarray] | None = None  # the DCP chunk loaded last (see _chunk)
        self._pool: ThreadPoolExecutor | None = None  # reads chunks straight into outputs (see _read_straight)
        self._dir = DcpDirectory(loc.local_path)
        try:
            self.tree = _tree(self._dir)
            structure, leaves = flatten(self.tree)
            self.metadata_file = self._dir.metadata_file
            entries: list[Entry] = []
            self._values: dict[int, Any] = {}
            self._arrays: dict[tuple[Any, ...], ArraySource] = {}
            registry.autoload()
            for i, (key, obj) in enumerate(leaves):
                make = None if isinstance(obj, (ArraySource, Value)) else registry.source_for(obj)
                if make is not None:  # a tensor inside a value DCP pickled whole (a tuple's)
                    try:
                        obj = make(obj)
                    except XckptError as exc:  # (a sparse tensor, a quantized dtype): say where
                        raise exc.at(file=self.metadata_file, leaf=key_str(key)) from None
                if isinstance(obj, ArraySource):
                    entries.append(_entry(key, obj, self.metadata_file))
                    self._arrays[tuple(key)] = obj
                else:
                    value = obj.value if isinstance(obj, Value) else obj
                    try:
                        entries.append(ValueEntry(key, values_format.value_type(value)))
                    except XckptError as exc:  # a value xckpt has no type for (a numpy dtype): name it
                        if isinstance(value, dcp_numpy.PickledDtype):
                            exc = UnsupportedError(f"a numpy dtype ({value.dtype}) is not a value xckpt stores",
                                                   code=exc.code)
                        raise exc.at(file=self.metadata_file, leaf=key_str(key)) from None
                    self._values[i] = value
            self.manifest = Manifest(tree=structure, leaves=entries,
                                     producer={"library": "torch.distributed.checkpoint"})
        except BaseException:
            self._dir.close()
            raise

    def __enter__(self) -> "DcpCheckpoint":
        """This checkpoint (closed on exit)."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close it."""
        self.close()

    def values(self) -> dict[int, Any]:
        """Its value leaves, by leaf index (read when it was opened)."""
        return dict(self._values)

    def _source(self, entry: ArrayEntry) -> ArraySource:
        src = self._arrays.get(tuple(entry.key))
        if src is None:
            raise KeyMismatchError(f"{self.loc} holds no array {key_str(entry.key)!r}", missing=[key_str(entry.key)],
                                   file=self.metadata_file, leaf=key_str(entry.key))
        return src

    def read(self, requests: Sequence[ReadRequest], *, precheck: bool = False) -> int:
        """Fill each request's output (the entry's storage dtype) from the DCP chunks its region touches, each
        chunk read once: straight into the output where one request wants it whole into C-ordered memory
        (:meth:`_read_straight`, a few at once), else read or loaded whole (:meth:`_chunk`, one at a time)
        and copied from; returns the bytes read. ``precheck`` needs nothing more: every stored range was checked
        against its file when the checkpoint was opened."""
        wanted: dict[int, tuple[Shard, list[tuple[ReadRequest, Region]]]] = {}
        for req in requests:
            if req.region.is_empty():
                continue
            src = self._source(req.entry)
            if tuple(req.out.shape) != req.region.sizes or \
                    req.out.dtype.itemsize != xdtypes.itemsize(req.entry.dtype) or not req.region.within(src.shape):
                raise ShapeError(f"output {req.out.shape} {req.out.dtype} does not fit region {req.region.offsets}+"
                                 f"{req.region.sizes} of {req.entry.dtype} {list(src.shape)}",
                                 leaf=key_str(req.entry.key))
            for sh in src.shards:
                part = intersect(req.region, sh.region)
                if part is not None:
                    wanted.setdefault(id(sh), (sh, []))[1].append((req, part))
        total, done = self._read_straight(wanted.values())
        for sh, parts in wanted.values():
            if id(sh) in done:
                continue
            try:
                data = self._chunk(sh, parts[0][0].out.dtype)
            except XckptError as exc:  # a chunk that is not what its metadata says: name the tensor
                raise exc.at(leaf=key_str(parts[0][0].entry.key)) from None
            total += data.nbytes
            for req, part in parts:
                got = data[part.relative_to(sh.region).slices() + (Ellipsis,)]  # (a view, 0-d ones too)
                out = req.out[part.relative_to(req.region).slices() + (Ellipsis,)]
                np.copyto(out, got if got.dtype == out.dtype else got.view(out.dtype))
        return total

    def _read_straight(self, chunks: Iterable[tuple[Shard, list[tuple[ReadRequest, Region]]]]) -> tuple[int, set[int]]:
        """Read each chunk that one request wants whole (:func:`_straight_out`) straight into that output, a few at
        once (:func:`xckpt.engine.threads.gather`: every read done before the first error is raised), on
        :func:`xckpt.engine.threads.io_threads` threads of this checkpoint's own (a read may come from a thread
        of the shared pool, which must not wait on that pool); the bytes read and the ids of the chunks read
        (the others: 0 bytes, as :meth:`StoredChunk.read_into` found them not to lie as one run)."""
        done: set[int] = set()

        def read(sh: Shard, parts: list[tuple[ReadRequest, Region]], out: np.ndarray) -> int:
            try:
                n = sh.fetch.read_into(out)
            except XckptError as exc:  # a file cut short since it was opened: name the tensor
                raise exc.at(leaf=key_str(parts[0][0].entry.key)) from None
            if n:
                done.add(id(sh))
            return n

        jobs = [(sh, parts, out) for sh, parts in chunks for out in [_straight_out(sh, parts)] if out is not None]
        if len(jobs) <= 1:
            return sum(read(*job) for job in jobs), done
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(threads.io_threads(), thread_name_prefix="xckpt-dcp")
            pool = self._pool
        return threads.gather([pool.submit(read, *job) for job in jobs]), done

    def _chunk(self, sh: Shard, dtype: np.dtype) -> np.ndarray:
        """A DCP chunk's data, whole (``dtype``: its storage dtype): its bytes read into new memory where they
        lie as one run (:meth:`StoredChunk.read_whole`), else loaded (``torch.load``); the last one is kept
        for the next read, which reads in pieces (a diff, a conversion) may take from the same chunk."""
        with self._lock:
            if self._last is not None and self._last[0] is sh:
                return self._last[1]
        data = sh.fetch.read_whole(dtype) if isinstance(sh.fetch, StoredChunk) else None
        if data is None:
            data = sh.fetch()
        with self._lock:
            self._last = (sh, data)
        return data

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Nothing more to check: every stored range was checked against its file when it was opened."""

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """A TensorStore view of an array leaf (its storage dtype) whose reads go through :meth:`read`."""
        self._source(entry)
        return read_view(entry, self.read)

    def replaced(self) -> bool:
        """False: DCP replaces no checkpoint in place (its files are read through the directory opened)."""
        return False

    def close(self) -> None:
        """Close the directory (once the reads under way are done), and let the chunk kept go."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._last = None
        self._dir.close()


def _tree(d: DcpDirectory) -> Any:
    """The state a DCP checkpoint holds, as ``xckpt.save`` takes it: its metadata read and checked, every
    stored range checked against its file, arrays as lazily read sources, values read now."""
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
    return listify(tree)


def _entry(key: Any, src: ArraySource, file: str | None) -> ArrayEntry:
    """The manifest entry of an array leaf: its DCP chunks' shape as its chunk shape where they are alike.
    Chunks that do not tile the tensor (a gap a read would leave unfilled, an overlap) are ``shape.tiling``."""
    why = check_tiling(src.shape, [sh.region for sh in src.shards])
    if why is not None:
        raise ShapeError(f"the DCP chunks of this tensor do not tile it: {why}", code="shape.tiling",
                         file=file, leaf=key_str(key))
    sizes = {sh.region.sizes for sh in src.shards}
    chunk = next(iter(sizes)) if len(sizes) == 1 else src.shape
    chunk = tuple(max(1, int(c)) for c in chunk)
    e = ArrayEntry(tuple(key), fqn_of(tuple(key)), tuple(src.shape), src.dtype, xdtypes.storage_name(src.dtype),
                   chunk, chunk, sharding=src.sharding)
    manifest_mod.check_shape(e, file or "")
    return e


def _leaf(d: DcpDirectory, storage: dict[MetadataIndex, _StorageInfo], fqn: str, smd: Any) -> Any:
    """The tree leaf of one DCP entry: a lazily read array, or the value read now."""
    if isinstance(smd, TensorStorageMetadata):
        dt = smd.properties.dtype
        shape = tuple(int(s) for s in smd.size)
        shards = []
        for c in smd.chunks:
            region = Region(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
            info = storage[MetadataIndex(fqn, c.offsets)]
            shards.append(Shard(region, StoredChunk(d, info, fqn, region, dt)))
        return LazySource(shape, logical_dtype(dt), shards, {"framework": "torch", "via": "dcp"})
    if isinstance(smd, BytesStorageMetadata):
        return as_leaf(_read_value(d, storage[MetadataIndex(fqn)], fqn))
    # check_metadata admits no other kind
    raise UnsupportedError(f"unknown DCP storage metadata {type(smd).__name__}", leaf=fqn)



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
        except Exception as exc:  # noqa: BLE001 - BadZipFile, ValueError, OSError, NotImplementedError...
            if f.truncated is not None:
                raise f.truncated from None
            raise UnsupportedError(f"{what} is not torch.save data ({type(exc).__name__}: {exc})", code=code,
                                   file=f.path) from None
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


class StoredChunk:
    """One DCP chunk of a tensor, as a :class:`~xckpt.registry.Shard`'s ``fetch`` (called: the chunk as numpy).
    Where its bytes lie in its archive as one C-ordered run (:func:`_locate`), they are read from its storage
    record (:meth:`read_into` an output, :meth:`read_whole` into new memory); else it is loaded whole
    (``torch.load``)."""

    def __init__(self, d: DcpDirectory, info: _StorageInfo, fqn: str, region: Region, dtype: torch.dtype) -> None:
        self.d, self.info, self.fqn, self.region, self.dtype = d, info, fqn, region, dtype
        self.nbytes = region.numel * dtype.itemsize
        self._at: int | None | bool = False  # where its bytes lie in its item (False: not looked up yet)

    def __call__(self) -> np.ndarray:
        """The chunk as host numpy (the dtype ``torch.load`` would give it): read from its storage record
        (:meth:`read_whole`), else loaded whole."""
        data = self.read_whole(to_host(torch.empty(0, dtype=self.dtype)).dtype)
        return data if data is not None else _read_chunk(self.d, self.info, self.fqn, self.region, self.dtype)

    def read_whole(self, dtype: np.dtype) -> np.ndarray | None:
        """The chunk's bytes read into a new array of its shape and ``dtype`` (an item size of its dtype), where
        it has at least :data:`STRAIGHT_MIN_BYTES` that lie as one C-ordered run; else None."""
        if self.nbytes < STRAIGHT_MIN_BYTES or self._where() is None:
            return None
        out = np.empty(self.region.sizes, dtype)
        return out if self.read_into(out) else None

    def _where(self) -> int | None:
        if self._at is False:
            self._at = _locate(self.d, self.info, self.region, self.dtype)
        return self._at  # type: ignore[return-value]

    def read_into(self, out: np.ndarray) -> int:
        """Read the chunk's bytes into ``out`` (C-contiguous, its shape, an item size of its dtype); the bytes
        read, or 0 (``out`` untouched) where they do not lie as one C-ordered run of native byte order."""
        at = self._where()
        if at is None or not out.flags.c_contiguous or out.nbytes != self.nbytes:
            return 0
        with self.d.item(self.info) as f:
            f.seek(at)
            got = f.readinto(out.reshape(-1).view(np.uint8))
        if got != out.nbytes:  # the range was checked: only a file cut short since reads less
            raise DataError(f"the file ends {out.nbytes - got} bytes short of a stored DCP item",
                            code="chunk.truncated", file=self.d.path(self.info.relative_path))
        return got


#: Chunks smaller than this are loaded whole even where they could be read straight: finding where a chunk's
#: bytes lie costs about what loading it whole does up to about 1 MiB (0.8 against 0.6 ms for 4 KiB).
STRAIGHT_MIN_BYTES = 1 << 20


def _straight_out(sh: Shard, parts: list[tuple[ReadRequest, Region]]) -> np.ndarray | None:
    """Where a DCP chunk of at least :data:`STRAIGHT_MIN_BYTES` that one request wants whole goes, if that is
    C-ordered memory (a view of the request's output), to be read straight into it; else None."""
    if len(parts) != 1 or not isinstance(sh.fetch, StoredChunk) or parts[0][1] != sh.region \
            or sh.fetch.nbytes < STRAIGHT_MIN_BYTES:
        return None
    req, part = parts[0]
    out = req.out[part.relative_to(req.region).slices() + (Ellipsis,)]
    return out if out.flags.c_contiguous else None


#: The bytes of a zip local file header before its name and extra field.
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


def _little_endian(f: Any) -> bool:
    """Whether ``torch.load`` takes the archive ``f`` as little-endian, asking torch's own zip reader (a load onto
    the meta device must not be asked to swap bytes: torch would swap memory it does not have)."""
    f.seek(0)
    reader = torch._C.PyTorchFileReader(f)
    if reader.has_record("byteorder"):
        return bool(reader.get_record("byteorder") == b"little")
    return torch.serialization.get_default_load_endianness() in (None, torch.serialization.LoadEndianness.LITTLE)


def _locate(d: DcpDirectory, info: _StorageInfo, region: Region, dtype: torch.dtype) -> int | None:
    """Where, within its stored item, a DCP chunk's bytes lie as one C-ordered run, found from the archive's
    pickle (``torch.load`` onto the meta device: no data read) and zip directory; None where they cannot be
    read straight: compressed (DCP's ZStandard extension), in another byte order, not the tensor the
    metadata records, not contiguous, or a storage record whose bytes do not hold it. Anything wrong is left
    for the whole load (:func:`_read_chunk`) to report."""
    if zstd_compressed(info) or sys.byteorder != "little":
        return None
    itemsize = dtype.itemsize
    with d.item(info) as f:
        try:
            with zipfile.ZipFile(f) as z:
                members = z.infolist()
            if any(m.compress_type != zipfile.ZIP_STORED for m in members) or not _little_endian(f):
                return None
            f.seek(0)
            t = torch.load(f, map_location="meta", weights_only=True)
        except Exception:  # noqa: BLE001 - not plain torch.save data: the whole load says what is wrong
            return None
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != dtype \
                or tuple(t.shape) != tuple(region.sizes) or not t.is_contiguous():
            return None
        start = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if not isinstance(start, int):
            return None
        first, end = start + t.storage_offset() * itemsize, start + (t.storage_offset() + t.numel()) * itemsize
        for m in members:  # the storage record the data lies in, from its local header
            if m.header_offset + _LOCAL_HEADER.size > info.length:
                return None
            f.seek(m.header_offset)
            head = f.read(_LOCAL_HEADER.size)
            if len(head) != _LOCAL_HEADER.size:
                return None
            sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack(head)
            data = m.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if sig == b"PK\x03\x04" and data == start:
                return first if end <= data + m.file_size <= info.length else None
    return None


def _read_chunk(d: DcpDirectory, info: _StorageInfo, fqn: str, region: Region, dtype: torch.dtype) -> np.ndarray:
    what = f"DCP chunk at {region.offsets} of {fqn!r}"
    t = _torch_load(d, info, what, "convert.dcp_chunk", region.numel * dtype.itemsize + ARCHIVE_OVERHEAD)
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype != dtype \
            or tuple(t.shape) != tuple(region.sizes):
        layout = f" and layout {t.layout}" if isinstance(t, torch.Tensor) and t.layout != torch.strided else ""
        desc = (f"a {t.dtype} tensor of shape {tuple(t.shape)}{layout}" if isinstance(t, torch.Tensor)
                else f"a {type(t).__name__}")
        raise UnsupportedError(f"{what} holds {desc}, not the {dtype} chunk of shape {tuple(region.sizes)} "
                               "(strided) its metadata records", code="convert.dcp_chunk",
                               file=d.path(info.relative_path))
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
    stored = MAX_VALUE_BYTES if zstd_compressed(info) else info.length  # (at most, once decompressed)
    with torch.serialization.safe_globals([io.BytesIO, (_empty_bytes, "builtins.bytes"), *dcp_numpy.GLOBALS]), \
            dcp_numpy.data_budget(stored):
        what = f"DCP value {fqn!r}"
        loaded = _torch_load(d, info, what, "convert.dcp_value", MAX_VALUE_BYTES)
    try:
        return plain_value(loaded, stored + 4096)
    except XckptError as exc:  # an array the pickle left unbuilt, a value of too many items
        raise exc.naming(d.path(info.relative_path), message=f"{what} holds {exc.message}") from None
