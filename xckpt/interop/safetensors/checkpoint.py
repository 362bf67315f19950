"""Reading Hugging Face safetensors checkpoints as a :class:`~xckpt.sources.base.Source`.

:func:`open_safetensors` opens

* a directory holding ``model.safetensors``, or ``model.safetensors.index.json`` (sharded:
  its ``weight_map`` maps each tensor name to one of the directory's ``*.safetensors`` files;
  ``model.safetensors`` wins when both are there, as in ``transformers``);
* a path to one ``*.safetensors`` file, or to a ``*.safetensors.index.json``.

Key scheme: every tensor is one leaf of a flat dict at the root, keyed by its full name
(``model.layers.0.self_attn.q_proj.weight`` is the key ``("model.layers.0.self_attn.q_proj.weight",)``,
not split on dots): the names of a ``torch`` module's ``state_dict()``, which is what
``transformers`` writes, so ``xckpt.load(hf_dir, like=model)`` or ``like=model.state_dict()`` (tensors,
DTensors) and ``like={name: jax.ShapeDtypeStruct(...)}`` match without a mapping.

Every file's header is read and checked when the checkpoint is opened
(:mod:`xckpt.format.safetensors`), through the directory's
:class:`~xckpt.engine.storage.Store`: a link (``path.link``) or a special file (``path.special``)
in place of a file is refused, never followed or waited on. The files stay open until
:meth:`SafetensorsCheckpoint.close`, so every read comes from the files that were checked.
A read of a region of a tensor reads exactly the contiguous byte runs of that region (C order,
runs coalesced along the trailing dimensions the region spans whole), in pieces of at most
:data:`PIECE_BYTES`, straight into the output where it is contiguous.
"""

from __future__ import annotations

import math
import os
import stat
import sys
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import tensorstore as ts

from xckpt.engine import threads as pools
from xckpt.engine.copy import copy_checkpoint
from xckpt.engine.read import ReadRequest
from xckpt.engine.storage import Blob, Location, Store
from xckpt.engine.views import read_view
from xckpt.errors import DataError, ManifestError, NotACheckpointError, ShapeError, XckptError
from xckpt.format import dtypes
from xckpt.format import manifest as manifest_mod
from xckpt.format.manifest import ArrayEntry, Entry, Manifest
from xckpt.format.regions import Region
from xckpt.format.tree import Key, key_str
from xckpt.format.safetensors import (INDEX_FILE, MAX_INDEX_BYTES, PREFIX_BYTES, SINGLE_FILE, Header, TensorInfo,
                                      header_length, parse_header, parse_index)
#: Most bytes one read call (and one staging buffer) covers.
PIECE_BYTES = 16 << 20
#: Offsets of byte runs turned into Python ints at a time (a narrow region of a tall tensor has millions).
_OFFSETS_AT_ONCE = 4096
#: Most read tasks that one job of the I/O pool runs, one after the other: the regions smaller than
#: :data:`PIECE_BYTES` are read in jobs of up to that many tasks or about that many bytes (a job of its own for
#: each tiny tensor would cost more than reading it).
_TASKS_PER_JOB = 512
#: ``__metadata__["format"]`` -> the framework recorded as the producer.
_FRAMEWORKS = {"pt": "torch", "np": "numpy", "tf": "tensorflow", "flax": "jax", "mlx": "mlx", "paddle": "paddle"}


def is_safetensors_name(name: str) -> bool:
    """Whether a file name is a safetensors file or a safetensors index."""
    return name.endswith((".safetensors", ".safetensors.index.json"))


def entry_file(store: Store) -> str | None:
    """The file a directory's safetensors checkpoint starts from: :data:`SINGLE_FILE`, else
    :data:`INDEX_FILE`, else None. A link or a special file in their place raises
    (``path.link``, ``path.special``): it is never taken for an absence."""
    for name in (SINGLE_FILE, INDEX_FILE):
        blob = store.open(name)
        if blob is not None:
            blob.close()
            return name
    return None


def file_target(loc: Location) -> tuple[Location, str] | None:
    """When ``loc`` names a safetensors file or index rather than a directory: its directory and its name.

    Local paths are looked at without following a link (a link is then refused when it is opened);
    on an object store the object must exist.
    """
    head, _, name = loc.url.rstrip("/").rpartition("/")
    if not name or not is_safetensors_name(name):
        return None
    if loc.is_local:
        try:
            st = os.lstat(loc.local_path)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode):
            return None
        return Location.of(os.path.dirname(loc.local_path) or "."), name
    parent = Location(head)
    store = parent.store()
    try:
        return (parent, name) if store.exists(name) else None
    finally:
        store.close()


@dataclass
class _File:
    """One opened safetensors file and its checked header."""

    name: str
    path: str
    blob: Blob
    header: Header


@dataclass(frozen=True, slots=True)
class _Tensor:
    """Where a leaf's bytes are."""

    file: _File
    info: TensorInfo

    @property
    def base(self) -> int:
        """Offset of its first byte in the file."""
        return self.file.header.data_start + self.info.begin


class SafetensorsCheckpoint:
    """A Hugging Face safetensors checkpoint (one file or a sharded directory), opened for reading."""

    format = "safetensors"

    def __init__(self, loc: Location, store: Store, files: list[_File], manifest: Manifest,
                 tensors: dict[Key, _File] | None) -> None:
        self.loc = loc
        self.store = store
        self.files = files
        self.manifest = manifest
        #: The file of each leaf's key; None for a checkpoint of one file, which holds them all (``_only``).
        self._tensors = tensors
        self._only = files[0] if tensors is None else None

    def values(self) -> dict[int, Any]:
        """No value leaves: every leaf is a tensor."""
        return {}

    def tensor(self, entry: ArrayEntry) -> tuple[str, TensorInfo]:
        """The file (display path) and header entry of an array leaf."""
        t = self._where(entry)
        return t.file.path, t.info

    def _where(self, entry: ArrayEntry) -> _Tensor:
        key = tuple(entry.key)
        if self._tensors is not None:
            f = self._tensors.get(key)
        else:
            only = self._only
            f = only if only is not None and len(key) == 1 and key[0] in only.header.tensors else None
        if f is None:
            raise DataError(f"{self.loc} holds no tensor {key_str(entry.key)!r}", code="safetensors.missing",
                            file=str(self.loc), leaf=key_str(entry.key))
        return _Tensor(f, f.header.tensors[key[0]])  # a key is (its tensor's name,)

    def read(self, requests: Sequence[ReadRequest], *, precheck: bool = False) -> int:
        """Fill each request's output (the storage dtype) with the bytes of its region; returns the bytes read.

        Only the region's bytes are read. ``precheck`` needs nothing more: every file was opened and its
        header checked against its size when the checkpoint was opened.
        """
        jobs: list[list[tuple[_Tensor, Callable[[], int]]]] = []  # in the order of the requests and their tasks
        small: list[tuple[_Tensor, Callable[[], int]]] = []  # the job being filled with the tasks of small regions
        small_bytes = 0
        for req in requests:
            if req.region.is_empty():
                continue
            t = self._where(req.entry)
            if tuple(req.out.shape) != req.region.sizes or req.out.dtype.itemsize != dtypes.itemsize(req.entry.dtype):
                raise ShapeError(f"output {req.out.shape} {req.out.dtype} does not fit region "
                                 f"{req.region.offsets}+{req.region.sizes} of {req.entry.dtype}",
                                 leaf=key_str(req.entry.key))
            if not req.region.within(t.info.shape):
                raise ShapeError(f"region {req.region.offsets}+{req.region.sizes} lies outside shape "
                                 f"{list(t.info.shape)}", file=t.file.path, leaf=key_str(req.entry.key))
            tasks = [(t, task) for task in plan_reads(t.file.blob, t.base, t.info.shape, req.out.dtype.itemsize,
                                                      req.region, req.out)]
            if req.out.nbytes >= PIECE_BYTES:  # each of its tasks a job, after the small ones before it
                if small:
                    jobs.append(small)
                    small, small_bytes = [], 0
                jobs.extend([task] for task in tasks)
                continue
            small += tasks
            small_bytes += req.out.nbytes
            if small_bytes >= PIECE_BYTES or len(small) >= _TASKS_PER_JOB:
                jobs.append(small)
                small, small_bytes = [], 0
        if small:
            jobs.append(small)
        total = _run(jobs)
        for req in requests:
            if req.region.is_empty():
                continue
            # max(), not (out > 1).any(): no temporary the size of the tensor
            if req.entry.dtype == "bool" and int(req.out.view(np.uint8).max()) > 1:
                t = self._where(req.entry)
                raise DataError("a BOOL tensor holds bytes other than 0 and 1", code="safetensors.data",
                                file=t.file.path, leaf=t.info.name)
            if sys.byteorder == "big" and req.out.dtype.itemsize > 1:  # safetensors is little-endian
                req.out.byteswap(inplace=True)
        return total

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Nothing more to check: every header was checked against its file's size when opened."""

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """A TensorStore view of a tensor (its storage dtype) whose reads go through :meth:`read`."""
        self._where(entry)
        return read_view(entry, self.read)

    def replaced(self) -> bool:
        """Whether the directory at its path was replaced or removed since it was opened (its files stay
        open, so reads still come from the checkpoint opened)."""
        return self.store.replaced()

    def close(self) -> None:
        """Close the files and the store."""
        for f in self.files:
            f.blob.close()
        self.files = []
        self.store.close()


# -- reading regions -------------------------------------------------------------------------------


def byte_runs(base: int, shape: tuple[int, ...], itemsize: int, region: Region) -> tuple[np.ndarray, int]:
    """The contiguous byte runs of ``region`` of a C-order tensor whose bytes start at ``base``: the file
    offset of each run, in C order of the region, and their common length.

    Runs are coalesced along the trailing dimensions the region spans whole: a block of whole rows
    is one run.
    """
    offsets, sizes = region.offsets, region.sizes
    j = len(shape) - 1
    while j >= 0 and sizes[j] == shape[j]:
        j -= 1
    inner = math.prod(shape[j + 1:]) * itemsize
    if j < 0:
        return np.array([base], dtype=np.int64), inner
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(j + 1)]
    starts = np.array([base + sum(offsets[d] * strides[d] for d in range(j + 1))], dtype=np.int64)
    for d in range(j):
        starts = (starts[:, None] + np.arange(sizes[d], dtype=np.int64)[None, :] * strides[d]).reshape(-1)
    return starts, sizes[j] * inner


def _read_at(blob: Blob, offset: int, dst: np.ndarray) -> int:
    """Read the bytes ``dst`` (contiguous) at ``offset``; returns how many."""
    blob.read_into(offset, dst)
    return dst.nbytes


def _read_runs(blob: Blob, starts: np.ndarray, run: int, dst: np.ndarray) -> int:
    """Read runs of ``run`` bytes at ``starts`` one after the other into the bytes ``dst``."""
    for first in range(0, len(starts), _OFFSETS_AT_ONCE):  # Python ints for a block of offsets at a time
        for k, s in enumerate(starts[first:first + _OFFSETS_AT_ONCE].tolist(), first):
            blob.read_into(s, dst[k * run:(k + 1) * run])
    return len(starts) * run


def _direct(blob: Blob, starts: np.ndarray, run: int, dst: np.ndarray) -> list[Callable[[], int]]:
    """Tasks reading the runs straight into the contiguous bytes ``dst``, each of at most about
    :data:`PIECE_BYTES` (a long run is split; short runs are grouped)."""
    tasks: list[Callable[[], int]] = []
    if run >= PIECE_BYTES:
        for k, s in enumerate(starts.tolist()):
            for p in range(0, run, PIECE_BYTES):
                n = min(PIECE_BYTES, run - p)
                tasks.append(partial(_read_runs, blob, np.array([s + p], dtype=np.int64), n,
                                     dst[k * run + p:k * run + p + n]))
        return tasks
    per = max(1, PIECE_BYTES // run)
    for k in range(0, len(starts), per):
        part = starts[k:k + per]
        tasks.append(partial(_read_runs, blob, part, run, dst[k * run:(k + len(part)) * run]))
    return tasks


def _staged(blob: Blob, base: int, shape: tuple[int, ...], region: Region, out: np.ndarray) -> int:
    """Read a region (at most about :data:`PIECE_BYTES`) into a buffer, then copy it into ``out``."""
    tmp = np.empty(region.sizes, dtype=out.dtype)
    starts, run = byte_runs(base, shape, out.dtype.itemsize, region)
    n = _read_runs(blob, starts, run, tmp.reshape(-1).view(np.uint8))
    np.copyto(out, tmp, casting="no")
    return n


def plan_reads(blob: Blob, base: int, shape: tuple[int, ...], itemsize: int, region: Region,
               out: np.ndarray) -> list[Callable[[], int]]:
    """Tasks that fill ``out`` (the region's shape; any strides) with ``region`` of the C-order tensor
    ``shape`` whose bytes start at ``base`` in ``blob``; each returns the bytes it read.

    A contiguous output is read into directly; any other is filled through buffers of at most about
    :data:`PIECE_BYTES`, block by block along its first dimension (row by row below that when one row
    is larger). Only the region's bytes are read.
    """
    if region.is_empty():
        return []
    if out.flags.c_contiguous or not shape:  # a 0-d output is always contiguous
        if region.sizes == shape and not any(region.offsets) and out.nbytes <= PIECE_BYTES:  # one run, one piece
            return [partial(_read_at, blob, base, out.reshape(-1).view(np.uint8))]
        starts, run = byte_runs(base, shape, itemsize, region)
        return _direct(blob, starts, run, out.reshape(-1).view(np.uint8))
    sizes, offsets = region.sizes, region.offsets
    row = math.prod(sizes[1:]) * itemsize
    if row > PIECE_BYTES and len(shape) > 1:
        stride0 = math.prod(shape[1:]) * itemsize
        tasks: list[Callable[[], int]] = []
        for a in range(sizes[0]):
            tasks += plan_reads(blob, base + (offsets[0] + a) * stride0, shape[1:], itemsize,
                                Region(offsets[1:], sizes[1:]), out[a])
        return tasks
    rows = max(1, PIECE_BYTES // max(1, row))
    return [partial(_staged, blob, base, shape, Region((offsets[0] + a,) + offsets[1:], (min(rows, sizes[0] - a),)
                                                       + sizes[1:]), out[a:a + rows])
            for a in range(0, sizes[0], rows)]


def _guarded(t: _Tensor, task: Callable[[], int]) -> int:
    """Run one read task; an error names the file and the tensor."""
    try:
        return task()
    except XckptError as exc:
        if exc.code == "chunk.truncated":  # the file shrank after its header was checked
            raise DataError(f"file is shorter than its header says: {exc.message}", code="safetensors.truncated",
                            file=t.file.path, leaf=t.info.name) from None
        raise exc.at(file=t.file.path, leaf=t.info.name) from None
    except OSError as exc:
        raise DataError(f"cannot read: {exc.strerror or exc}", code="io.read", file=t.file.path,
                        leaf=t.info.name) from exc


def _run_job(job: list[tuple[_Tensor, Callable[[], int]]]) -> int:
    """Run read tasks one after the other, up to the first that fails; returns the bytes read."""
    return sum(_guarded(t, task) for t, task in job)


def _run(jobs: list[list[tuple[_Tensor, Callable[[], int]]]]) -> int:
    """Run the jobs of read tasks on the I/O pool (inline when there is one, or when already on a pool thread);
    the first error (of the first job, in order, that met one) is raised once no task writes any more."""
    if len(jobs) <= 1 or threading.current_thread().name.startswith("xckpt-"):
        return sum(_run_job(job) for job in jobs)
    return pools.gather([pools.pool().submit(_run_job, job) for job in jobs])


# -- opening ---------------------------------------------------------------------------------------


def _display(loc: Location, name: str) -> str:
    return str(loc.child(name))


def _read_header(store: Store, dir_loc: Location, name: str) -> _File:
    """Open one safetensors file and check its header (the length before anything is allocated for it)."""
    path = _display(dir_loc, name)
    blob = store.open(name)  # a link or a special file raises (path.link, path.special)
    if blob is None:
        raise DataError(f"{name} is missing", code="safetensors.missing", file=path)
    try:
        size = blob.size
        if size is not None and size < PREFIX_BYTES:
            header_length(b"", size, file=path)
        prefix = np.empty(PREFIX_BYTES, dtype=np.uint8)
        try:
            blob.read_into(0, prefix)
            n = header_length(prefix.tobytes(), size, file=path)
            raw = bytearray(n)  # read into and parsed from, never copied
            blob.read_into(PREFIX_BYTES, np.frombuffer(raw, dtype=np.uint8))
        except XckptError as exc:
            if exc.code != "chunk.truncated":
                raise
            raise ManifestError(f"file ends inside its header: {exc.message}", code="safetensors.header",
                                file=path) from None
        header = parse_header(raw, size, file=path)
        if size is None and header.buffer_size > 0:  # an object store: the data must reach the last tensor's end
            try:
                blob.read_into(header.data_start + header.buffer_size - 1, np.empty(1, dtype=np.uint8))
            except XckptError as exc:
                if exc.code != "chunk.truncated":
                    raise
                raise ManifestError(f"the file ends before the last tensor does (byte {header.buffer_size} of its "
                                    "data buffer)", code="safetensors.offsets", file=path) from None
        return _File(name, path, blob, header)
    except BaseException:
        blob.close()
        raise


def _read_index(store: Store, dir_loc: Location, name: str) -> dict[str, str]:
    """Read and parse an index, its size checked before it is read."""
    path = _display(dir_loc, name)
    blob = store.open(name)
    if blob is None:
        raise DataError(f"{name} is missing", code="safetensors.missing", file=path)
    try:
        if blob.size is not None and blob.size > MAX_INDEX_BYTES:
            raise ManifestError(f"index has {blob.size} bytes, more than {MAX_INDEX_BYTES}",
                                code="safetensors.index", file=path)
        if blob.size is not None:
            buf = np.empty(blob.size, dtype=np.uint8)
            try:
                blob.read_into(0, buf)
            except XckptError as exc:
                if exc.code != "chunk.truncated":
                    raise
                raise DataError(f"index is shorter than when it was opened: {exc.message}",
                                code="safetensors.truncated", file=path) from None
            raw: bytes | None = buf.tobytes()
        else:
            raw = store.read(name)
    finally:
        blob.close()
    if raw is None:
        raise DataError(f"{name} disappeared while it was opened", code="safetensors.missing", file=path)
    if len(raw) > MAX_INDEX_BYTES:
        raise ManifestError(f"index has {len(raw)} bytes, more than {MAX_INDEX_BYTES}", code="safetensors.index",
                            file=path)
    return parse_index(raw, file=path)


def _open_files(store: Store, dir_loc: Location, name: str) -> list[_File]:
    """Open the file ``name`` (a safetensors file or an index and the files it names), headers checked."""
    if not name.endswith(".index.json"):
        return [_read_header(store, dir_loc, name)]
    index_path = _display(dir_loc, name)
    weight_map = _read_index(store, dir_loc, name)
    files: list[_File] = []
    try:
        opened: dict[str, _File] = {}
        for file_name in dict.fromkeys(weight_map.values()):
            opened[file_name] = f = _read_header(store, dir_loc, file_name)
            files.append(f)
        for tensor, file_name in weight_map.items():
            if tensor not in opened[file_name].header.tensors:
                raise ManifestError(f"weight_map puts {tensor!r} in {file_name}, which does not hold it",
                                    code="safetensors.index", file=index_path, leaf=tensor)
        for f in files:
            for tensor in f.header.tensors:
                listed = weight_map.get(tensor)
                if listed is None:
                    raise ManifestError(f"{f.name} holds {tensor!r}, which the weight_map does not list",
                                        code="safetensors.index", file=index_path, leaf=tensor)
                if listed != f.name:
                    raise ManifestError(f"{tensor!r} is in both {listed} and {f.name}",
                                        code="safetensors.duplicate", file=f.path, leaf=tensor)
    except BaseException:
        for f in files:
            f.blob.close()
        raise
    return files


def _manifest(files: list[_File]) -> tuple[Manifest, dict[Key, _File] | None]:
    """The manifest of the tensors of ``files``: a flat dict keyed by full tensor names; and the file of each key
    (None for exactly one file: it holds every key, each once).

    Every leaf goes through :func:`~xckpt.format.manifest.check_shape`, once for each shape and dtype (leaves of
    one shape and dtype have the same chunks: its checks give the same answer). A leaf shares its tensor's shape
    tuple, also as its chunk shape where no dimension is 0.
    """
    items: list[list[Any]] = []
    leaves: list[Entry] = []
    where: dict[Key, _File] = {}
    several = len(files) != 1  # (an index may name no file)
    storage: dict[str, str] = {}  # logical dtype -> storage dtype
    checked: set[tuple[tuple[int, ...], str]] = set()  # (shape, dtype) of the leaves check_shape passed
    for f in files:
        for name, info in f.header.tensors.items():
            key: Key = (name,)
            if several:
                if key in where:
                    raise ManifestError(f"{name!r} is in both {where[key].name} and {f.name}",
                                        code="safetensors.duplicate", file=f.path, leaf=name)
                where[key] = f
            shape, dtype = info.shape, info.dtype
            chunk = shape if 0 not in shape else tuple(max(1, s) for s in shape)
            storage_dtype = storage.get(dtype)
            if storage_dtype is None:
                storage_dtype = storage[dtype] = dtypes.storage_name(dtype)
            e = ArrayEntry(key, name, shape, dtype, storage_dtype, chunk, chunk)
            if (shape, dtype) not in checked:
                manifest_mod.check_shape(e, f.path)
                checked.add((shape, dtype))
            items.append([name, {"kind": "leaf", "index": len(leaves)}])
            leaves.append(e)
    metadata = {f.name: f.header.metadata for f in files}
    producer: dict[str, Any] = {"library": "safetensors"}
    formats = {(m or {}).get("format") for m in metadata.values()}
    if len(formats) == 1 and next(iter(formats)) in _FRAMEWORKS:
        producer["framework"] = _FRAMEWORKS[next(iter(formats))]
    m = Manifest(tree={"kind": "dict", "items": items}, leaves=leaves, producer=producer,
                 metadata={"safetensors": {"files": [f.name for f in files], "metadata": metadata}})
    return m, where if several else None


def open_directory(loc: Location, store: Store, name: str | None = None, *,
                   dir_loc: Location | None = None) -> SafetensorsCheckpoint:
    """Open the safetensors checkpoint in the directory of ``store`` from the file ``name`` (default:
    :func:`entry_file`); takes over ``store`` (closed on error, or by the checkpoint's ``close``).
    ``loc`` is the path the caller named (the directory, or one file in it)."""
    dir_loc = dir_loc or loc
    try:
        name = name or entry_file(store)
        if name is None:
            raise NotACheckpointError(f"{loc} holds no safetensors checkpoint (no {SINGLE_FILE} or {INDEX_FILE})",
                                      code="safetensors.missing", file=str(loc))
        files = _open_files(store, dir_loc, name)
        try:
            m, where = _manifest(files)
        except BaseException:
            for f in files:
                f.blob.close()
            raise
    except BaseException:
        store.close()
        raise
    return SafetensorsCheckpoint(loc, store, files, m, where)


def open_safetensors(path: Any) -> SafetensorsCheckpoint:
    """Open a safetensors checkpoint: a directory (``model.safetensors`` or ``model.safetensors.index.json``),
    or a path to one ``*.safetensors`` file or ``*.safetensors.index.json``."""
    loc = Location.of(path)
    target = file_target(loc)
    if target is not None:
        dir_loc, name = target
        return open_directory(loc, dir_loc.store(), name, dir_loc=dir_loc)
    return open_directory(loc, loc.store())


def safetensors_to_xckpt(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Convert the safetensors checkpoint at ``src`` into an xckpt checkpoint at ``dst``, piece by piece
    (``xckpt convert --from safetensors``); leaf keys are the tensor names."""
    ckpt = open_safetensors(src)
    try:
        copy_checkpoint(ckpt, dst, overwrite=overwrite)
    finally:
        ckpt.close()
