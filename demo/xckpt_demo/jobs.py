"""The demo's three child jobs and where they keep their files (``DIR/work``: job files, results, logs)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from . import procs
from .config import Config


class Demo:
    """Paths, settings and the three child jobs of one demo run."""

    def __init__(self, out: Path, cfg: Config) -> None:
        self.out, self.cfg = out, cfg
        self.torch_ckpt = out / f"torch_step{cfg.pretrain_steps}"
        self.jax_ckpt = out / f"jax_step{cfg.pretrain_steps}"
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)

    def _job(self, name: str, **fields: Any) -> Path:
        job = {"cfg": self.cfg.to_json(), "torch_ckpt": str(self.torch_ckpt), "jax_ckpt": str(self.jax_ckpt),
               "result": str(self.work / f"{name}.result.json"), **fields}
        path = self.work / f"{name}.job.json"
        path.write_text(json.dumps(job, indent=1))
        Path(job["result"]).unlink(missing_ok=True)
        return path

    def _result(self, name: str) -> dict[str, Any]:
        return json.loads((self.work / f"{name}.result.json").read_text())

    def torch_job(self, name: str, phase: str, mesh: dict[str, int]) -> dict[str, Any]:
        """Run a PyTorch job on ``dp * tp`` spawned ranks; its rank 0's result."""
        world = mesh["dp"] * mesh["tp"]
        job = self._job(name, phase=phase, world=world, mesh=mesh, port=procs.free_port())
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs.run_group(f"PyTorch job {name!r} ({world} ranks)",
                        [[sys.executable, "-m", "xckpt_demo.train_torch", str(job), str(r)] for r in range(world)],
                        [self.work / f"{name}.rank{r}.log" for r in range(world)], env=env)
        return self._result(name)

    def jax_job(self, name: str, mesh: dict[str, int]) -> dict[str, Any]:
        """Run the JAX job in a process with ``data * model`` host devices; its result."""
        n = mesh["data"] * mesh["model"]
        job = self._job(name, mesh=mesh)
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={n}")
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
        procs.run_group(f"JAX job {name!r} ({n} devices)", [[sys.executable, "-m", "xckpt_demo.train_jax", str(job)]],
                        [self.work / f"{name}.log"], env=env)
        return self._result(name)
