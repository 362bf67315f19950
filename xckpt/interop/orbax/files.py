"""Checking a local Orbax checkpoint's files before TensorStore opens any of them by path.

TensorStore's ``file`` key-value store opens files by path: it follows symbolic links and a
FIFO would block it. So, before anything of a local Orbax checkpoint is opened through
TensorStore, :func:`check_tree` walks the whole checkpoint once
(:meth:`~xckpt.engine.storage.LocalStore.walk`, through the directory the store opened, never
following a link) and refuses anything but plain directories and regular files. The whole
tree is walked because OCDBT may read any file below the root (``manifest.ocdbt``, ``d/``,
``ocdbt.process_*/``), and plain zarr reads each array's directory and its chunk files.

Orbax's JSON files (``_METADATA``, ``_sharding``, ``_strings.json``, ``_CHECKPOINT_METADATA``, the
zarr metadata of its arrays, JSON items) are parsed by :func:`xckpt.format.jsonobj.parse_json` alone, so
that every defect of one is the same specific error, never a ``ValueError`` or ``RecursionError`` of the parser.
"""

from __future__ import annotations

from collections.abc import Mapping

from xckpt.engine.storage import LocalStore
from xckpt.errors import UnsafePathError

#: How each kind of entry that is refused is named in errors.
_REFUSED = {"link": ("path.link", "a symbolic link"), "fifo": ("path.special", "a FIFO"),
            "socket": ("path.special", "a socket"), "device": ("path.special", "a device"),
            "other": ("path.special", "not a regular file")}


def check_tree(store: LocalStore, leaves: Mapping[str, str] | None = None, top_dirs: set[str] | None = None) -> int:
    """Refuse any entry of the checkpoint that is not a directory or a regular file; the number of files.

    ``leaves`` maps a top-level name (an array's directory) to the leaf stored there, named in errors.
    ``top_dirs``, when given, receives the names of the top-level directories (found by the same walk).
    Raises :class:`~xckpt.errors.UnsafePathError` (``path.link`` for a symbolic link, ``path.special``
    for a FIFO, socket or device) naming the file, or an ``io.read`` error for an unreadable directory.
    """
    files = 0
    for name, kind in store.walk():
        if kind in _REFUSED:
            code, what = _REFUSED[kind]
            file = f"{store.root.rstrip('/')}/{name}"
            raise UnsafePathError(f"{file} is {what}; a checkpoint holds plain files and directories only",
                                  code=code, file=file, leaf=(leaves or {}).get(name.split("/", 1)[0]))
        files += kind == "file"
        if top_dirs is not None and kind == "dir" and "/" not in name:
            top_dirs.add(name)
    return files
