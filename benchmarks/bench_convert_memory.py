"""Peak host memory while converting a DCP checkpoint: ``xckpt convert --from dcp`` vs DCP's own converter.

A DCP checkpoint of ``--tensors`` float32 tensors of ``--mib`` MiB each (and a step) is written
once under /dev/shm. Each method then runs in a fresh process, which reports its peak RSS
growth during the conversion (the kernel's high-water mark):

- ``xckpt convert --from dcp`` (:func:`xckpt.convert`): reads one stored item at a time, each
  straight into its tensor's memory, and writes it while the next is read: its peak stays near two
  items, whatever the state's size (before, each item was held twice over: as bytes, and as its tensor).
- ``dcp_to_torch_save`` (``torch.distributed.checkpoint.format_utils``): loads the whole state, then
  ``torch.save``s it.

    .venv/bin/python benchmarks/bench_convert_memory.py --tensors 4 --mib 256
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings

import _common as C

MIB = 1 << 20


def _make(src: str, tensors: int, mib: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    n = mib * MIB // 4
    state = {f"w{i}": torch.arange(n, dtype=torch.float32) + i for i in range(tensors)}
    state["step"] = torch.tensor(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=src, no_dist=True)


def _convert(method: str, src: str, dst: str) -> None:
    """Run in a fresh process: convert, print the peak RSS growth in bytes."""
    import torch  # noqa: F401 - imported before the base is taken, by both methods alike

    if method == "xckpt":
        from xckpt.convert import convert as xckpt_convert
        convert = lambda: xckpt_convert(src, dst, source="dcp")  # noqa: E731
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        convert = lambda: dcp_to_torch_save(src, os.path.join(dst, "model.pt"))  # noqa: E731
        os.makedirs(dst)
    with C.PeakRSS() as peak:
        convert()
    print(peak.peak - peak.base)


def main() -> None:
    """Write the DCP checkpoint, convert it by each method in a fresh process, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=4)
    p.add_argument("--mib", type=int, default=256, help="MiB per tensor (one DCP item each)")
    p.add_argument("--convert", nargs=3, help=argparse.SUPPRESS)  # method src dst: the child's part
    args = p.parse_args()
    if args.convert:
        _convert(*args.convert)
        return
    src = C.fresh_dir("convmem-src")
    _make(src, args.tensors, args.mib)
    item = args.mib * MIB
    peaks = {}
    for method in ("xckpt", "dcp_to_torch_save"):
        dst = C.fresh_dir(f"convmem-{method}")
        C.remove(dst)
        out = subprocess.run([sys.executable, __file__, "--convert", method, src, dst], check=True,
                             capture_output=True, text=True).stdout
        peaks[method] = int(out.strip().splitlines()[-1])
        C.remove(dst)
    C.remove(src)
    print(f"DCP checkpoint: {args.tensors} tensors of {args.mib} MiB ({args.tensors * args.mib} MiB)")
    print(f"{'method':<24} {'peak growth':>12} {'x one item':>11} {'x state':>8}")
    for method, grown in peaks.items():
        print(f"{method:<24} {grown / MIB:>8.0f} MiB {grown / item:>11.2f} {grown / (item * args.tensors):>8.2f}")
    print(f"ratio xckpt / dcp_to_torch_save: {peaks['xckpt'] / peaks['dcp_to_torch_save']:.2f}")


if __name__ == "__main__":
    main()
