"""Checking a local Orbax checkpoint's files before TensorStore opens any of them by path.

TensorStore's ``file`` key-value store opens files by path: it follows symbolic links and a
FIFO would block it. So, before anything of a local Orbax checkpoint is opened through
TensorStore, :func:`check_tree` walks the whole checkpoint once, through the directory its
:class:`~xckpt.engine.storage.LocalStore` opened, never following a link, and refuses
anything but plain directories and regular files. The whole tree is walked because OCDBT
may read any file below the root (``manifest.ocdbt``, ``d/``, ``ocdbt.process_*/``), and
plain zarr reads each array's directory and its chunk files.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Mapping

from xckpt.errors import UnsafePathError, XckptError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_tree(root: str, display: str, leaves: Mapping[str, str] | None = None) -> int:
    """Refuse any entry below the directory ``root`` that is not a directory or a regular file.

    ``root`` is the path to walk from (the store's pinned directory, ``/proc/self/fd/N``);
    ``display`` is the checkpoint's own path, used to name files in errors; ``leaves`` maps a
    top-level name (an array's directory) to the leaf stored there, named in errors where known.
    One ``scandir`` per directory; directories are opened relative to their parent with
    ``O_NOFOLLOW``, so a link swapped in during the walk is not entered either.

    Returns the number of regular files seen. Raises :class:`~xckpt.errors.UnsafePathError`
    (code ``path.link`` for a symbolic link, ``path.special`` for a FIFO, socket or device) naming
    the file, or :class:`~xckpt.errors.XckptError` (``io.read``) when a directory cannot be read.
    """
    leaves = leaves or {}

    def refuse(rel: str, code: str, what: str) -> UnsafePathError:
        file = f"{display.rstrip('/')}/{rel}"
        return UnsafePathError(f"{file} is {what}; a checkpoint holds plain files and directories only",
                               code=code, file=file, leaf=leaves.get(rel.split("/", 1)[0]))

    def entries(fd: int, rel: str) -> Iterator[os.DirEntry[str]]:
        try:
            with os.scandir(fd) as it:
                listed = list(it)
        except OSError as exc:
            file = f"{display.rstrip('/')}/{rel}".rstrip("/")
            raise XckptError(f"cannot list {file}: {exc.strerror}", code="io.read", file=file) from None
        return iter(sorted(listed, key=lambda e: e.name))

    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise XckptError(f"cannot open {display}: {exc.strerror}", code="io.read", file=display) from None
    # one open descriptor per level of the walk: (descriptor, relative path with '/', entries left)
    try:
        stack: list[tuple[int, str, Iterator[os.DirEntry[str]]]] = [(top, "", entries(top, ""))]
    except BaseException:
        os.close(top)
        raise
    files = 0
    try:
        while stack:
            fd, rel, it = stack[-1]
            entry = next(it, None)
            if entry is None:
                os.close(stack.pop()[0])
                continue
            name = rel + entry.name
            if entry.is_symlink():
                raise refuse(name, "path.link", "a symbolic link")
            if entry.is_dir(follow_symlinks=False):
                try:
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:  # replaced since it was listed
                    if exc.errno == errno.ELOOP:
                        raise refuse(name, "path.link", "a symbolic link") from None
                    file = f"{display.rstrip('/')}/{name}"
                    raise XckptError(f"cannot open {file}: {exc.strerror}", code="io.read", file=file) from None
                try:
                    stack.append((sub, name + "/", entries(sub, name + "/")))
                except BaseException:
                    os.close(sub)
                    raise
            elif entry.is_file(follow_symlinks=False):
                files += 1
            else:
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                except OSError:
                    mode = 0
                kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
                raise refuse(name, "path.special", kind)
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return files
