"""W1's PyTorch save in a loop, xckpt against DCP and the bare bytes: wall time and the CPU time it costs, less noise.

One group of 4 gloo ranks holds W1 as ``bench_torch.py`` does (matrices ``[Shard(0)]``, vectors
``[Replicate()]``) and saves it ``--repeats`` times with each method, alternating their order from
round to round, into a fresh directory each time (deleted before the next save; the first round is an
untimed warm-up). The third method, ``raw``, is the floor of any save in these processes: each rank
writes the bytes it holds, its shard of every matrix and every fourth vector (rank 0 the step too),
one file per array with ``tofile`` + flush + ``os.fsync`` on 2 threads, with no checksum, no layout,
no metadata and no commit. Per save: the wall time between barriers (the max over ranks) and the CPU time of
the 4 processes, all their threads (``getrusage``), user and system, summed over the ranks. On a host
that shares its cores, a save's wall time swings with what the host does; its CPU time does not, and
with 4 ranks on 2 cores a save's wall time is about its CPU time over 2. Timing only: ``bench_torch.py``
checks the checkpoints element by element.

    python benchmarks/bench_save_loop.py [--repeats 12] [--root /dev/shm]
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

import _common as C
import bench_torch as B

WORLD = 4
METHODS = ("xckpt", "DCP", "raw")


def _held(state: dict[str, Any], rank: int) -> dict[str, np.ndarray]:
    """What ``raw`` writes on this rank: its shard of every matrix, every fourth vector, and on rank 0 the step."""
    from torch.distributed.tensor import DTensor

    vectors = sorted(k for k, v in state.items() if isinstance(v, DTensor) and v.ndim == 1)
    mine = set(vectors[rank::WORLD])  # vector j is written by rank j % WORLD
    out: dict[str, np.ndarray] = {}
    for k, v in state.items():
        if not isinstance(v, DTensor):
            if rank == 0:
                out[k] = v.numpy()
        elif v.ndim != 1 or k in mine:
            out[k] = v.to_local().numpy()
    return out


def _rank(rank: int, port: int, repeats: int, root: str, out: str) -> None:
    """One rank: save W1 ``repeats + 1`` times with each method; write each timed save's measurements."""
    mesh = B._init(rank, WORLD, port)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import xckpt

    wl = C.w1(1.0)
    state = B._source_state(wl, mesh, rank, WORLD)
    mine = _held(state, rank)
    got: list[dict[str, Any]] = []
    for r, order in C.rounds(METHODS, repeats):
        for m in order:
            path = os.path.join(root, f"loop_{m}_{r}")
            dist.barrier()
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            if m == "xckpt":
                xckpt.save(state, path)
            elif m == "DCP":
                dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
            else:
                C.raw_save(mine, os.path.join(path, f"rank{rank}"))
            seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            dist.barrier()
            if r is not None:  # None: the warm-up
                got.append({"method": m, "round": r, "s": seconds, "user": after.ru_utime - before.ru_utime,
                            "sys": after.ru_stime - before.ru_stime})
            if rank == 0:
                shutil.rmtree(path)
            dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


def main() -> int:
    """Run the loop and print its table (exit 1 on a failed goal with --strict)."""
    p = C.common_args(__doc__.splitlines()[0], workload=False)
    p.set_defaults(repeats=12)
    args = C.parse(p)
    import torch.multiprocessing as mp

    C.log_xckpt()
    root = tempfile.mkdtemp(dir=C.ROOT, prefix="xckpt-bench-loop-")
    out = tempfile.mkdtemp(prefix="xckpt-bench-loop-results-")
    try:
        mp.spawn(_rank, args=(C.free_port(), args.repeats, root, out), nprocs=WORLD)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(WORLD)]
    finally:
        C.remove(root)
        shutil.rmtree(out, ignore_errors=True)
    saves: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for i, first in enumerate(ranks[0]):
        saves[first["method"]].append({"s": max(r[i]["s"] for r in ranks), "user": sum(r[i]["user"] for r in ranks),
                                       "sys": sum(r[i]["sys"] for r in ranks)})
    for m in METHODS:
        C.log(f"{m}: wall " + " ".join(f"{x['s']:.3f}" for x in saves[m]) + " s; CPU "
              + " ".join(f"{x['user'] + x['sys']:.2f}" for x in saves[m]) + " CPU-s")
    wl = C.w1(1.0)
    t = C.Table(f"W1 torch save in a loop (4 gloo ranks, [Shard(0)]), {C.ROOT}, median of {args.repeats} "
                f"alternating rounds\n  {C.size_note(wl)}", list(METHODS))
    wall = {m: C.median(x["s"] for x in saves[m]) for m in METHODS}
    cpu = {m: C.median(x["user"] + x["sys"] for x in saves[m]) for m in METHODS}
    t.add("save s (wall, max over ranks)", [wall[m] for m in METHODS], fmt="{:.3f}", goal=C.Goal("<=", 0.6))
    t.add("save s / raw's", [wall[m] / wall["raw"] for m in METHODS],
          note=f"0.6 x DCP's time is this many times raw's: {0.6 * wall['DCP'] / wall['raw']:.2f}")
    t.add("CPU-s, user (4 ranks)", [C.median(x["user"] for x in saves[m]) for m in METHODS])
    t.add("CPU-s, system (4 ranks)", [C.median(x["sys"] for x in saves[m]) for m in METHODS])
    t.add("CPU-s, total (4 ranks)", [cpu[m] for m in METHODS])
    t.add("CPU-s, total / raw's", [cpu[m] / cpu["raw"] for m in METHODS])
    t.print()
    return 1 if args.strict and t.failed else 0


if __name__ == "__main__":
    sys.exit(main())
