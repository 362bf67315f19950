"""The copies of xckpt/engine/hostcopy.py and its compiled helper: the streaming copy of asynchronous
saves and loads, the same bytes as numpy's copy for every shape, stride, dtype, alignment and size it
takes or passes on; the checksumming copy of synchronous saves, the same bytes and the same crc32c as
numpy's copy followed by the crc32c package."""

from __future__ import annotations

import os
import platform
import shutil
import sysconfig

import crc32c
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.engine import hostcopy
from xckpt.format import shard

native = pytest.mark.skipif(not hostcopy.available(), reason="the streaming copy was not built (no C compiler)")
native_crc = pytest.mark.skipif(not hostcopy.crc_available(),
                                reason="the checksumming copy was not built, or this processor lacks SSE4.2/PCLMULQDQ")


def test_built_where_a_compiler_is():
    """The package's install builds the helper wherever a C compiler and Python's headers are found
    (CI's machine has both); on x86-64 it checksums as it copies where the processor has SSE4.2 and
    PCLMULQDQ, and only there."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no C compiler or no Python headers here")
    assert hostcopy.available()
    flags = set()
    if platform.machine() == "x86_64" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    assert not flags or hostcopy.crc_available() == ({"sse4_2", "pclmulqdq"} <= flags)


DTYPES = [np.uint8, np.int16, np.float32, np.float64, ml_dtypes.bfloat16, np.complex64]


@st.composite
def copies(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """A source view (sliced, transposed, maybe reversed) of random data and an empty destination of
    its shape, itself a view at a random byte offset (unaligned) of a bigger buffer, maybe transposed."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    shape = shape[:-1] + (draw(st.sampled_from([1, 3, 64, 100, 257, 1030])),)  # runs under and over a line, odd
    base = np.random.default_rng(draw(st.integers(0, 99))).integers(0, 256, (int(np.prod(shape)) + 8) * dtype.itemsize,
                                                                     dtype=np.uint8)
    src = base[:int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
    if ndim > 1 and draw(st.booleans()):
        order = draw(st.permutations(range(ndim - 1))) + [ndim - 1]  # last dimension stays contiguous
        src = src.transpose(order)
    if draw(st.booleans()):
        src = src[tuple(slice(None, None, draw(st.sampled_from([1, -1]))) for _ in range(ndim - 1))]
    offset = draw(st.integers(0, 63))
    raw = np.full(src.nbytes + offset + 64, 0xAB, dtype=np.uint8)
    dst = raw[offset:offset + src.nbytes].view(dtype).reshape(src.shape)
    return dst, src


@native
@settings(max_examples=300, deadline=None)
@given(copies())
def test_native_copy_is_numpy_copy(case: tuple[np.ndarray, np.ndarray]):
    """The compiled copy itself, on any shape (merging contiguous dimensions into runs), stride (negative
    too), alignment and run length: every byte as numpy copies it, and nothing written outside ``dst``."""
    dst, src = case
    outside = dst.base.copy() if dst.base is not None else None
    hostcopy._native.copy(dst.__array_interface__["data"][0], src.__array_interface__["data"][0], dst.shape,
                          dst.strides, src.strides, dst.itemsize)
    assert np.array_equal(dst.view(np.uint8), src.view(np.uint8))
    if outside is not None:
        lo = dst.__array_interface__["data"][0] - dst.base.__array_interface__["data"][0]
        rest = np.concatenate([dst.base[:lo], dst.base[lo + dst.nbytes:]])
        assert np.array_equal(rest, np.concatenate([outside[:lo], outside[lo + dst.nbytes:]]))


@settings(max_examples=150, deadline=None)
@given(copies(), st.booleans())
def test_stream_copy_is_numpy_copy(case: tuple[np.ndarray, np.ndarray], swap: bool):
    """stream_copy: the compiled copy where it applies, numpy's elsewhere (a byte-swapped source, a
    strided last dimension, a small array), element for element the result of numpy.copyto."""
    dst, src = case
    if swap and src.dtype.kind in "iuf" and src.dtype.itemsize > 1 and src.dtype != ml_dtypes.bfloat16:
        src = src.astype(src.dtype.newbyteorder(">"))  # equivalent casting: numpy swaps it
    want = np.empty_like(dst)
    np.copyto(want, src, casting="equiv")
    hostcopy.stream_copy(dst, src)
    assert np.array_equal(dst.view(np.uint8), want.view(np.uint8))


def test_stream_copy_of_a_strided_last_dimension_and_an_overlap():
    """A last dimension that is not contiguous, and arrays that overlap, are copied by numpy, correctly."""
    a = np.arange(40000, dtype=np.float32).reshape(200, 200)
    dst = np.empty((200, 100), np.float32)
    hostcopy.stream_copy(dst, a[:, ::2])
    assert np.array_equal(dst, a[:, ::2])
    b = np.arange(100000, dtype=np.float64)
    want = b[:-10].copy()
    hostcopy.stream_copy(b[10:], b[:-10])  # overlapping: numpy.copyto's result
    assert np.array_equal(b[10:], want)


@pytest.mark.parametrize("ndim", [33, 64])
def test_stream_copy_of_many_dimensions(ndim: int):
    """Up to numpy's 64 dimensions, transposed, the copy is numpy's; lay_out of a chunk of over 32
    dimensions (whose split view numpy could not make) copies inner chunk by inner chunk, alike."""
    a = np.random.default_rng(1).random((2,) * 3 + (1,) * (ndim - 4) + (20000,), dtype=np.float32)
    src = a.transpose((2, 0, 1) + tuple(range(3, ndim)))
    dst = np.empty(src.shape, np.float32)
    hostcopy.stream_copy(dst, src)
    assert np.array_equal(dst, src)
    g = shard.Geometry((4,) + (1,) * (ndim - 2) + (20000,), (2,) + (1,) * (ndim - 2) + (10000,), np.dtype(np.float32))
    data = np.random.default_rng(2).random(g.chunk_shape, dtype=np.float32)
    bufs = [np.empty(shard.laid_nbytes(g, g.chunk_shape), dtype=np.uint8) for _ in range(2)]
    assert np.array_equal(shard.lay_out(g, data, bufs[0]).payloads,
                          shard.lay_out(g, data, bufs[1], hostcopy.stream_copy).payloads)


def test_stream_copy_refuses_what_numpy_refuses():
    """A copy numpy would refuse (shapes that do not broadcast, an unsafe cast) raises the same way."""
    with pytest.raises(ValueError):
        hostcopy.stream_copy(np.empty((300, 300), np.float32), np.empty((300, 299), np.float32))
    with pytest.raises(TypeError):
        hostcopy.stream_copy(np.empty((300, 300), np.float32), np.empty((300, 300), np.float64))


@st.composite
def checksummed_copies(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """A source view (a slice of a wider array, so its rows are runs apart; maybe transposed or
    reversed; maybe contiguous, merged into one run) whose runs fall in each of the helper's three
    ways (one lane under 64 bytes, three runs at a time, three lanes within runs of 12 KiB and more,
    with any remainder of runs), a C-contiguous destination at a random byte offset, a crc to go on from."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ndim = draw(st.integers(1, 3))
    outer = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim - 1, max_size=ndim - 1)))
    last = draw(st.sampled_from([1, 3, 7, 8, 15, 16, 17, 100, 1030, 1536, 1540, 3100, 6200]))
    wide = last + draw(st.sampled_from([0, 0, 1, 5]))  # 0: rows contiguous, merged into longer runs
    base = np.random.default_rng(draw(st.integers(0, 99))).integers(
        0, 256, int(np.prod(outer + (wide,))) * dtype.itemsize, dtype=np.uint8)
    src = base.view(dtype).reshape(outer + (wide,))[..., :last]
    if ndim > 2 and draw(st.booleans()):
        src = src.transpose(list(draw(st.permutations(range(ndim - 1)))) + [ndim - 1])
    if ndim > 1 and draw(st.booleans()):
        src = src[tuple(slice(None, None, draw(st.sampled_from([1, -1]))) for _ in range(ndim - 1))]
    offset = draw(st.integers(0, 63))
    raw = np.full(src.nbytes + offset + 64, 0xAB, dtype=np.uint8)
    dst = raw[offset:offset + src.nbytes].view(dtype).reshape(src.shape)
    return dst, src, draw(st.sampled_from([0, 1, 0xFFFFFFFF, 0x1234ABCD]))


def _copied_and_crc(dst: np.ndarray, src: np.ndarray, crc: int) -> tuple[np.ndarray, int]:
    """What the checksumming copy must give: numpy's copy, and the crc32c package's checksum of it."""
    want = np.empty(dst.shape, dst.dtype)
    np.copyto(want, src, casting="equiv")
    return want, crc32c.crc32c(want.reshape(-1).view(np.uint8), crc)


@native_crc
@settings(max_examples=300, deadline=None)
@given(checksummed_copies())
def test_native_copy_crc_is_a_copy_and_its_crc32c(case: tuple[np.ndarray, np.ndarray, int]):
    """The compiled checksumming copy itself, at any size (no lower bound): every byte as numpy copies
    it, the crc32c the crc32c package takes of them, and nothing written outside ``dst``."""
    dst, src, crc = case
    want, want_crc = _copied_and_crc(dst, src, crc)
    outside = dst.base.copy()
    got = hostcopy._native.copy_crc(dst.__array_interface__["data"][0], src.__array_interface__["data"][0],
                                    src.shape, src.strides, src.itemsize, crc)
    assert got == want_crc
    assert np.array_equal(dst.view(np.uint8), want.view(np.uint8))
    lo = dst.__array_interface__["data"][0] - dst.base.__array_interface__["data"][0]
    assert np.array_equal(dst.base[:lo], outside[:lo]) and np.array_equal(dst.base[lo + dst.nbytes:],
                                                                          outside[lo + dst.nbytes:])


@settings(max_examples=100, deadline=None)
@given(checksummed_copies(), st.booleans())
def test_copy_checksum_is_a_copy_and_its_crc32c(case: tuple[np.ndarray, np.ndarray, int], swap: bool):
    """copy_checksum: the compiled copy where it applies, numpy's copy and the crc32c package elsewhere
    (a byte-swapped source, a small array, no helper): the same bytes and crc32c either way."""
    dst, src, crc = case
    if swap and src.dtype.kind in "iuf" and src.dtype.itemsize > 1 and src.dtype != ml_dtypes.bfloat16:
        src = src.astype(src.dtype.newbyteorder(">"))
    want, want_crc = _copied_and_crc(dst, src, crc)
    assert hostcopy.copy_checksum(dst, src, crc) == want_crc
    assert np.array_equal(dst.view(np.uint8), want.view(np.uint8))


@native_crc
@settings(max_examples=200, deadline=None)
@given(checksummed_copies(), st.integers(1, 7))
def test_native_copy_crc_write_writes_the_copy_then_its_crc32c(case: tuple[np.ndarray, np.ndarray, int],
                                                               block_rows: int):
    """The compiled copy-checksum-write of one inner chunk, into a real file: the source's bytes in C order,
    block by block through a buffer of one block and the crc32c (several blocks, a last one shorter, one
    block alone), then the crc32c of them all (u32 LE), and that crc32c returned."""
    import tempfile

    _, src, _ = case
    want, want_crc = _copied_and_crc(np.empty(src.shape, src.dtype), src, 0)
    rows = min(block_rows, src.shape[0])
    scratch = np.empty(rows * (src.nbytes // src.shape[0]) + 4, dtype=np.uint8)
    with tempfile.TemporaryFile() as f:
        got = hostcopy._native.copy_crc_write(f.fileno(), scratch.__array_interface__["data"][0], scratch.nbytes,
                                              src.__array_interface__["data"][0], src.shape, src.strides,
                                              src.itemsize, block_rows)
        f.seek(0)
        written = f.read()
    assert got == want_crc
    assert written == want.tobytes() + want_crc.to_bytes(4, "little")


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 20), st.integers(0, 1 << 40), st.integers(0, 8191))
def test_page_view_lies_within_a_page_as_its_file_position(nbytes: int, position: int, at: int):
    """A page view of a page buffer (at any address) starts where the file position starts within a page, so
    the kernel's copy between them is never skewed; skewed() is the destination 1 to 31 bytes past the source
    within a page."""
    raw = np.empty(nbytes + hostcopy.PAGE_BYTES + 8192, dtype=np.uint8)
    buf = raw[at:at + nbytes + hostcopy.PAGE_BYTES]
    view = hostcopy.page_view(buf, nbytes, position)
    assert view.size == nbytes and np.shares_memory(view, buf)
    assert (view.ctypes.data - position) % hostcopy.PAGE_BYTES == 0
    assert view.ctypes.data + nbytes <= buf.ctypes.data + buf.size
    assert not hostcopy.skewed(view.ctypes.data, position) and not hostcopy.skewed(position, view.ctypes.data)
    for d in (0, 1, 31, 32, 4095, 4096, 4097, 4127, 4128):
        assert hostcopy.skewed(position + d, position) == (d % 4096 in range(1, 32))


def _prefixed_file(tmp_path, prefix: int):
    """A file open for writing at position ``prefix`` (that many bytes written before)."""
    f = open(tmp_path / f"f{prefix}", "w+b")
    f.write(b"\x5a" * prefix)
    f.flush()
    return f


@native_crc
@settings(max_examples=100, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 4095), st.integers(1, 7), st.integers(0, 99))
def test_native_copy_crc_write_places_each_block_within_a_page_as_its_file_position(
        tmp_path_factory, prefix: int, at: int, block_rows: int, seed: int):
    """Given a page to spare, the compiled copy-checksum-write copies each block to where the buffer lies
    within a page as the block's file position (the kernel's copy then runs at full speed), wherever the file
    and the buffer start: the bytes written are the same, and the last block and the crc32c are found in the
    buffer at that place."""
    tmp_path = tmp_path_factory.mktemp("w")
    src = np.random.default_rng(seed).integers(0, 1 << 30, (29, 300), dtype=np.int32)[:, 7:263]
    want, want_crc = _copied_and_crc(np.empty(src.shape, src.dtype), src, 0)
    row = src.shape[1] * 4
    raw = np.zeros(block_rows * row + 4 + hostcopy.PAGE_BYTES + 4096, dtype=np.uint8)
    scratch = raw[at:at + block_rows * row + 4 + hostcopy.PAGE_BYTES]
    with _prefixed_file(tmp_path, prefix) as f:
        got = hostcopy._native.copy_crc_write(f.fileno(), scratch.ctypes.data, scratch.nbytes, src.ctypes.data,
                                              src.shape, src.strides, 4, block_rows)
        f.seek(0)
        written = f.read()
    assert got == want_crc
    assert written == b"\x5a" * prefix + want.tobytes() + want_crc.to_bytes(4, "little")
    last_rows = src.shape[0] - (src.shape[0] - 1) // block_rows * block_rows
    last_at = prefix + (src.shape[0] - last_rows) * row  # the last block's file position
    start = (last_at - scratch.ctypes.data) % hostcopy.PAGE_BYTES
    assert scratch[start:start + last_rows * row + 4].tobytes() == written[last_at:]


@native_crc
@settings(max_examples=150, deadline=None)
@given(st.integers(0, 5000), st.sampled_from([0, 1, 4, 16, 31, 32, 2048]), st.integers(0, 4095),
       st.sampled_from([1000, 4096, 12289, 40000, shard.PIECE_BYTES + 5000]),
       st.sampled_from([0, 3000, shard.PIECE_BYTES + hostcopy.PAGE_BYTES]))
def test_native_crc_write_copies_a_skewed_piece_through_the_scratch_buffer(
        tmp_path_factory, prefix: int, skew: int, scratch_at: int, nbytes: int, room: int):
    """Given a scratch buffer, the compiled checksum-and-write copies each piece (of ``PIECE_BYTES``) that lies
    where the kernel would copy it slowly (skewed against its file position) into the buffer, placed within a
    page as that position (at the buffer's start where it has no page to spare, if that lies well), and writes
    it from there; a piece that lies well, or that the buffer cannot hold, is written as it lies. The bytes
    written are the same every way, and nothing is written outside the buffer."""
    tmp_path = tmp_path_factory.mktemp("w")
    raw = np.random.default_rng(prefix).integers(0, 256, nbytes + 8192, dtype=np.uint8)
    payload_at = (prefix - skew - raw.ctypes.data) % hostcopy.PAGE_BYTES  # the first piece this far skewed
    payload = raw[payload_at:payload_at + nbytes]
    assert (prefix - payload.ctypes.data) % hostcopy.PAGE_BYTES == skew
    outer = np.full(room + 4096 + 128, 0xEE, dtype=np.uint8)
    scratch = outer[64 + scratch_at:64 + scratch_at + room]
    with _prefixed_file(tmp_path, prefix) as f:
        got = hostcopy.write_checked(f.fileno(), shard.Checked(payload, scratch))
        f.seek(0)
        written = f.read()
    want = crc32c.crc32c(payload.tobytes())
    assert got and written == b"\x5a" * prefix + payload.tobytes() + want.to_bytes(4, "little")
    assert (outer[:64 + scratch_at] == 0xEE).all() and (outer[64 + scratch_at + room:] == 0xEE).all()
    moved = []  # where each piece that went through the buffer lies in it, as the test works it out
    for a in range(0, nbytes, shard.PIECE_BYTES):
        n, position = min(shard.PIECE_BYTES, nbytes - a), prefix + a
        if not hostcopy.skewed(position, payload.ctypes.data + a) or n > room:
            continue
        start = (position - scratch.ctypes.data) % hostcopy.PAGE_BYTES
        if start + n > room:
            start = 0
            if hostcopy.skewed(position, scratch.ctypes.data):
                continue
        moved.append((start, a, n))
    if not moved:
        assert (scratch == 0xEE).all()
        assert not (0 < skew < 32 and room >= min(nbytes, shard.PIECE_BYTES) + hostcopy.PAGE_BYTES)
    else:
        start, a, n = moved[-1]
        assert scratch[start:start + n].tobytes() == payload[a:a + n].tobytes()


@native_crc
def test_native_copy_crc_write_refuses_a_short_buffer_and_reports_a_failed_write(tmp_path):
    """A buffer without room for a block and the crc32c is refused before anything is copied; a write
    that fails raises OSError with its errno (a descriptor open for reading only: EBADF)."""
    import errno

    src = np.arange(64 * 40, dtype=np.float32).reshape(64, 40)
    scratch = np.empty(16 * 160 + 3, dtype=np.uint8)
    with pytest.raises(ValueError, match="less than a block"):
        hostcopy._native.copy_crc_write(1, scratch.__array_interface__["data"][0], scratch.nbytes,
                                        src.__array_interface__["data"][0], src.shape, src.strides, 4, 16)
    (tmp_path / "f").write_bytes(b"")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            hostcopy.write_copied(fd, shard.Copied(src[:, :32], np.empty(16 * 128 + 4, np.uint8), 16,
                                                   np.dtype("<f4"), hostcopy.copy_checksum))
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)


@native_crc
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40000), st.sampled_from([1, 7, 8, 4096, 12288, 12289, 1 << 20]), st.integers(0, 15),
       st.integers(0, 99))
def test_native_crc_write_writes_the_bytes_then_their_crc32c(nbytes: int, piece: int, offset: int, seed: int):
    """The compiled checksum-and-write of bytes already laid out, into a real file: the bytes as they lie,
    piece by piece (one lane, and three lanes from 12 KiB, with remainders of any length, at any
    alignment), then the crc32c of all (u32 LE), and that crc32c returned."""
    import tempfile

    raw = np.random.default_rng(seed).integers(0, 256, nbytes + offset, dtype=np.uint8)
    payload = raw[offset:]
    with tempfile.TemporaryFile() as f:
        got = hostcopy._native.crc_write(f.fileno(), payload.__array_interface__["data"][0], payload.nbytes, piece)
        f.seek(0)
        written = f.read()
    want = crc32c.crc32c(payload.tobytes())
    assert got == want
    assert written == payload.tobytes() + want.to_bytes(4, "little")


@native_crc
def test_native_crc_write_refuses_bad_sizes_and_reports_a_failed_write(tmp_path):
    """A piece of no bytes or a negative size is refused; a write that fails raises OSError with its errno."""
    import errno

    payload = np.arange(100000, dtype=np.uint8)
    addr = payload.__array_interface__["data"][0]
    for nbytes, piece in ((100, 0), (-1, 8)):
        with pytest.raises(ValueError):
            hostcopy._native.crc_write(1, addr, nbytes, piece)
    (tmp_path / "f").write_bytes(b"")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            hostcopy.write_checked(fd, shard.Checked(payload))
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)


@pytest.mark.parametrize("swap", [False, True])
def test_a_local_store_writes_the_pieces_of_a_copied_part(tmp_path, swap: bool):
    """A local store writes exactly the bytes a Copied part's pieces hold: in the compiled call, or, for a
    byte-swapped source the helper does not take (write_copied declines, writing nothing), piece by piece."""
    from xckpt.engine.storage import LocalStore

    src = np.random.default_rng(9).random((300, 1000), dtype=np.float32)[:, 100:900]
    if swap:
        src = src.astype(">f4")
    part = shard.Copied(src, np.empty(64 * 3200 + 4, np.uint8), 64, np.dtype("<f4"), hostcopy.copy_checksum)
    want = b"".join(bytes(p) for p in part.pieces())
    with open(tmp_path / "direct", "wb") as f:
        took = hostcopy.write_copied(f.fileno(), part)
    assert took == (hostcopy.crc_available() and not swap)
    assert (tmp_path / "direct").read_bytes() == (want if took else b"")
    store = LocalStore(str(tmp_path / "store"), create=True)
    store.write("o", [part])
    store.close()
    assert (tmp_path / "store" / "o").read_bytes() == want
    payload = np.ascontiguousarray(src, dtype="<f4").tobytes()
    assert want == payload + crc32c.crc32c(payload).to_bytes(4, "little")


def test_copy_checksum_of_a_strided_last_dimension():
    """A source whose last dimension is not contiguous is copied by numpy, then checksummed: the same."""
    a = np.random.default_rng(4).random((300, 400), dtype=np.float32)
    dst = np.empty((300, 200), np.float32)
    assert hostcopy.copy_checksum(dst, a[:, ::2], 7) == crc32c.crc32c(np.ascontiguousarray(a[:, ::2]).view(np.uint8), 7)
    assert np.array_equal(dst, a[:, ::2])


@pytest.mark.parametrize("chunk,inner,valid", [((832, 3328), (832, 832), (832, 3328)),
                                               ((384, 96, 9), (128, 32, 9), (300, 70, 9)),
                                               ((4096, 600), (2048, 600), (4096, 600)),
                                               ((64, 70000), (64, 35000), (50, 70000))])
def test_encode_parts_with_the_checksumming_copy(chunk: tuple[int, ...], inner: tuple[int, ...],
                                                 valid: tuple[int, ...]):
    """A synchronous save's objects (encode_parts with the checksumming copy, as the writer calls it)
    are byte for byte those of numpy's copy and the crc32c package: W1's geometry, inner chunks of
    several blocks, rows of over 12 KiB, zero-padded edge chunks, and a source that is a view."""
    g = shard.Geometry(chunk, inner, np.dtype(np.float32))
    wide = np.random.default_rng(5).random(valid[:-1] + (valid[-1] + 3,), dtype=np.float32)
    data = wide[..., 1:valid[-1] + 1]
    objects = []
    for copy in (shard.copy_then_checksum, hostcopy.copy_checksum):
        scratch = np.empty(g.scratch_nbytes, dtype=np.uint8)
        objects.append(b"".join(bytes(p) for p in shard.buffers(shard.encode_parts(g, data, scratch, b"gen\0name",
                                                                                    copy))))
    assert objects[0] == objects[1]
    shard.parse_index(g, np.frombuffer(objects[1][-shard.tail_nbytes(g, b"gen\0name"):], np.uint8),
                      len(objects[1]), valid, place=b"gen\0name")


@pytest.mark.parametrize("chunk,inner,valid", [((832, 3328), (832, 832), (832, 3328)),
                                               ((384, 96, 9), (128, 32, 9), (300, 70, 9))])
def test_lay_out_with_the_streaming_copy(chunk: tuple[int, ...], inner: tuple[int, ...], valid: tuple[int, ...]):
    """An asynchronous save's staging (lay_out with the streaming copy) stores the same bytes as the
    ordinary one, whole inner chunks and zero-padded edge chunks alike."""
    g = shard.Geometry(chunk, inner, np.dtype(np.float32))
    data = np.random.default_rng(0).random(valid, dtype=np.float32)
    bufs = [np.full(shard.laid_nbytes(g, valid), 0xAB, dtype=np.uint8) for _ in range(2)]
    a = shard.lay_out(g, data, bufs[0])
    b = shard.lay_out(g, data, bufs[1], hostcopy.stream_copy)
    assert a.valid == b.valid and np.array_equal(a.payloads, b.payloads)


def test_a_load_reads_around_outputs_the_kernel_would_copy_into_slowly(tmp_path, monkeypatch):
    """Inner chunks an output needs whole and contiguous are read straight into it, except where the output
    lies skewed against the chunk's file position (the kernel copies into it three times slower): those go
    through the thread's buffer, placed within a page as the file's bytes. At every placement of the output
    within a page, both ways give the stored values element by element, each inner chunk taking the way
    skewed() says."""
    from xckpt.engine import read
    from xckpt.engine.read import ReadRequest
    from xckpt.format.regions import Region
    from xckpt.sources.detect import open_checkpoint

    a = np.random.default_rng(5).random(1 << 18, dtype=np.float32)
    xckpt.save({"a": a}, str(tmp_path / "c"), inner_chunk_bytes=64 << 10)
    direct: list[int] = []
    real = read._read_direct

    def counted(blob, off, nbytes, out, geom):
        direct.append(off)
        return real(blob, off, nbytes, out, geom)

    monkeypatch.setattr(read, "_read_direct", counted)
    ckpt = open_checkpoint(tmp_path / "c")
    try:
        (e,) = ckpt.manifest.leaves
        (stored,) = e.arrays()
        n, per_object = stored.inner_chunk_shape[0], stored.chunk_shape[0] // stored.inner_chunk_shape[0]
        count = a.size // n
        assert count >= 8 and per_object >= 4, (stored.chunk_shape, stored.inner_chunk_shape)
        raw = np.empty(a.nbytes + 2 * hostcopy.PAGE_BYTES, dtype=np.uint8)
        for shift in range(0, 128, 4):
            start = (-raw.ctypes.data) % hostcopy.PAGE_BYTES + shift
            out = raw[start:start + a.nbytes].view(np.float32)
            out[...] = np.nan
            direct.clear()
            ckpt.read([ReadRequest(e, Region.full(a.shape), out)])
            np.testing.assert_array_equal(out, a)
            # inner chunk k: at byte k * n * 4 of the output, at file position (k % per_object) * (n * 4 + 4)
            want = [k % per_object * (n * 4 + 4) for k in range(count)
                    if not hostcopy.skewed(out.ctypes.data + k * n * 4, k % per_object * (n * 4 + 4))]
            assert sorted(direct) == sorted(want), shift
            if 4 <= shift < 32:
                assert len(want) < count  # some went through the buffer
    finally:
        ckpt.close()


def test_a_load_copies_parts_of_inner_chunks_alike(tmp_path):
    """A load copies the parts of inner chunks a region cuts through into the caller's array with the
    streaming copy: a region at odd offsets, and a whole array, equal the saved one element by element."""
    a = np.random.default_rng(3).random((2048, 2048), dtype=np.float32)
    xckpt.save({"a": a}, str(tmp_path / "c"))
    region = (slice(3, 2001), slice(517, 1999))
    part = xckpt.load(str(tmp_path / "c"), like={"a": xckpt.ReadSpec(region=region)})["a"]
    assert np.array_equal(part, a[region])
    assert np.array_equal(xckpt.load(str(tmp_path / "c"))["a"], a)


def _root(a: np.ndarray) -> np.ndarray:
    """The array whose memory ``a`` views."""
    while a.base is not None:
        a = a.base
    return a


def _like(strided: np.ndarray, buf: np.ndarray, shift: int) -> np.ndarray:
    """A view of ``buf`` (uint8, at least ``shift`` + 8 bytes longer than ``strided``'s :func:`_root`) laid out
    as ``strided`` lies in its memory, moved ``shift`` bytes."""
    assert buf.size >= _root(strided).nbytes + shift + 8
    at = shift + strided.__array_interface__["data"][0] - _root(strided).__array_interface__["data"][0]
    return np.lib.stride_tricks.as_strided(buf[at:at + strided.itemsize].view(strided.dtype), strided.shape,
                                           strided.strides)


def _filled(a: np.ndarray, seed: int) -> np.ndarray:
    """``a`` (C-contiguous) filled with random bytes."""
    a.reshape(-1).view(np.uint8)[...] = np.random.default_rng(seed).integers(0, 256, a.nbytes, dtype=np.uint8)
    return a


@native_crc
@settings(max_examples=300, deadline=None)
@given(checksummed_copies(), st.integers(0, 8))
def test_native_crc_copy_is_a_copy_and_the_crc32c_of_its_source(case: tuple[np.ndarray, np.ndarray, int],
                                                                 shift: int):
    """The load's mirror of the checksumming copy: a C-contiguous source (an inner chunk just read) copied into
    a strided destination (the strategy's strided view, moved ``shift`` bytes: streaming stores only where every
    run starts 8-byte aligned) at every run length the helper splits three ways, the crc32c of the source's
    bytes returned, and no byte of the destination's buffer written but its elements'."""
    contiguous, strided, crc = case
    src = _filled(contiguous, crc & 0xFF)
    buf = np.random.default_rng(shift).integers(0, 256, _root(strided).nbytes + 16, dtype=np.uint8)
    want = buf.copy()
    _like(strided, want, shift)[...] = src
    dst = _like(strided, buf, shift)
    got = hostcopy._native.crc_copy(dst.__array_interface__["data"][0], src.__array_interface__["data"][0],
                                    dst.shape, dst.strides, dst.itemsize, crc)
    assert got == crc32c.crc32c(src.tobytes(), crc)
    assert np.array_equal(buf, want)


@settings(max_examples=100, deadline=None)
@given(checksummed_copies(), st.booleans())
def test_checksum_copy_is_a_copy_and_the_crc32c_of_its_source(case: tuple[np.ndarray, np.ndarray, int],
                                                              compiled: bool):
    """checksum_copy: the compiled pass where it applies, else the crc32c package and the streaming copy (a
    small array, no helper, or ``compiled`` False): the same values and crc32c either way."""
    contiguous, strided, _ = case
    src = _filled(contiguous, 7)
    dst = _like(strided, np.zeros(_root(strided).nbytes + 16, dtype=np.uint8), 0)
    real = hostcopy._NATIVE_CRC
    try:
        hostcopy._NATIVE_CRC = real and compiled
        assert hostcopy.checksum_copy(dst, src) == crc32c.crc32c(src.tobytes())
    finally:
        hostcopy._NATIVE_CRC = real
    assert np.array_equal(dst.view(np.uint8), src.view(np.uint8))


def test_a_load_checks_an_inner_chunk_it_copies_whole_into_a_strided_output(tmp_path, monkeypatch):
    """Inner chunks a resharded load copies whole into its output (a block of columns of each row, not
    contiguous) are checksummed as they are copied: the values equal the saved ones element by element, and a
    payload byte changed on disk fails the load with chunk.crc32c, naming the object and the leaf."""
    from xckpt.engine import read
    from xckpt.engine.read import ReadRequest
    from xckpt.errors import IntegrityError
    from xckpt.format.regions import Region
    from xckpt.sources.detect import open_checkpoint

    a = np.random.default_rng(11).random((256, 1024), dtype=np.float32)
    xckpt.save({"a": a}, str(tmp_path / "c"), inner_chunk_bytes=64 << 10)
    ckpt = open_checkpoint(tmp_path / "c")
    try:
        (e,) = ckpt.manifest.leaves
        (stored,) = e.arrays()
        rows, cols = stored.inner_chunk_shape
        assert cols < a.shape[1], stored.inner_chunk_shape  # an inner chunk is a block of columns
        out = np.full((256, 2048), np.nan, np.float32)[:, 512:1536]
        copied: list[int] = []
        real = read.checksum_copy
        monkeypatch.setattr(read, "checksum_copy", lambda d, s: copied.append(s.size) or real(d, s))
        ckpt.read([ReadRequest(e, Region.full(a.shape), out)])
        monkeypatch.undo()
        np.testing.assert_array_equal(out, a)
        assert len(copied) == (256 // rows) * (1024 // cols) and set(copied) == {rows * cols}
    finally:
        ckpt.close()
    name = f"{stored.path}/c/0/0"
    path = tmp_path / "c" / name
    data = bytearray(path.read_bytes())
    data[100] ^= 0x40
    path.write_bytes(bytes(data))
    ckpt = open_checkpoint(tmp_path / "c")
    try:
        with pytest.raises(IntegrityError) as info:
            ckpt.read([ReadRequest(e, Region.full(a.shape), np.empty((256, 2048), np.float32)[:, 512:1536])])
    finally:
        ckpt.close()
    assert info.value.code == "chunk.crc32c" and info.value.file.endswith(name) and info.value.leaf == "a"
