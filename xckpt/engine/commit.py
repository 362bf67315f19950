"""Committing a save: where it is written first, the files the coordinating process adds, the move into place.

On a local file system every process writes into a hidden temporary directory beside
the target; once every chunk is written and synced, the coordinating process writes the
values, the Orbax view, the manifest and ``commit_success.txt``, syncs them and renames
the directory into place (then syncs the parent). On an object store there is no
rename: the prefix is written in place, every object only created where none is, and
the manifest, created after every other object of the save has landed, is the commit
(``commit_success.txt`` follows it).
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import crc32c
import numpy as np

from xckpt._version import __version__
from xckpt.engine import atomic, claims, failpoints, owned
from xckpt.engine.plan import INNER_CHUNK_BYTES, ArrayPlan, GlobalPlan, LeafLayout
from xckpt.engine.storage import LocalStore, Location, Store
from xckpt.engine.write import MAX_INFLIGHT_BYTES, ChunkWriter
from xckpt.errors import CollectiveError, SaveError, XckptError, XckptWarning
from xckpt.format import dtypes, jsonobj, names, orbax_view, safetensors, values as values_format, zarr
from xckpt.format.manifest import ArrayEntry, Entry, Manifest, StoredArray, ValueEntry, parse as parse_manifest, \
    version_for
from xckpt.format.regions import chunk_indices
from xckpt.format.tree import Key



@dataclass
class SaveOptions:
    """Options of one save."""

    overwrite: bool = False
    compression: str = "none"
    inner_chunk_bytes: int = INNER_CHUNK_BYTES
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES
    metadata: dict[str, Any] = field(default_factory=dict)
    producer: dict[str, Any] = field(default_factory=dict)
    stale_after_s: float | None = None  # a lease unrenewed this long marks a dead save (None: XCKPT_STALE_AFTER_S)

    def stale_after(self) -> float:
        """Seconds after which a leftover's unrenewed lease marks it dead."""
        return claims.stale_after_s() if self.stale_after_s is None else self.stale_after_s

    def check(self) -> None:
        """Refuse options the format does not know."""
        if self.compression not in zarr.COMPRESSIONS:
            raise SaveError(f"compression must be one of {zarr.COMPRESSIONS}, not {self.compression!r}")


@dataclass(frozen=True)
class Target:
    """What a save found at its destination and may do there."""

    final: Location
    replaces: str | None = None  # identity (:func:`identity`) of the committed checkpoint it replaces
    empty_dir: bool = False  # an empty local directory stands at the destination (it is removed)
    kind: str = "xckpt"  # what it writes and may replace: "xckpt", or "dcp" (a torch DCP directory)
    #: what the checkpoint it replaces is made of (:func:`xckpt.engine.owned.owner`), as found when the save began:
    #: all it deletes
    owns: Callable[[str, str], bool] | None = None


#: What each kind of directory a save may replace is, for messages.
KINDS = {"xckpt": "a committed xckpt checkpoint", "dcp": "a torch DCP checkpoint",
         "safetensors": "a safetensors export (model.safetensors or its index)"}


def _identity_bytes(store: Store, kind: str) -> bytes | None:
    """The bytes that identify a committed directory of ``kind``: xckpt's manifest, DCP's ``.metadata``, a
    safetensors export's index or its single file's header."""
    if kind == "dcp":
        return store.read(names.DCP_METADATA, limit=1 << 30)  # the DCP reader's own bound (spec 8.1)
    if kind != "safetensors":
        return store.read(names.MANIFEST)
    index = store.read(safetensors.INDEX_FILE)
    if index is not None:
        return b"index\0" + index
    blob = store.open(safetensors.SINGLE_FILE)
    if blob is None or blob.size is None or blob.size < safetensors.PREFIX_BYTES:
        return None
    try:
        prefix = np.empty(safetensors.PREFIX_BYTES, dtype=np.uint8)
        blob.read_into(0, prefix)
        n = safetensors.header_length(prefix.tobytes(), blob.size, file=blob.name)
        header = np.empty(n, dtype=np.uint8)
        blob.read_into(safetensors.PREFIX_BYTES, header)
        return b"single\0" + prefix.tobytes() + header.tobytes()
    finally:
        blob.close()


def identity(loc: Location, kind: str = "xckpt") -> str | None:
    """Which committed directory of ``kind`` (:data:`KINDS`) ``loc`` holds: an xckpt manifest's generation
    (format 1.1 and later), else a digest of what identifies it (:func:`_identity_bytes`); None when it holds
    none or cannot be read."""
    try:
        store = loc.store()
    except XckptError:
        return None
    try:
        data = _identity_bytes(store, kind)
    except XckptError:
        return None
    finally:
        store.close()
    if data is None:
        return None
    generation = jsonobj.string_member(data, "generation") if kind == "xckpt" else None
    return generation if generation is not None else hashlib.blake2b(data, digest_size=16).hexdigest()


def check_target(final: Location, opts: SaveOptions, kind: str = "xckpt", writes: Iterable[str] = ()) -> Target:
    """What a save to ``final`` may do, or a specific refusal; first tidies what dead saves left there.

    A save creates a new checkpoint, or with ``overwrite`` replaces a committed xckpt
    checkpoint (on a file system only): anything else at the destination is refused, never
    deleted (``save.exists``, ``save.not_checkpoint``, ``save.not_empty``, ``save.in_progress``),
    files put into the checkpoint's directory included (``save.foreign``), except the top-level names
    ``writes`` that the new one writes too (the ``config.json`` an export puts beside its weights); one
    whose manifest or index cannot be read, so that which files are its own cannot be told, is
    ``save.not_checkpoint``.
    """
    if final.is_local:
        path = final.local_path
        parent, name = os.path.split(path.rstrip("/"))
        claims.recover(final, stale_after=opts.stale_after())
        claims.remove_stale(Location(parent or "/"), stale_after=opts.stale_after())
        if not os.path.lexists(path):
            if claims.live_side_copy(final, stale_after=opts.stale_after()) is not None:
                raise SaveError(f"another save is replacing {path} (its checkpoint is aside); nothing was written",
                                code="save.in_progress", file=path)
            return Target(final, kind=kind)
        if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
            return Target(final, empty_dir=True, kind=kind)
        if not opts.overwrite:
            raise SaveError(f"{path} already exists; pass overwrite=True to replace it", code="save.exists",
                            file=path)
        held = identity(final, kind) if os.path.isdir(path) and not os.path.islink(path) else None
        if held is None:
            raise SaveError(f"{path} is not {KINDS[kind]}; overwrite=True replaces only one, so nothing was written",
                            code="save.not_checkpoint", file=path)
        owns = _refuse_foreign(final, kind, frozenset(writes))
        return Target(final, replaces=held, kind=kind, owns=owns)
    store = final.store()
    if store.exists(names.MANIFEST):
        raise SaveError(f"{final} holds a committed checkpoint; object stores cannot replace one atomically, so a "
                        "save never overwrites one: save to a new prefix", code="save.exists", file=str(final))
    if store.exists(claims.CLAIM):
        found = claims.scan(final, stale_after=opts.stale_after(), name="")  # its own claim, read directly
        if found and found[0].stale:
            claims.remove(found[0])  # everything a dead save wrote under the prefix it claimed
        if not found or not found[0].stale or store.exists(claims.CLAIM):  # live, or taken over by another first
            raise SaveError(f"another save is writing to {final} (it holds {claims.CLAIM}); nothing was written",
                            code="save.in_progress", file=str(final.child(claims.CLAIM)))
    listed = store.list()
    if names.MANIFEST in listed or claims.CLAIM in listed:  # another save claimed (and committed) it since
        raise SaveError(f"another save is writing to {final} or committed it; nothing was written",
                        code="save.exists" if names.MANIFEST in listed else "save.in_progress", file=str(final))
    if listed:
        raise SaveError(f"{final} is not empty and holds no checkpoint; a save writes only to a new or empty "
                        "prefix, so nothing was written", code="save.not_empty", file=str(final))
    return Target(final)


def _refuse_foreign(final: Location, kind: str, writes: frozenset[str]) -> Callable[[str, str], bool]:
    """Refuse to replace a committed directory of ``kind`` that holds anything it is not made of (a README, a
    tokenizer folder, a ``config.json``, a note in a leaf's directory, put there by hand): replacing it would
    delete them (``save.foreign``, naming the first; :func:`xckpt.engine.owned.owner`). One whose own names cannot
    be told (its manifest or index unreadable) is refused too (``save.not_checkpoint``). Returns what it is made of
    (``owns``)."""
    try:
        owns, which = owned.owner(final, kind, writes)
    except XckptError as exc:
        file = str(final.child(owned.telling_file(kind)))
        raise SaveError(f"{owned.telling_file(kind)} of {final} cannot be read ([{exc.code}] {exc.message}), so which "
                        "files are its own cannot be told and replacing it could delete files put into it; nothing "
                        "was written: remove it yourself, or save elsewhere", code="save.not_checkpoint",
                        file=file) from None
    foreign: list[str] = []
    store = final.store()
    try:
        assert isinstance(store, LocalStore)  # (overwrite replaces on file systems only)
        for name, what in store.walk():  # depth first: what lies in a foreign directory follows it at once
            if not (foreign and name.startswith(f"{foreign[-1]}/")) and not owns(name, what):
                foreign.append(name)
    finally:
        store.close()
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise SaveError(f"{final} holds {shown}, {which}; overwrite replaces what a save wrote, never files "
                        "put into it, so nothing was written: move them out first",
                        code="save.foreign", file=str(final.child(foreign[0])))
    return owns


def _remove_replaced(old: str, target: Target, generation: str) -> None:
    """Delete the checkpoint this save replaced, now at ``old`` (moved out of the way, and found to be the one
    it set out to replace): what it is made of only (``target.owns``, as :func:`_refuse_foreign` found it when
    the save began; :func:`xckpt.engine.owned.remove_owned`, its manifest last). Anything put into it since stays:
    its directory is renamed ``<name>.xckpt-kept-<generation>`` beside the new checkpoint, with a warning. A file of
    its own that cannot be deleted is ``io.write`` (the caller warns; the directory stays beside, for gc)."""
    assert target.owns is not None
    kept = owned.remove_owned(old, target.owns, f"{target.final.local_path.rstrip('/')}.xckpt-kept-{generation}")
    if kept is None:
        return
    warnings.warn(f"{target.final}: the checkpoint this save replaced held files put into it while the save ran; "
                  f"they were not deleted, and are in {kept}", XckptWarning, stacklevel=2)


def _io_error(file: str, what: str, exc: OSError) -> SaveError:
    """``io.write`` naming ``file``, for an ``OSError`` of the commit's own file operations."""
    return SaveError(f"cannot {what}: {exc.strerror or exc}; nothing was committed", code="io.write", file=file)


@contextmanager
def _writing(file: str, what: str) -> Iterator[None]:
    """Raise an ``OSError`` of the block as :func:`_io_error`."""
    try:
        yield
    except OSError as exc:
        raise _io_error(file, what, exc) from exc


def publish(tmp: Location, target: Target, generation: str, rank: int = 0, hold: Hold | None = None) -> None:
    """Move a completely written and synced checkpoint from ``tmp`` into place (file systems; on object
    stores the manifest was the commit, and this does nothing); ``hold``, the save's, is marked
    :attr:`Hold.committed` as soon as it is in place, before the steps that follow (:func:`_settle`), so a
    caller that meets an interrupt there knows not to remove anything.

    A new checkpoint moves in only if nothing is there (``save.exists`` if another save got
    there first). A replacement swaps in atomically (``renameat2(RENAME_EXCHANGE)``), checks
    that it displaced the checkpoint it meant to (else swaps back: ``save.conflict``), syncs
    the parent and removes the old one. Without an atomic exchange the old checkpoint is
    renamed aside first (``.<name>.xckpt-old-<generation>``), where the next save or load of
    the path restores it if the process dies before the new one is in.
    """
    if not tmp.is_local or tmp == target.final:
        return
    src, dst = tmp.local_path, target.final.local_path
    parent = os.path.dirname(dst) or "."
    failpoints.hit("before_publish", rank)
    def committed_new() -> None:  # the new checkpoint is in place and nothing it replaced is left to remove
        _committed(hold)
        _settle(dst, (_SYNC, lambda: atomic.sync_dir(parent)), ("", lambda: failpoints.hit("after_publish", rank)))

    if target.replaces is None:
        if target.empty_dir:
            try:
                os.rmdir(dst)
            except OSError:
                pass
        try:
            atomic.move_new(src, dst)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise SaveError(f"another save committed {dst} first; nothing was committed", code="save.exists",
                                file=dst) from None
            raise _io_error(dst, "move the new checkpoint into place", exc) from exc
        committed_new()
        return
    try:
        atomic.exchange(src, dst)
    except atomic.Unsupported:
        _publish_aside(src, dst, target, generation, rank, hold)
        return
    except FileNotFoundError:
        gone = dst if os.path.lexists(src) else f"this save's temporary directory {src}"
        raise SaveError(f"{gone} disappeared while this save replaced {dst} (a save stopped past its lease is "
                        "judged dead, and what it wrote removed); nothing was committed",
                        code="save.conflict", file=dst) from None
    except OSError as exc:
        raise _io_error(dst, "swap the new checkpoint into place", exc) from exc
    failpoints.hit("after_exchange", rank)
    if identity(Location(src), target.kind) != target.replaces:
        if not os.path.lexists(src):
            # the exchange was made, and then a cleanup that judged this save dead (stopped past its lease)
            # removed the checkpoint it replaced: the save is committed, with nothing left to remove
            committed_new()
            return
        try:  # another save replaced it since this one began: put it back
            atomic.exchange(src, dst)
        except OSError as exc:
            raise _io_error(dst, "put back the checkpoint another save committed meanwhile", exc) from exc
        raise SaveError(f"another save replaced {dst} while this one was writing; nothing was committed",
                        code="save.conflict", file=dst)
    _committed(hold)
    _settle(dst, (_SYNC_REPLACING, lambda: atomic.sync_dir(parent)),
            (_REMOVE, lambda: _remove_replaced(src, target, generation)),
            ("", lambda: failpoints.hit("after_publish", rank)))


def _committed(hold: Hold | None) -> None:
    if hold is not None:
        hold.committed = True


#: What :func:`_settle` says of a failed step after the move into place.
_SYNC = "syncing its parent directory failed: until that is done a crash of the machine may undo the move"
_SYNC_REPLACING = _SYNC + "; the checkpoint it replaced is not removed: it is left beside it, where xckpt gc removes it"
_REMOVE = "removing the checkpoint it replaced failed: it is left beside it, where xckpt gc removes it"


def _settle(dst: str, *steps: tuple[str, Callable[[], Any]]) -> None:
    """Run the steps that follow a commit on a file system (the move into place: nothing undoes it, and the save
    reports it committed), each ``(what its failure means, step)``, one after the other up to the first that
    fails, which is a warning: the parent directory's sync, then the removal of the replaced checkpoint."""
    for what, step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - an interrupt goes on to the caller; the checkpoint stays either way
            warnings.warn(f"{dst} is committed, but a failure followed the commit: {what or 'a step after it'} "
                          f"({exc})", XckptWarning, stacklevel=4)
            return


def _publish_aside(src: str, dst: str, target: Target, generation: str, rank: int, hold: Hold | None) -> None:
    """A replacement with two renames (no atomic exchange here); see :func:`publish`."""
    aside = claims.sibling(target.final, "old", generation).local_path
    conflict = SaveError(f"another save replaced {dst} while this one was writing; nothing was committed",
                         code="save.conflict", file=dst)
    try:
        os.rename(dst, aside)
    except FileNotFoundError:
        raise SaveError(f"{dst} disappeared while this save replaced it; nothing was committed",
                        code="save.conflict", file=dst) from None
    except OSError as exc:
        raise _io_error(dst, "move the old checkpoint aside", exc) from exc
    try:
        atomic.sync_dir(os.path.dirname(dst) or ".")
        failpoints.hit("after_aside", rank)
        if identity(Location(aside), target.kind) != target.replaces:
            raise conflict
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another save put a checkpoint there meanwhile
                raise conflict from None
            raise _io_error(dst, "move the new checkpoint into place", exc) from exc
    except BaseException:  # the new one is not in place: the old one goes back (unless something else is there)
        if os.path.lexists(aside) and not os.path.lexists(dst):
            os.rename(aside, dst)
        raise
    _committed(hold)
    _settle(dst, (_SYNC_REPLACING, lambda: atomic.sync_dir(os.path.dirname(dst) or ".")),
            (_REMOVE, lambda: _remove_replaced(aside, target, generation)),
            ("", lambda: failpoints.hit("after_publish", rank)))


class Hold:
    """The coordinating process's hold on a destination for one save: what it found there, its lease
    (renewed by a heartbeat) and its temporary directory (file systems)."""

    def __init__(self, target: Target, generation: str, stale_after: float) -> None:
        self.target = target
        self.generation = generation
        self.lease = claims.Lease(target.final, generation)
        self.tmp = claims.sibling(target.final, "tmp", generation) if target.final.is_local else target.final
        try:
            if self.tmp.is_local:
                os.makedirs(os.path.dirname(self.tmp.local_path), exist_ok=True)
            self.lease.acquire()
        except OSError as exc:
            raise SaveError(f"cannot write beside {target.final}: {exc.strerror or exc}; nothing was written",
                            code="io.write", file=str(target.final)) from exc
        try:
            if self.tmp.is_local:
                os.mkdir(self.tmp.local_path)
        except BaseException as exc:
            self.lease.release()
            if isinstance(exc, OSError):
                raise SaveError(f"cannot write beside {target.final}: {exc.strerror or exc}; nothing was written",
                                code="io.write", file=str(target.final)) from exc
            raise
        self._heartbeat: claims.Heartbeat | None = claims.Heartbeat(self.lease, claims.heartbeat_s(stale_after))
        #: Leave the lease when the hold ends: an object store's commit whose marker may be missing (write_marker)
        self.keep = False
        #: The save is committed (the move into place, :func:`publish`; an object store's manifest created,
        #: :func:`write_commit_files`): nothing undoes it, whatever fails or interrupts after
        self.committed = False

    def end(self) -> None:
        """Stop renewing the lease and release it (unless :attr:`keep`: it then ages into a leftover)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if not self.keep:
            self.lease.release()


def plan_objects(plan: GlobalPlan) -> Iterator[str]:
    """Every array object a plan has the processes write (chunk objects and ``zarr.json`` files)."""
    for a in plan.arrays.values():
        if a.segmented:
            yield f"{a.name}/{zarr.METADATA}"
        for path, s in stored_arrays(a):
            yield f"{path}/{zarr.METADATA}"
            for idx in chunk_indices(s.shape, s.chunk_shape):
                yield f"{path}/{zarr.chunk_key(idx)}"


def discard(tmp: Location, written: Iterable[str], *, hold: Hold | None = None,
            plan: GlobalPlan | None = None, generation: str | None = None,
            created: Mapping[str, bytes] | None = None) -> None:
    """Remove what a failed save wrote (best effort, never anything else).

    Every process deletes the objects it wrote (``written``, and ``created``); the coordinating process
    (``hold``) also removes the temporary directory (file systems) or every object the plan
    could have had any process write (object stores, where processes that died cannot clean
    up), then releases its lease. On an object store, once the prefix's claim is no longer this
    save's (``generation``; judged dead and taken over, its object names may be another save's
    now), only what this process's own writes created (``created``, :attr:`Store.created`) is
    deleted, each object only while it is still the version created, and only where that version
    cannot be another save's (:func:`_surely_own`).
    """
    try:
        if hold is not None and hold.committed:  # nothing after the commit undoes it (an interrupt there)
            return
        if not tmp.is_local and (hold is not None and not hold.lease.held()
                                 or hold is None and generation and claims.claimed_by(tmp) != generation):
            store = tmp.store()
            try:
                store.delete_created(_surely_own(store, created or {}))
            finally:
                store.close()
            return
        store = tmp.store()
        try:
            written = list(dict.fromkeys([*written, *(created or {})]))
            if not tmp.is_local and names.MANIFEST in written:
                # a manifest whose write failed may have landed all the same (its answer lost): it goes first,
                # and only if it is this save's, so that no reader finds a manifest over deleted data
                written.remove(names.MANIFEST)
                if generation and identity(tmp) == generation:
                    store.delete(names.MANIFEST)
            for name in dict.fromkeys([*written, *(plan_objects(plan) if plan is not None and hold is not None
                                                   and not tmp.is_local else ())]):
                try:
                    store.delete(name)
                except (XckptError, OSError):  # one that cannot go (a name too long) stops none of the others
                    pass
        finally:
            store.close()
        if hold is not None and tmp.is_local:
            shutil.rmtree(tmp.local_path, ignore_errors=True)
        elif tmp.is_local:
            _remove_empty_dirs(tmp.local_path)
    except Exception:  # noqa: BLE001 - cleanup is best effort; what is left ages into a leftover
        pass
    finally:
        if hold is not None:
            hold.end()


def _surely_own(store: Store, created: Mapping[str, bytes]) -> dict[str, bytes]:
    """Of the objects a save judged dead created in the prefix another save took over (``created``), those it
    deletes, each only while its version is the one created: an object store's version is its ETag, a digest of
    its bytes, so an object the new owner deleted and wrote again with the same bytes (a ``zarr.json`` of the same
    array) would look unchanged. Where the prefix holds the new owner's committed manifest, every object that
    manifest does not name; else only chunk objects, whose bytes name their save (the place tag; two saves' chunks
    of the same data differ in it, and in their ETag but with a chance of 2**-32). What is left (a few small files
    at most, written before the new owner committed) stays beside that checkpoint; no reader looks at it."""
    mine = {n: v for n, v in created.items() if n != names.MANIFEST}
    try:
        raw = store.read(names.MANIFEST)
        committed = None if raw is None else parse_manifest(raw, file=str(store.location.child(names.MANIFEST)))
    except XckptError:
        committed = None
    if committed is not None:
        return {n: v for n, v in mine.items() if not committed.owns(n, False)}
    return {n: v for n, v in mine.items() if zarr.is_chunk_object(n)}


def _remove_empty_dirs(root: str) -> None:
    for d, _, _ in sorted(os.walk(root), key=lambda x: -len(x[0])):
        try:
            os.rmdir(d)
        except OSError:
            pass


def stored_arrays(a: ArrayPlan | LeafLayout) -> list[tuple[str, StoredArray]]:
    """``(path from the checkpoint root, array)`` of each Zarr array a leaf is stored as (segment paths in
    the array are relative to the leaf's group)."""
    if len(a.segments) == 1:
        s, inner = a.segments[0]
        return [(a.name, StoredArray(a.name, s.offset, s.shape, s.chunk, inner))]
    return [(f"{a.name}/{n}", StoredArray(str(n), s.offset, s.shape, s.chunk, inner))
            for n, (s, inner) in enumerate(a.segments)]


def array_metadata(a: ArrayPlan | LeafLayout, dtype: str, segment: int, compression: str) -> tuple[str, bytes]:
    """``(object name, bytes)`` of the ``zarr.json`` of one segment (-1: the group of a segmented leaf)."""
    arrays = stored_arrays(a)
    if segment < 0:
        meta = zarr.group_metadata([{"path": s.path, "offset": list(s.offset), "shape": list(s.shape)}
                                    for _, s in arrays])
        return f"{a.name}/{zarr.METADATA}", zarr.encode_metadata(meta)
    path, s = arrays[segment]
    return f"{path}/{zarr.METADATA}", zarr.array_json(s.shape, dtypes.storage_name(dtype), s.chunk_shape,
                                                      s.inner_chunk_shape, compression)


def array_entry(a: ArrayPlan, compression: str) -> ArrayEntry:
    """The manifest entry of a planned array leaf (made once per plan and compression)."""
    e = a.entries.get(compression)
    if e is None:
        e = a.entries[compression] = _array_entry(a, compression)
    return e  # type: ignore[no-any-return]


def _array_entry(a: ArrayPlan, compression: str) -> ArrayEntry:
    arrays = stored_arrays(a)
    sharding = dict(a.sharding or {})
    sharding.setdefault("shard_shape", list(arrays[0][1].chunk_shape))
    sharding.setdefault("num_shards", a.n_pieces)
    if a.segmented:
        return ArrayEntry(a.key, a.name, a.shape, a.dtype, dtypes.storage_name(a.dtype), (), (), compression,
                          sharding, tuple(s for _, s in arrays))
    s = arrays[0][1]
    return ArrayEntry(a.key, a.name, a.shape, a.dtype, dtypes.storage_name(a.dtype), s.chunk_shape,
                      s.inner_chunk_shape, compression, sharding)


def build_manifest(plan: GlobalPlan, values: dict[int, Any], opts: SaveOptions, producer: dict[str, Any],
                   values_info: dict[str, Any] | None, generation: str | None = None) -> Manifest:
    """The manifest of a planned save whose value leaves are ``values`` (by leaf index)."""
    entries: list[Entry] = []
    for i, key in enumerate(plan.keys):
        a = plan.arrays.get(i)
        if a is not None:
            entries.append(array_entry(a, opts.compression))
        else:
            mirror = names.path_name(key) if orbax_view.mirrors(values[i]) else None
            entries.append(ValueEntry(key, plan.kinds[i], mirror))
    meta = dict(opts.metadata)
    return Manifest(tree=plan.tree, leaves=entries, producer=producer, values=values_info, metadata=meta,
                    version=version_for(entries), generation=generation)


def producer_of(plan: GlobalPlan, opts: SaveOptions) -> dict[str, Any]:
    """Who wrote the checkpoint: xckpt, and the framework the adapters recorded in each leaf's sharding."""
    out: dict[str, Any] = {"library": "xckpt", "library_version": __version__}
    for a in plan.arrays.values():
        info = a.sharding or {}
        if info.get("framework"):
            out["framework"] = str(info["framework"])
            if info.get("framework_version"):
                out["framework_version"] = str(info["framework_version"])
            break
    else:
        out.update(framework="numpy", framework_version=np.__version__)
    out.update(opts.producer)
    return out


def write_commit_files(store: Store, plan: GlobalPlan, values: dict[int, Any], opts: SaveOptions,
                       generation: str, *, hold: Hold | None = None, written: list[str] | None = None) -> Manifest:
    """The coordinating process's part of the commit, into the (temporary) checkpoint; returns the manifest.

    Writes the ``zarr.json`` of arrays with no element (no process wrote a chunk of them), the
    values file and the Orbax view (0-d mirrors of numeric values, ``_METADATA``,
    ``_CHECKPOINT_METADATA``, ``_strings.json``), then creates the manifest: on an object store
    that is the commit (the store's writes before it have landed: :class:`KvStore`), refused if
    another save's manifest is there (``save.exists``) or if this save lost its claim
    (``save.conflict``). Orbax's commit marker follows, last, so that Orbax, which takes
    ``commit_success.txt`` for a finished checkpoint on object stores, never finds one before the
    commit: that is :func:`write_marker`, which the caller calls next, having noted the commit. The names
    it writes are added to ``written``.
    """
    _check_held(hold)
    with ChunkWriter(store, generation, opts.max_inflight_bytes) as w:
        for i, a in plan.arrays.items():
            if math.prod(a.shape) == 0:
                for seg in range(-1 if a.segmented else 0, len(a.segments)):
                    w.file(*array_metadata(a, a.dtype, seg, opts.compression))
        values_info = None
        if values:
            blob = values_format.encode({i: values[i] for i in sorted(values)})
            w.file(names.VALUES, blob)
            values_info = {"path": names.VALUES, "size": len(blob), "crc32c": crc32c.crc32c(blob)}
        manifest = build_manifest(plan, values, opts, producer_of(plan, opts), values_info, generation)
        strings: dict[Key, str] = {}
        for i, e in enumerate(manifest.leaves):
            if isinstance(e, ValueEntry) and e.orbax_path:
                meta, data = orbax_view.scalar_array(values[i])
                w.file(f"{e.orbax_path}/{zarr.METADATA}", zarr.encode_metadata(meta))
                w.chunk(f"{e.orbax_path}/{zarr.chunk_key(())}", zarr.geometry(meta["data_type"], (), (), "none"),
                        data, e.orbax_path)
            elif orbax_view.in_strings(e):
                strings[e.key] = values[i]
        for name, data in orbax_view.files(_orbax_metadata(plan, manifest, strings), strings).items():
            w.file(name, data)
    if written is not None:
        written.extend(w.names)
    failpoints.hit("after_values")
    _check_held(hold)
    if written is not None and not store.location.is_local:
        written.append(names.MANIFEST)  # (it may land although its write fails: discard then removes it first)
    with _writing(str(store.location.child(names.MANIFEST)), f"write {names.MANIFEST}"):
        if not store.create(names.MANIFEST, manifest.dumps()):
            raise SaveError(f"another save committed {store.location} first; nothing was committed",
                            code="save.exists", file=str(store.location))
    if not store.location.is_local:
        _committed(hold)  # the manifest was the commit
    return manifest


def write_marker(store: Store, hold: Hold | None = None) -> None:
    """Orbax's commit marker, after the manifest (:func:`write_commit_files`), then sync.

    On a file system this is inside the temporary directory, before the commit (the move into place): a
    failure fails the save. On an object store the manifest was the commit, and nothing after it undoes it
    (readers may be loading already): a failure is a warning, and the save's claim (``hold``) is left in place
    whatever stops this, so that once it is stale, ``xckpt gc`` (or the next save beside it) writes the marker
    as it removes the claim."""
    if not store.location.is_local and hold is not None:
        hold.keep = True
    try:
        failpoints.hit("after_manifest")
        with _writing(str(store.location.child(names.COMMIT)), f"write {names.COMMIT}"):
            store.write(names.COMMIT, names.COMMIT_TEXT)
            store.sync()
        failpoints.hit("after_commit_marker")
    except Exception as exc:  # noqa: BLE001 - on an object store the manifest was the commit; see above
        if store.location.is_local:
            raise
        warnings.warn(f"{store.location} is committed, but a failure followed the commit ({exc}): if its "
                      f"{names.COMMIT} is missing, Orbax treats the checkpoint as unfinished until it is there; the "
                      "save's claim is left for xckpt gc, which writes the marker once the claim is stale",
                      XckptWarning, stacklevel=2)
        return
    if hold is not None:
        hold.keep = False


def _orbax_metadata(plan: GlobalPlan, manifest: Manifest, strings: dict[Key, str]) -> bytes:
    """Orbax's ``_METADATA`` of the manifest, built once per plan and value-leaf signature."""
    signature = orbax_view.values_signature(manifest)
    found = plan.orbax_metadata.get(signature)
    if found is None:
        if len(plan.orbax_metadata) >= 4:  # value leaves that keep changing type: keep the latest few
            plan.orbax_metadata.clear()
        found = plan.orbax_metadata[signature] = orbax_view.metadata_json(manifest, strings)
    return found


def _check_held(hold: Hold | None) -> None:
    if hold is not None and not hold.lease.held():
        raise SaveError(f"this save lost its claim on {hold.target.final} (judged dead and taken over); "
                        "nothing was committed", code="save.conflict", file=str(hold.target.final))


def commit_failed(final: Location, error: BaseException) -> XckptError:
    """The error a failed save raises: nothing was committed at ``final`` (or, ``save.outcome_unknown``
    and ``async.timeout`` on a process that lost the coordinating one, the outcome is unknown)."""
    if isinstance(error, CollectiveError) or (isinstance(error, SaveError)
                                              and error.message.startswith(f"save to {final} failed")):
        return error
    if isinstance(error, XckptError) and error.code == "save.outcome_unknown":
        return error
    code = error.code if isinstance(error, XckptError) else "save.failed"  # e.g. save.exists, save.conflict
    file, leaf = (error.file, error.leaf) if isinstance(error, XckptError) else (None, None)
    text = error.message if isinstance(error, XckptError) else str(error)  # its code, file and leaf: said once, below
    err = SaveError(f"save to {final} failed; nothing was committed: {text}", code=code, file=file or str(final),
                    leaf=leaf)
    err.__cause__ = error
    return err
