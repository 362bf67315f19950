"""Which kind of stored checkpoint a path holds: :func:`open_checkpoint` opens it as a source.

Detection is table driven: :data:`FILE_KINDS` are tried first on the path itself (a single file,
such as ``model.safetensors``), then :data:`KINDS`, in order, on the directory: the first whose
marker file is there opens it. To read another format, add a :class:`Kind` (or a
:class:`FileKind`) in the right place. Marker files are looked at through the directory's
:class:`~xckpt.engine.storage.Store`: a link or a special file in place of one raises
(``path.link``, ``path.special``) instead of being taken for an absence, so that, say, a
symlinked ``xckpt.json`` never makes the checkpoint read as another format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from xckpt import registry
from xckpt.engine.claims import CLAIM, live_side_copy, recover
from xckpt.engine.storage import Location, Store
from xckpt.errors import NotACheckpointError, XckptError
from xckpt.format import names
from xckpt.interop.orbax import layouts as orbax_layouts
from xckpt.interop.orbax.checkpoint import open_orbax
from xckpt.interop.safetensors import checkpoint as safetensors
from xckpt.sources.base import Source
from xckpt.sources.native import open_native


def _present(store: Store, name: str) -> bool:
    """Whether ``name`` is there; a link or a special file in its place is an error, not an absence (a
    symlinked ``xckpt.json`` must not make the checkpoint read as another format)."""
    blob = store.open(name)
    if blob is None:
        return False
    blob.close()
    return True


@dataclass(frozen=True)
class Kind:
    """One kind of checkpoint a directory may hold."""

    #: The format's name (a source's ``format``).
    name: str
    #: Whether the directory of ``store`` holds one (raises where a marker is a link or a special file).
    holds: Callable[[Store], bool]
    #: Open it from ``(loc, store)``; takes over ``store`` (closes it on error, or when the source closes).
    open: Callable[[Location, Store], Source]


@dataclass(frozen=True)
class FileKind:
    """One kind of checkpoint that a path naming a single file may be."""

    name: str
    #: Whether ``loc`` names such a file (no link is followed to decide).
    matches: Callable[[Location], bool]
    #: Open it from the path.
    open: Callable[[Location], Source]


def _open_native(loc: Location, store: Store) -> Source:
    """Open an xckpt checkpoint; a failure because a save swapped another one in is ``load.replaced``."""
    try:
        return open_native(loc, store)
    except XckptError as exc:
        replaced = store.replaced()
        store.close()
        if replaced:  # a save swapped another checkpoint in while this one was opened
            raise XckptError(f"{loc} was replaced while it was opened: {exc.message}", code="load.replaced",
                             file=str(loc)) from exc
        raise
    except BaseException:
        store.close()
        raise


def _open_orbax(loc: Location, store: Store) -> Source:
    store.close()  # it opens its own
    return open_orbax(loc)


def _open_dcp(loc: Location, store: Store) -> Source:
    """A PyTorch DCP checkpoint, through the reader an adapter registers (``xckpt.sources``: ``dcp``); without
    one (torch missing), ``manifest.missing`` naming its metadata file and saying what reads it."""
    marker = next(m for m in names.DCP_MARKERS if _present(store, m))
    store.close()
    opener = registry.source_opener("dcp")
    if opener is None:
        raise NotACheckpointError(f"{loc} holds a PyTorch Distributed Checkpoint, which xckpt reads with its torch "
                                  "adapter: install torch (pip install 'xckpt[torch]')", file=str(loc.child(marker)))
    return opener(loc)


#: Directory kinds, in the order they are tried.
KINDS: list[Kind] = [
    Kind("xckpt", lambda s: _present(s, names.MANIFEST), _open_native),
    Kind("orbax", lambda s: _present(s, names.ORBAX_METADATA), _open_orbax),
    # Orbax v1 checkpoints, CheckpointManager steps with named items (xckpt or Orbax ones), a bare default/
    Kind("orbax-layout", orbax_layouts.holds, lambda loc, store: orbax_layouts.open_kind(loc, store, _open_native)),
    Kind("safetensors", lambda s: safetensors.entry_file(s) is not None, safetensors.open_directory),
    Kind("dcp", lambda s: any(_present(s, m) for m in names.DCP_MARKERS), _open_dcp),
]

#: Single-file kinds, tried on the path itself before it is opened as a directory.
FILE_KINDS: list[FileKind] = [
    FileKind("safetensors", lambda loc: safetensors.file_target(loc) is not None, safetensors.open_safetensors),
]


def _kind_of(store: Store, kinds: Sequence[Kind]) -> Kind | None:
    return next((k for k in kinds if k.holds(store)), None)


def open_checkpoint(path: Any) -> Source:
    """Open the checkpoint at ``path``: xckpt, one written by Orbax, a PyTorch DCP directory, or Hugging Face
    safetensors (a directory, or a path to one ``.safetensors`` file or index).

    Orbax layouts with items (v1 checkpoints, ``CheckpointManager`` step directories such as
    ``<root>/<step>/default/``) are read through :mod:`xckpt.interop.orbax.layouts`: one item as
    its tree, several as a dict by item name. When a save replaces the checkpoint while
    it is opened, the error is ``load.replaced`` (:func:`xckpt.load` then starts again).
    A PyTorch DCP directory is read through the torch adapter's reader (without torch: ``manifest.missing``
    saying so). A directory holding none of them is ``manifest.missing``.
    """
    loc = Location.of(path)
    for fk in FILE_KINDS:
        if fk.matches(loc):
            return fk.open(loc)
    recover(loc)  # a replace that died between its two renames left the checkpoint aside
    aside = live_side_copy(loc)  # a live replace without an atomic exchange is between its two renames:
    if aside is not None:  # read the checkpoint that stood at the path, whole (once it goes, a load starts again)
        loc = aside
    store = loc.store()
    try:
        kind = _kind_of(store, KINDS)
        if (kind is None or kind.name != "xckpt") and _present(store, CLAIM):
            # an xckpt save's prefix without its manifest: a save still writing, or one that died before its
            # commit. Its Orbax view may be complete already, and its data goes if the save fails: never read
            raise NotACheckpointError(f"{loc} is being written by an xckpt save, or by one that died before it "
                                      f"committed (it holds {CLAIM} and no {names.MANIFEST}): nothing is "
                                      "committed there", file=str(loc.child(names.MANIFEST)))
    except BaseException:
        store.close()
        raise
    return (kind.open if kind is not None else _open_native)(loc, store)
