"""Save/load throughput of xckpt against its peers, single process, on local disk.

Prints MB/s for: xckpt save, xckpt load, xckpt partial load (1/8 of every array),
numpy ``np.save`` per array, and Orbax ``StandardCheckpointer`` (if installed).
Usage: python benchmarks/bench_save_load.py [--mb 512] [--arrays 16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import xckpt


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    """Run the benchmark and print a table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512, help="total array megabytes")
    ap.add_argument("--arrays", type=int, default=16)
    args = ap.parse_args()
    rows = args.mb * (1 << 20) // args.arrays // 4 // 1024
    rng = np.random.default_rng(0)
    tree = {"model": {f"layer{i}.weight": rng.standard_normal((rows, 1024)).astype(np.float32)
                      for i in range(args.arrays)}, "step": 1}
    total = sum(a.nbytes for a in tree["model"].values()) / 1e6
    root = tempfile.mkdtemp(prefix="xckpt-bench-")
    results: list[tuple[str, float]] = []
    try:
        p = os.path.join(root, "xckpt")
        results.append(("xckpt save", _timed(lambda: xckpt.save(tree, p))))
        results.append(("xckpt load (all)", _timed(lambda: xckpt.load(p))))
        like = {"model": {k: xckpt.ReadSpec(region=(slice(0, rows // 8), slice(0, 1024))) for k in tree["model"]}}
        t = _timed(lambda: xckpt.load(p, like=like))
        results.append(("xckpt load (1/8 region)", t * 8))
        n = os.path.join(root, "npy")
        os.makedirs(n)
        results.append(("np.save per array", _timed(lambda: [np.save(os.path.join(n, k), v)
                                                             for k, v in tree["model"].items()])))
        results.append(("np.load per array", _timed(lambda: [np.load(os.path.join(n, k + ".npy"))
                                                             for k in tree["model"]])))
        try:
            import orbax.checkpoint as ocp
            o = os.path.join(root, "orbax")
            ckptr = ocp.StandardCheckpointer()
            results.append(("orbax save (OCDBT)", _timed(lambda: (ckptr.save(o, tree), ckptr.wait_until_finished()))))
            results.append(("orbax restore", _timed(lambda: ckptr.restore(o))))
        except ImportError:
            pass
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{total:.0f} MB in {args.arrays} float32 arrays, {os.cpu_count()} cores")
    for name, secs in results:
        print(f"  {name:<26} {secs:7.3f} s  {total / secs:8.0f} MB/s"
              + ("  (time x8 for the full size)" if "1/8" in name else ""))


if __name__ == "__main__":
    main()
