"""Peak host memory per rank while saving a sharded model: xckpt vs torch DCP vs gathering.

Spawns ``--ranks`` gloo processes on CPU. Each holds ``--tensors`` local shards of
``rows x cols`` float32 (its shard), so the model is ``ranks`` times larger than
one shard. For each method, each rank takes its peak RSS during the save (the kernel's
high-water mark, else sampled every half millisecond) and reports its growth over the RSS
just before it.
Checkpoints are written under /dev/shm and deleted.

    .venv/bin/python benchmarks/bench_torch_memory.py --ranks 4 --tensors 16 --rows 1024 --cols 1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
import warnings

import _common as C


class _Peak(C.PeakRSS):
    """:class:`_common.PeakRSS` (sampling every half millisecond where the kernel keeps no peak), plus the
    seconds the block took."""

    def __init__(self) -> None:
        """Sample every 0.5 ms, where sampling is needed."""
        super().__init__(interval=0.0005)

    def __enter__(self) -> "_Peak":
        """Start measuring the peak, and the clock."""
        super().__enter__()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the clock, then read the peak."""
        self.seconds = time.perf_counter() - self.t0
        super().__exit__(*exc)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One rank: save its shards with every method in turn, write its peak RSS growth to rank<N>.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    import gc

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import xckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    model = {f"layer{i}": DTensor.from_local(torch.randn(args.rows, args.cols, generator=g), mesh, [Shard(0)],
                                             run_check=False) for i in range(args.tensors)}
    shard = args.tensors * args.rows * args.cols * 4
    xckpt.save({"warm": model["layer0"]}, os.path.join(out, "warm"))   # thread pools, imports
    dcp.save({"warm": model["layer0"]}, storage_writer=dcp.FileSystemWriter(os.path.join(out, "warm_dcp")))

    def gather_then_save(path: str) -> None:
        """The naive way: gather every full tensor, rank 0 writes them with np.save."""
        full = {k: v.full_tensor() for k, v in model.items()}   # what xckpt never does
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            for k, v in full.items():
                np.save(os.path.join(path, k + ".npy"), v.numpy())
        dist.barrier()

    methods = {
        "xckpt (max_inflight 8 MiB)": lambda p: xckpt.save({"model": model}, p, max_inflight_bytes=8 << 20),
        "xckpt (default, 256 MiB)": lambda p: xckpt.save({"model": model}, p),
        "xckpt zstd (8 MiB)": lambda p: xckpt.save({"model": model}, p, compression="zstd",
                                                   max_inflight_bytes=8 << 20),
        "torch DCP FileSystemWriter": lambda p: dcp.save({"model": model}, storage_writer=dcp.FileSystemWriter(p)),
        "gather full tensors, rank 0 writes": gather_then_save,
    }
    report = {}
    for i, (name, fn) in enumerate(methods.items()):
        gc.collect()
        dist.barrier()
        path = os.path.join(out, f"m{i}")
        with _Peak() as peak:
            fn(path)
        dist.barrier()
        report[name] = {"growth": peak.peak - peak.base, "seconds": peak.seconds}
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"shard": shard, "report": report}, f)
    dist.destroy_process_group()


def main() -> None:
    """Run the benchmark and print one line per method."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=1024)
    args = p.parse_args()
    import torch.multiprocessing as mp
    port = C.free_port()
    out = C.fresh_dir("torch-memory")
    try:
        mp.spawn(_worker, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True)
        reports = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.ranks)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    shard = reports[0]["shard"]
    mib = 1 << 20
    print(f"{args.ranks} ranks, shard {shard / mib:.0f} MiB per rank, model {args.ranks * shard / mib:.0f} MiB "
          f"(peak RSS growth during the save, max over ranks)")
    print(f"{'method':<38} {'peak growth':>12} {'x shard':>8} {'rank 0':>10} {'seconds':>8}")
    for name in reports[0]["report"]:
        growth = max(r["report"][name]["growth"] for r in reports)
        r0 = reports[0]["report"][name]["growth"]
        secs = max(r["report"][name]["seconds"] for r in reports)
        print(f"{name:<38} {growth / mib:>9.1f} MiB {growth / shard:>8.2f} {r0 / mib:>6.1f} MiB {secs:>8.2f}")


if __name__ == "__main__":
    sys.exit(main())
