"""xckpt save and full-load throughput on numpy arrays in one process, against raw files.

The tree is W1's 24 matrices (8 layers x weight, exp_avg, exp_avg_sq, fp32 3328x3328,
1.06 GB) as numpy arrays in one dict. Measured after an untimed warm-up round at full
size, interleaved (xckpt, raw; raw, xckpt; ...) ``--repeats`` times, each run in a fresh
directory under ``--root`` (default /dev/shm) deleted afterwards:

* xckpt: ``xckpt.save(tree, path)`` and the full load ``xckpt.load(path)``;
* raw: one file per matrix written by 2 threads with ``ndarray.tofile`` + flush + ``os.fsync``,
  read back by 2 threads with ``np.fromfile``.

Every load is compared with the saved arrays element by element (a difference raises).
The table gives seconds, GB/s (the goal: xckpt >= 0.6 x raw, for save and for load),
bytes read (/proc/self/io ``rchar`` delta around the load) and peak RSS (the kernel's
high-water mark, reset before the call); medians over the runs.

Run (full size, then a quick reduced-size check)::

    .venv/bin/python benchmarks/bench_numpy.py --repeats 3
    .venv/bin/python benchmarks/bench_numpy.py --scale 0.1 --repeats 1
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np

import _common as C

METHODS = ("xckpt", "raw")


def run(wl: C.Workload, repeats: int) -> C.Table:
    """Measure save and full load of ``wl``'s matrices with xckpt and raw files; return the table."""
    import xckpt

    C.log(f"numpy: building {len(wl.matrices)} x fp32 {wl.side}x{wl.side}")
    tree = C.full_arrays(wl, matrices_only=True)
    nbytes = sum(a.nbytes for a in tree.values())
    warm = C.fresh_dir("numpy-warm")
    try:
        xckpt.save({"warm": np.ones((64, 64), np.float32)}, os.path.join(warm, "ckpt"))
        xckpt.load(os.path.join(warm, "ckpt"))
    finally:
        C.remove(warm)

    def save(m: str, path: str) -> None:
        """Save the tree with method ``m``."""
        if m == "xckpt":
            xckpt.save(tree, path)
        else:
            C.raw_save(tree, path)

    def load(m: str, path: str) -> dict[str, np.ndarray]:
        """Load the whole tree with method ``m``."""
        return xckpt.load(path) if m == "xckpt" else C.raw_load(tree, path)

    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for rep, order in C.rounds(METHODS, repeats):
        for m in order:
            root = C.fresh_dir(f"numpy-{m}")
            try:
                path = os.path.join(root, "ckpt")
                s, _ = C.measure(lambda: save(m, path))
                ld, got = C.measure(lambda: load(m, path))
                if set(got) != set(tree):
                    raise AssertionError(f"numpy {m} load, {C.run_name(rep)}: keys differ from the saved tree")
                for k, a in tree.items():
                    C.check_equal(k, np.asarray(got[k]), a, f"numpy {m} load, {C.run_name(rep)}")
                del got
                gc.collect()
                if rep is not None:
                    runs[m].append({"save": s.seconds, "load": ld.seconds, "rchar": ld.rchar,
                                    "save_peak": s.peak_rss, "load_peak": ld.peak_rss})
                C.log(f"numpy {m:<5} {C.run_name(rep)}: save {s.seconds:.2f} s, load {ld.seconds:.2f} s, verified")
            finally:
                C.remove(root)

    def med(key: str, scale: float = 1.0) -> list[float]:
        """Median over runs of one quantity, for each method."""
        return [C.median(r[key] for r in runs[m]) / scale for m in METHODS]

    t = C.Table(f"numpy, 1 process: W1's {len(wl.matrices)} matrices ({nbytes / C.GB:.3f} GB) in one dict, {C.ROOT}, "
                f"median of {repeats}\n  raw = 2 threads, tofile+flush+fsync per matrix / np.fromfile",
                list(METHODS))
    save_s, load_s = med("save"), med("load")
    t.add("save s", save_s)
    t.add("load s (full)", load_s)
    t.add("save GB/s", [nbytes / C.GB / x for x in save_s], goal=C.Goal(">=", 0.6))
    t.add("load GB/s", [nbytes / C.GB / x for x in load_s], goal=C.Goal(">=", 0.6))
    t.add("load: bytes read GB", med("rchar", C.GB), fmt="{:.3f}")
    t.add("save: peak RSS GB", med("save_peak", C.GB))
    t.add("load: peak RSS GB", med("load_peak", C.GB), note="includes the saved tree held in memory")
    return t


def main() -> int:
    """Parse flags, run, print the table (exit 1 on a failed goal with --strict)."""
    args = C.parse(C.common_args(__doc__.splitlines()[0], workload=False))
    C.log_xckpt()
    t = run(C.w1(args.scale), args.repeats)
    t.print()
    return 1 if args.strict and t.failed else 0


if __name__ == "__main__":
    sys.exit(main())
