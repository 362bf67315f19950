"""How bytes move on load: regions of xckpt arrays read straight into the caller's buffers.

A request names an array leaf, a region of it and an output array of the region's shape
(any strides: a slice of a preallocated tensor is fine). :func:`read_regions` finds the
chunk objects the regions touch, planning each as it is read (a bounded window at a time), and on
a few threads opens each object once, checks its index and place tag
(:func:`xckpt.format.shard.parse_index`), reads only the inner chunks the requests need, checks
each one's crc32c and copies the needed part into the outputs (an inner chunk one output takes
whole is checksummed as it is copied: :func:`~xckpt.engine.hostcopy.checksum_copy`). An inner chunk
that an output needs whole and contiguous is read straight into it, unless it lies where the
kernel would copy into it slowly (:func:`~xckpt.engine.hostcopy.skewed`); the others go through
one buffer per thread, placed within a page as the file's bytes are. Host memory beyond the
outputs is one inner chunk per thread.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, islice
from typing import Callable, Iterator, Sequence

import numpy as np

from xckpt.engine.storage import Blob, Store
from xckpt.engine import threads as pools
from xckpt.engine.hostcopy import PAGE_BYTES, checksum_copy, page_buffer, page_view, skewed, stream_copy
from xckpt.errors import DataError, ResourceError, XckptError
from xckpt.format import dtypes, shard, zarr as zarr_format
from xckpt.format.manifest import ArrayEntry, StoredArray
from xckpt.format.regions import Region, chunk_box, chunks_of, count_chunks, intersect
from xckpt.format.tree import key_str

#: Objects at most this large are read with one request.
SMALL_OBJECT = 64 << 10
#: Small objects (and ``zarr.json`` files) an object store is asked for at once (:meth:`Store.prefetch`): at
#: most 16 MiB of them held at a time.
PREFETCH_WINDOW = 256
#: Small objects a checking pass (``precheck``) keeps, read and checked, for the filling pass, at most.
MAX_KEPT_BYTES = 64 << 20
#: Chunk objects one read plans at most, beyond one for every :data:`BYTES_PER_OBJECT` bytes it reads: each
#: planned object costs memory before it is opened, so a manifest declaring millions of one-byte chunks (which
#: no writer makes) is refused (``resource.too_large``) rather than planned.
MAX_OBJECTS = 1 << 20
#: See :data:`MAX_OBJECTS`.
BYTES_PER_OBJECT = 64
_CRC = 4


#: Byte alignment of the arrays :func:`empty` makes (what XLA's CPU client needs to adopt host memory).
ALIGNMENT = 64


def memory_limit() -> int:
    """The most bytes a load reads into memory unless told otherwise: this machine's physical memory, or
    less where the process is held to less (its address-space limit, ``RLIMIT_AS``; its cgroup's
    ``memory.max``, a container's limit)."""
    limits = [1 << 40]
    try:
        limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    except (ValueError, OSError):
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY and soft > 0:
            limits.append(soft)
    except (ImportError, ValueError, OSError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", "rb") as f:
            text = f.read(64).strip()
        if text.isdigit():
            limits.append(int(text))
    except OSError:
        pass
    return min(limits)


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new uninitialised array whose data starts on a :data:`ALIGNMENT`-byte boundary.

    Loaded arrays are made this way, so a framework can adopt them without a copy (``jax.device_put``
    on a CPU device does, for such arrays). Memory the system refuses is ``resource.too_large``.
    """
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    try:
        raw = np.empty(n + ALIGNMENT, dtype=np.uint8)
    except MemoryError:
        raise ResourceError(f"cannot allocate {n} bytes for an array of shape {list(shape)}: the system refuses "
                            "that much memory") from None
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + n].view(dtype).reshape(shape)


@dataclass
class ReadRequest:
    """Read ``region`` of array leaf ``entry`` into ``out`` (the region's shape, the storage dtype)."""

    entry: ArrayEntry
    region: Region
    out: np.ndarray


@dataclass
class _Part:
    inner: int  # inner chunk number
    src: tuple[slice, ...]  # in the inner chunk
    out: np.ndarray  # the destination view
    full: bool  # it takes every element of the inner chunk (its payload holds nothing else)
    whole: bool  # full, and the destination is contiguous, uncompressed, in the stored dtype: the payload itself


@dataclass
class _Want:
    """What one request wants of one chunk object: the box ``[lo, hi)`` in chunk coordinates, going to ``out``
    (the request's output) moved by ``shift`` (chunk coordinates -> the output's)."""

    out: np.ndarray
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    shift: tuple[int, ...]


@dataclass
class _Object:
    name: str
    geom: shard.Geometry
    valid: tuple[int, ...]
    entry: ArrayEntry
    parts: list[_Part]  # parts known when planned (the whole of a one-inner-chunk object)
    wants: list[_Want] = field(default_factory=list)  # the rest, made into parts only when the object is read

    @property
    def leaf(self) -> str:
        """The leaf it belongs to, for messages."""
        return key_str(self.entry.key)

    def all_parts(self) -> list[_Part]:
        """Every part to fill: those planned, and those its wants make (:func:`_parts_of`). Made when the
        object is read, after its index was checked: a manifest that declares millions of tiny inner chunks
        costs nothing before an object holding them is found."""
        return self.parts + [p for w in self.wants for p in _parts_of(self.geom, self.valid, w)]


def _parts_of(geom: shard.Geometry, valid: tuple[int, ...], w: _Want) -> Iterator[_Part]:
    """The parts of the inner chunks of an object (the chunk clipped to the array: ``valid``) that ``w`` wants."""
    lo, hi, shift = w.lo, w.hi, w.shift
    for k, inner_start, sl in geom.inner_chunks(valid, lo, hi):
        got = [(max(x.start, a), min(x.stop, b)) for x, a, b in zip(sl, lo, hi)]
        src = tuple(slice(g0 - i, g1 - i) for (g0, g1), i in zip(got, inner_start))
        dst = w.out[tuple(slice(g0 + d, g1 + d) for (g0, g1), d in zip(got, shift)) + (Ellipsis,)]
        full = all(g1 - g0 == n for (g0, g1), n in zip(got, geom.inner_shape))
        whole = full and dst.flags.c_contiguous and geom.compression == "none" and dst.dtype == geom.le_dtype
        yield _Part(k, src, dst, full, whole)


def _whole(req: ReadRequest, geom: shard.Geometry, a: StoredArray) -> bool:
    """Whether a request reads the whole of an array that is one object of one inner chunk."""
    return (req.region.offsets == a.offset and req.region.sizes == a.shape == a.chunk_shape == a.inner_chunk_shape)


@dataclass
class _Group:
    """The requests that read one stored array (all of one leaf's, in the order given)."""

    entry: ArrayEntry
    array: StoredArray
    requests: list[ReadRequest]

    @cached_property
    def geom(self) -> shard.Geometry:
        """Its objects' encoding (worked out once its ``zarr.json`` was checked against the manifest)."""
        a, e = self.array, self.entry
        return zarr_format.geometry(e.storage_dtype, a.chunk_shape, a.inner_chunk_shape, e.compression)

    @property
    def small(self) -> bool:
        """Whether its objects are read whole, on the calling thread (:data:`SMALL_OBJECT`)."""
        return self.geom.max_nbytes < SMALL_OBJECT

    @property
    def leaf(self) -> str:
        """The leaf it belongs to, for messages."""
        return key_str(self.entry.key)

    @property
    def expected(self) -> tuple[tuple[int, ...], str, tuple[int, ...], tuple[int, ...], str]:
        """What its ``zarr.json`` must say (:func:`xckpt.format.zarr.zarr_metadata`'s arguments)."""
        a, e = self.array, self.entry
        return (a.shape, e.storage_dtype, a.chunk_shape, a.inner_chunk_shape, e.compression)

    @cached_property
    def chunks(self) -> int:
        """How many chunk objects its array has: at least :attr:`count`, and cheaper to tell."""
        a = self.array
        return math.prod(-(-s // c) for s, c in zip(a.shape, a.chunk_shape))

    @cached_property
    def count(self) -> int:
        """How many objects :func:`_plan` makes of it, at most (counted without planning any)."""
        a = self.array
        boxes = [intersect(r.region, a.region) for r in self.requests]
        return sum(count_chunks(b.relative_to(a.region), a.chunk_shape) for b in boxes if b is not None)


def _groups(requests: Sequence[ReadRequest]) -> list[_Group]:
    """The requests grouped by the stored array they read, in the order the arrays first appear."""
    groups: dict[str, _Group] = {}
    for req in requests:
        e = req.entry
        if req.region.is_empty():
            continue
        for a in e.arrays():
            g = groups.get(a.path)
            if g is None:
                g = groups[a.path] = _Group(e, a, [])
            g.requests.append(req)
    return list(groups.values())


def _check_object_count(groups: Sequence[_Group], nbytes: int, file: Callable[[str], str]) -> None:
    """Refuse a read of ``nbytes`` bytes that would plan more chunk objects than :data:`MAX_OBJECTS` allows for
    them, naming the leaf that declares the most (its ``zarr.json``); counted without planning any."""
    limit = MAX_OBJECTS + nbytes // BYTES_PER_OBJECT
    if sum(g.chunks for g in groups) <= limit:  # (the usual: not worth counting exactly)
        return
    counts = [g.count for g in groups]
    count = sum(counts)
    if count > limit:
        n, g = max(zip(counts, groups), key=lambda c: c[0])
        a = g.array
        raise ResourceError(f"the read would open {count} chunk objects for {nbytes} bytes, more than the {limit} "
                            f"a read of that size may ({n} of them this leaf's: chunks of {list(a.chunk_shape)} in "
                            f"an array of {list(a.shape)})", file=file(f"{a.path}/{zarr_format.METADATA}"),
                            leaf=g.leaf)


def _plan(groups: Sequence[_Group]) -> Iterator[_Object]:
    """The objects to open and, for each, which inner chunk parts go where: made one at a time as they are
    read (a manifest declaring a million chunks costs nothing before the first one is found wanting), each
    object once with what every request of its array wants of it."""
    for g in groups:
        e, a, geom = g.entry, g.array, g.geom
        if len(g.requests) == 1 and _whole(g.requests[0], geom, a):  # the usual small leaf: one object, all of it
            dst = g.requests[0].out[(Ellipsis,)]
            whole = dst.flags.c_contiguous and geom.compression == "none" and dst.dtype == geom.le_dtype
            yield _Object(f"{a.path}/{zarr_format.chunk_key((0,) * len(a.shape))}", geom, a.shape, e,
                          [_Part(0, (Ellipsis,), dst, True, whole)])
            continue
        locals_: list[tuple[ReadRequest, Region]] = []
        for req in g.requests:
            part = intersect(req.region, a.region)
            if part is not None:
                locals_.append((req, part.relative_to(a.region)))
        if not locals_:
            continue
        if len(locals_) == 1:  # the usual: streamed
            req, local = locals_[0]
            for idx in chunks_of(local, a.chunk_shape):
                start, valid = _chunk_at(a, idx)
                yield _Object(f"{a.path}/{zarr_format.chunk_key(idx)}", geom, valid, e, [],
                              [_want(a, req, local, start, valid)])
            continue
        objects: dict[tuple[int, ...], _Object] = {}  # several requests of one array: each object once
        for req, local in locals_:
            for idx in chunks_of(local, a.chunk_shape):
                start, valid = _chunk_at(a, idx)
                obj = objects.get(idx)
                if obj is None:
                    obj = objects[idx] = _Object(f"{a.path}/{zarr_format.chunk_key(idx)}", geom, valid, e, [])
                obj.wants.append(_want(a, req, local, start, valid))
        yield from objects.values()


def _chunk_at(a: StoredArray, idx: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where chunk ``idx`` of ``a`` starts, and its shape clipped to the array (:func:`chunk_box`)."""
    box = chunk_box(idx, a.chunk_shape, a.shape)
    return box.offsets, box.sizes


def _want(a: StoredArray, req: ReadRequest, local: Region, start: tuple[int, ...], valid: tuple[int, ...]) -> _Want:
    """What ``req`` (``local``: its part of ``a``, in ``a``'s coordinates) wants of the chunk at ``start``
    (clipped shape ``valid``), which the part intersects."""
    want = intersect(local, Region(start, valid))
    assert want is not None  # the chunk is one of the part's
    lo = tuple(o - s for o, s in zip(want.offsets, start))  # what is wanted, in chunk coordinates
    hi = tuple(x - s for x, s in zip(want.ends, start))
    shift = tuple(s + o - r for s, o, r in zip(start, a.offset, req.region.offsets))  # chunk -> out
    return _Want(req.out, lo, hi, shift)


@dataclass
class ReadMemo:
    """What the reads of one opened checkpoint found, for the reads that follow on it: the arrays whose
    ``zarr.json`` matched the manifest, and the small objects a checking pass read whole and checked (their
    index and every inner chunk's crc32c; at most :data:`MAX_KEPT_BYTES` of them), which a filling pass then
    takes instead of reading them again. An opened checkpoint's objects do not change (a save that replaces it
    makes a new directory: :meth:`~xckpt.engine.storage.Store.replaced`)."""

    arrays: set[str] = field(default_factory=set)
    kept: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def kept_nbytes(self) -> int:
        """Bytes of the objects kept."""
        return sum(whole.nbytes for whole, _ in self.kept.values())


def _check_arrays(store: Store, groups: Sequence[_Group], file: Callable[[str], str], checked: set[str]) -> int:
    """:func:`_check_array` of every array read but those ``checked`` already (each checked is added), their
    ``zarr.json`` fetched a window at a time where the store serves many requests at once
    (:meth:`~xckpt.engine.storage.Store.prefetch`); the bytes read."""
    total = 0
    groups = [g for g in groups if g.array.path not in checked]
    for at in range(0, len(groups), PREFETCH_WINDOW):
        window = groups[at:at + PREFETCH_WINDOW]
        # (those above SMALL_OBJECT, which real ones never are, are read one by one under their own bound)
        names = [f"{g.array.path}/{zarr_format.METADATA}" for g in window]
        got = store.prefetch(names, SMALL_OBJECT)
        for g, name in zip(window, names):
            total += _check_array(store, g, file, got.get(name))
            checked.add(g.array.path)
    return total


def _check_array(store: Store, g: _Group, file: Callable[[str], str], raw: bytes | None = None) -> int:
    """The array's ``zarr.json`` (``raw``, when already read) must say what the manifest says (other
    readers go by it)."""
    name = f"{g.array.path}/{zarr_format.METADATA}"
    try:
        if raw is None:
            raw = store.read(name, limit=zarr_format.MAX_METADATA_BYTES)
    except XckptError as exc:
        raise exc.at(leaf=g.leaf) from None
    if raw is None:
        raise DataError("array metadata (zarr.json) is missing", code="array.metadata_missing", file=file(name),
                        leaf=g.leaf)
    defect = None if raw == zarr_format.array_json(*g.expected) else \
        zarr_format.metadata_defect(raw, zarr_format.zarr_metadata(*g.expected))
    if defect is not None:  # the code says which check failed (the validator's codes for the same defect)
        code, why = defect
        raise DataError(why, code=code, file=file(name), leaf=g.leaf)
    return len(raw)


class _Scratch(threading.local):
    """One buffer per reading thread for the inner chunks not read straight into an output, grown as needed."""

    buf: np.ndarray | None = None

    def get(self, n: int, position: int) -> np.ndarray:
        """``n`` bytes to read an object's bytes at ``position`` into, placed within a page as that position is
        (:func:`~xckpt.engine.hostcopy.page_view`: the kernel copies into them at full speed)."""
        if self.buf is None or self.buf.size < n + PAGE_BYTES:
            self.buf = page_buffer(n)
        return page_view(self.buf, n, position)


def _read_object(store: Store, obj: _Object, scratch: _Scratch, file: Callable[[str], str],
                 generation: str | None, fill: bool = True, kept: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                 fetched: bytes | None = None) -> int:
    """Open one object, check its index (and its place tag, with ``generation``), fill every part (unless
    ``fill`` is False); returns the bytes read. ``kept`` (objects by name, for one thread): with ``fill``
    False, an object small enough to be read whole is put there, checked, for the filling pass, which then
    takes it from there and opens nothing. ``fetched``: the whole object, already read
    (:meth:`~xckpt.engine.storage.Store.prefetch`), at most :data:`SMALL_OBJECT` bytes: nothing is opened."""
    if fill and kept and obj.name in kept:
        whole, index = kept.pop(obj.name)
        try:
            _fill(obj, index, whole, None, scratch)
        except XckptError as exc:
            raise exc.at(file=file(obj.name), leaf=obj.leaf) from None
        return 0
    blob: Blob | None = None
    if fetched is None:
        try:
            blob = store.open(obj.name)
        except XckptError as exc:
            raise exc.at(leaf=obj.leaf) from None
        if blob is None:
            raise DataError("chunk object is missing", code="chunk.missing", file=file(obj.name), leaf=obj.leaf)
    geom = obj.geom
    place = None if generation is None else shard.place_of(generation, obj.name)
    n_tail = shard.tail_nbytes(geom, place)
    try:
        whole = None
        if fetched is not None:
            whole = np.frombuffer(fetched, dtype=np.uint8)
        else:
            assert blob is not None
            if blob.size is not None and (blob.size <= SMALL_OBJECT or blob.size < n_tail):
                whole = np.empty(blob.size, dtype=np.uint8)
                blob.read_into(0, whole)
        if whole is not None:
            size: int | None = whole.size
            tail = whole[whole.size - n_tail:] if whole.size >= n_tail else whole
        else:
            assert blob is not None
            size, tail = blob.size, blob.read_tail(n_tail)
        index = shard.parse_index(geom, tail, size, obj.valid, place=place)
        done = whole.size if whole is not None else tail.size
        if not fill:
            if kept is not None and whole is not None:
                for k in {p.inner for p in obj.all_parts()}:  # its inner chunks' crc32c too: the fill cannot fail
                    shard.open_inner(geom, whole[int(index[k, 0]):int(index[k, 0]) + int(index[k, 1])])
                kept[obj.name] = (whole, index)
            return done
        return done + _fill(obj, index, whole, blob, scratch)
    except XckptError as exc:
        raise exc.at(file=file(obj.name), leaf=obj.leaf) from None
    except OSError as exc:
        raise DataError(f"cannot read: {exc.strerror or exc}", code="io.read", file=file(obj.name),
                        leaf=obj.leaf) from exc
    finally:
        if blob is not None:
            blob.close()


def _fill(obj: _Object, index: np.ndarray, whole: np.ndarray | None, blob: Blob | None, scratch: _Scratch) -> int:
    """Fill every part of an object whose index is checked, from the ``whole`` object when read, else
    from ``blob``; returns the bytes read from ``blob``."""
    geom = obj.geom
    done = 0
    by_inner: dict[int, list[_Part]] = {}
    for p in obj.all_parts():
        by_inner.setdefault(p.inner, []).append(p)
    for k, parts in by_inner.items():
        off, nbytes = int(index[k, 0]), int(index[k, 1])
        if whole is not None:
            encoded = whole[off:off + nbytes]
        elif len(parts) == 1 and parts[0].whole and not skewed(parts[0].out.ctypes.data, off):
            assert blob is not None
            _read_direct(blob, off, nbytes, parts[0].out, geom)
            done += nbytes
            continue
        else:  # (an output the kernel would copy into slowly goes through the scratch buffer too: faster)
            assert blob is not None
            encoded = scratch.get(nbytes, off)
            blob.read_into(off, encoded)
            done += nbytes
        if len(parts) == 1 and parts[0].full and geom.compression == "none":  # checked as it is copied
            data = np.ndarray(geom.inner_shape, dtype=geom.le_dtype, buffer=encoded[:-_CRC])  # (its size: the index's)
            shard.check_inner(encoded, checksum_copy(parts[0].out, data))
            continue
        payload = shard.open_inner(geom, encoded)
        data = np.ndarray(geom.inner_shape, dtype=geom.le_dtype, buffer=payload)
        for p in parts:
            stream_copy(p.out, data[p.src])
    return done


def _read_direct(blob: Blob, off: int, nbytes: int, out: np.ndarray, geom: shard.Geometry) -> None:
    """Read an uncompressed inner chunk straight into ``out``, then check its crc32c."""
    raw = out.reshape(-1).view(np.uint8)
    if nbytes != raw.size + _CRC:
        raise DataError("inner chunk has the wrong size", code="chunk.size")
    blob.read_into(off, raw)
    crc = np.empty(_CRC, dtype=np.uint8)
    blob.read_into(off + raw.size, crc)
    shard.check_inner(crc, shard.checksum(raw))


def placeholder(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An output of ``shape`` that holds no memory (every element aliases one), for ``fill=False`` reads."""
    return np.lib.stride_tricks.as_strided(np.empty(1, dtype=dtype), shape=shape, strides=(0,) * len(shape))


def read_regions(store: Store, requests: Sequence[ReadRequest], file: Callable[[str], str], *,
                 generation: str | None = None, precheck: bool = False, fill: bool = True,
                 memo: ReadMemo | None = None) -> int:
    """Fill every request's ``out`` from the arrays in ``store``; returns the bytes read.

    ``generation``: the checkpoint's (format 1.2 and later), whose every chunk object must carry the
    place tag naming it (:func:`xckpt.format.shard.place_of`); None for older formats.

    Raises a specific :class:`~xckpt.errors.XckptError` (naming the object and the leaf) for
    a missing, truncated or corrupt object; outputs are then partly written. With
    ``precheck``, every object is opened and its index checked before any output is written,
    so only a corrupt inner chunk can stop the reads half way. ``fill=False`` only checks (the
    outputs may then be views of no memory, see :func:`placeholder`). ``memo`` (kept by the opened
    checkpoint across its reads) skips what an earlier read of it checked, and lets a checking pass
    (``fill=False``) keep the small objects it read for the filling pass that follows.
    """
    given = memo is not None
    memo = memo if memo is not None else ReadMemo()
    groups = _groups(requests)
    total = _check_arrays(store, groups, file, memo.arrays)  # before planning: a lying manifest is refused
    _check_object_count(groups, sum(r.out.size * r.out.dtype.itemsize for r in requests if not r.region.is_empty()),
                        file)  # before its chunk counts are walked
    if not groups:
        return total
    scratch = _Scratch()
    ex = pools.pool()
    big = [g for g in groups if not g.small]
    small = [g for g in groups if g.small]
    # small objects a checking pass reads and checks are kept for the filling pass: this call's, or (memo
    # given) the next call's
    keep = (fill and precheck or not fill and given) and \
        sum(g.chunks * g.geom.max_nbytes for g in small) + memo.kept_nbytes() <= MAX_KEPT_BYTES
    kept = memo.kept
    for do_fill in ((False,) if not fill else (False, True) if precheck else (True,)):
        # a local object's check reads only its index: on this thread too, where a thread's handover would
        # cost more (an object store's wait for each answer is what the threads overlap)
        here = not do_fill and not store.remote
        # finished within this pass, so the closure's do_fill is this pass's
        pump = pools.Pump(ex, lambda o: _read_object(store, o, scratch, file, generation, do_fill),
                          () if here else _plan(big), pools.io_threads())
        first: BaseException | None = None
        try:  # small objects on this thread: their cost is Python, threads only contend (an object store's
            # requests go out a window at a time: Store.prefetch)
            planned = chain(_plan(small), _plan(big)) if here else _plan(small)
            while pump.first is None:  # (a large object failed: stop here)
                window = list(islice(planned, PREFETCH_WINDOW))
                if not window:
                    break
                got = store.prefetch([o.name for o in window if o.name not in kept], SMALL_OBJECT)
                # (only small arrays' objects are kept, as counted above: not a large one compressed small)
                total += sum(_read_object(store, o, scratch, file, generation, do_fill,
                                          kept if (keep or do_fill) and o.geom.max_nbytes < SMALL_OBJECT else None,
                                          got.get(o.name)) for o in window)
        except BaseException as exc:  # noqa: BLE001 - raised once no thread writes into the outputs
            first = exc
        total += pump.finish(first)
    if fill:  # a sub-byte element's high bits carry no meaning (spec 3.4): clear any a writer left set
        for r in requests:
            mask = dtypes.low_bits(r.entry.dtype)
            if mask is not None:
                np.bitwise_and(r.out, np.uint8(mask), out=r.out)
    return total
