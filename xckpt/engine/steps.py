"""Deleting a run's step directory (spec 6.8): only what the saves of the step wrote goes; files put into it by hand
are kept beside the run, as an overwrite keeps those put into the checkpoint it replaces (spec 6.3).

A step the checkpoint manager wrote holds an xckpt checkpoint as its ``default/`` item (or, saved by hand into a
run, at its top, or as an item of another name) and the manager's Orbax files around it. Which of its entries
are its own is what its manifest says a save writes (:meth:`~xckpt.format.manifest.Manifest.owns`), plus those
Orbax files. The manifest goes last, so that a deletion interrupted midway (a killed process) is finished by
whoever finds it with the same knowledge. A step Orbax wrote holds nothing xckpt can tell its own by; the
manager, which found it to be Orbax's, has it deleted whole, as Orbax's own ``CheckpointManager`` deletes it;
what a deletion of one that was interrupted left is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import warnings
from typing import Any, Callable

from xckpt.engine.storage import LocalStore
from xckpt.errors import XckptError, XckptWarning
from xckpt.format import names
from xckpt.format.manifest import Manifest, parse as parse_manifest

#: The item a checkpoint manager keeps a step's metrics in (a directory holding one JSON file of the same name), as
#: Orbax's ``CheckpointManager`` does.
METRICS_ITEM = "metrics"
#: Largest ``_CHECKPOINT_METADATA`` read to learn a step's items.
_METADATA_BYTES = 1 << 20
#: The files the manager writes around a step's ``default/`` item.
MANAGER_FILES = frozenset({names.ORBAX_CHECKPOINT_METADATA, names.COMMIT, f"{METRICS_ITEM}/{METRICS_ITEM}",
                        f"{METRICS_ITEM}/{names.COMMIT}"})


def regular(path: str) -> os.stat_result | None:
    """The status of ``path`` when it is a regular file (a link is not followed), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def json_object(path: str, limit: int = 1 << 24) -> dict[str, Any] | None:
    """A small JSON object file (None when missing, a link, not a regular file, above ``limit`` bytes, or not a
    JSON object)."""
    st = regular(path)
    if st is None or st.st_size > limit:
        return None
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # (not UTF-8 or JSON, a number of 5,000 digits, deep nesting)
        return None
    return obj if isinstance(obj, dict) else None


def _items(path: str) -> list[str]:
    """Where the step at ``path`` holds its xckpt checkpoint (a regular ``xckpt.json``, never found through a
    link): its top (``""``), or else each item its ``_CHECKPOINT_METADATA`` names (``item_handlers``: ``default``,
    or another name an Orbax-layout step gave its item), or, without one, ``default/``. A folder the metadata
    does not name is not the step's, whatever it holds (a copy of another checkpoint put into it)."""
    if regular(os.path.join(path, names.MANIFEST)) is not None:
        return [""]
    named = [names.DEFAULT_ITEM]
    meta = json_object(os.path.join(path, names.ORBAX_CHECKPOINT_METADATA), _METADATA_BYTES)
    handlers = meta.get("item_handlers") if meta is not None else None
    if isinstance(handlers, dict):
        named = sorted(k for k in handlers if isinstance(k, str) and k and "/" not in k and not k.startswith("."))
    return [f"{d}/" for d in named if regular(os.path.join(path, d, names.MANIFEST)) is not None
            and not os.path.islink(os.path.join(path, d))]


def _manifests(path: str) -> list[tuple[Manifest, str]] | None:
    """The manifest of each checkpoint of the step at ``path`` with the item it lies in (:func:`_items`; empty
    when none); None when one does not parse (what the step's saves wrote cannot be told)."""
    out = []
    for item in _items(path):
        store = LocalStore(os.path.join(path, item))
        try:
            raw = store.read(names.MANIFEST)
            if raw is None:
                return None
            out.append((parse_manifest(raw, file=os.path.join(path, item, names.MANIFEST)), item))
        except XckptError:
            return None
        finally:
            store.close()
    return out


def owns(checkpoints: list[tuple[Manifest, str]]) -> Callable[[str, str], bool]:
    """``owns(name, kind)`` of a step holding the checkpoints of these manifests, each in its item
    (``default/``, or ``""``: the step's top): whether the entry ``name`` (relative to the step; kinds as
    :meth:`LocalStore.walk` gives them: a link or a special file never is) is one the manager's save of the step
    wrote: what the manifest says a save of it writes, and the manager's files around an item."""
    def step_owns(name: str, kind: str) -> bool:
        if kind not in ("file", "dir"):
            return False
        for manifest, item in checkpoints:
            if not item:
                return manifest.owns(name, kind == "dir")
            if name.startswith(item):
                return manifest.owns(name[len(item):], kind == "dir")
            if kind == "dir" and name == item[:-1]:
                return True
        return name == METRICS_ITEM if kind == "dir" else name in MANAGER_FILES
    return step_owns


def delete(path: str, kept: str, *, whole: bool = False) -> str | None:
    """Delete the step moved aside to ``path`` (a ``.<step>.xckpt-deleting-<token>`` directory) or what an
    interrupted deletion left of it; returns ``kept`` when entries that are not known to be the step's own
    remained and the directory holding them was renamed so (with an :class:`~xckpt.errors.XckptWarning` naming
    them), else None.

    ``whole``: the caller found the step to be one Orbax wrote (it holds no xckpt manifest): it is removed
    whole, as Orbax's manager removes it. Otherwise a step with a manifest loses what the manifest and the
    manager's layout say is its own (:func:`owns`), the manifests and then the metadata naming the items last;
    anything else (a deletion interrupted
    after its manifest went, one whose manifest does not parse, what an interrupted deletion of an Orbax step
    left) loses only its empty directories: what is left of it cannot be told from files put into it."""
    found = [] if whole else _manifests(path)
    store = LocalStore(path)
    try:
        if whole:
            shutil.rmtree(path, ignore_errors=True)
            gone = not os.path.lexists(path)
        elif found:
            # the manifests, then the metadata naming their items, last: an interrupted deletion is finished
            # knowing what it knew
            step_owns = owns(found)
            manifests = {f"{item}{names.MANIFEST}" for _, item in found}
            store.prune(lambda name, kind: step_owns(name, kind) and name not in manifests
                        and name != names.ORBAX_CHECKPOINT_METADATA)
            store.prune(lambda name, kind: step_owns(name, kind) and name != names.ORBAX_CHECKPOINT_METADATA)
            gone = store.prune(step_owns)
        else:
            gone = store.prune(lambda name, kind: kind == "dir")
        left = [] if gone else [name for name, _ in store.walk() if "/" not in name]
    finally:
        store.close()
    if gone:
        return None
    try:
        os.rename(path, kept)
    except OSError:
        kept = path
    shown = ", ".join(sorted(left)[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
    warnings.warn(f"a deleted step held entries that are not known to be its own ({shown}); they were not deleted, "
                  f"and are in {kept}", XckptWarning, stacklevel=2)
    return kept
