"""Reading a PyTorch DCP checkpoint in place: xckpt.load against DCP's own load, in one process.

W1's whole tree (24 x fp32 3328x3328, 200 x fp32[1024], the step; 1.06 GB) as plain tensors is
saved once with ``dcp.save`` (``FileSystemWriter`` defaults, no process group) under ``--root``
(default /dev/shm). Then, after an untimed warm-up round, ``--repeats`` interleaved rounds of:

* DCP: ``dcp.load(targets, storage_reader=FileSystemReader(path))`` into preallocated tensors (allocated
  and zeroed before the timed call: a model's parameters already in memory);
* xckpt: ``xckpt.load(path, like=targets)`` into the same kind of preallocated tensors (each DCP
  chunk wanted whole is read straight from its archive into the tensor's memory);
* xckpt into numpy: ``xckpt.load(path)``, the whole tree as new numpy arrays (DCP has no such load).

Every load is compared with the saved tree element by element (a difference raises). The table
gives medians: seconds, bytes read (/proc/self/io ``rchar``), and peak RSS growth during the call
(the numpy load's includes its new arrays; on this VM faulting in fresh memory alone swings from
0.2 to 1 s per GB from run to run).

    .venv/bin/python benchmarks/bench_dcp_read.py --repeats 3
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np

import _common as C

METHODS = ("xckpt", "DCP")


def run(wl: C.Workload, repeats: int) -> C.Table:
    """Save ``wl`` with DCP once, load it back with each method ``repeats`` times; return the table."""
    import torch
    import torch.distributed.checkpoint as dcp

    import xckpt

    warnings.filterwarnings("ignore")  # "torch.distributed is disabled ... single process"
    tree = C.full_arrays(wl)
    state = {k: torch.from_numpy(a.copy()) for k, a in tree.items()}  # (C order; a 0-d array stays 0-d)
    nbytes = sum(a.nbytes for a in tree.values())
    root = C.fresh_dir("dcp-read")
    path = os.path.join(root, "ckpt")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in (*METHODS, "numpy")}
    try:
        C.log(f"dcp.save of {len(state)} tensors ({nbytes / C.GB:.3f} GB)")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)

        def load(m: str, targets: dict[str, torch.Tensor]) -> dict[str, object]:
            """Load the whole tree with method ``m`` (into ``targets`` but for numpy)."""
            if m == "numpy":
                return xckpt.load(path)
            if m == "xckpt":
                return xckpt.load(path, like=targets)
            dcp.load(targets, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            return targets

        for rep, order in C.rounds((*METHODS, "numpy"), repeats):
            for m in order:
                targets = {} if m == "numpy" else {k: torch.zeros_like(t) for k, t in state.items()}  # in memory
                sample, got = C.measure(lambda m=m, t=targets: load(m, t))
                for k, a in tree.items():
                    v = got[k]
                    C.check_equal(k, np.asarray(v.numpy() if isinstance(v, torch.Tensor) else v), a,
                                  f"{m} load, {C.run_name(rep)}")
                del got, targets
                if rep is not None:
                    runs[m].append({"s": sample.seconds, "rchar": sample.rchar, "peak": sample.growth})
                C.log(f"{m:<5} {C.run_name(rep)}: {sample.seconds:.2f} s, verified")
    finally:
        C.remove(root)

    def med(key: str, scale: float = 1.0) -> list[float]:
        """Median over runs of one quantity: xckpt (tensors), DCP, xckpt (numpy)."""
        return [C.median(r[key] for r in runs[m]) / scale for m in (*METHODS, "numpy")]

    t = C.Table(f"A DCP checkpoint read in place, 1 process, {C.ROOT}, median of {repeats}\n  {C.size_note(wl)}"
                "\n  xckpt and DCP load into preallocated tensors; 'xckpt numpy' loads the whole tree as numpy",
                [*METHODS, "xckpt numpy"])
    t.add("load s", med("s"))
    t.add("load: bytes read GB", med("rchar", C.GB), fmt="{:.3f}")
    t.add("load: peak RSS growth GB", med("peak", C.GB))
    return t


def main() -> int:
    """Parse flags, run, print the table."""
    args = C.parse(C.common_args(__doc__.splitlines()[0], workload=False))
    C.log_xckpt()
    run(C.w1(args.scale), args.repeats).print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
