"""Multi-process OCDBT checkpoints whose per-process databases were never merged.

When several processes save one Orbax checkpoint with OCDBT, each writes its own database
``ocdbt.process_<id>/`` (its ``manifest.ocdbt`` and ``d/`` data files) holding the keys it
wrote: the zarr metadata of each array (``w/.zarray`` or ``w/zarr.json``, written by the
primary process) and the chunks of the shards that process wrote (``w/0.0`` or
``w/c/0/0``). At the end of the save one process merges them: it copies every key of every
per-process database into a root database (``manifest.ocdbt``, ``d/``) that refers to the
per-process data files. Orbax reads only that root database; without it, Orbax takes the
directory for a non-OCDBT checkpoint and cannot read it.

A checkpoint is taken for an unmerged one when ``_METADATA`` says ``use_ocdbt`` (or says nothing
and ``ocdbt.process_0/`` is there) and the root has neither ``manifest.ocdbt`` nor ``d/`` (a root
``d/`` alone is a merge that did not finish: ``orbax.ocdbt_missing``). xckpt reads it without
merging it (nothing is written): it lists
the keys of every per-process database (:func:`index_databases`) and opens each array through
a TensorStore ``kvstack`` key-value store whose layers send each run of keys to the database
that holds them (:meth:`KeyIndex.spec`). A key found in several databases is read from the
first, in the order of :func:`process_databases`.

When a database itself is damaged (its ``manifest.ocdbt``, or a B-tree node in one of its data files under
``d/``, cut short, garbled, missing), TensorStore's error names the file it could not read or decode, by the
path it was given (on Linux, through ``/proc/self/fd``): :func:`naming_damaged_file` makes the xckpt error
name that file, as the checkpoint's reader displays it.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable
from typing import Any

import tensorstore as ts

from xckpt.engine.storage import Location, Store
from xckpt.errors import DataError, XckptError

#: A per-process database directory, as Orbax names it (``ocdbt.process_0``, ``ocdbt.process_replica_3``).
PROCESS_DIR = re.compile(r"^ocdbt\.process_(replica_)?([A-Za-z0-9]+)$")
OCDBT_MANIFEST = "manifest.ocdbt"
#: A file of an OCDBT database, by its path in the checkpoint: the manifest or a data file (``d/<name>``: B-tree
#: nodes and values) of the root database or of a per-process one.
_DATABASE_FILE = re.compile(r"(?:ocdbt\.process_(?:replica_)?[A-Za-z0-9]+/)?(?:manifest\.ocdbt|d/[^/]+)")
#: A name TensorStore quotes in an error (a ``"`` in it escaped).
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
#: What follows a key read from an OCDBT database, quoted (``"w/0.0" in OCDBT database at ...``: an array's key,
#: not a file).
_KEY_OF_DATABASE = " in OCDBT database"


def _order(name: str) -> tuple[int, int, str]:
    m = PROCESS_DIR.match(name)
    assert m is not None
    ident = m.group(2)
    return (1 if m.group(1) else 0, int(ident) if ident.isdigit() else -1, ident)


def process_databases(store: Store, top_dirs: Iterable[str]) -> list[str]:
    """The per-process OCDBT databases among the top-level directories ``top_dirs`` (those holding a
    ``manifest.ocdbt``), process order: ``ocdbt.process_0``, ``ocdbt.process_1``, ..., replicas last."""
    found = [d for d in top_dirs if PROCESS_DIR.match(d) and store.exists(f"{d}/{OCDBT_MANIFEST}")]
    return sorted(found, key=_order)


def top_directories(store: Store) -> set[str]:
    """The top-level directory names of a store that has no cheaper listing (an object store: every key is
    listed once)."""
    return {k.split("/", 1)[0] for k in store.list() if "/" in k}


class KeyIndex:
    """Which per-process database holds each key of an unmerged OCDBT checkpoint."""

    def __init__(self, databases: list[str], keys: list[str], owners: list[int]) -> None:
        #: The databases' directory names.
        self.databases = databases
        #: Every key, sorted; ``owners[i]`` is the index (in ``databases``) of the one ``keys[i]`` is read from.
        self.keys = keys
        self.owners = owners

    def spec(self, path: str, db_spec: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """The kvstore spec of the directory ``path`` ('' for the root): the one database holding all its keys,
        or a ``kvstack`` with one layer per run of keys held by the same database.

        ``db_spec(name)`` is the kvstore spec of the OCDBT database ``name``.
        """
        prefix = path.rstrip("/") + "/" if path else ""
        lo = bisect.bisect_left(self.keys, prefix)
        hi = bisect.bisect_left(self.keys, prefix[:-1] + "0") if prefix else len(self.keys)  # '0' follows '/'
        runs: list[tuple[int, str]] = []
        for i in range(lo, hi):
            if not runs or runs[-1][0] != self.owners[i]:
                runs.append((self.owners[i], self.keys[i]))
        if len(runs) <= 1:
            out = dict(db_spec(self.databases[runs[0][0] if runs else 0]))
            if prefix:
                out["path"] = prefix
            return out
        layers = []
        for n, (owner, first) in enumerate(runs):
            layer: dict[str, Any] = {"base": db_spec(self.databases[owner]), "inclusive_min": first,
                                     "strip_prefix": 0}
            if n + 1 < len(runs):
                layer["exclusive_max"] = runs[n + 1][1]
            layers.append(layer)
        out = {"driver": "kvstack", "layers": layers}
        if prefix:
            out["path"] = prefix
        return out


def index_databases(databases: list[str], db_spec: Callable[[str], dict[str, Any]], context: ts.Context,
                    file: Callable[[str], str]) -> KeyIndex:
    """List every key of every per-process database (concurrently) into a :class:`KeyIndex`.

    ``file(name)`` is the display path of database ``name``, for errors (``orbax.ocdbt``).
    """
    opened = [(d, ts.KvStore.open(db_spec(d), context=context)) for d in databases]
    listed = []
    for d, fut in opened:
        try:
            listed.append((d, fut.result().list()))
        except Exception as exc:  # noqa: BLE001 - reported as a specific xckpt error
            raise DataError(f"cannot open the per-process OCDBT database: {str(exc)[:400]}", code="orbax.ocdbt",
                            file=file(d)) from exc
    owner: dict[str, int] = {}
    for i, (d, fut) in enumerate(listed):
        try:
            keys = fut.result()
        except Exception as exc:  # noqa: BLE001
            raise DataError(f"cannot list the per-process OCDBT database: {str(exc)[:400]}", code="orbax.ocdbt",
                            file=file(d)) from exc
        for raw in keys:
            try:
                key = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"key {raw[:100]!r} is not UTF-8", code="orbax.ocdbt", file=file(d)) from exc
            owner.setdefault(key, i)  # the first database holding a key is the one read
    keys = sorted(owner)
    return KeyIndex(databases, keys, [owner[k] for k in keys])


def damaged_file(text: str, base: str, root: Location) -> str | None:
    """The display path (below ``root``) of the OCDBT database file that the TensorStore error ``text`` says it
    could not read or decode: the first quoted name that is ``base`` (the path of the checkpoint's directory
    that TensorStore was given, its kvstore spec's ``path``) followed by a database file's path in the
    checkpoint (:data:`_DATABASE_FILE`). None when it names none (a chunk's key, a database's directory)."""
    for m in _QUOTED.finditer(text):
        name = m.group(1)
        if text.startswith(_KEY_OF_DATABASE, m.end()):
            continue
        if name.startswith(base) and _DATABASE_FILE.fullmatch(name[len(base):]):
            return str(root.child(name[len(base):]))
    return None


def naming_damaged_file(err: XckptError, base: str, root: Location,
                        cause: BaseException | None = None) -> XckptError:
    """``err``, an error reading an OCDBT checkpoint raised from the TensorStore error ``cause`` (default:
    ``err``'s cause; without one, ``err``'s message is read), naming as its ``file`` the database file that
    error says is damaged (:func:`damaged_file`), and in its message the file's display path instead of the
    one TensorStore was given; ``code`` and ``leaf`` (the array being read, if any) stay. ``err`` itself when
    TensorStore named no database file."""
    cause = cause if cause is not None else err.__cause__
    text = str(cause) if cause is not None and not isinstance(cause, XckptError) else err.message
    file = damaged_file(text, base, root)
    if file is None:
        return err
    message = err.message.replace(f'"{base}', f'"{str(root).rstrip("/")}/') if base else err.message
    return err.naming(file, message)
