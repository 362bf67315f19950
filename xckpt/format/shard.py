r"""One stored chunk object: Zarr v3's ``sharding_indexed`` codec, encoded and checked without TensorStore.

An array's chunk is one object. Its bytes, as Zarr v3 (``index_location: end``) lays them out::

    [inner chunk 0][inner chunk 1]...[place tag][index: n x (offset u64 LE, nbytes u64 LE)][crc32c of the index, u32 LE]

Inner chunks are numbered in C order of the inner grid. Each encoded inner chunk is its
payload (the elements in C order, little-endian; compressed by zstd when the array says so)
followed by the crc32c of the payload (u32 LE); ``nbytes`` counts both. An index entry of
two ``2**64 - 1`` marks an inner chunk that is not stored (only allowed wholly outside the array).

The *place tag* (format 1.2) binds the object to its place: 16 bytes, ``XCKPLACE``, then the
crc32c (u32 LE) of the save's generation, the object's name in the checkpoint and the index
(:func:`place_crc`), then 4 zero bytes. No index entry points at it, so zarr-python and
TensorStore skip it; a chunk object swapped within an array, or copied from another
checkpoint, carries a tag that names another place, and the reader refuses it (``chunk.place``).

Writing streams: :func:`encode_parts` yields the object in pieces of about 1 MiB, each
checksummed as it passes (copied into a small buffer first only where the data is not
already laid out as stored: such an inner chunk is one :class:`Copied` part, one already laid
out a :class:`Checked` part, either of which a writer into a local file makes in one compiled
call), so a writer never holds a whole object. An asynchronous save
copies each chunk once, into the stored layout (:func:`lay_out`), and encodes that copy
without copying again. Reading checks before it trusts: :func:`parse_index` verifies the
index's crc32c and every entry against the object's size (no overlap, exact sizes when
uncompressed), :func:`open_inner` verifies an inner chunk's crc32c.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterable, Iterator

import crc32c
import numpy as np

from xckpt.errors import DataError, IntegrityError, XckptError
from xckpt.format.regions import walk

#: Bytes an uncompressed inner chunk is checksummed and written in at a time: small enough that a
#: block copied into the scratch buffer is still in the cache when it is checksummed and written,
#: large enough that the Python around each piece, and each handover of the GIL between writer
#: threads, stays small beside it (1 MiB pieces cut the CPU time of a numpy save by about 8 %
#: against 256 KiB ones on the 2-core VM; 512 KiB to 2.7 MiB measured alike).
PIECE_BYTES = 1 << 20


def _numpy_max_dims() -> int:
    """The most dimensions a numpy array may have: 64 from numpy 2, 32 before (the package takes 1.26)."""
    try:
        np.empty((1,) * 64, dtype=np.uint8)
    except ValueError:
        return 32
    return 64


#: The most dimensions a numpy array may have here.
_NUMPY_MAX_DIMS = _numpy_max_dims()
#: A copy between two arrays of one shape, as ``numpy.copyto(dst, src, casting="equiv")``.
Copy = Callable[[np.ndarray, np.ndarray], None]


def _copyto(dst: np.ndarray, src: np.ndarray) -> None:
    """The ordinary copy of :func:`lay_out`."""
    np.copyto(dst, src, casting="equiv")


#: A copy between two arrays of one shape into a C-contiguous destination that returns the crc32c of
#: the destination's bytes, continuing from the crc32c given (of what came before).
CopyChecksum = Callable[[np.ndarray, np.ndarray, int], int]


def copy_then_checksum(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
    """A :data:`CopyChecksum` in two passes, :func:`encode_parts`'s default: numpy's copy, then
    :func:`checksum` of ``dst``'s bytes in C order."""
    np.copyto(dst, src, casting="equiv")
    return checksum(dst.reshape(-1).view(np.uint8), crc)


#: Index entry of an inner chunk that is not stored.
MISSING = 2**64 - 1
_CRC = 4
#: The place tag's first bytes, and its size.
TAG_MAGIC = b"XCKPLACE"
TAG_NBYTES = 16


def checksum(data: np.ndarray | bytes, value: int = 0) -> int:
    """The crc32c of a contiguous uint8 array (or bytes), continuing from ``value`` (the crc32c of what came
    before; the GIL is released while it runs)."""
    return crc32c.crc32c(data, value)


@dataclass(frozen=True)
class Geometry:
    """The encoding of one array's chunk objects: chunk and inner chunk shapes, element type, codec."""

    chunk_shape: tuple[int, ...]
    inner_shape: tuple[int, ...]
    dtype: np.dtype  # the storage dtype
    compression: str = "none"

    @cached_property
    def inner_grid(self) -> tuple[int, ...]:
        """Number of inner chunks along each dimension."""
        return tuple(c // i for c, i in zip(self.chunk_shape, self.inner_shape))

    @cached_property
    def n_inner(self) -> int:
        """Number of inner chunks in one object."""
        return math.prod(self.inner_grid)

    @cached_property
    def inner_nbytes(self) -> int:
        """Payload bytes of one uncompressed inner chunk."""
        return math.prod(self.inner_shape) * self.dtype.itemsize

    @cached_property
    def index_nbytes(self) -> int:
        """Bytes of the index, its crc32c included."""
        return self.n_inner * 16 + _CRC

    @cached_property
    def max_nbytes(self) -> int:
        """Bytes of an uncompressed object with every inner chunk stored."""
        return self.n_inner * (self.inner_nbytes + _CRC) + self.index_nbytes

    @cached_property
    def row_nbytes(self) -> int:
        """Bytes of one row of an inner chunk (its elements with the same first index)."""
        return math.prod(self.inner_shape[1:]) * self.dtype.itemsize

    @cached_property
    def block_rows(self) -> int:
        """Rows of an inner chunk :func:`encode_parts` handles at a time: about :data:`PIECE_BYTES`."""
        return max(1, min(self.inner_shape[0] if self.inner_shape else 1, PIECE_BYTES // max(1, self.row_nbytes)))

    @cached_property
    def scratch_nbytes(self) -> int:
        """Bytes of the buffer :func:`encode_parts` needs: a block of rows and a crc32c after it (a whole
        inner chunk when compressed)."""
        if self.compression != "none" or not self.inner_shape:
            return self.inner_nbytes
        return self.block_rows * self.row_nbytes + _CRC

    @cached_property
    def le_dtype(self) -> np.dtype:
        """The storage dtype, little-endian (the byte order on disk)."""
        return self.dtype.newbyteorder("<") if self.dtype.itemsize > 1 else self.dtype

    def inner_chunks(self, valid: tuple[int, ...], lo: tuple[int, ...] | None = None,
                     hi: tuple[int, ...] | None = None) -> Iterator[tuple[int, tuple[int, ...], tuple[slice, ...]]]:
        """``(number, start, slices)`` of every inner chunk intersecting the ``valid`` part of the
        chunk (the chunk clipped to the array), ``slices`` clipped to it, in chunk coordinates; only
        those are visited, in C order. ``lo`` and ``hi`` (within ``valid``) narrow the visit to the inner
        chunks intersecting the box ``[lo, hi)``."""
        lo = lo or (0,) * len(valid)
        hi = hi or valid
        ranges = [range(a // i, min(-(-b // i), n)) for a, b, i, n in zip(lo, hi, self.inner_shape, self.inner_grid)]
        strides = [math.prod(self.inner_grid[d + 1:]) for d in range(len(self.inner_grid))]
        for g in walk(ranges):
            start = tuple(gi * i for gi, i in zip(g, self.inner_shape))
            k = sum(gi * s for gi, s in zip(g, strides))
            yield k, start, tuple(slice(s, min(s + i, v)) for s, i, v in zip(start, self.inner_shape, valid))

    def needed(self, valid: tuple[int, ...]) -> np.ndarray:
        """Which inner chunks (by number) intersect the ``valid`` part of the chunk, as a boolean mask."""
        mask = np.ones(self.inner_grid, dtype=bool)
        for d, (v, i, n) in enumerate(zip(valid, self.inner_shape, self.inner_grid)):
            shape = [1] * len(self.inner_grid)
            shape[d] = n
            mask &= (np.arange(n) < -(-v // i)).reshape(shape)
        return mask.reshape(-1)

    def payload_view(self, buf: np.ndarray, offset: int) -> np.ndarray:
        """The inner chunk payload at ``offset`` of ``buf`` (uint8) as an array of the inner shape."""
        raw = buf[offset:offset + self.inner_nbytes]
        return np.ndarray(self.inner_shape, dtype=self.le_dtype, buffer=raw)


def _fill(geom: Geometry, part: np.ndarray, view: np.ndarray, copy: Copy = _copyto) -> None:
    """Copy an inner chunk's data ``part`` (clipped to the array) into its payload ``view`` (zero-padded)."""
    if part.shape != geom.inner_shape:
        view[...] = 0
        view[tuple(slice(0, s) for s in part.shape) + (Ellipsis,)] = part
    else:
        copy(view, part)


@dataclass(frozen=True)
class LaidOut:
    """A chunk's data copied into the layout its object stores: the payloads of the inner chunks
    intersecting the array (the chunk clipped to it: ``valid``), one after another in C order,
    zero-padded and little-endian (:func:`lay_out`), so that encoding it copies nothing."""

    valid: tuple[int, ...]
    payloads: np.ndarray  # uint8

    @property
    def nbytes(self) -> int:
        """Bytes of the payloads."""
        return int(self.payloads.nbytes)


def array_nbytes(geom: Geometry, data: np.ndarray | LaidOut) -> int:
    """Bytes of array data a chunk holds (laid-out payloads also hold the padding of edge inner chunks)."""
    if isinstance(data, LaidOut):
        return math.prod(data.valid) * geom.dtype.itemsize
    return int(data.nbytes)


def laid_nbytes(geom: Geometry, valid: tuple[int, ...]) -> int:
    """Bytes :func:`lay_out` needs for the chunk clipped to ``valid``: one payload per inner chunk intersecting it."""
    return math.prod(-(-v // i) for v, i in zip(valid, geom.inner_shape)) * geom.inner_nbytes


def lay_out(geom: Geometry, data: np.ndarray, buf: np.ndarray, copy: Copy = _copyto) -> LaidOut:
    """Copy ``data`` (the chunk clipped to the array, storage dtype) into ``buf`` (uint8, of
    :func:`laid_nbytes` bytes) as the payloads of its inner chunks, in the order the object stores them;
    ``copy(dst, src)`` copies between views of one shape (``numpy.copyto`` with ``casting="equiv"``
    by default)."""
    valid = tuple(int(s) for s in data.shape)
    inner = geom.inner_shape
    if inner and 2 * len(inner) <= _NUMPY_MAX_DIMS and all(v % i == 0 for v, i in zip(valid, inner)):
        # whole inner chunks only: one copy between views that split every dimension into (inner chunk
        # number, place in it), visited in the data's order (it is read once, front to back); such a
        # view has twice the dimensions, which numpy must allow
        grid = tuple(v // i for v, i in zip(valid, inner))
        split = tuple(x for g, i in zip(grid, inner) for x in (g, i))
        stored = np.ndarray(grid + inner, dtype=geom.le_dtype, buffer=buf)  # the inner grid's axes first
        back = tuple(a for d in range(len(inner)) for a in (d, len(inner) + d))
        copy(stored.transpose(back), data.reshape(split))
        return LaidOut(valid, buf)
    n = geom.inner_nbytes
    for i, (_, _, sl) in enumerate(geom.inner_chunks(valid)):
        _fill(geom, data[sl + (Ellipsis,)], geom.payload_view(buf, i * n), copy)
    return LaidOut(valid, buf)


def _views(payload: np.ndarray) -> Iterator[np.ndarray]:
    """A whole payload (uint8, already as stored) as views of about :data:`PIECE_BYTES`."""
    for start in range(0, payload.size, PIECE_BYTES):
        yield payload[start:start + PIECE_BYTES]


@dataclass(frozen=True)
class Checked:
    """A part of :func:`encode_parts`'s stream still to be made: the stored bytes of one uncompressed inner
    chunk whose ``payload`` (uint8, contiguous) already lies as stored (data that is its own payload, an
    asynchronous save's staged copy): the payload, then its crc32c, taken as it passes. A consumer takes
    it as :meth:`pieces` or makes it its own way (:func:`xckpt.engine.hostcopy.write_checked` writes it to a
    file in one compiled call, through ``scratch`` where that is faster), before it asks for the next part."""

    payload: np.ndarray
    scratch: np.ndarray | None = None  # a buffer a writer may copy pieces through (:meth:`pieces` does not)

    def pieces(self) -> Iterator[np.ndarray]:
        """Its bytes: views of the payload of about :data:`PIECE_BYTES`, then the crc32c."""
        crc = 0
        for piece in _views(self.payload):
            crc = checksum(piece, crc)
            yield piece
        yield _le32(crc)


@dataclass(frozen=True)
class Copied:
    """A part of :func:`encode_parts`'s stream still to be made: the stored bytes of one uncompressed inner
    chunk (its payload, then the payload's crc32c) whose data ``src`` (the inner chunk's shape, in the
    storage dtype) is not laid out as stored, so it goes through ``scratch`` (uint8, at least
    :attr:`Geometry.scratch_nbytes`) ``block_rows`` rows at a time as ``dtype`` (the storage dtype,
    little-endian), copied and checksummed in one pass by ``copy``. A consumer takes it as :meth:`pieces`
    or makes it its own way (:func:`xckpt.engine.hostcopy.write_copied` writes it to a file in one compiled
    call), before it asks for the next part."""

    src: np.ndarray
    scratch: np.ndarray
    block_rows: int
    dtype: np.dtype
    copy: CopyChecksum

    def pieces(self) -> Iterator[np.ndarray]:
        """Its bytes: each block of rows copied into ``scratch`` (valid until the next is asked for), then
        the crc32c."""
        rows, step = self.src.shape[0], self.block_rows
        row_nbytes = self.src.nbytes // max(1, rows)
        crc = 0
        for a in range(0, rows, step):
            b = min(rows, a + step)
            raw = self.scratch[:(b - a) * row_nbytes]
            crc = self.copy(np.ndarray((b - a,) + self.src.shape[1:], dtype=self.dtype, buffer=raw),
                            self.src[a:b], crc)
            yield raw
        yield _le32(crc)


#: The parts of :func:`encode_parts`'s stream that are still to be made (each has ``pieces()``).
Deferred = (Copied, Checked)


def buffers(parts: Iterable[np.ndarray | bytes | Copied | Checked]) -> Iterator[np.ndarray | bytes]:
    """:func:`encode_parts`'s stream as bytes-like parts only: each :data:`Deferred` part as its pieces."""
    for part in parts:
        if isinstance(part, Deferred):
            yield from part.pieces()
        else:
            yield part


def _padded_pieces(geom: Geometry, part: np.ndarray, scratch: np.ndarray, copy: CopyChecksum
                   ) -> Iterator[np.ndarray]:
    """The stored bytes of one uncompressed inner chunk cut by the array's edge (``part``: its data, clipped)
    or of a 0-d array: blocks of rows in ``scratch``, zero-padded where the edge cuts them (the others
    copied by ``copy``, which checksums as it copies), then the crc32c."""
    n = geom.inner_nbytes
    if not geom.inner_shape:  # a 0-d array's one element
        _fill(geom, part, geom.payload_view(scratch, 0))
        yield scratch[:n]
        yield _le32(checksum(scratch[:n]))
        return
    rows, have = geom.inner_shape[0], part.shape[0]
    padded = part.shape[1:] != geom.inner_shape[1:]
    crc = 0
    for a in range(0, rows, geom.block_rows):
        b = min(rows, a + geom.block_rows)
        raw = scratch[:(b - a) * geom.row_nbytes]
        view = np.ndarray((b - a,) + geom.inner_shape[1:], dtype=geom.le_dtype, buffer=raw)
        if padded or b > have:
            view[...] = 0
            if a < have:
                src = part[a:min(b, have)]
                np.copyto(view[(slice(0, src.shape[0]),) + tuple(slice(0, s) for s in src.shape[1:])], src,
                          casting="equiv")
            crc = checksum(raw, crc)
        else:
            crc = copy(view, part[a:b], crc)
        yield raw
    yield _le32(crc)


def _stored(geom: Geometry, part: np.ndarray, scratch: np.ndarray, copy: CopyChecksum
            ) -> Iterator[np.ndarray | Copied | Checked]:
    """The stored bytes of one uncompressed inner chunk (``part``: its data, clipped to the array), payload
    then crc32c: one :class:`Checked` part of ``part`` itself where it already is the payload (C order,
    little-endian, not clipped); one :class:`Copied` part where it only needs copying; else zero-padded
    blocks (:func:`_padded_pieces`)."""
    if part.shape == geom.inner_shape and part.flags.c_contiguous and part.dtype.str == geom.le_dtype.str:
        yield Checked(part.reshape(-1).view(np.uint8), scratch)
    elif part.shape == geom.inner_shape and geom.inner_shape:
        yield Copied(part, scratch, geom.block_rows, geom.le_dtype, copy)
    else:
        yield from _padded_pieces(geom, part, scratch, copy)


def place_crc(place: bytes, index: bytes | np.ndarray) -> int:
    """The crc32c a place tag holds: of ``place`` (the generation, a NUL, the object's name) and the index."""
    return crc32c.crc32c(index, crc32c.crc32c(place))


def place_of(generation: str, name: str) -> bytes:
    """What a chunk object's tag binds it to: its save's generation and its name in the checkpoint."""
    return generation.encode() + b"\0" + name.encode()


def place_tag(place: bytes, index: bytes | np.ndarray) -> bytes:
    """The 16-byte place tag of an object whose index (crc32c included) is ``index``."""
    return TAG_MAGIC + struct.pack("<I", place_crc(place, index)) + bytes(TAG_NBYTES - len(TAG_MAGIC) - 4)


def encode_parts(geom: Geometry, data: np.ndarray | LaidOut, scratch: np.ndarray, place: bytes | None = None,
                 copy: CopyChecksum = copy_then_checksum) -> Iterator[np.ndarray | Copied | Checked]:
    """The bytes of one chunk's object, inner chunk by inner chunk, then the place tag (when ``place``
    is given: :func:`place_of`) and the index.

    ``data`` is the chunk clipped to the array (every dimension at most the chunk's), in the
    storage dtype, or that chunk already laid out (:func:`lay_out`); parts of inner chunks
    outside the array are zero-filled and inner chunks wholly outside it are not stored. An
    uncompressed inner chunk goes out in pieces of about :data:`PIECE_BYTES`, checksummed as
    they pass: slices of ``data`` itself where it already is the payload, else copied into
    ``scratch`` (uint8, at least ``scratch_nbytes``; for payloads that need no copy, a writer may
    copy pieces through it: :attr:`Checked.scratch`) by ``copy``,
    which checksums them as it copies (numpy's copy, then :func:`checksum`, by default); a
    compressed one is copied whole, compressed and checksummed. A yielded part
    is only valid until the next one is asked for, so a writer writes each part as it comes.
    """
    index = np.full((geom.n_inner, 2), MISSING, dtype="<u8")
    offset = 0
    n = geom.inner_nbytes
    laid = data if isinstance(data, LaidOut) else None
    valid = laid.valid if laid is not None else tuple(int(s) for s in data.shape)  # type: ignore[union-attr]
    for i, (k, _, sl) in enumerate(geom.inner_chunks(valid)):
        whole = None if laid is None else laid.payloads[i * n:(i + 1) * n]
        if geom.compression == "zstd":
            from xckpt.format.codecs import zstd_compress
            if whole is None:
                _fill(geom, data[sl + (Ellipsis,)], geom.payload_view(scratch, 0))  # type: ignore[index]
                whole = scratch[:n]
            payload = np.frombuffer(zstd_compress(whole), dtype=np.uint8)
            size = payload.size
            yield payload
            yield _le32(checksum(payload))
        else:
            if whole is None:
                yield from _stored(geom, data[sl + (Ellipsis,)], scratch, copy)  # type: ignore[index]
            else:
                yield Checked(whole, scratch)
            size = n
        index[k] = (offset, size + _CRC)
        offset += size + _CRC
    raw_index = index.reshape(-1).view(np.uint8)
    tail = np.empty(tail_nbytes(geom, place), dtype=np.uint8)  # the tag (when tagged) and the index: one part
    index_part = tail[tail.size - geom.index_nbytes:]
    index_part[:-_CRC] = raw_index
    index_part[-_CRC:] = _le32(checksum(raw_index))
    if place is not None:
        tail[:TAG_NBYTES] = np.frombuffer(place_tag(place, index_part), dtype=np.uint8)
    yield tail


def _le32(value: int) -> np.ndarray:
    return np.frombuffer(value.to_bytes(4, "little"), dtype=np.uint8)


def encode(geom: Geometry, data: np.ndarray | LaidOut, place: bytes | None = None) -> bytes:
    """The whole object of one chunk (see :func:`encode_parts` for ``data`` and ``place``)."""
    if geom.n_inner == 1 and geom.compression == "none":
        if isinstance(data, LaidOut):
            return _encode_whole(data.payloads, place)
        if data.shape == geom.inner_shape and data.flags.c_contiguous and data.dtype.str == geom.le_dtype.str:
            return _encode_whole(data, place)
    scratch = np.empty(0 if isinstance(data, LaidOut) else geom.scratch_nbytes, dtype=np.uint8)
    return b"".join(bytes(part) for part in buffers(encode_parts(geom, data, scratch, place)))


def _encode_whole(data: np.ndarray, place: bytes | None) -> bytes:
    """:func:`encode` of an object of one uncompressed inner chunk whose data is its payload as it lies
    (a small leaf's usual object), built without the streaming machinery: the same bytes."""
    payload = data.reshape(-1).view(np.uint8)
    index = struct.pack("<QQ", 0, payload.size + _CRC)
    index += struct.pack("<I", crc32c.crc32c(index))
    tag = b"" if place is None else TAG_MAGIC + struct.pack("<I", place_crc(place, index)) + bytes(4)
    return b"".join((payload, struct.pack("<I", crc32c.crc32c(payload)), tag, index))


def tail_nbytes(geom: Geometry, place: bytes | None) -> int:
    """Bytes at the end of an object that :func:`parse_index` needs: the index, and the tag when checked."""
    return geom.index_nbytes + (TAG_NBYTES if place is not None else 0)


def parse_index(geom: Geometry, tail: bytes | np.ndarray, size: int | None, valid: tuple[int, ...], *,
                place: bytes | None = None, file: str | None = None, leaf: str | None = None) -> np.ndarray:
    """The checked ``(n, 2)`` index of an object of ``size`` bytes, from its last
    :func:`tail_nbytes` bytes (``size`` None: a store that cannot tell it without reading the object).

    Raises a specific error when the index's crc32c fails, the place tag (checked when ``place``
    is given) names another place, an entry points outside the data part of the object, the
    entries overlap or leave a gap, an uncompressed entry has the wrong size, or an inner
    chunk that intersects the array (``valid``: the chunk clipped to it) is not stored.
    """
    need_bytes = tail_nbytes(geom, place)
    known = size is not None
    if size is None:  # the largest a valid object can be
        size = geom.max_nbytes + need_bytes - geom.index_nbytes if geom.compression == "none" else 2**63 - 1
    if size < need_bytes:
        raise DataError(f"object has {size} bytes, less than its {need_bytes}-byte shard index",
                        code="chunk.truncated", file=file, leaf=leaf)
    if known and geom.compression == "none":  # an uncompressed object has at least its inner chunks' bytes: one
        # cut short is told so (its tail, read as the index, would only fail the index's crc32c)
        # (the place tag not counted: an object without one is told so by the tag check, chunk.place)
        least = math.prod(-(-v // i) for v, i in zip(valid, geom.inner_shape)) * (geom.inner_nbytes + _CRC) \
            + geom.index_nbytes
        if size < least:
            raise DataError(f"object has {size} bytes, less than the {least} of its inner chunks and index",
                            code="chunk.truncated", file=file, leaf=leaf)
    raw = tail if isinstance(tail, bytes) else tail.tobytes()
    if len(raw) != need_bytes:
        raise DataError("shard index is truncated", code="chunk.truncated", file=file, leaf=leaf)
    tag, raw = raw[:need_bytes - geom.index_nbytes], raw[need_bytes - geom.index_nbytes:]
    body = raw[:-_CRC]
    if checksum(body) != int.from_bytes(raw[-_CRC:], "little"):
        raise IntegrityError("shard index crc32c does not match", code="chunk.crc32c", file=file, leaf=leaf)
    if place is not None and tag != place_tag(place, raw):
        why = "has no place tag" if tag[:8] != TAG_MAGIC else "belongs to another place or checkpoint"
        raise IntegrityError(f"chunk object {why} (its tag does not name this object of this save)",
                             code="chunk.place", file=file, leaf=leaf)
    flat = struct.unpack(f"<{len(body) // 8}Q", body)
    _check_entries(geom, flat, valid, size - need_bytes, known, file, leaf)
    return np.frombuffer(body, dtype="<u8").reshape(-1, 2).astype(np.uint64)


def _check_entries(geom: Geometry, flat: tuple[int, ...], valid: tuple[int, ...], data_end: int, known: bool,
                   file: str | None, leaf: str | None) -> None:
    """:func:`parse_index`'s checks of the entries (``flat``: offset, size, offset, size, ...) of an index whose
    crc32c matched, against the object's ``data_end`` data bytes (exact when ``known``). Plain Python: an
    object holds a few inner chunks, and numpy's cost per call is many times theirs."""
    offs, lens = flat[0::2], flat[1::2]
    present = [k for k, (o, n) in enumerate(zip(offs, lens)) if o != MISSING or n != MISSING]
    if len(present) < len(offs):
        need = geom.needed(valid)
        kept = set(present)
        lost = [k for k in range(len(offs)) if need[k] and k not in kept]
        if lost:
            raise DataError(f"inner chunk {lost[0]} is missing from the shard", code="chunk.missing",
                            file=file, leaf=leaf)
        offs, lens = [offs[k] for k in present], [lens[k] for k in present]
    if any(n < _CRC or o > data_end or n > data_end - o for o, n in zip(offs, lens)):
        raise DataError(f"an inner chunk lies outside the {data_end} data bytes of the object",
                        code="chunk.truncated", file=file, leaf=leaf)
    exact = geom.inner_nbytes + _CRC
    if geom.compression == "none" and any(n != exact for n in lens):
        raise DataError(f"an inner chunk does not have the {exact} bytes of an uncompressed one",
                        code="chunk.truncated" if min(lens) < exact else "chunk.size", file=file, leaf=leaf)
    spans = sorted(zip(offs, lens))  # by offset (ties: either order fails below)
    end = 0
    for k, (o, n) in enumerate(spans):
        if k and o < end:
            raise DataError("two inner chunks of the shard overlap", code="chunk.overlap", file=file, leaf=leaf)
        end = o + n
    at = 0
    for o, n in spans:
        if o != at:
            break
        at = o + n
    else:
        if not known or at == data_end:
            return
    raise DataError(f"the inner chunks leave a gap in the {data_end} data bytes of the object", code="chunk.gap",
                    file=file, leaf=leaf)


def check_inner(encoded: np.ndarray, crc: int, *, file: str | None = None, leaf: str | None = None) -> None:
    """Refuse an encoded inner chunk (uint8) whose payload's crc32c, ``crc`` (taken by the caller, perhaps as
    it copied the payload), is not the one stored after it."""
    if crc != int.from_bytes(encoded[-_CRC:].tobytes(), "little"):
        raise IntegrityError("inner chunk crc32c does not match", code="chunk.crc32c", file=file, leaf=leaf)


def open_inner(geom: Geometry, encoded: np.ndarray, *, file: str | None = None,
               leaf: str | None = None) -> np.ndarray:
    """The payload of one encoded inner chunk (uint8), its crc32c checked (and zstd undone)."""
    payload = encoded[:-_CRC]
    check_inner(encoded, checksum(payload), file=file, leaf=leaf)
    if geom.compression == "zstd":
        from xckpt.format.codecs import zstd_decompress
        try:
            payload = np.frombuffer(zstd_decompress(payload, geom.inner_nbytes), dtype=np.uint8)
        except XckptError as exc:
            raise DataError(exc.message, code=exc.code, file=file, leaf=leaf) from None
    if payload.size != geom.inner_nbytes:
        raise DataError(f"inner chunk holds {payload.size} bytes, expected {geom.inner_nbytes}",
                        code="chunk.truncated", file=file, leaf=leaf)
    return payload
