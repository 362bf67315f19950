"""Storage names of array leaves and the checks that keep them inside a checkpoint.

An array leaf is stored in the directory named by its key joined with ``.``,
the name Orbax gives it too (``model.layers.0.weight``).
"""

from __future__ import annotations

import posixpath
from typing import Iterable

from xckpt.errors import TreeError, UnsafePathError
from xckpt.format.tree import Key, key_str

MANIFEST = "xckpt.json"
VALUES = "values.msgpack"
COMMIT = "commit_success.txt"
ORBAX_METADATA = "_METADATA"
ORBAX_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ORBAX_SHARDING = "_sharding"
#: A hidden directory holding an empty zarr v2 array's ``.zarray``: what Orbax v1 looks for before it loads.
ORBAX_MARKER_DIR = ".orbax_marker"
#: The file that makes a directory a committed torch DCP checkpoint (written by ``xckpt convert --to dcp``).
DCP_METADATA = ".metadata"
#: Longest storage name of a stored path, in UTF-8 bytes (a file name on ext4, XFS, tmpfs, APFS, NTFS).
MAX_NAME_BYTES = 255
#: The item a checkpoint manager's step directory holds its checkpoint in (Orbax's default item name).
DEFAULT_ITEM = "default"
#: What each rank writes instead when DCP saves without collectives (``use_collectives=False``): rank 0's.
DCP_RANK0_METADATA = "__0.metadata"
#: File and directory names at the top of a checkpoint that no array may take.
RESERVED = frozenset({MANIFEST, VALUES, COMMIT, ORBAX_METADATA, ORBAX_CHECKPOINT_METADATA,
                      ORBAX_SHARDING, "_strings.json", "manifest.ocdbt", "array_metadatas", ORBAX_MARKER_DIR})


def storage_name(key: Key) -> str:
    """The directory name of the array at ``key`` (components joined with ``.``)."""
    name = ".".join(str(k) for k in key)
    if not key or not name:
        raise TreeError("a bare array at the root of a tree has no storage name; wrap it in a dict",
                        leaf=key_str(key))
    for k in key:
        text = str(k)
        if "/" in text or "\\" in text or "\x00" in text:
            raise TreeError(f"key component {text!r} contains a path separator or NUL",
                            leaf=key_str(key))
    if name in (".", "..") or name.startswith(".") or name in RESERVED:
        raise TreeError(f"storage name {name!r} is reserved or hidden", leaf=key_str(key))
    return name


def path_name(key: Key) -> str:
    """The storage name of a leaf that is stored at that path (an array, a numeric value's Orbax mirror):
    also a path a reader takes (:func:`check_relative`), so it holds no ``:``."""
    name = storage_name(key)
    if ":" in name:
        raise TreeError(f"key {key_str(key)!r} holds ':', which a stored path may not (readers refuse it: a drive or "
                        "a stream on some file systems); rename it", leaf=key_str(key))
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise TreeError(f"the storage name of this key is {len(name.encode('utf-8', 'surrogatepass'))} bytes long, more "
                        f"than the {MAX_NAME_BYTES} a file name may have on common file systems; shorten it",
                        leaf=key_str(key))
    return name


def check_unique(keys: Iterable[Key]) -> dict[Key, str]:
    """Storage names of ``keys``; raise when two keys would share one name."""
    seen: dict[str, Key] = {}
    names: dict[Key, str] = {}
    for key in keys:
        name = storage_name(key)
        if name in seen:
            raise TreeError(
                f"leaves {key_str(seen[name])!r} and {key_str(key)!r} would both be stored as "
                f"{name!r} (Orbax names arrays by joining keys with '.'); rename one",
                code="tree.name_collision", leaf=key_str(key))
        seen[name] = key
        names[key] = name
    return names


def check_relative(path: str, *, file: str | None = None, leaf: str | None = None) -> str:
    """Validate a stored relative path: no absolute path, no ``..``, no empty part."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"stored path {path!r} is empty or not a string", file=file, leaf=leaf)
    if path.startswith("/") or "\\" in path or "\x00" in path or ":" in path.split("/")[0]:
        raise UnsafePathError(f"stored path {path!r} is absolute or has forbidden characters",
                              file=file, leaf=leaf)
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or posixpath.normpath(path) != path:
        raise UnsafePathError(f"stored path {path!r} leaves the checkpoint or is not normal",
                              file=file, leaf=leaf)
    return path
