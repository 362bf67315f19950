"""Named points of the save and commit protocol where a test can make a process die or fail.

Inactive unless the environment variable ``XCKPT_FAILPOINTS`` names points, as a comma
separated list of ``point[@rank][:action]``: ``action`` is ``kill`` (the default: the
process sends itself SIGKILL, as a node that dies would), ``raise`` (an ``OSError``, as
a failing disk would) or ``stop`` (SIGSTOP: every thread of the process stands still until
someone sends SIGCONT, as a paused machine would, then the save goes on); ``@rank`` limits
it to one process. For example
``XCKPT_FAILPOINTS=after_write@1,before_publish:raise``. The points are listed in
:data:`POINTS`, in the order a save reaches them.
"""

from __future__ import annotations

import functools
import os
import signal

#: Every point, in protocol order (the last five only on an asynchronous save).
POINTS = (
    "after_plan",          # every process: planned, the temporary directory and the lease exist
    "mid_write",           # every process: after its first chunk object
    "after_write",         # every process: all its objects written and synced
    "before_commit_files", # coordinator: every process reported success
    "after_values",        # coordinator: the values file and the Orbax view are written
    "after_manifest",      # coordinator: the manifest is written (object stores: the commit), commit_success.txt not
    "after_commit_marker", # coordinator: commit_success.txt is written too, and everything synced
    "before_publish",      # coordinator: everything synced, not yet moved into place
    "after_aside",         # coordinator, replace without an atomic exchange: the old checkpoint is aside
    "after_exchange",      # coordinator: the new checkpoint is in place, the old one not yet removed
    "after_publish",       # coordinator: the old checkpoint is removed, the lease not yet released
    "after_stage",         # asynchronous: this process staged its shards
    "before_status",       # asynchronous: this process wrote its objects, not its status
    "after_status",        # asynchronous: this process reported its status
)


@functools.lru_cache(maxsize=8)
def _parse(spec: str) -> dict[str, tuple[int | None, str]]:
    out: dict[str, tuple[int | None, str]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        point, _, action = item.partition(":")
        point, _, rank = point.partition("@")
        if point not in POINTS or action not in ("", "kill", "raise", "stop"):
            raise ValueError(f"XCKPT_FAILPOINTS: unknown point or action in {item!r}")
        out[point] = (int(rank) if rank else None, action or "kill")
    return out


def hit(point: str, rank: int = 0) -> None:
    """Die, fail or stand still here if ``XCKPT_FAILPOINTS`` says so for ``point`` on ``rank``."""
    spec = os.environ.get("XCKPT_FAILPOINTS")
    if not spec:
        return
    found = _parse(spec).get(point)
    if found is None or (found[0] is not None and found[0] != rank):
        return
    if found[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if found[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    raise OSError(f"failpoint {point} on rank {rank}")
