"""Who owns a save in progress, and what is left of saves that died.

Every save is named by its *generation* (128 random bits, in hex), which its manifest
records. While it runs, its coordinating process holds a *lease* on the destination:

* on a file system, a file ``.<name>.xckpt-lease-<generation>`` beside the destination,
  next to the temporary directory ``.<name>.xckpt-tmp-<generation>`` it writes into;
* on an object store, the object ``<prefix>/.xckpt-claim``, created only if absent (a
  conditional write: of two savers, one gets the prefix), naming the generation.

A :class:`Heartbeat` renews the lease every :func:`heartbeat_s` seconds. A temporary,
lease, status directory or claim whose lease was not renewed for ``stale_after_s``
seconds (``XCKPT_STALE_AFTER_S``, default an hour) belongs to a dead save: a later save
to the same parent removes it (:func:`remove_stale`), as does ``xckpt gc``. A live one
is never touched.

A :class:`xckpt.CheckpointManager` leaves its own kind beside the steps of a run
(:data:`MANAGER_LEFTOVER`, :func:`scan_steps`): the rule that judges them is here too, shared by
the manager's cleanup before each save and by ``xckpt gc``. A staged step whose save's lease names a
process of this machine that no longer runs is dead at once, as a side copy's save is (:func:`lease_live`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgpack

from xckpt.engine import atomic, env, owned, steps
from xckpt.engine.storage import ABSENT, MAX_READ_BYTES, Location, kv_result, landed, open_kvstore
from xckpt.errors import SaveError, XckptError, XckptWarning
from xckpt.format import jsonobj, names, safetensors

#: Object that claims an object-store prefix for one save.
CLAIM = ".xckpt-claim"
#: Default age after which a lease that is not renewed marks a dead save, in seconds.
STALE_AFTER_S = 3600.0
#: ``.<name>.xckpt-<kind>-<generation>``: what a save leaves beside its destination while it runs.
LEFTOVER = re.compile(r"\.(?P<name>.+)\.xckpt-(?P<kind>tmp|lease|status|old)-(?P<generation>[0-9a-f]{32})")
#: The name of an object in an asynchronous save's status directory (spec 6.5): a process's status, or the outcome.
_STATUS_NAME = r"rank-(?:0|[1-9][0-9]*)|outcome"
#: A status object on an object store (spec 6.5), below the listed prefix: ``.<name>.xckpt-status-<generation>/<it>``.
STATUS_OBJECT = re.compile(rf"\.(?P<name>[^/]+)\.xckpt-status-(?P<generation>[0-9a-f]{{32}})/(?:{_STATUS_NAME})")
#: Bytes of a status object read to learn when it was written, at most.
MAX_STATUS_BYTES = 1 << 20
#: What a checkpoint manager leaves beside the steps of a run while it works: ``.<step>.xckpt-step-<token>`` (a
#: step being written, moved to ``<step>`` once committed) and ``.<step>.xckpt-deleting-<token>`` (a step being
#: deleted). See :func:`scan_steps`.
MANAGER_LEFTOVER = re.compile(r"\.(?P<step>[0-9]+)\.xckpt-(?P<kind>step|deleting)-(?P<token>[0-9a-f]{32})")


def new_generation() -> str:
    """A fresh generation id."""
    return uuid.uuid4().hex


def stale_after_s() -> float:
    """Seconds after which an unrenewed lease marks a dead save (``XCKPT_STALE_AFTER_S``)."""
    return env.number("XCKPT_STALE_AFTER_S", STALE_AFTER_S)


def heartbeat_s(stale_after: float) -> float:
    """How often a lease is renewed: often enough that a live save never looks stale."""
    return max(0.05, min(60.0, stale_after / 8))


def sibling(final: Location, kind: str, generation: str) -> Location:
    """``.<name>.xckpt-<kind>-<generation>`` beside ``final`` (kind: tmp, lease, status, old)."""
    parent, name = _split(final)
    return Location(f"{parent}/.{name}.xckpt-{kind}-{generation}")


def _split(loc: Location) -> tuple[str, str]:
    parent, _, name = loc.url.rstrip("/").rpartition("/")
    return parent, name


def _kv(prefix: Location) -> Any:
    """The key-value store of an object-store prefix (a spec the store refuses: ``io.read`` naming it)."""
    return open_kvstore(prefix.kvstore(), str(prefix))


def _read_small(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(256).strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _pidns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


#: What tells this machine's processes apart from another's: the host name, and where the system says
#: (Linux) the boot and the process-id namespace (a container on the same host sees other process ids).
_MACHINE = {"host": socket.gethostname(), "boot": _read_small("/proc/sys/kernel/random/boot_id"), "pidns": _pidns()}


def _record(generation: str) -> bytes:
    return json.dumps({"generation": generation, **_MACHINE, "pid": os.getpid(), "heartbeat": time.time()}).encode()


class Lease:
    """The coordinating process's hold on a destination while its save runs."""

    def __init__(self, final: Location, generation: str) -> None:
        self.final = final
        self.generation = generation
        self._stamp: bytes | None = None  # object stores: the claim's storage generation
        self.lost = False

    # -- local -----------------------------------------------------------------------------------

    @property
    def _path(self) -> str:
        return sibling(self.final, "lease", self.generation).local_path

    def acquire(self) -> None:
        """Take the lease; raise ``save.in_progress`` when another live save claimed an object-store prefix."""
        if self.final.is_local:
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                try:
                    os.write(fd, _record(self.generation))
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException:  # a full disk, an interrupt: the save fails having written nothing, lease included
                with contextlib.suppress(OSError):
                    os.unlink(self._path)
                raise
            return
        kv, file = _kv(self.final), str(self.final.child(CLAIM))
        # empty: another save's claim; or this one's, created by an attempt whose answer was lost (the driver
        # retried; or it could not, and the write failed: :func:`landed`)
        try:
            stamp = kv_result(kv.write(CLAIM, _record(self.generation), if_equal=ABSENT), file,
                              write=True).generation or self._own(kv)
        except XckptError as exc:
            stamp = landed(exc, lambda: self._own(kv))
        if not stamp:
            raise SaveError(f"another save is writing to {self.final} (it holds {self.final}/{CLAIM}); "
                            "nothing was written", code="save.in_progress", file=str(self.final.child(CLAIM)))
        self._stamp = stamp
        manifest = kv_result(kv.read(names.MANIFEST, byte_range=slice(0, 0)), str(self.final.child(names.MANIFEST)))
        if manifest.state == "value":
            self.release()  # another save committed here after this one checked the prefix: never write into it
            raise SaveError(f"another save committed {self.final} first; nothing was written", code="save.exists",
                            file=str(self.final))

    def renew(self) -> None:
        """Show that the save is alive."""
        if self.final.is_local:
            try:
                os.utime(self._path)
            except FileNotFoundError:
                self.lost = True
            return
        kv, file = _kv(self.final), str(self.final.child(CLAIM))
        # empty: taken over; or renewed by an attempt whose answer was lost, then retried
        stamp = kv_result(kv.write(CLAIM, _record(self.generation), if_equal=self._stamp), file,
                          write=True).generation or self._own(kv)
        if stamp:
            self._stamp = stamp
        else:
            self.lost = True

    def held(self) -> bool:
        """Whether the lease is still this save's (nobody judged it dead and took the destination)."""
        if self.lost:
            return False
        if self.final.is_local:
            return os.path.exists(self._path)
        return self._own(_kv(self.final)) is not None

    def _own(self, kv: Any) -> bytes | None:
        """The storage stamp of the prefix's claim when it is this save's, else None."""
        claim = _read_claim(kv, self.final)
        return claim[1] if claim is not None and claim[0] == self.generation else None

    def release(self) -> None:
        """Give the lease up (best effort: a lease left behind only ages into a leftover)."""
        try:
            if self.final.is_local:
                os.unlink(self._path)
            elif self._stamp is not None:
                _kv(self.final).write(CLAIM, None, if_equal=self._stamp).result()
        except (OSError, ValueError, XckptError):
            pass


def _read_claim(kv: Any, prefix: Location) -> tuple[str, bytes] | None:
    """``(generation, storage stamp)`` of the claim in the opened ``prefix`` (generation "" when unreadable);
    None when there is none. A store that cannot answer is ``io.read`` naming the claim."""
    res = kv_result(kv.read(CLAIM), str(prefix.child(CLAIM)))
    if res.state != "value":
        return None
    return jsonobj.string_member(bytes(res.value), "generation") or "", res.stamp.generation


def claimed_by(prefix: Location) -> str | None:
    """The generation of the save whose claim an object-store prefix holds (None: no readable claim)."""
    claim = _read_claim(_kv(prefix), prefix)
    return claim[0] or None if claim is not None else None


def _heartbeat_of(record: bytes) -> float | None:
    try:
        obj = json.loads(record.decode())
        return float(obj["heartbeat"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None


class Heartbeat:
    """Renews a lease on a daemon thread until :meth:`stop`."""

    def __init__(self, lease: Lease, every_s: float) -> None:
        self.lease = lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), name="xckpt-lease", daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.lease.renew()
            except Exception:  # noqa: BLE001 - a missed renewal only makes the lease age
                pass

    def stop(self) -> None:
        """Stop renewing."""
        self._stop.set()
        self._thread.join()


# -- leftovers of dead saves -------------------------------------------------------------------


@dataclass(frozen=True)
class Leftover:
    """Something a save left beside (or, on object stores, under) a destination."""

    path: str
    kind: str  # tmp, lease, status, old (a file system's side copy), claim (an object-store prefix);
    # step, deleting (a checkpoint manager's staged step, interrupted deletion: :func:`scan_steps`)
    name: str  # the destination's name (a manager's leftover: the step)
    generation: str  # (a manager's leftover: its token)
    age_s: float  # since its lease was last renewed
    stale: bool
    stamp: bytes | None = field(default=None, compare=False, repr=False)  # a claim's storage generation when seen

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description."""
        return {"path": self.path, "kind": self.kind, "name": self.name, "generation": self.generation,
                "age_s": round(self.age_s, 3), "stale": self.stale}


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except OSError:
        return None


def _listing(root: str) -> list[str]:
    """The names in the local directory ``root`` (none when it is missing or not a directory); one it cannot
    list (a permission, a link loop) is ``io.read`` naming it."""
    try:
        return os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise XckptError(f"cannot list {root}: {exc.strerror or exc}", code="io.read", file=root) from exc


def scan(directory: Location, *, stale_after: float | None = None, name: str | None = None) -> list[Leftover]:
    """Every leftover in ``directory`` (a local directory, or an object-store prefix whose
    sub-prefixes are checkpoints), optionally only those of destination ``name`` (on an object store,
    ``""``: the claim of the prefix ``directory`` itself, read without listing anything).

    A temporary or status directory is as old as the lease of its generation (or, without a
    lease, as itself); a side copy (``old``) is never stale while its destination is
    missing: it is the checkpoint, to be restored (:func:`recover`).
    """
    limit = stale_after_s() if stale_after is None else stale_after
    now = time.time()
    if not directory.is_local:
        return _scan_claims(directory, limit, now, name)
    root = directory.local_path
    entries = _listing(root)
    found = [(e, m) for e in entries for m in [LEFTOVER.fullmatch(e)]
             if m and (name is None or m["name"] == name) and _as_made(os.path.join(root, e), m["kind"])]
    leases = {(m["name"], m["generation"]): _mtime(os.path.join(root, e)) for e, m in found if m["kind"] == "lease"}
    out = []
    for entry, m in found:
        path = os.path.join(root, entry)
        seen = leases.get((m["name"], m["generation"]))
        if seen is None:
            seen = _mtime(path)
        if seen is None:
            continue
        age = now - seen
        stale = age > limit
        if m["kind"] == "old" and not os.path.lexists(os.path.join(root, m["name"])):
            stale = False
        out.append(Leftover(path, m["kind"], m["name"], m["generation"], age, stale))
    return sorted(out, key=lambda x: x.path)


def _as_made(path: str, kind: str) -> bool:
    """Whether the entry ``path``, named as a leftover of ``kind``, is what a save makes under that name: a lease is
    a regular file; a temporary or status directory a directory (not a link); a side copy a directory holding a
    checkpoint's telling file (:data:`xckpt.engine.owned.TELLING`: the checkpoint a save moved aside is xckpt's, a
    DCP directory or a safetensors export). Anything else under such a name was not made by a save, and is never
    removed."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if kind == "lease":
        return stat.S_ISREG(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return False
    return kind != "old" or any(steps.regular(os.path.join(path, n)) is not None for n in owned.TELLING)


def _newest_mtime(path: str) -> float | None:
    """The newest modification time of ``path`` and of the entries at its top (no link followed)."""
    try:
        newest = os.lstat(path).st_mtime
        with os.scandir(path) as it:
            for e in it:
                try:
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    pass
    except OSError:
        return None
    return newest


def scan_steps(directory: Location, *, stale_after: float | None = None, name: str | None = None) -> list[Leftover]:
    """Every leftover of a checkpoint manager in the run directory ``directory`` (:data:`MANAGER_LEFTOVER`;
    none on an object store), optionally only those of step ``name``; ``kind`` is ``step`` or ``deleting``,
    ``name`` the step, ``generation`` the token.

    A staged step (``step``) is dead when no live leftover is inside it (its save's lease, see :func:`scan`)
    and neither it nor any entry at its top was modified for ``stale_after`` seconds: its save died, or
    died before moving it into place. It is dead at once, however recent, when its save's lease names a
    process of this machine that no longer runs (:func:`_save_gone`, the rule :func:`lease_live` applies): a
    save killed here; a lease of another machine, or of a process that runs, keeps it until the age rule
    above says otherwise. A step being deleted (``deleting``) is always dead: it left the run's
    listing when its deletion began, and an interrupted deletion is finished by whoever finds it. Its age
    is that of its newest modification. A link, or anything not a directory, is never one.
    """
    if not directory.is_local:
        return []
    limit = stale_after_s() if stale_after is None else stale_after
    now = time.time()
    root = directory.local_path
    entries = _listing(root)
    out = []
    for entry in entries:
        m = MANAGER_LEFTOVER.fullmatch(entry)
        if m is None or (name is not None and m["step"] != name):
            continue
        path = os.path.join(root, entry)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        newest = _newest_mtime(path)
        if newest is None:
            continue
        age = now - newest
        if m["kind"] == "deleting":
            stale = True
        else:
            inside = scan(Location(path), stale_after=limit)
            stale = (age > limit and all(x.stale for x in inside)) or _save_gone(inside)
        out.append(Leftover(path, m["kind"], m["step"], m["token"], age, stale))
    return sorted(out, key=lambda x: x.path)


def _save_gone(inside: list[Leftover]) -> bool:
    """Whether the leftovers found inside a staged step (:func:`scan`) are those of a save that is dead at once:
    it holds a lease, every lease there is stale or names a process of this machine that no longer runs
    (:func:`_lease_gone`), and everything else there is stale or belongs to such a lease's generation.
    A lease that is missing (released meanwhile), unreadable or of another machine never makes it so."""
    leases = [x for x in inside if x.kind == "lease"]
    if not leases:
        return False
    dead = {(x.name, x.generation) for x in leases if x.stale or _lease_gone(x.path)}
    return len(dead) == len(leases) and all(x.stale or (x.name, x.generation) in dead for x in inside)


def _scan_claims(directory: Location, limit: float, now: float, name: str | None) -> list[Leftover]:
    """The claims on ``directory`` and on its sub-prefixes one level down (``name``: on ``directory/name`` only,
    or with ``""`` on ``directory`` itself, read directly, without listing ``directory``)."""
    kv = _kv(directory)
    status: dict[tuple[str, str], list[str]] = {}
    if name is not None:
        keys = [f"{name}/{CLAIM}" if name else CLAIM]
    else:
        listed = [k.decode() for k in kv_result(kv.list(), str(directory))]
        keys = sorted(k for k in listed if k == CLAIM or k.endswith("/" + CLAIM) and k.count("/") == 1)
        for k in listed:
            m = STATUS_OBJECT.fullmatch(k)
            if m is not None:
                status.setdefault((m["name"], m["generation"]), []).append(k)
    out = []
    for key in keys:
        sub = key[:-len(CLAIM)].rstrip("/")  # "" for the claim of ``directory`` itself
        prefix = directory.child(sub) if sub else directory
        res = kv_result(kv.read(key), str(prefix.child(CLAIM)))
        if res.state != "value":
            continue
        record = bytes(res.value)
        beat = _heartbeat_of(record)
        # a claim that is not a record of ours was not written by a save of ours: never judged dead
        age = now - beat if beat is not None else 0.0
        out.append(Leftover(str(prefix), "claim", sub, jsonobj.string_member(record, "generation") or "", age,
                            beat is not None and age > limit, res.stamp.generation))
    claimed = {(x.name, x.generation): x for x in out}
    for (sub, gen), objects in sorted(status.items()):
        owner = claimed.get((sub, gen))
        if owner is not None:  # its save's claim says how old it is
            age, stale = owner.age_s, owner.stale
        else:  # its save is over (committed, or removed) or its claim is gone: as old as its newest record
            written = [_written_at(kv, k, str(directory.child(k))) for k in objects]
            age = now - max(written) if written and None not in written else 0.0
            stale = None not in written and age > limit  # a record without a time is never judged dead
        out.append(Leftover(str(directory.child(f".{sub}.xckpt-status-{gen}")), "status", sub, gen, age, stale))
    return out


def _written_at(kv: Any, key: str, file: str) -> float | None:
    """When a status object says it was written (its ``time``, spec 6.5), or None (gone, unreadable, or of a
    writer that did not say)."""
    res = kv_result(kv.read(key), file)
    if res.state != "value" or len(res.value) > MAX_STATUS_BYTES:
        return None
    try:
        record = msgpack.unpackb(bytes(res.value), raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    t = record.get("time") if isinstance(record, dict) else None
    return float(t) if type(t) in (int, float) and t == t else None


def _own_objects(keys: Iterable[str]) -> list[str]:
    """Of the keys under a dead save's claimed prefix, those that save may have written (its claim aside): the
    names a save writes (:func:`xckpt.format.names.may_write`), and none under a sub-prefix holding a manifest
    or a claim (a checkpoint committed, or a save begun, inside the prefix after it was claimed: a save writes
    neither name below its top level). Objects put there by others stay."""
    keys = list(keys)
    nested = tuple({k.rsplit("/", 1)[0] + "/" for k in keys
                    if "/" in k and k.rsplit("/", 1)[1] in (names.MANIFEST, CLAIM)})
    return [k for k in keys if k != CLAIM and not k.startswith(nested) and names.may_write(k)]


def _remove_replaced(leftover: Leftover, kept: str) -> bool:
    """Delete a save's temporary directory or side copy that holds a committed checkpoint other than what the save
    itself wrote: the checkpoint it replaced, left there when a step after its commit failed (the parent
    directory's sync after the exchange, the removal itself) or when it died between its two renames. Only what
    that checkpoint is made of goes (:func:`xckpt.engine.owned.remove_owned`: its telling file last, so that a
    removal cut short is finished the same way); anything else (files put into it while the save ran) stays, the
    directory renamed ``kept``, with an :class:`~xckpt.errors.XckptWarning`; one whose manifest or index cannot be
    read is kept whole. Whether it held such a checkpoint (else nothing was done); ``io.write`` when an entry of its
    own cannot be deleted (it stays, for a later try).

    A side copy always holds the replaced checkpoint. A temporary directory holds the save's own writing unless it
    holds an xckpt manifest without the save's generation (one of another save, or of format 1.0, which had none;
    a manifest that does not parse is the save's own, cut short: the checkpoint it replaced was read whole when
    the save began), or a DCP directory or safetensors export while one of the same kind stands at the destination
    (the one the save put there, or the one it would have replaced; either way the files of its kind go, and a
    safetensors export's extra top-level files, ``config.json``, are those of the export at the destination)."""
    path = leftover.path
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    kind = owned.kind_held(path)
    if kind is None:
        return False
    writes: frozenset[str] = frozenset()
    if leftover.kind == "tmp":
        final = os.path.join(os.path.dirname(path), leftover.name)
        if kind == "xckpt":
            record = steps.json_object(os.path.join(path, names.MANIFEST), MAX_READ_BYTES)
            if record is None or record.get("generation") == leftover.generation:
                return False  # the dead save's own manifest: it died before moving it into place
        elif os.path.islink(final) or not os.path.isdir(final) or owned.kind_held(final) != kind:
            return False  # nothing of its kind at the destination: the temporary directory is the conversion's own
        elif kind == "safetensors":
            writes = frozenset(e.name for e in os.scandir(final) if e.is_file(follow_symlinks=False))
    try:
        owns: owned.Owns = owned.owner(Location(path), kind, writes)[0]
    except XckptError:
        owns = lambda _name, _what: False  # noqa: E731 - which files are its own cannot be told: all stay
    where = owned.remove_owned(path, owns, kept)
    if where is not None:
        warnings.warn(f"{path} held a checkpoint a save replaced, and files that are not known to be its own; they "
                      f"were not deleted, and are in {where}", XckptWarning, stacklevel=3)
    return True


def remove(leftover: Leftover) -> None:
    """Delete one leftover (a claimed prefix: the objects its dead save may have written there, never a
    checkpoint it committed nor objects others put under it, :func:`_own_objects`; an interrupted deletion of
    a manager's step: what the step's saves wrote, never files put into it, :func:`xckpt.engine.steps.delete`;
    a temporary directory or side copy holding a checkpoint the save replaced: what that checkpoint is made of,
    never files put into it, :func:`_remove_replaced`).

    A claim is first taken over with a conditional write, and only if it is still the one judged
    dead (same storage generation): a claim renewed, released or taken over since, by a save or
    another cleaner, is no longer a leftover, and nothing is deleted. What cannot be deleted (a
    permission) is ``io.write`` naming the leftover.
    """
    if leftover.kind == "claim":
        _remove_claimed(leftover)
        return
    if leftover.kind == "status" and not Location(leftover.path).is_local:
        _remove_status_objects(leftover)
        return
    kept = os.path.join(os.path.dirname(leftover.path), f"{leftover.name}.xckpt-kept-{leftover.generation}")
    if leftover.kind == "deleting":  # what the step's saves wrote; anything put into it is kept beside it
        steps.delete(leftover.path, kept)
        return
    if leftover.kind in ("tmp", "old") and _remove_replaced(leftover, kept):
        return
    failed: list[tuple[str, str]] = []

    def note(_fn: Any, path: str, info: Any) -> None:
        exc = info[1]
        if not isinstance(exc, FileNotFoundError):  # gone meanwhile is gone
            failed.append((path, exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)))

    if os.path.isdir(leftover.path) and not os.path.islink(leftover.path):
        shutil.rmtree(leftover.path, onerror=note)
    else:
        try:
            os.unlink(leftover.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed.append((leftover.path, exc.strerror or str(exc)))
    if failed:
        path, why = failed[0]
        raise XckptError(f"cannot remove the leftover {leftover.path}: {why} ({path}"
                         + (f", and {len(failed) - 1} more" if len(failed) > 1 else "") + ")",
                         code="io.write", file=leftover.path)


def _remove_status_objects(leftover: Leftover) -> None:
    """:func:`remove` of an object store's status directory: its ``rank-<r>`` and ``outcome`` objects, nothing else
    put beside them. A store that refuses is ``io.write`` naming the object."""
    prefix = Location(leftover.path)
    file = str(prefix)
    try:
        kv = _kv(prefix)
        for k in (k.decode() for k in kv_result(kv.list(), file)):
            if re.fullmatch(_STATUS_NAME, k):
                file = str(prefix.child(k))
                kv_result(kv.write(k, None), file, write=True)
    except XckptError as exc:
        raise XckptError(f"cannot remove the leftover {leftover.path}: {exc.message}", code="io.write",
                         file=exc.file or file) from exc


def _remove_claimed(leftover: Leftover) -> None:
    """:func:`remove` of a dead claim: take it over, delete what its save may have written (:func:`_own_objects`),
    then the claim; a prefix its save committed keeps its checkpoint and gets the commit marker it may lack. A
    store that refuses is ``io.write`` naming the prefix (the claim, taken over, ages again)."""
    prefix = Location(leftover.path)
    file = str(prefix.child(CLAIM))
    try:
        kv = _kv(prefix)
        claim = _read_claim(kv, prefix)
        if claim is None or claim[0] != leftover.generation or leftover.stamp not in (None, claim[1]):
            return
        mine = kv_result(kv.write(CLAIM, _record(new_generation()), if_equal=claim[1]), file, write=True).generation
        if not mine:
            return
        keys = [k.decode() for k in kv_result(kv.list(), str(prefix))]
        # a manifest: the save committed and died before releasing its claim; the checkpoint stays, and gets
        # Orbax's commit marker if the save died before writing it (it follows the manifest)
        if names.MANIFEST in keys and names.COMMIT not in keys and _committed_by(kv, prefix, leftover.generation):
            file = str(prefix.child(names.COMMIT))
            kv_result(kv.write(names.COMMIT, names.COMMIT_TEXT, if_equal=ABSENT), file, write=True)
        for k in [] if names.MANIFEST in keys else _own_objects(keys):
            file = str(prefix.child(k))
            kv_result(kv.write(k, None), file, write=True)
        file = str(prefix.child(CLAIM))
        kv_result(kv.write(CLAIM, None, if_equal=mine), file, write=True)
    except XckptError as exc:
        raise XckptError(f"cannot remove the leftover {leftover.path}: {exc.message}", code="io.write",
                         file=exc.file or file) from exc


def _committed_by(kv: Any, prefix: Location, generation: str) -> bool:
    """Whether the manifest in the opened ``prefix`` is that of the save of ``generation`` (its ``generation``)."""
    res = kv_result(kv.read(names.MANIFEST), str(prefix.child(names.MANIFEST)))
    if res.state != "value":
        return False
    return jsonobj.string_member(bytes(res.value), "generation") == generation


def remove_stale(directory: Location, *, stale_after: float | None = None,
                 name: str | None = None) -> list[Leftover]:
    """Remove the stale leftovers of ``directory`` (see :func:`scan`); returns them."""
    return remove_all(x for x in scan(directory, stale_after=stale_after, name=name) if x.stale)


def remove_all(leftovers: Iterable[Leftover]) -> list[Leftover]:
    """Remove dead leftovers beside a save that is about to run (:func:`remove`); returns those removed. One
    that cannot be removed is not that save's to fail on: it is warned about, and the others go on."""
    gone = []
    for x in leftovers:
        try:
            remove(x)
        except XckptError as exc:
            warnings.warn(XckptWarning(str(exc)), stacklevel=3)
            continue
        gone.append(x)
    return gone


def _process_runs(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie, killed but not yet reaped, does not)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
        return st[st.rindex(b")") + 2:][:1] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True


def _owner_gone(record: bytes) -> bool:
    """Whether a lease record names a process of this machine (same host, boot and process-id namespace)
    that no longer runs. A record of another machine, or one that cannot be read, never does."""
    try:
        obj = json.loads(record.decode())
    except (UnicodeDecodeError, ValueError):
        return False
    if not isinstance(obj, dict) or any(obj.get(k) != v for k, v in _MACHINE.items()):
        return False
    pid = obj.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    return not _process_runs(pid)


def lease_live(final: Location, generation: str, *, stale_after: float | None = None) -> bool:
    """Whether the save ``generation`` to the local ``final`` still holds its lease: the lease file is there,
    was renewed within ``stale_after`` seconds (default ``XCKPT_STALE_AFTER_S``), and does not name a process
    of this machine that is gone (a save killed here is dead at once; one of another machine only once its
    lease is stale)."""
    limit = stale_after_s() if stale_after is None else stale_after
    path = sibling(final, "lease", generation).local_path
    seen = _mtime(path)
    if seen is None or time.time() - seen > limit:
        return False
    return not _lease_gone(path)


def _lease_gone(path: str) -> bool:
    """Whether the local lease file ``path`` names a process of this machine that no longer runs
    (:func:`_owner_gone`). One that is missing, a link, or cannot be read does not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            record = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return False
    return _owner_gone(record)


#: Files one of which a side copy holds when it is a whole checkpoint (xckpt, DCP, safetensors).
_CHECKPOINT_FILES = (names.MANIFEST, names.DCP_METADATA, safetensors.SINGLE_FILE, safetensors.INDEX_FILE)


def _side_copies(final: Location) -> list[Leftover]:
    """The whole side copies of the missing local ``final``, newest first (none when ``final`` exists)."""
    if not final.is_local or os.path.lexists(final.local_path):
        return []
    parent, name = os.path.split(final.local_path.rstrip("/"))
    olds = [x for x in scan(Location(parent), name=name) if x.kind == "old"]
    return [x for x in sorted(olds, key=lambda x: x.age_s)
            if any(os.path.exists(os.path.join(x.path, n)) for n in _CHECKPOINT_FILES)]


def live_side_copy(final: Location, *, stale_after: float | None = None) -> Location | None:
    """The side copy a live save (:func:`lease_live`) made of the missing local ``final``, between its two
    renames: the checkpoint that stood at ``final``, whole, which a reader may read meanwhile (the save
    deletes it once the new one is in place; a reader then starts again). None when there is none."""
    for old in _side_copies(final):
        if lease_live(final, old.generation, stale_after=stale_after):
            return Location(old.path)
    return None


def recover(final: Location, *, stale_after: float | None = None, dry_run: bool = False) -> bool:
    """Restore a side copy (``.<name>.xckpt-old-<g>``) to ``final`` when ``final`` is missing: what a
    replace without an atomic exchange leaves if it dies between its two renames. Returns whether
    it restored one (``dry_run``: whether it would, changing nothing).

    A side copy whose save is alive (:func:`lease_live`, with ``stale_after``) is that save's, between its
    two renames: while there is one, nothing is restored (the save puts either checkpoint in place itself).
    """
    olds = _side_copies(final)
    if not olds or any(lease_live(final, x.generation, stale_after=stale_after) for x in olds):
        return False
    if dry_run:
        return True
    try:
        atomic.move_new(olds[0].path, final.local_path)
    except OSError:
        return False
    atomic.sync_dir(os.path.dirname(final.local_path.rstrip("/")) or ".")
    return True
