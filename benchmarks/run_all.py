"""Run every benchmark in sequence and print all their tables at the end.

Runs, each as its own Python process (so memory is given back between them):
``bench_torch.py`` (torch, W1/W2 against DCP; async, save_async on W1), ``bench_jax.py``
(W1/W2 against Orbax) and ``bench_numpy.py`` (W1's matrices against raw files).
Progress goes to stderr as it happens; each script's tables are echoed when it ends and
printed again, all together, at the end. ``--workload``, ``--repeats``, ``--scale`` and
``--strict`` are passed on; ``--only`` picks the parts (numpy and async are W1-only, so
``--workload w2`` skips them unless ``--only`` names them).

Run (everything at full size; then a quick reduced-size check of every script)::

    .venv/bin/python benchmarks/run_all.py
    .venv/bin/python benchmarks/run_all.py --scale 0.1 --repeats 1
    .venv/bin/python benchmarks/run_all.py --workload w1 --only torch,jax,numpy,async
"""

from __future__ import annotations

import os
import subprocess
import sys

import _common as C

PARTS = ("torch", "async", "jax", "numpy")
HERE = os.path.dirname(os.path.abspath(__file__))


def _commands(only: list[str], workload: str, explicit: bool, common: list[str]) -> list[tuple[str, list[str]]]:
    """The (name, argv) of each script to run for the selected parts."""
    w1_parts_ok = workload != "w2" or explicit
    cmds: list[tuple[str, list[str]]] = []
    torch_parts = [p for p in ("torch", "async") if p in only and (p == "torch" or w1_parts_ok)]
    if torch_parts:
        which = "all" if len(torch_parts) == 2 else torch_parts[0]
        cmds.append(("torch", ["bench_torch.py", "--workload", workload, "--only", which, *common]))
    if "jax" in only:
        cmds.append(("jax", ["bench_jax.py", "--workload", workload, *common]))
    if "numpy" in only and w1_parts_ok:
        cmds.append(("numpy", ["bench_numpy.py", *common]))
    return cmds


def main() -> int:
    """Parse flags, run the selected scripts one after the other, print every table; non-zero if one failed."""
    p = C.common_args(__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(PARTS),
                   help=f"comma-separated parts to run, of {', '.join(PARTS)} (default all)")
    args = C.parse(p)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {unknown}; choose from {PARTS}")
    common = ["--repeats", str(args.repeats), "--scale", str(args.scale), "--root", C.ROOT]
    common += ["--strict"] if args.strict else []
    explicit = any(a == "--only" or a.startswith("--only=") for a in sys.argv[1:])
    outputs: list[tuple[str, int, str]] = []
    for name, argv in _commands(only, args.workload, explicit, common):
        C.log(f"run_all: {' '.join(argv)}")
        proc = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]], cwd=os.path.dirname(HERE),
                              stdout=subprocess.PIPE, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            C.log(f"run_all: {argv[0]} exited with status {proc.returncode}")
        outputs.append((name, proc.returncode, proc.stdout))
    print("=" * 100 + "\nAll tables\n" + "=" * 100)
    for name, rc, out in outputs:
        print(out.rstrip() + "\n" if out.strip() else f"({name}: no output)\n")
        if rc:
            print(f"!! {name}: exit status {rc}\n")
    return 1 if any(rc for _, rc, _ in outputs) else 0


if __name__ == "__main__":
    sys.exit(main())
