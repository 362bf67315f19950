"""Atomic directory moves on a local file system, and syncing directories.

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

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _load() -> "ctypes._NamedFuncPointer | None":
    if not sys.platform.startswith("linux") or os.environ.get("XCKPT_NO_RENAMEAT2"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load()


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
