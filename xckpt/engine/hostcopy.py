"""Copies of array data on its way to and from storage: streaming stores, and a copy that checksums.

An asynchronous save copies the whole state into host buffers before it returns, and its
background writer reads them long after; a load copies each inner chunk it read into the
caller's arrays, which the training loop reads later. Ordinary stores read each destination
cache line before writing it and push the training loop's data out of the cache; streaming
(non-temporal) stores write around the cache. The compiled helper (``_hostcopy.c``, built with
the package where a C compiler is found) does that; without it, or for arrays it does not take,
:func:`stream_copy` is ``numpy.copyto``. The result is the same.

A synchronous save copies each block of a chunk into a small buffer, in the order the object
stores it, and takes the block's crc32c before writing it: :func:`copy_checksum` does both in one
pass over the source with the same helper (crc32c on three lanes of the SSE4.2 instruction; rows a
stride apart prefetched ahead, which the processor does not do for them), where
the processor has it; else it copies, then checksums (:func:`xckpt.format.shard.checksum`). Into a
local file, :func:`write_copied` runs that loop over a whole inner chunk in one compiled call, the
writes included, so no Python runs between its blocks; :func:`write_checked` does the same for an
inner chunk already laid out as stored (an asynchronous save's staged copy), checksumming each piece
just before it writes it. A load's mirror, :func:`checksum_copy`, copies an inner chunk it read into
the caller's array and checksums it in the same pass.
"""

from __future__ import annotations

import numpy as np

from xckpt.format import shard

try:
    from xckpt.engine import _hostcopy as _native
except ImportError:  # built without a C compiler: numpy copies
    _native = None

#: Below this many bytes the ordinary copy is as fast.
MIN_BYTES = 1 << 16
#: Bytes in a page of the kernel's page cache: ``read`` and ``write`` of a file copy between it and
#: the caller's buffer, and how fast depends on where the buffer starts within a page (:func:`skewed`).
PAGE_BYTES = 4096
#: The kernel's copy of file data (``rep movsb``) runs about three times slower when its destination
#: starts 1 to 31 bytes past its source, counted within a page (AMD EPYC, measured: 2.0 GB/s from
#: the page cache of a tmpfs file into a buffer skewed so, 6.5 GB/s otherwise; writes alike).
SKEW_BYTES = 32
#: The most dimensions the compiled copy takes (numpy's limit).
MAX_DIMS = 64


#: Whether the helper checksums as it copies (built, on a processor with SSE4.2 and PCLMULQDQ).
_NATIVE_CRC = _native is not None and bool(_native.CRC32C)


def skewed(dst: int, src: int) -> bool:
    """Whether the kernel copies slowly from ``src`` to ``dst`` (a memory address, or a file's position):
    the destination starts 1 to :data:`SKEW_BYTES` - 1 bytes past the source within a page."""
    return 0 < (dst - src) % PAGE_BYTES < SKEW_BYTES


def page_buffer(nbytes: int) -> np.ndarray:
    """A uint8 buffer that holds :func:`page_view` of up to ``nbytes`` for any file position."""
    return np.empty(nbytes + PAGE_BYTES, dtype=np.uint8)


def page_view(buf: np.ndarray, nbytes: int, position: int) -> np.ndarray:
    """``nbytes`` of ``buf`` (a :func:`page_buffer` of at least ``nbytes``) that start where file position
    ``position`` starts within a page, so that the kernel copies between them at full speed (see
    :func:`skewed`)."""
    start = (position - buf.ctypes.data) % PAGE_BYTES
    assert start + nbytes <= buf.size
    return buf[start:start + nbytes]


def crc_available() -> bool:
    """Whether :func:`copy_checksum` checksums while it copies (the helper built, on a processor with
    SSE4.2 and PCLMULQDQ)."""
    return _NATIVE_CRC


def available() -> bool:
    """Whether the streaming copy was built (else :func:`stream_copy` is ``numpy.copyto``)."""
    return _native is not None


def _compiled_takes(dst: np.ndarray, src: np.ndarray) -> bool:
    """What both compiled copies need: at least :data:`MIN_BYTES` (checked first: a load copies many
    small parts), same shape and dtype (no object dtype), a writable ``dst``, ``src``'s last dimension
    contiguous, no overlap."""
    return (dst.nbytes >= MIN_BYTES and 0 < dst.ndim <= MAX_DIMS and dst.shape == src.shape and dst.dtype == src.dtype
            and not dst.dtype.hasobject and dst.flags.writeable and src.strides[-1] == src.itemsize
            and not np.may_share_memory(dst, src))


def stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``numpy.copyto(dst, src, casting="equiv")``, with streaming stores where it can: what
    :func:`_compiled_takes` lists, and ``dst``'s last dimension contiguous too."""
    if _native is None or not _compiled_takes(dst, src) or dst.strides[-1] != dst.itemsize:
        np.copyto(dst, src, casting="equiv")
        return
    _native.copy(dst.__array_interface__["data"][0], src.__array_interface__["data"][0], dst.shape,
                 dst.strides, src.strides, dst.itemsize)


def copy_checksum(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
    """``numpy.copyto(dst, src, casting="equiv")`` into a C-contiguous ``dst``; return the crc32c of
    ``dst``'s bytes, continuing from ``crc`` (:func:`xckpt.format.shard.checksum`'s value). In one
    pass where it can (:func:`_compiled_takes`), else :func:`xckpt.format.shard.copy_then_checksum`."""
    if not _NATIVE_CRC or not _compiled_takes(dst, src) or not dst.flags.c_contiguous:
        return shard.copy_then_checksum(dst, src, crc)
    return int(_native.copy_crc(dst.__array_interface__["data"][0], src.__array_interface__["data"][0], src.shape,
                                src.strides, src.itemsize, crc))


def checksum_copy(dst: np.ndarray, src: np.ndarray) -> int:
    """:func:`stream_copy` of a C-contiguous ``src`` (a load's inner chunk, just read); return the crc32c of
    ``src``'s bytes (:func:`xckpt.format.shard.checksum`'s value). In one pass where it can
    (:func:`_compiled_takes`, ``dst``'s last dimension contiguous), else a checksum, then the copy."""
    if not (_NATIVE_CRC and src.flags.c_contiguous and _compiled_takes(dst, src) and dst.strides[-1] == dst.itemsize):
        crc = shard.checksum(src.reshape(-1).view(np.uint8))
        stream_copy(dst, src)
        return crc
    return int(_native.crc_copy(dst.__array_interface__["data"][0], src.__array_interface__["data"][0], dst.shape,
                                dst.strides, dst.itemsize, 0))


def write_copied(fd: int, part: shard.Copied) -> bool:
    """Write ``part`` (an inner chunk's stored bytes still to be copied, and their crc32c) to the open file
    ``fd`` in one compiled call that copies, checksums and writes each block in turn with the GIL released
    (each block copied to where the scratch buffer, given a page to spare, lies within a page as the block's
    file position: see :func:`skewed`), where the helper takes it (:func:`_compiled_takes`' conditions, the
    storage byte order); False, with
    nothing written, where it does not (the caller writes :meth:`~xckpt.format.shard.Copied.pieces`). A
    failed write raises :class:`OSError`."""
    src, scratch = part.src, part.scratch
    if not (_NATIVE_CRC and src.ndim and src.dtype.str == part.dtype.str and src.strides[-1] == src.itemsize
            and not src.dtype.hasobject and scratch.dtype == np.uint8 and scratch.flags.c_contiguous):
        return False
    _native.copy_crc_write(fd, scratch.__array_interface__["data"][0], scratch.nbytes,
                           src.__array_interface__["data"][0], src.shape, src.strides, src.itemsize, part.block_rows)
    return True


def write_checked(fd: int, part: shard.Checked) -> bool:
    """Write ``part`` (an inner chunk's payload as stored, and its crc32c) to the open file ``fd`` in one
    compiled call that checksums each piece just before writing it, with the GIL released, where the
    helper is built (a piece lying where the kernel copies it slowly, :func:`skewed`, goes through the
    part's scratch buffer, placed within a page as its file position); False, with nothing written, where
    it is not (the caller writes :meth:`~xckpt.format.shard.Checked.pieces`). A failed write raises
    :class:`OSError`."""
    payload, scratch = part.payload, part.scratch
    if not (_NATIVE_CRC and payload.dtype == np.uint8 and payload.flags.c_contiguous):
        return False
    if scratch is None or scratch.dtype != np.uint8 or not scratch.flags.c_contiguous:
        scratch = np.empty(0, dtype=np.uint8)
    _native.crc_write(fd, payload.__array_interface__["data"][0], payload.nbytes, shard.PIECE_BYTES,
                      scratch.__array_interface__["data"][0], scratch.nbytes)
    return True


def write_part(fd: int, part: shard.Copied | shard.Checked) -> bool:
    """Write one of :func:`xckpt.format.shard.encode_parts`' deferred parts to the open file ``fd`` in one
    compiled call (:func:`write_copied`, :func:`write_checked`); False, with nothing written, where the
    helper does not take it."""
    return write_copied(fd, part) if isinstance(part, shard.Copied) else write_checked(fd, part)
