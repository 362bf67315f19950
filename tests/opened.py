"""Which files and directories a block of code opened or read, seen by the kernel (inotify).

Unlike access times, this does not depend on how the file system is mounted (``noatime``,
``relatime``): every ``open`` and every read of a watched file, and every ``opendir`` of a
watched directory, is reported, whichever process made it.

    with Opened(outside) as seen:
        xckpt.load(ckpt)            # ckpt holds a link to ``outside``
    assert seen.paths() == []
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from pathlib import Path
from types import TracebackType

IN_ACCESS = 0x001
IN_OPEN = 0x020
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then the name, NUL-padded)

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class Opened:
    """Watch ``root`` (a file, or a directory and everything below it) for opens and reads."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._fd = -1
        self._where: dict[int, Path] = {}

    def __enter__(self) -> "Opened":
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._fd = fd
        paths = [self.root] + (sorted(self.root.rglob("*")) if self.root.is_dir() else [])
        for p in paths:
            if p.is_symlink():
                continue
            wd = _libc.inotify_add_watch(fd, os.fsencode(p), IN_OPEN | IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {p}")
            self._where[wd] = p
        return self

    def paths(self) -> list[str]:
        """The watched paths opened or read since the watch began or the last call (each once, sorted)."""
        seen: set[str] = set()
        while True:
            try:
                data = os.read(self._fd, 65536)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    break
                raise
            at = 0
            while at < len(data):
                wd, _mask, _cookie, n = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size:at + _EVENT.size + n].rstrip(b"\0")
                at += _EVENT.size + n
                if wd in self._where:  # not the IN_IGNORED of a removed watch
                    base = self._where[wd]
                    seen.add(str(base / os.fsdecode(name)) if name else str(base))
        return sorted(seen)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        os.close(self._fd)


def probe(directory: Path) -> None:
    """Check, once, that the watch sees a read in ``directory`` (a test relying on it must not pass blind)."""
    f = directory / "opened-probe"
    f.write_bytes(b"x" * 100)
    with Opened(f) as seen:
        f.read_bytes()
        assert seen.paths() == [str(f)], "inotify did not report a read"
    f.unlink()
