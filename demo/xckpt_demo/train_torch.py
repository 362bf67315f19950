"""One rank of the demo's PyTorch jobs: ``python -m xckpt_demo.train_torch JOB.json RANK``.

Phase ``train`` (4 ranks, mesh dp=2 x tp=2): train from scratch, then save model,
AdamW state, step and RNG with xckpt from every rank.

Phase ``resume`` (another mesh): continue (1) from that PyTorch checkpoint and
(2) from the JAX checkpoint, loaded through the flax -> torch mapping, each for
the same steps on the same batches. Rank 0 prints progress and writes the losses
to the job's result file.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .procs import guard_parent


def _setup(job: dict[str, Any], rank: int) -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=job["world"], timeout=datetime.timedelta(seconds=120))
    mesh = job["mesh"]
    return init_device_mesh("cpu", (mesh["dp"], mesh["tp"]), mesh_dim_names=("dp", "tp"))


class Trainer:
    """The model, its optimizer and the training step of this rank."""

    def __init__(self, cfg: Any, mesh: Any, seed: int) -> None:
        import torch

        from . import model_torch
        self.cfg, self.mesh = cfg, mesh
        torch.manual_seed(seed)  # the same on every rank: each keeps its slices of the same full tensors
        self.model = model_torch.parallelize(model_torch.GPT(cfg), mesh, cfg)
        self.opt = model_torch.make_optimizer(self.model, cfg)
        self._loss = model_torch.loss_fn

    def step(self, step: int) -> float:
        """Train on this rank's rows of global batch ``step``; returns the global mean loss."""
        import torch
        import torch.distributed as dist

        from .data import batch
        dp = self.mesh["dp"]
        rows = self.cfg.batch // dp.size()
        lo = dp.get_local_rank() * rows
        ids, targets = batch(self.cfg, step)
        loss = self._loss(self.model, torch.from_numpy(ids[lo:lo + rows]), torch.from_numpy(targets[lo:lo + rows]))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        total = loss.detach().clone()
        if dp.size() > 1:
            dist.all_reduce(total, group=dp.get_group())
        return float(total.item()) / dp.size()

    def run(self, start: int, steps: int, tag: str, rank: int, every: int = 1) -> list[float]:
        """Train ``steps`` steps from ``start``, printing progress on rank 0 (every ``every`` steps and the last)."""
        losses = []
        for s in range(start, start + steps):
            t0 = time.perf_counter()
            losses.append(self.step(s))
            if rank == 0 and ((s + 1) % every == 0 or s == start + steps - 1):
                print(f"{tag} step {s:>2}  loss {losses[-1]:.6f}  ({time.perf_counter() - t0:.2f} s)", flush=True)
        return losses


def train(job: dict[str, Any], rank: int, mesh: Any, cfg: Any, tag: str) -> dict[str, Any]:
    """Train from scratch, then save everything with xckpt (collective)."""
    import xckpt
    t = Trainer(cfg, mesh, cfg.init_seed)
    losses = t.run(0, cfg.pretrain_steps, tag, rank, every=5)
    t0 = time.perf_counter()
    state = {"model": t.model, "optim": t.opt, "step": cfg.pretrain_steps, "rng": xckpt.torch.rng_state()}
    xckpt.save(state, job["torch_ckpt"], overwrite=True)
    if rank == 0:
        print(f"{tag} saved model, AdamW state, step and RNG to {job['torch_ckpt']} "
              f"({time.perf_counter() - t0:.2f} s, every rank writing its own shards)", flush=True)
    return {"losses": losses}


def resume_torch(job: dict[str, Any], rank: int, mesh: Any, cfg: Any, tag: str) -> list[float]:
    """Continue from the PyTorch checkpoint, on this job's mesh."""
    import xckpt
    t = Trainer(cfg, mesh, cfg.init_seed + 1)  # other weights: the load has to replace them
    state = {"model": t.model, "optim": t.opt, "step": 0, "rng": xckpt.torch.rng_state()}
    out = xckpt.load(job["torch_ckpt"], like=state)
    if rank == 0:
        print(f"{tag} loaded {job['torch_ckpt']} (step {out['step']}, resharded onto this mesh)", flush=True)
    return t.run(out["step"], cfg.continue_steps, tag, rank)


def resume_jax(job: dict[str, Any], rank: int, mesh: Any, cfg: Any, tag: str) -> list[float]:
    """Continue from the JAX checkpoint: one load through the flax -> torch mapping."""
    import xckpt

    from xckpt import mapping as M

    from .report import mapping_sample
    t = Trainer(cfg, mesh, cfg.init_seed + 1)
    like = {"model": t.model, "optim": t.opt, "step": 0}
    planned = M.flax_to_torch().plan(job["jax_ckpt"], like)
    if rank == 0:
        print(mapping_sample("xckpt.mapping.flax_to_torch()", planned,
                             ("model/blocks.0.attn.q.weight", "optim/state/blocks.0.attn.q.weight/exp_avg_sq",
                              "optim/state/blocks.0.attn.q.weight/step")), flush=True)
    planned.close()
    # optax keeps its hyper-parameters in the transformation, so the optimizer keeps its own param_groups
    out = xckpt.load(job["jax_ckpt"], like=like, mapping=M.flax_to_torch())
    if rank == 0:
        print(f"{tag} loaded {job['jax_ckpt']} through xckpt.mapping.flax_to_torch "
              f"(step {out['step']}: kernels transposed, optax mu/nu/count -> exp_avg/exp_avg_sq/step)", flush=True)
    return t.run(out["step"], cfg.continue_steps, tag, rank)


def main(argv: list[str]) -> int:
    """Run one rank of the job described by ``argv[0]`` (a JSON file); ``argv[1]`` is the rank."""
    guard_parent()
    job = json.loads(Path(argv[0]).read_text())
    rank = int(argv[1])
    mesh = _setup(job, rank)
    from .config import Config
    cfg = Config.from_json(job["cfg"])
    m = job["mesh"]
    tag = f"[torch {job['world']} ranks, mesh dp={m['dp']} x tp={m['tp']}]"
    if job["phase"] == "train":
        result = train(job, rank, mesh, cfg, tag)
    else:
        result = {"from_torch": resume_torch(job, rank, mesh, cfg, tag + " torch ckpt ->"),
                  "from_jax": resume_jax(job, rank, mesh, cfg, tag + " jax ckpt ->")}
    import torch.distributed as dist
    dist.barrier()
    if rank == 0:
        Path(job["result"]).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
