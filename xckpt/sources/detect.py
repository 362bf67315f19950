"""Which kind of stored checkpoint a path holds: :func:`open_checkpoint` opens it as a source."""

from __future__ import annotations

from typing import Any

from xckpt.engine.claims import recover
from xckpt.engine.storage import Location, Store
from xckpt.errors import XckptError
from xckpt.format import names
from xckpt.interop.orbax.checkpoint import open_orbax
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


def open_checkpoint(path: Any) -> Source:
    """Open the checkpoint at ``path``: xckpt, or one written by Orbax.

    An Orbax ``CheckpointManager`` step directory (``<root>/<step>/default/``) is
    opened through its single ``default`` item. When a save replaces the checkpoint while
    it is opened, the error is ``load.replaced`` (:func:`xckpt.load` then starts again).
    """
    loc = Location.of(path)
    recover(loc)  # a replace that died between its two renames left the checkpoint aside
    store = loc.store()
    try:
        if not _present(store, names.MANIFEST) and not _present(store, names.ORBAX_METADATA):
            item = loc.child("default")
            inner = item.store()
            if _present(inner, names.MANIFEST) or _present(inner, names.ORBAX_METADATA):
                store.close()
                loc, store = item, inner
            else:
                inner.close()
        if not _present(store, names.MANIFEST) and _present(store, names.ORBAX_METADATA):
            store.close()
            return open_orbax(loc)
    except BaseException:
        store.close()
        raise
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
