"""Storage names of array leaves and the checks that keep them inside a checkpoint.

An array leaf is stored in the directory named by its key joined with ``.``,
the name Orbax gives it too (``model.layers.0.weight``). A key component holding ``/``
(Haiku's module names: ``mlp/~/linear_0``) makes the name nest in directories, as Orbax
stores it too (``mlp/~/linear_0.w``; format 1.3): each part is a plain name, and no
storage name may lie inside another's directory.
"""

from __future__ import annotations

import posixpath
import re
from typing import Iterable, Iterator

from xckpt.errors import TreeError, UnsafePathError
from xckpt.format.tree import Key, key_str

MANIFEST = "xckpt.json"
VALUES = "values.msgpack"
COMMIT = "commit_success.txt"
#: What a writer puts in it (any text will do: spec 6.7).
COMMIT_TEXT = b"xckpt checkpoint committed\n"
ORBAX_METADATA = "_METADATA"
ORBAX_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ORBAX_SHARDING = "_sharding"
#: A hidden directory holding an empty zarr v2 array's ``.zarray``: what Orbax v1 looks for before it loads.
ORBAX_MARKER_DIR = ".orbax_marker"
#: The file in it.
ORBAX_MARKER = f"{ORBAX_MARKER_DIR}/.zarray"
#: The file that makes a directory a committed torch DCP checkpoint (written by ``xckpt convert --to dcp``).
DCP_METADATA = ".metadata"
#: Longest part of a stored path, in UTF-8 bytes (a file name on ext4, XFS, tmpfs, APFS, NTFS).
MAX_NAME_BYTES = 255
#: Longest storage name that nests (parts joined with ``/``), in UTF-8 bytes: far from a path's limit (4,096
#: bytes on Linux) wherever the checkpoint lies.
MAX_PATH_BYTES = 1024
#: The item a checkpoint manager's step directory holds its checkpoint in (Orbax's default item name).
DEFAULT_ITEM = "default"
#: What each rank writes instead when DCP saves without collectives (``use_collectives=False``): rank 0's.
DCP_RANK0_METADATA = "__0.metadata"
#: Either makes a directory a PyTorch DCP checkpoint (the first when it is there).
DCP_MARKERS = (DCP_METADATA, DCP_RANK0_METADATA)
#: File and directory names at the top of a checkpoint that no array may take.
RESERVED = frozenset({MANIFEST, VALUES, COMMIT, ORBAX_METADATA, ORBAX_CHECKPOINT_METADATA,
                      ORBAX_SHARDING, "_strings.json", "manifest.ocdbt", "array_metadatas", ORBAX_MARKER_DIR})


#: An object a save writes below its checkpoint's top level (spec 3.2, 4, 4.2, 7): a leaf's (or a segment's)
#: ``zarr.json`` or chunk object. No part of a storage name (a nested one, 1.3, has several) starts with ``.``.
_BELOW_TOP = re.compile(r"(?:[^/.][^/]*/)+(?:zarr\.json|c(?:/[0-9]+)*)")


def may_write(name: str) -> bool:
    """Whether a save may write the object ``name`` (relative to its checkpoint's root): a reserved name at the
    top (:data:`RESERVED`); below it a leaf's or a segment's ``zarr.json`` or chunk object, or the Orbax marker."""
    if "/" not in name:
        return name in RESERVED
    return name == ORBAX_MARKER or _BELOW_TOP.fullmatch(name) is not None


def storage_name(key: Key) -> str:
    """The directory name of the array at ``key`` (components joined with ``.``; a ``/`` in a component
    nests it: every part between two ``/`` a plain name, not hidden, the first not reserved)."""
    name = ".".join(str(k) for k in key)
    if not key or not name:
        raise TreeError("a bare array at the root of a tree has no storage name; wrap it in a dict",
                        leaf=key_str(key))
    for k in key:
        text = str(k)
        if "\\" in text or "\x00" in text:
            raise TreeError(f"key component {text!r} contains a backslash or NUL", leaf=key_str(key))
    parts = name.split("/")
    if any(not p or p.startswith(".") for p in parts) or parts[0] in RESERVED:
        where = "" if len(parts) == 1 else f" (a part between '/' is empty or hidden: {name!r} nests in directories)"
        raise TreeError(f"storage name {name!r} is reserved or hidden{where}", leaf=key_str(key))
    return name


def path_name(key: Key) -> str:
    """The storage name of a leaf that is stored at that path (an array, a numeric value's Orbax mirror):
    also a path a reader takes (:func:`check_relative`), so it holds no ``:``."""
    name = storage_name(key)
    if ":" in name:
        raise TreeError(f"key {key_str(key)!r} holds ':', which a stored path may not (readers refuse it: a drive or "
                        "a stream on some file systems); rename it", leaf=key_str(key))
    size, longest = _byte_sizes(name)
    if longest > MAX_NAME_BYTES:
        raise TreeError(f"the storage name of this key has a part {longest} bytes long, more than the "
                        f"{MAX_NAME_BYTES} a file name may have on common file systems; shorten it", leaf=key_str(key))
    if "/" in name and size > MAX_PATH_BYTES:
        raise TreeError(f"the storage name of this key nests {size} bytes "
                        f"deep, more than the {MAX_PATH_BYTES} a stored path may have; shorten it", leaf=key_str(key))
    return name


def _byte_sizes(name: str) -> tuple[int, int]:
    """A stored path's length and its longest part's, in UTF-8 bytes (lone surrogates as they are encoded)."""
    return (len(name.encode("utf-8", "surrogatepass")),
            max(len(p.encode("utf-8", "surrogatepass")) for p in name.split("/")))


def parents(name: str) -> Iterator[str]:
    """The directories a stored path lies in, outermost first (``a/b/c``: ``a``, ``a/b``)."""
    i = name.find("/")
    while i != -1:
        yield name[:i]
        i = name.find("/", i + 1)


def nesting(names: Iterable[tuple[str, Key]]) -> tuple[Key, Key, str] | None:
    """Of ``(stored name, key)`` pairs, the first two keys whose names share one place, as
    ``(earlier key, later key, name)``: the same name, or one name inside the other's directory
    (``a`` and ``a/b``); None when every name has a place of its own."""
    seen: dict[str, Key] = {}
    dirs: dict[str, Key] = {}
    for name, key in names:
        other = seen.get(name, dirs.get(name))
        if other is None:
            other = next((seen[p] for p in parents(name) if p in seen), None)
        if other is not None:
            return other, key, name
        seen[name] = key
        for p in parents(name):
            dirs.setdefault(p, key)
    return None


def check_unique(keys: Iterable[Key]) -> dict[Key, str]:
    """Storage names of ``keys``; raise when two keys would share one name, or one would lie in the
    other's directory."""
    names = {key: storage_name(key) for key in keys}
    clash = nesting((name, key) for key, name in names.items())
    if clash is not None:
        first, key, name = clash
        how = ("would both be stored as" if storage_name(first) == name
               else "would be stored one inside the other's directory, at")
        raise TreeError(
            f"leaves {key_str(first)!r} and {key_str(key)!r} {how} {name!r} (Orbax names arrays by joining keys "
            "with '.', and a '/' in a key nests the name in directories); rename one",
            code="tree.name_collision", leaf=key_str(key))
    return names


def check_relative(path: str, *, file: str | None = None, leaf: str | None = None, bounded: bool = True) -> str:
    """Validate a stored relative path: no absolute path, no ``..``, no empty part; with ``bounded`` (an xckpt
    manifest's paths) no part longer than :data:`MAX_NAME_BYTES` and no path longer than :data:`MAX_PATH_BYTES`:
    what an xckpt writer may store (a longer one is no xckpt checkpoint's, and the work of walking it grows
    with its length). An Orbax array's name is not bounded so: in OCDBT it is a key of its database, not a
    file's name, and Orbax writes longer ones."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"stored path {path[:80] if isinstance(path, str) else path!r} is empty or not a "
                              "string", file=file, leaf=leaf)
    size, longest = _byte_sizes(path)
    if bounded and (size > MAX_PATH_BYTES or longest > MAX_NAME_BYTES):
        raise UnsafePathError(f"stored path {path[:80]!r}... ({size} bytes) is longer than a stored path may be "
                              f"({MAX_PATH_BYTES} bytes, {MAX_NAME_BYTES} a part)", file=file, leaf=leaf)
    if path.startswith("/") or "\\" in path or "\x00" in path or ":" in path.split("/")[0]:
        raise UnsafePathError(f"stored path {path!r} is absolute or has forbidden characters",
                              file=file, leaf=leaf)
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or posixpath.normpath(path) != path:
        raise UnsafePathError(f"stored path {path!r} leaves the checkpoint or is not normal",
                              file=file, leaf=leaf)
    return path
