"""Finding and removing what dead saves left behind (``xckpt gc``).

A save that dies (killed, or its node lost) can leave beside its destination a temporary
directory, a lease, a status directory or a side copy (``.<name>.xckpt-<kind>-<generation>``),
and on an object store a claimed prefix; a :class:`xckpt.CheckpointManager` save can leave its
staged step (``.<step>.xckpt-step-<token>``, holding that save's temporary directory and lease)
and an interrupted deletion (``.<step>.xckpt-deleting-<token>``) beside the steps of a run.
A later save to the same parent (a manager's next save, for a run) removes those whose lease
went unrenewed for longer than the stale age; :func:`gc` does it on demand, by the same rules
(:func:`xckpt.engine.claims.scan`, :func:`xckpt.engine.claims.scan_steps`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from xckpt.engine import claims
from xckpt.engine.storage import Location
from xckpt.errors import XckptError


@dataclass(frozen=True)
class Collected:
    """One leftover and what :func:`gc` did with it."""

    leftover: claims.Leftover
    action: str  # "removed", "restored" (a side copy moved back to its missing destination), "kept" (live),
    #              "failed" (it could not be removed: ``error`` says why)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description."""
        return {**self.leftover.to_json(), "action": self.action, "error": self.error}


def gc(path: Any, *, older_than_s: float | None = None, dry_run: bool = False) -> list[Collected]:
    """Remove the leftovers of dead saves in the directory (or object-store prefix) ``path``, and those
    beside ``path`` itself when it names a checkpoint; returns every leftover found, with what was done.

    A leftover is dead when its save's lease was not renewed for ``older_than_s`` seconds
    (default ``XCKPT_STALE_AFTER_S``, an hour); a live one is kept. A side copy whose
    destination is missing is the checkpoint itself: it is restored, never removed, and left
    alone while the save that moved it aside is alive. A directory that is the root of a
    :class:`xckpt.CheckpointManager` run also yields the manager's leftovers: a staged step is
    dead when no live lease is inside it and it was untouched for ``older_than_s``, or at once when
    its save's lease names a process of this machine that no longer runs (a save killed here); an
    interrupted deletion always is. ``dry_run`` only reports ("would remove", "would restore"). A
    leftover that cannot be removed (a permission) is reported as "failed", with why; the others are still
    removed. A path whose directory does not exist is ``io.read``.
    """
    loc = Location.of(path)
    if older_than_s is not None and not (math.isfinite(older_than_s) and older_than_s >= 0):
        raise XckptError(f"older_than_s must be a number of seconds, 0 or more, not {older_than_s}",
                         code="gc.option", file=str(loc))
    if loc.is_local and not os.path.lexists(loc.local_path) and not os.path.isdir(os.path.dirname(loc.local_path)):
        # (a checkpoint path that does not exist is fine: a dead first save may have left things beside it)
        raise XckptError(f"neither {loc.local_path} nor the directory it would be in exists", code="io.read",
                         file=loc.local_path)
    found = {x.path: x for x in claims.scan(loc, stale_after=older_than_s)}
    found.update((x.path, x) for x in claims.scan_steps(loc, stale_after=older_than_s))
    parent, _, name = loc.url.rstrip("/").rpartition("/")
    if parent and name and (loc.is_local or "://" in parent):  # a bucket (s3://b) has no parent: s3:/ is no place
        found.update((x.path, x) for x in claims.scan(Location(parent), stale_after=older_than_s, name=name))
        found.update((x.path, x) for x in claims.scan_steps(Location(parent), stale_after=older_than_s, name=name))
    out = []
    for x in sorted(found.values(), key=lambda x: x.path):
        final = os.path.join(os.path.dirname(x.path), x.name)
        if x.kind == "old" and not os.path.lexists(final):
            restored = claims.recover(Location(final), stale_after=older_than_s, dry_run=dry_run)
            out.append(Collected(x, ("would restore" if dry_run else "restored") if restored else "kept"))
        elif x.stale:
            try:
                if not dry_run:
                    claims.remove(x)
            except XckptError as exc:  # the others are still tried
                out.append(Collected(x, "failed", exc.message))
                continue
            out.append(Collected(x, "would remove" if dry_run else "removed"))
        else:
            out.append(Collected(x, "kept"))
    return out
