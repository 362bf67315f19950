"""The main job behind ``xckpt demo``: one training run moved from PyTorch to JAX, and one back.

1. PyTorch, 4 ranks (gloo), mesh dp=2 x tp=2 (FSDP2 + tensor-parallel DTensors):
   train a small GPT, save model, AdamW state, step and RNG with xckpt.
2. JAX, 8 host devices, mesh data=4 x model=2: restore that checkpoint into the
   same model in flax + optax (one ``xckpt.load`` through ``torch_to_flax``) and
   continue; then train the flax model from scratch, save, and continue from it.
3. PyTorch, 2 ranks, mesh dp=1 x tp=2: continue from the PyTorch checkpoint, and
   from the JAX one (one ``xckpt.load`` through ``flax_to_torch``).
4. ``xckpt validate --deep`` on both checkpoints.
5. Side-by-side loss tables, a PNG of the curves; exit 0 only when both
   directions agree step by step within float32 tolerance and both checkpoints
   are valid.

Children run in sessions of their own and are ended on Ctrl-C (see :mod:`.procs`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import procs
from .config import JAX_MESH, TORCH_RESUME_MESH, TORCH_TRAIN_MESH, Config
from .jobs import Demo
from .report import Direction, checkpoint_summary, plot, table, validate


def _mesh_text(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


def _params(cfg: Config) -> int:
    d, m, v, t = cfg.d_model, cfg.d_mlp, cfg.vocab, cfg.seq_len
    block = 2 * 2 * d + 4 * (d * d + d) + (d * m + m) + (m * d + d)
    return v * d + t * d + cfg.n_layers * block + 2 * d + d * v + v


def run(out: Path, cfg: Config) -> int:
    """The whole demo; returns the exit code."""
    demo = Demo(out, cfg)
    n, k = cfg.pretrain_steps, cfg.continue_steps
    t_start = time.perf_counter()
    print(f"xckpt demo: a GPT trained in PyTorch resumes in JAX, and one trained in JAX resumes in PyTorch\n"
          f"  model: {cfg.n_layers} blocks, d_model {cfg.d_model}, {cfg.n_heads} heads, vocab {cfg.vocab}, "
          f"{_params(cfg)} parameters, float32; AdamW lr {cfg.lr:g}, betas ({cfg.beta1}, {cfg.beta2}), "
          f"weight decay {cfg.weight_decay}\n"
          f"  {n} steps before each checkpoint, {k} after; batch {cfg.batch} x {cfg.seq_len} tokens, "
          f"the same deterministic batches in both frameworks\n  output: {out}", flush=True)

    tw = TORCH_TRAIN_MESH["dp"] * TORCH_TRAIN_MESH["tp"]
    print(f"\n[1/5] PyTorch, {tw} ranks (gloo), mesh {_mesh_text(TORCH_TRAIN_MESH)}: FSDP2 over dp, tensor-parallel "
          f"DTensors over tp; train {n} steps, save with xckpt", flush=True)
    t0 = time.perf_counter()
    torch_train = demo.torch_job("torch_train", "train", TORCH_TRAIN_MESH)
    print(checkpoint_summary(demo.torch_ckpt))
    print(f"    ({time.perf_counter() - t0:.1f} s)", flush=True)

    jn = JAX_MESH["data"] * JAX_MESH["model"]
    print(f"\n[2/5] JAX, {jn} host devices, mesh {_mesh_text(JAX_MESH)}: restore the PyTorch checkpoint in flax + "
          f"optax and continue {k} steps; then train the flax model {n} steps from scratch, save, continue {k}",
          flush=True)
    t0 = time.perf_counter()
    jax_res = demo.jax_job("jax", JAX_MESH)
    print(checkpoint_summary(demo.jax_ckpt))
    print(f"    ({time.perf_counter() - t0:.1f} s)", flush=True)

    rw = TORCH_RESUME_MESH["dp"] * TORCH_RESUME_MESH["tp"]
    print(f"\n[3/5] PyTorch, {rw} ranks, mesh {_mesh_text(TORCH_RESUME_MESH)}: continue {k} steps from the PyTorch "
          f"checkpoint, and {k} steps from the JAX checkpoint", flush=True)
    t0 = time.perf_counter()
    torch_res = demo.torch_job("torch_resume", "resume", TORCH_RESUME_MESH)
    print(f"    ({time.perf_counter() - t0:.1f} s)", flush=True)

    print("\n[4/5] validate both checkpoints", flush=True)
    valid = [validate(demo.torch_ckpt), validate(demo.jax_ckpt)]

    print("\n[5/5] compare the continuations", flush=True)
    directions = [
        Direction(title=f"PyTorch -> JAX: {demo.torch_ckpt.name} (PyTorch, {tw} ranks) continued in JAX "
                        f"({jn} devices) and in PyTorch ({rw} ranks)",
                  short=f"PyTorch checkpoint ({tw} ranks) -> JAX ({jn} devices)", origin="PyTorch",
                  pretrain=torch_train["losses"], torch=torch_res["from_torch"], jax=jax_res["from_torch"], start=n),
        Direction(title=f"JAX -> PyTorch: {demo.jax_ckpt.name} (JAX, {jn} devices) continued in PyTorch "
                        f"({rw} ranks) and in JAX ({jn} devices)",
                  short=f"JAX checkpoint ({jn} devices) -> PyTorch ({rw} ranks)", origin="JAX",
                  pretrain=jax_res["pretrain"], torch=torch_res["from_jax"], jax=jax_res["from_jax"], start=n),
    ]
    for d in directions:
        print(table(d, cfg.rtol) + "\n", flush=True)
    (out / "losses.json").write_text(json.dumps(
        {"rtol": cfg.rtol, "directions": [{"title": d.title, "origin": d.origin, "start": d.start,
                                           "pretrain": d.pretrain, "torch": d.torch, "jax": d.jax,
                                           "max_rel_diff": d.max_rel_diff()} for d in directions]}, indent=1))
    png = out / "losses.png"
    try:
        plot(directions, png, cfg.rtol)
        print(f"  plot of both directions' loss curves: {png}")
        plotted = True
    except ImportError:
        print("  no plot: matplotlib is not installed (pip install 'xckpt[demo]')", file=sys.stderr)
        plotted = False
    agree = all(d.max_rel_diff() <= cfg.rtol for d in directions)
    ok = agree and all(valid) and plotted and all(len(d.torch) == k for d in directions)
    took = time.perf_counter() - t_start
    if ok:
        print(f"\nPASS: both directions agree step by step within {cfg.rtol:.0e} relative (float32); both "
              f"checkpoints are valid ({took:.1f} s)")
        return 0
    why = [w for w, bad in (("the continuations disagree", not agree), ("a checkpoint is invalid", not all(valid)),
                            ("no plot", not plotted)) if bad]
    print(f"\nFAIL: {'; '.join(why)} ({took:.1f} s)")
    return 1


def main(args: argparse.Namespace) -> int:
    """Run the demo (``xckpt demo --out DIR``); returns the process exit code."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with procs.interrupt_on_sigterm():
        try:
            return run(out, Config())
        except procs.JobError as exc:
            print(f"\nFAIL: {exc}", file=sys.stderr)
            return 1
        finally:
            procs.end_all()
