"""Atomic directory moves on a local file system, syncing directories, and starting a file's writeback.

Linux's ``renameat2`` gives the two moves a commit needs: ``RENAME_NOREPLACE`` (move into a
name only if nothing is there: of two savers, exactly one wins) and ``RENAME_EXCHANGE``
(swap two names in one step: a path holds the old or the new checkpoint at every instant).
Where the system or the file system lacks them (:func:`supported` is False), the caller
falls back to plain renames and the recovery described in the spec, section 6.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Any

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _libc(name: str, argtypes: list[Any]) -> Any:
    """The C library's function ``name`` taking ``argtypes`` and returning an int (errno kept), or None
    off Linux or where the library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _load() -> Any:
    """``renameat2``, or None (also when ``XCKPT_NO_RENAMEAT2`` is set)."""
    if os.environ.get("XCKPT_NO_RENAMEAT2"):
        return None
    return _libc("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])


_renameat2 = _load()
_sync_file_range = _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_SYNC_FILE_RANGE_WRITE = 2


class Unsupported(OSError):
    """The system or the file system cannot do this move atomically."""


def supported() -> bool:
    """Whether ``renameat2`` is available (it may still be refused by a file system: :class:`Unsupported`)."""
    return _renameat2 is not None


def _call(src: str, dst: str, flags: int) -> None:
    if _renameat2 is None:
        raise Unsupported(errno.ENOSYS, "renameat2 is not available", src)
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        raise Unsupported(err, os.strerror(err), src, None, dst)
    raise OSError(err, os.strerror(err), src, None, dst)


def rename_noreplace(src: str, dst: str) -> None:
    """Move ``src`` to ``dst``; :class:`FileExistsError` if anything is at ``dst``."""
    _call(src, dst, _RENAME_NOREPLACE)


def move_new(src: str, dst: str) -> None:
    """Move ``src`` to ``dst`` only if nothing is at ``dst`` (:class:`FileExistsError` otherwise): atomically
    with ``renameat2``, else by checking first and renaming (a race between the two is then possible)."""
    try:
        rename_noreplace(src, dst)
    except Unsupported:
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "exists", dst) from None
        os.rename(src, dst)


def exchange(a: str, b: str) -> None:
    """Swap what the names ``a`` and ``b`` point to, in one step (both must exist)."""
    _call(a, b, _RENAME_EXCHANGE)


def sync_dir(path: str) -> None:
    """fsync a directory, so that the names created, moved or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages to the device now, without waiting (Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): a hint that makes the later fsync shorter, never a
    substitute for it. Nothing happens elsewhere, or where the file system ignores it (tmpfs)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
