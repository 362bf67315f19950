"""Which entries of a committed directory are its own, and deleting only those (spec 6.3, 6.6).

A save that replaces a checkpoint, and ``xckpt gc`` removing one a save left behind (the checkpoint it
replaced, when a step after its commit failed), delete what that checkpoint is made of and nothing else:
files put into it by hand (a README, a note in a leaf's directory) are kept, in a directory renamed
``<name>.xckpt-kept-<generation>`` beside it. What a directory is made of depends on its kind: an xckpt
checkpoint's entries are what its manifest says a save writes (:meth:`~xckpt.format.manifest.Manifest.owns`);
a torch DCP directory's, its metadata and data files; a safetensors export's, its index and the files it
names (or its one file).
"""

from __future__ import annotations

import errno
import os
import re
from typing import Callable

from xckpt.engine import steps
from xckpt.engine.storage import LocalStore, Location
from xckpt.errors import XckptError
from xckpt.format import names, safetensors
from xckpt.format.manifest import parse as parse_manifest

#: ``owns(name, kind)``: whether the entry ``name`` (relative to the directory; its kind as
#: :meth:`LocalStore.walk` gives it: links and special files never are) is one of the directory's own.
Owns = Callable[[str, str], bool]

#: The names a torch DCP directory is made of (its writer's data files, and its metadata).
_DCP_NAME = re.compile(r"__[0-9]+_[0-9]+\.distcp|\.metadata")


def owner(root: Location, kind: str, writes: frozenset[str] = frozenset()) -> tuple[Owns, str]:
    """Which entries of a committed directory of ``kind`` (``xckpt``, ``dcp``, ``safetensors``) at ``root`` are its
    own, and what tells them (for messages); the top-level names ``writes`` too. Raises the
    :class:`~xckpt.errors.XckptError` of a manifest or index that cannot be read (which files are its own cannot
    be told then)."""
    if kind == "dcp":
        return (lambda name, what: what == "file" and (name in writes or _DCP_NAME.fullmatch(name) is not None)), \
            "which are not DCP's own files (.metadata, __<rank>_<n>.distcp)"
    store = root.store()
    try:
        if kind == "safetensors":
            raw = store.read(safetensors.INDEX_FILE, limit=safetensors.MAX_INDEX_BYTES)
            if raw is None:
                return _flat({safetensors.SINGLE_FILE} | writes), f"which are not its {safetensors.SINGLE_FILE}"
            index = safetensors.parse_index(raw, file=str(root.child(safetensors.INDEX_FILE)))
            return _flat({safetensors.INDEX_FILE, *index.values()} | writes), "which its index does not name"
        raw = store.read(names.MANIFEST)
        if raw is None:
            raise XckptError("the manifest is gone", code="manifest.missing", file=str(root.child(names.MANIFEST)))
        m = parse_manifest(raw, file=str(root.child(names.MANIFEST)))
    finally:
        store.close()

    def owns(name: str, what: str) -> bool:
        return what in ("file", "dir") and (name in writes or m.owns(name, what == "dir"))
    return owns, "which its manifest does not account for"


def telling_file(kind: str) -> str:
    """The file whose reading tells what a directory of ``kind`` is made of (for messages)."""
    return safetensors.INDEX_FILE if kind == "safetensors" else names.MANIFEST


def _flat(made_of: set[str] | frozenset[str]) -> Owns:
    """``owns`` of a directory made of the files ``made_of`` at its top level and nothing else."""
    return lambda name, what: what == "file" and name in made_of


def kind_held(path: str) -> str | None:
    """The kind of committed directory the local directory ``path`` holds, by its telling file (a regular file,
    never found through a link): ``xckpt`` (a manifest), ``dcp`` (DCP's ``.metadata``), ``safetensors`` (an
    index or the one file); None for none of these."""
    def regular(name: str) -> bool:
        return steps.regular(os.path.join(path, name)) is not None
    if regular(names.MANIFEST):
        return "xckpt"
    if regular(names.DCP_METADATA):
        return "dcp"
    if regular(safetensors.INDEX_FILE) or regular(safetensors.SINGLE_FILE):
        return "safetensors"
    return None


#: The top-level files that tell what a committed directory is (:func:`kind_held`, and what a side copy must hold to
#: be one): deleted last, so that a removal cut short (a killed process) still leaves a directory known for what it is,
#: whose next removal knows again which entries are its own.
TELLING = frozenset({names.MANIFEST, names.DCP_METADATA, names.DCP_RANK0_METADATA, safetensors.INDEX_FILE,
                     safetensors.SINGLE_FILE})


def remove_owned(path: str, owns: Owns, kept: str) -> str | None:
    """Delete the entries of the local directory ``path`` that ``owns`` says are its own, its telling files
    (:data:`TELLING`) last, and the directory once empty; return None. When anything else stays (files put into
    it), the directory is first renamed ``kept`` (or, where that name is taken, ``kept`` and a suffix), then loses
    its telling files; return where it went.

    An entry of its own that cannot be deleted (a permission), or a rename that fails, is ``io.write`` naming it:
    the directory stays where it was with its telling files, for a later try."""
    store = LocalStore(path)
    try:
        store.prune(lambda name, what: owns(name, what) and name not in TELLING)
        if not os.path.isdir(path):  # (removed meanwhile)
            return None
        left = list(store.walk())
    finally:
        store.close()
    stuck = [name for name, what in left if what == "file" and name not in TELLING and owns(name, what)]
    if stuck:
        raise XckptError(f"cannot delete {os.path.join(path, stuck[0])}"
                         + (f" and {len(stuck) - 1} more of its own files" if len(stuck) > 1 else ""),
                         code="io.write", file=os.path.join(path, stuck[0]))
    telling = {name for name, what in left if name in TELLING and owns(name, what)}
    if all(name in telling for name, _ in left):  # nothing but its telling files: all of it goes
        _unlink(path, telling)
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise XckptError(f"cannot delete {path}: {exc.strerror or exc}", code="io.write", file=path) from exc
        return None
    where = _rename_free(path, kept)
    _unlink(where, telling)
    return where


def _rename_free(path: str, kept: str) -> str:
    """Rename ``path`` to ``kept``, or where a directory already has that name, to ``kept`` with a suffix; return
    the name it has now (``io.write`` when it cannot be renamed)."""
    for attempt in range(100):
        name = kept if attempt == 0 else f"{kept}-{attempt}"
        try:
            os.rename(path, name)  # (a rename onto an empty directory replaces it: nothing is lost)
            return name
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise XckptError(f"cannot move {path} to {name}: {exc.strerror or exc}", code="io.write",
                                 file=path) from exc
    raise XckptError(f"cannot move {path} aside: {kept} and 99 more names after it are taken", code="io.write",
                     file=path)


def _unlink(root: str, names_: set[str]) -> None:
    """Delete the top-level files ``names_`` of the directory ``root`` (missing ones are gone already)."""
    for name in sorted(names_):
        try:
            os.unlink(os.path.join(root, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise XckptError(f"cannot delete {os.path.join(root, name)}: {exc.strerror or exc}", code="io.write",
                             file=os.path.join(root, name)) from exc
