"""Bodies of the checkpoint manager tests that run in other processes.

* :func:`manager_torch`: a 2-rank ``torch.distributed`` (gloo) training loop with
  :class:`xckpt.CheckpointManager`, spawned by :func:`torch_workers.run_group` as
  ``"manager_workers:manager_torch"``.
* ``python manager_workers.py kill <root> <failpoint>``: a single process that saves steps 1
  and 2 with the manager, then step 3 with ``XCKPT_FAILPOINTS=<failpoint>`` (it dies by SIGKILL there).
* ``python manager_workers.py jax <rank> <port> <root>``: one of 2 ``jax.distributed`` processes
  (:func:`jax_main`).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np



# -- a numpy state every process can rebuild -----------------------------------------------------


def numpy_state(step: int) -> dict[str, Any]:
    """The state saved at ``step`` by the kill worker (a few arrays, several chunk objects, a value)."""
    return {"a": np.arange(300_000, dtype=np.float32).reshape(600, 500) * 0.5 + step,
            "b": {"c": np.full((64, 33), step, dtype=np.int64), "d": np.linspace(0, step, 4097)},
            "step": step}


def kill_main(root: str, point: str) -> None:
    """Save steps 1 and 2, then die (a failpoint's SIGKILL) during the save of step 3."""
    import xckpt

    with xckpt.CheckpointManager(root, save_interval_steps=1, max_to_keep=5) as m:
        for step in (1, 2):
            assert m.save(step, numpy_state(step), metrics={"loss": 1.0 / step})
            m.wait()
        os.environ["XCKPT_FAILPOINTS"] = point
        m.save(3, numpy_state(3), metrics={"loss": 1.0 / 3})
        m.wait()
    print("not killed", flush=True)


# -- JAX, two processes ---------------------------------------------------------------------------------


def jax_main(rank: int, port: str, root: str) -> None:
    """One of 2 ``jax.distributed`` processes (4 CPU devices each): a save request on rank 1 only, retention,
    and a restore into arrays sharded over all 8 devices."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import xckpt

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
    sharding = NamedSharding(mesh, P("x"))

    def value(step: int) -> np.ndarray:
        return np.arange(64, dtype=np.float32).reshape(16, 4) * 0.5 + step

    saved = []
    with xckpt.CheckpointManager(root, save_interval_steps=4, max_to_keep=2) as m:
        assert m.coordinator.world_size == 2 and m.coordinator.rank == rank
        for step in range(1, 11):
            if step == 6 and rank == 1:
                m.request_save()
            if m.should_save(step):
                g = value(step)
                w = jax.make_array_from_callback(g.shape, sharding, lambda idx: g[idx])
                assert m.save(step, {"w": w, "step": step}, metrics={"loss": float(step)})
                saved.append(step)
        m.wait()
        steps = [s.step for s in m.all_steps()]
        out = m.restore(like={"w": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=sharding), "step": 0})
    assert saved == [4, 6, 8], saved
    assert steps == [6, 8], steps
    assert out["step"] == 8 and out["w"].sharding == sharding
    for shard in out["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value(8)[shard.index])
    print(f"OK {rank}", flush=True)
    jax.distributed.shutdown()


# -- the torch loop --------------------------------------------------------------------------------


class Loader:
    """A data loader's resumable position (``state_dict``/``load_state_dict``, as torchdata's loaders have)."""

    def __init__(self) -> None:
        self.position = 0
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        """Where it is."""
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Go back to a saved position."""
        self.position, self.epoch = int(sd["position"]), int(sd["epoch"])

    def batch(self, rank: int) -> tuple[Any, Any]:
        """This rank's next batch (deterministic in the position and the rank)."""
        import torch

        g = torch.Generator().manual_seed(1000 * self.position + rank)
        self.position += 1
        if self.position % 5 == 0:
            self.epoch += 1
        x = torch.randn(16, 4, generator=g, dtype=torch.float64)
        return x, x[:, :2] * 0.5 - x[:, 2:] ** 2


def _model(seed: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    return m, torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01)


def _train_step(m: Any, opt: Any, loader: Loader, rank: int, world: int) -> float:
    """One data-parallel step: this rank's batch, gradients averaged over the ranks (the replicas stay equal)."""
    import torch
    import torch.distributed as dist

    x, y = loader.batch(rank)
    x = x + 0.01 * torch.randn(x.shape, dtype=x.dtype)  # draws from the global RNG, so its state matters
    loss = ((m(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    out = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(out)
    return float(out.item()) / world


def _snapshot(m: Any, opt: Any) -> dict[str, np.ndarray]:
    """Copies of the parameters and of the optimizer's per-parameter state."""
    out = {f"param.{k}": v.detach().numpy().copy() for k, v in m.state_dict().items()}
    for i, (p, st) in enumerate(opt.state.items()):
        for k, v in st.items():
            out[f"opt.{i}.{k}"] = v.detach().numpy().copy() if hasattr(v, "numpy") else np.asarray(v)
    return out


def manager_torch(rank: int, world: int, wd: Path) -> dict[str, Any]:
    """Train with the manager on every rank; a save request and a SIGTERM on rank 1 only; resume from the latest."""
    import torch

    import xckpt

    assert world == 2
    root = wd / "run"
    m, opt = _model(0)
    loader = Loader()
    state = {"model": m, "optim": opt, "rng": xckpt.torch.rng_state(), "data": loader, "step": 0}
    saved, decisions = [], {}
    want: dict[str, np.ndarray] = {}
    after_save: list[float] = []
    original = signal.getsignal(signal.SIGTERM)
    with xckpt.CheckpointManager(root, save_interval_steps=3, max_to_keep=2, preemption_signal=signal.SIGTERM) as mgr:
        assert mgr.coordinator.world_size == 2 and mgr.coordinator.rank == rank
        assert signal.getsignal(signal.SIGTERM) != original  # the manager's handler
        for step in range(1, 20):
            loss = _train_step(m, opt, loader, rank, world)
            if step == 5 and rank == 1:
                mgr.request_save()  # on one rank only
            if step == 7 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler preempts one rank's node
            decisions[step] = mgr.should_save(step)
            if decisions[step]:
                state["step"] = step
                assert mgr.save(step, state, metrics={"loss": loss, "rank": rank})
                saved.append(step)
                want = _snapshot(m, opt)
                after_save = torch.rand(3).tolist()  # the stream right after the save, per rank
            if mgr.reached_preemption(step):
                break
        mgr.wait()
        steps = [s.step for s in mgr.all_steps()]
        metrics = [s.metrics for s in mgr.all_steps()]
    assert signal.getsignal(signal.SIGTERM) == original  # put back by close()
    assert saved == [3, 5, 6, 7], saved  # interval 3, the request (rank 1), the SIGTERM (rank 1)
    assert steps == [6, 7], steps  # max_to_keep=2, deleted once a newer step committed
    assert all(mt["rank"] == 0 for mt in metrics)  # the coordinating process's metrics

    # resume in fresh objects: another initialisation, the loader at 0, the RNG moved on
    m2, opt2 = _model(123)
    loader2 = Loader()
    torch.manual_seed(999)
    state2 = {"model": m2, "optim": opt2, "rng": xckpt.torch.rng_state(), "data": loader2, "step": 0}
    with xckpt.CheckpointManager(root) as mgr2:
        assert mgr2.latest_step() == 7
        out = mgr2.restore(like=state2)
    assert out["step"] == 7 and out["model"] is m2 and out["optim"] is opt2
    assert (loader2.position, loader2.epoch) == (7, 1), loader2.state_dict()
    got = _snapshot(m2, opt2)
    assert sorted(got) == sorted(want) and any(k.startswith("opt.") for k in want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert torch.rand(3).tolist() == after_save, "this rank's RNG stream was not restored"
    assert opt2.param_groups[0]["lr"] == 0.05
    _metric_and_publish_failures(rank, wd / "run2")
    return {"saved": saved, "steps": steps, "decisions": {str(k): v for k, v in decisions.items()}}


def _metric_and_publish_failures(rank: int, root: Path) -> None:
    """Failures on one rank only keep the ranks in step: rank 1's metrics are not read (only the coordinating
    process's are kept), rank 0's bad metric (a torch tensor of 3 elements: RuntimeError from item()) is
    manager.metrics naming it on both, a bad XCKPT_STALE_AFTER_S (read by rank 0 alone) config.env on both; a
    step that rank 0 alone fails to move into place (it appeared meanwhile) is raised on both, and both may save
    it again."""
    import torch

    import xckpt

    state = {"w": torch.full((4,), float(rank))}
    with xckpt.CheckpointManager(root) as mgr:
        assert mgr.save(1, state, force=True, metrics={"loss": np.zeros(3) if rank == 1 else 1.0})
        mgr.wait()
        try:
            mgr.save(2, state, force=True, metrics={"loss": torch.zeros(3) if rank == 0 else 1.0})
        except xckpt.XckptError as exc:
            assert exc.code == "manager.metrics" and exc.leaf == "loss" and "metric 'loss'" in str(exc) \
                and "not one number" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: a bad metric on rank 0 did not fail the save")
        os.environ["XCKPT_STALE_AFTER_S"] = "1h"
        try:
            mgr.save(2, state, force=True)
        except xckpt.XckptError as exc:
            assert exc.code == "config.env" and "XCKPT_STALE_AFTER_S='1h'" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: a bad XCKPT_STALE_AFTER_S did not fail the save")
        finally:
            del os.environ["XCKPT_STALE_AFTER_S"]
        assert mgr.should_save(2) is False  # no interval set: the ranks agree (a collective vote)
        publish = xckpt.CheckpointManager._publish
        if rank == 0:  # the step appears while it is saved: rank 0's publish fails
            def appearing(self: Any, flight: Any, *args: Any) -> None:
                os.makedirs(root / "3")
                publish(self, flight, *args)
            xckpt.CheckpointManager._publish = appearing
        assert mgr.save(3, state, force=True)
        try:
            mgr.wait()
        except xckpt.XckptError as exc:
            assert "manager.step_exists" in str(exc) or exc.code == "manager.step_exists", exc
        else:
            raise AssertionError(f"rank {rank}: a step that could not be moved into place did not fail")
        xckpt.CheckpointManager._publish = publish
        if rank == 0:
            os.rmdir(root / "3")
        mgr.request_save()
        assert mgr.should_save(3) is True  # on both ranks: step 3 was not saved anywhere
        assert mgr.save(3, state)
        mgr.wait()
        assert [s.step for s in mgr.all_steps()] == [1, 3]



if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill_main(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "jax":
        jax_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
