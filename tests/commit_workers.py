"""A rank of the failure tests of ``save_async`` and the DCP ``StorageWriter`` (tests/test_commit_async.py).

Run as ``python tests/commit_workers.py SCENARIO RANK WORLD PORT WORKDIR``: real gloo process
groups, one process per rank. Each step writes ``<step>.rank<r>.json`` (what it saw) into
WORKDIR for the test to check; failures are injected with ``XCKPT_FAILPOINTS``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path


def report(wd: Path, step: str, rank: int, **what: object) -> None:
    """Record what one step saw on this rank."""
    (wd / f"{step}.rank{rank}.json").write_text(json.dumps(what))


def tree(rank: int, world: int, value: float) -> dict:
    """A 2-rank tree: a DTensor sharded by rows, a replicated tensor and a step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = torch.full((256, 256), value, dtype=torch.float32)
    return {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": distribute_tensor(torch.arange(64.0) + value, mesh,
                                                                                 [Replicate()]), "step": int(value)}


def attempt(wd: Path, step: str, rank: int, fn) -> None:
    """Run ``fn``; record its error's code and message (or success) and how long it took."""
    started = time.monotonic()
    try:
        fn()
        report(wd, step, rank, ok=True, seconds=time.monotonic() - started)
    except BaseException as exc:  # noqa: BLE001 - recorded (torch DCP raises a BaseException)
        report(wd, step, rank, ok=False, code=getattr(exc, "code", None), error=str(exc),
               seconds=time.monotonic() - started)


def failing_rank(rank: int, world: int, wd: Path) -> None:
    """Rank 1 fails (an OSError) in the background of a save_async, then in a DCP StorageWriter's write_data;
    finally rank 1 dies (SIGKILL) right after staging a save_async, and rank 0 waits on it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import xckpt
    from xckpt_torch import XckptStorageWriter

    os.environ["XCKPT_FAILPOINTS"] = "before_status@1:raise"
    attempt(wd, "async_fails", rank,
            lambda: xckpt.save_async(tree(rank, world, 1.0), wd / "async_fails", commit_timeout_s=20).wait())
    dist.barrier()

    os.environ["XCKPT_FAILPOINTS"] = "after_write@1:raise"
    attempt(wd, "dcp_fails", rank, lambda: dcp.save(tree(rank, world, 2.0), storage_writer=XckptStorageWriter(
        wd / "dcp_fails")))
    dist.barrier()

    os.environ["XCKPT_FAILPOINTS"] = "after_stage@1:kill"
    handle = xckpt.save_async(tree(rank, world, 3.0), wd / "async_dies", commit_timeout_s=3)
    attempt(wd, "async_dies", rank, handle.wait)
    os._exit(0)  # the process group lost rank 1: no collective shutdown


def exit_pending(rank: int, world: int, wd: Path) -> None:
    """Rank 1 dies right after staging a save_async; rank 0 never waits and lets its interpreter exit."""
    import xckpt

    os.environ["XCKPT_FAILPOINTS"] = "after_stage@1:kill"
    xckpt.save_async(tree(rank, world, 4.0), wd / "exit_pending", commit_timeout_s=3)
    report(wd, "exit_pending", rank, returned_at=time.time())
    # falls off the end: the interpreter exits with the save pending


def root_dies(rank: int, world: int, wd: Path) -> None:
    """Rank 0 dies (SIGKILL) in the background of a save_async, after its own status; rank 1 waits."""
    import xckpt

    os.environ["XCKPT_FAILPOINTS"] = "after_status@0:kill"
    handle = xckpt.save_async(tree(rank, world, 5.0), wd / "root_dies", commit_timeout_s=3)
    attempt(wd, "root_dies", rank, handle.wait)
    os._exit(0)


def main() -> None:
    """Initialise the gloo group and run the scenario."""
    scenario, rank, world, port, wd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        {"failing_rank": failing_rank, "exit_pending": exit_pending, "root_dies": root_dies}[scenario](rank, world, wd)
    except BaseException:
        report(wd, f"{scenario}_crash", rank, error=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
