"""The demo's JAX job: ``python -m xckpt_demo.train_jax JOB.json`` (8 host devices, mesh data=4 x model=2).

1. Restores the PyTorch checkpoint into the flax model and optax state with one
   ``xckpt.load(..., mapping=torch_to_flax())`` (sharded over this mesh) and
   continues training on the same batches as the PyTorch continuation.
2. Trains the flax model from its own initialisation and saves params, optax
   state, step and RNG key with xckpt (for the reverse direction).
3. Continues from that checkpoint, loaded into fresh abstract state.

Prints progress; writes the losses to the job's result file.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .procs import guard_parent


class Trainer:
    """The flax model, the optax transformation, the mesh and the jitted training step."""

    def __init__(self, cfg: Any, mesh_shape: dict[str, int]) -> None:
        import jax
        import numpy as np
        import optax
        from jax.sharding import AxisType, Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from . import model_flax
        self.cfg = cfg
        devices = np.array(jax.devices()[:mesh_shape["data"] * mesh_shape["model"]])
        self.mesh = Mesh(devices.reshape(mesh_shape["data"], mesh_shape["model"]), ("data", "model"),
                         axis_types=(AxisType.Auto, AxisType.Auto))
        self.model = model_flax.GPT(cfg)
        self.tx = model_flax.make_optimizer(cfg)
        self.params_like, self.opt_like = model_flax.abstract_state(self.model, self.tx, self.mesh, cfg)
        self.batch_sharding = NamedSharding(self.mesh, P("data", None))
        self.replicated = NamedSharding(self.mesh, P())
        p_sh = jax.tree.map(lambda s: s.sharding, self.params_like)
        o_sh = jax.tree.map(lambda s: s.sharding, self.opt_like)
        model, tx, loss_fn = self.model, self.tx, model_flax.loss_fn

        def train_step(params: Any, opt_state: Any, ids: jax.Array, targets: jax.Array) -> tuple[Any, Any, jax.Array]:
            loss, grads = jax.value_and_grad(loss_fn)(params, model, ids, targets)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._step = jax.jit(train_step, out_shardings=(p_sh, o_sh, self.replicated), donate_argnums=(0, 1))

        def init(key: jax.Array) -> tuple[Any, Any]:
            ids = jax.numpy.zeros((cfg.batch, cfg.seq_len), jax.numpy.int32)
            params = model.init(key, ids)["params"]
            return params, tx.init(params)

        self._init = jax.jit(init, out_shardings=(p_sh, o_sh))

    def init(self, key: Any) -> tuple[Any, Any]:
        """Fresh parameters and optimizer state, sharded over the mesh."""
        return self._init(key)

    def run(self, params: Any, opt_state: Any, start: int, steps: int, tag: str,
            every: int = 1) -> tuple[Any, Any, list[float]]:
        """Train ``steps`` steps from ``start`` (progress every ``every`` steps and the last); new state, losses."""
        import jax

        from .data import batch
        losses = []
        for s in range(start, start + steps):
            t0 = time.perf_counter()
            ids, targets = batch(self.cfg, s)
            ids = jax.device_put(ids, self.batch_sharding)
            targets = jax.device_put(targets, self.batch_sharding)
            params, opt_state, loss = self._step(params, opt_state, ids, targets)
            losses.append(float(loss))
            if (s + 1) % every == 0 or s == start + steps - 1:
                print(f"{tag} step {s:>2}  loss {losses[-1]:.6f}  ({time.perf_counter() - t0:.2f} s)", flush=True)
        return params, opt_state, losses


def from_torch(job: dict[str, Any], t: Trainer, tag: str) -> list[float]:
    """Restore the PyTorch checkpoint through the torch -> flax mapping, then continue."""
    import xckpt

    from xckpt import mapping as M

    from .report import mapping_sample
    like = {"params": t.params_like, "opt_state": t.opt_like, "step": 0}
    planned = M.torch_to_flax().plan(job["torch_ckpt"], like)
    print(mapping_sample("xckpt.mapping.torch_to_flax()", planned,
                         ("params/blocks_0/attn/q/kernel", "params/blocks_0/ln1/scale",
                          "opt_state/0/mu/blocks_0/attn/q/kernel", "opt_state/0/count")), flush=True)
    planned.close()
    out = xckpt.load(job["torch_ckpt"], like=like, mapping=M.torch_to_flax())
    print(f"{tag} loaded {job['torch_ckpt']} through xckpt.mapping.torch_to_flax (step {out['step']}: "
          f"weights transposed to kernels, AdamW exp_avg/exp_avg_sq/step -> optax mu/nu/count "
          f"{int(out['opt_state'][0].count)})", flush=True)
    return t.run(out["params"], out["opt_state"], out["step"], t.cfg.continue_steps, tag)[2]


def train_and_save(job: dict[str, Any], t: Trainer, tag: str) -> list[float]:
    """Train from flax's own initialisation, then save params, optax state, step and RNG key."""
    import jax

    import xckpt
    key, init_key = jax.random.split(jax.random.PRNGKey(t.cfg.init_seed))
    params, opt_state = t.init(init_key)
    params, opt_state, losses = t.run(params, opt_state, 0, t.cfg.pretrain_steps, tag, every=5)
    t0 = time.perf_counter()
    state = {"params": params, "opt_state": opt_state, "step": t.cfg.pretrain_steps,
             "rng": jax.random.key_data(key)}
    xckpt.save(state, job["jax_ckpt"], overwrite=True)
    print(f"{tag} saved params, optax state, step and RNG key to {job['jax_ckpt']} "
          f"({time.perf_counter() - t0:.2f} s)", flush=True)
    return losses


def from_own(job: dict[str, Any], t: Trainer, tag: str) -> list[float]:
    """Continue from the JAX checkpoint, loaded into fresh abstract state."""
    import jax
    import numpy as np

    import xckpt
    like = {"params": t.params_like, "opt_state": t.opt_like, "step": 0,
            "rng": jax.ShapeDtypeStruct((2,), np.uint32, sharding=t.replicated)}
    out = xckpt.load(job["jax_ckpt"], like=like)
    print(f"{tag} loaded {job['jax_ckpt']} (step {out['step']})", flush=True)
    return t.run(out["params"], out["opt_state"], out["step"], t.cfg.continue_steps, tag)[2]


def main(argv: list[str]) -> int:
    """Run the job described by ``argv[0]`` (a JSON file)."""
    guard_parent()
    job = json.loads(Path(argv[0]).read_text())
    n = job["mesh"]["data"] * job["mesh"]["model"]
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    warnings.filterwarnings("ignore")
    from .config import Config
    t = Trainer(Config.from_json(job["cfg"]), job["mesh"])
    m = job["mesh"]
    tag = f"[jax {n} devices, mesh data={m['data']} x model={m['model']}]"
    result = {"from_torch": from_torch(job, t, tag + " torch ckpt ->"),
              "pretrain": train_and_save(job, t, tag),
              "from_jax": from_own(job, t, tag + " jax ckpt ->")}
    Path(job["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
