"""Bodies of the GPU tests (tests/test_gpu.py): PyTorch on CUDA through ``torch_workers.run_group`` (NCCL,
or gloo with every rank on the one GPU), and JAX on the GPU as a script (``python gpu_workers.py jax
WORKDIR``). Every check is made here, values compared element by element (bfloat16 by its bits)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the same kernels give the same bits, run after run

#: The device of the tests ("cpu" dry-runs them where no GPU is)
DEV = os.environ.get("XCKPT_TEST_DEVICE", "cuda")
#: A large tensor beside the model in the asynchronous save: its writing outlasts the staging.
BIG = (8192, 8192)


def cross_data() -> dict[str, np.ndarray]:
    """The arrays a torch-CUDA checkpoint carries into JAX on the GPU (and back, negated)."""
    rng = np.random.default_rng(123)
    return {"w": rng.standard_normal((300, 200)).astype(np.float32),
            "h": rng.standard_normal((64, 48)).astype(ml_dtypes.bfloat16),
            "i": rng.integers(-1000, 1000, (10, 7)).astype(np.int32)}


def bits(a: np.ndarray) -> np.ndarray:
    """An array's values as comparable numpy (bfloat16 as its bits)."""
    a = np.asarray(a)
    return a.view(np.int16) if a.dtype == ml_dtypes.bfloat16 else a


# ---------------------------------------------------------------------------------------------
# torch


def _net(seed: int) -> Any:
    import torch
    from torch import nn

    class Net(nn.Module):
        """A float32 layer and a bfloat16 one."""

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 32)
            self.b = nn.Linear(32, 8, dtype=torch.bfloat16)

        def forward(self, x: Any) -> Any:
            return self.b(torch.tanh(self.a(x)).to(torch.bfloat16)).float()

    torch.manual_seed(seed)
    return Net().to(DEV)


def _batch(step: int, rank: int, world: int) -> tuple[Any, Any]:
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)
    n = 12 // world
    return x[rank * n:(rank + 1) * n].to(DEV), y[rank * n:(rank + 1) * n].to(DEV)


def _step(model: Any, opt: Any, step: int, rank: int, world: int, *, replicated: bool, split: bool) -> None:
    """One AdamW step on batch ``step``: on this rank's part of it where the batch is ``split`` (data
    parallel: FSDP2 reduces the gradients, a replicated model averages them itself), else whole."""
    import torch.distributed as dist
    x, y = _batch(step, rank, world) if split else _batch(step, 0, 1)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    if replicated and split and world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    opt.step()


def _host(t: Any) -> np.ndarray:
    """A tensor's whole value on the host (bfloat16 as its bits); a DTensor's gathered from every rank's
    local shard and its offset, on the host (gloo's collectives on CUDA tensors are not all reliable)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def bits_of(x: Any) -> np.ndarray:
        x = x.detach().cpu()
        return x.view(torch.int16).numpy().copy() if x.dtype == torch.bfloat16 else x.numpy().copy()

    if not isinstance(t, DTensor):
        return bits_of(t)
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (tuple(int(o) for o in offset), bits_of(t.to_local())))
    whole = None
    for off, local in pieces:
        if whole is None:
            whole = np.zeros(tuple(t.shape), dtype=local.dtype)
        whole[tuple(slice(o, o + n) for o, n in zip(off, local.shape))] = local
    return whole


def _state_of(model: Any, opt: Any) -> dict[str, np.ndarray]:
    """Every model and optimizer tensor, whole, on the host (collective for DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": _host(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        out.update({f"optim.{fqn}.{k}": _host(v) for k, v in st.items()})
    return out


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], exact: bool, loose: bool = False) -> None:
    """The same tensors with the same values (``exact``: the same bits; else as close as one computation
    in another order gives: float32 to 1e-5, or where bfloat16 partial sums were rounded before they
    were added (``loose``, tensor parallel) to 1e-2 and 2e-4 absolute; bfloat16, held as its bits, to
    one rounding, or ``loose`` to a few)."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k, w in want.items():
        if exact:
            np.testing.assert_array_equal(got[k], w, err_msg=k)
        elif w.dtype == np.int16:
            np.testing.assert_allclose(got[k].view(ml_dtypes.bfloat16).astype(np.float32),
                                       w.view(ml_dtypes.bfloat16).astype(np.float32), rtol=0.1 if loose else 1.6e-2,
                                       atol=1e-4 if loose else 1e-6, err_msg=k)
        else:
            np.testing.assert_allclose(got[k], w, rtol=1e-2 if loose else 1e-5, atol=2e-4 if loose else 1e-8,
                                       err_msg=k)


def train_resume(rank: int, world: int, wd: Path, parallel: str = "fsdp") -> dict[str, Any]:
    """A model of DTensors on CUDA (``parallel``: FSDP2, data parallel; or "tp", tensor parallel) with
    AdamW trains 2 steps and saves (synchronously, then asynchronously while the next step runs); each
    checkpoint validates and loads into a fresh replicated model, whose state equals the saved one and
    whose next step equals the uninterrupted run's; the CUDA RNG state comes back; the asynchronous
    save holds the values of when it was called."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    import xckpt

    if DEV == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(DEV, (world,))
    split = parallel == "fsdp"

    def parallelized(m: Any, mesh: Any) -> Any:
        if split:
            fully_shard(m.a, mesh=mesh)
            fully_shard(m.b, mesh=mesh)
            fully_shard(m, mesh=mesh)
        else:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            parallelize_module(m, mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})
        return m

    model = parallelized(_net(7), mesh)
    assert next(model.parameters()).device.type == DEV
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for s in range(2):
        _step(model, opt, s, rank, world, replicated=False, split=split)
    torch.manual_seed(0)
    big = distribute_tensor(torch.randn(BIG, device=DEV), mesh, [Shard(0)])
    big_want = _host(big)
    saved = _state_of(model, opt)

    def state(m: Any, o: Any, b: Any) -> dict[str, Any]:
        return {"model": m, "optim": o, "big": b, "step": 2, "rng": xckpt.torch.rng_state()}

    xckpt.save(state(model, opt, big), wd / "sync")
    side = torch.cuda.Stream() if DEV == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        with torch.no_grad():  # work queued on the caller's stream just before: the checkpoint must see it
            big.to_local().mul_(2.0)
        big_wants = {"sync": big_want, "async": big_want * 2}  # doubling is exact
        # the second save of this structure: staged from the cached plan on a helper thread
        handle = xckpt.save_async(state(model, opt, big), wd / "async")
    returned_early = not handle.done()
    # the training goes on at once: the parameters and the optimizer state change in place on the GPU
    after_save = torch.rand(4, device=DEV).tolist()  # from the CUDA RNG state both checkpoints hold
    with torch.no_grad():
        big.to_local().fill_(-1.0)
    _step(model, opt, 2, rank, world, replicated=False, split=split)
    want_next = _state_of(model, opt)
    handle.wait()
    for name in ("sync", "async"):
        report = xckpt.validate(wd / name, deep=True)
        assert report.ok, [str(f) for f in report.findings]
    dist.barrier()

    # resume: into plain CUDA tensors (another placement: every rank holds every parameter), and with
    # several processes also into the same parallelism, where the step does the same arithmetic and so
    # gives the same bits (on the plain model it sums in another order: close, as far as the bfloat16
    # layer's rounding lets two orders be)
    results = {}
    for name in ("sync", "async"):
        for same_layout in ([False, True] if world > 1 else [False]):
            fresh = parallelized(_net(99), mesh) if same_layout else _net(99)
            f_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01, weight_decay=0.1)
            f_big = torch.zeros(BIG, device=DEV)
            torch.rand(16, device=DEV)  # move the CUDA RNG on: the load must set it back
            out = xckpt.load(wd / name, like=state(fresh, f_opt, f_big))
            assert out["step"] == 2 and out["model"] is fresh and f_big.device.type == DEV
            assert torch.rand(4, device=DEV).tolist() == after_save, f"{name}: the RNG state was not restored"
            _same(_state_of(fresh, f_opt), saved, exact=True)
            np.testing.assert_array_equal(_host(f_big), big_wants[name], err_msg=f"{name}: big")
            _step(fresh, f_opt, 2, rank, world, replicated=not same_layout, split=split)
            exact = same_layout or world == 1
            _same(_state_of(fresh, f_opt), want_next, exact=exact, loose=parallel == "tp")
            results[name] = results.get(name, 0) + exact

    # a second save_async of the same structure: every shard starts copying as its tensor is described,
    # into the buffers kept from the first; the training goes on at once again, the checkpoint holds
    # the values of the call
    want_async2 = _state_of(model, opt)
    handle = xckpt.save_async(state(model, opt, big), wd / "async2")
    early = handle.stats["early_copies"]
    with torch.no_grad():
        big.to_local().fill_(5.0)
    _step(model, opt, 3, rank, world, replicated=False, split=split)
    handle.wait()
    assert xckpt.validate(wd / "async2", deep=True).ok
    dist.barrier()
    fresh = _net(99)
    f_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01, weight_decay=0.1)
    f_big = torch.zeros(BIG, device=DEV)
    xckpt.load(wd / "async2", like=state(fresh, f_opt, f_big))
    _same(_state_of(fresh, f_opt), want_async2, exact=True)
    np.testing.assert_array_equal(_host(f_big), np.full(BIG, -1.0, dtype=np.float32), err_msg="async2: big")
    return {"returned_early": returned_early, "bf16": str(dict(model.b.named_parameters())["weight"].dtype),
            "early_copies": early, **results}


def cross_save(rank: int, world: int, wd: Path) -> None:
    """Save :func:`cross_data` from CUDA tensors (one of them a DTensor on a CUDA mesh)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import xckpt
    if DEV == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(DEV, (world,))
    data = {k: xckpt.torch.from_numpy(v).to(DEV) for k, v in cross_data().items()}
    data["w"] = distribute_tensor(data["w"], mesh, [Shard(1)])
    xckpt.save(data, wd / "t2j")


def cross_load(rank: int, world: int, wd: Path) -> None:
    """Load JAX's checkpoint (the arrays negated on the GPU) into CUDA tensors and a DTensor."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import xckpt
    if DEV == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(DEV, (world,))
    want = {k: -v for k, v in cross_data().items()}
    like = {k: torch.zeros(v.shape, dtype=xckpt.torch.torch_dtype(str(v.dtype)), device=DEV) for k, v in want.items()}
    like["w"] = distribute_tensor(like["w"], mesh, [Shard(0)])
    xckpt.load(wd / "j2t", like=like)
    for k, v in want.items():
        assert like[k].device.type == DEV
        np.testing.assert_array_equal(_host(like[k]), bits(v), err_msg=k)


# ---------------------------------------------------------------------------------------------
# JAX


def jax_main(wd: Path) -> None:
    """Sharded GPU arrays: save, save_async (the arrays deleted once it returns), load onto other shardings
    (CPU devices, and the GPU); then the torch-CUDA checkpoint into GPU arrays, and back negated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
    import xckpt

    gpus, cpus = jax.devices("gpu" if DEV == "cuda" else "cpu"), jax.devices("cpu")
    assert gpus and len(cpus) >= 4, (gpus, cpus)
    g_mesh = Mesh(np.array(gpus[:1]), ("x",))
    c_mesh = Mesh(np.array(cpus[:4]), ("x",))
    rng = np.random.default_rng(9)
    want = {"a": rng.standard_normal((1024, 512)).astype(np.float32),
            "b": rng.standard_normal((256, 384)).astype(ml_dtypes.bfloat16),
            "c": rng.integers(-50, 50, (40, 12)).astype(np.int32)}

    def on_gpu() -> dict[str, Any]:
        return {k: jax.device_put(v, NamedSharding(g_mesh, P("x", None))) for k, v in want.items()}

    arrays = on_gpu()
    assert all(a.devices() == {gpus[0]} for a in arrays.values())
    xckpt.save({**arrays, "step": 3}, wd / "jax_sync")
    arrays = on_gpu()
    handle = xckpt.save_async({**arrays, "step": 3}, wd / "jax_async")
    for a in arrays.values():
        a.delete()  # the caller frees its arrays at once
    handle.wait()
    for name in ("jax_sync", "jax_async"):
        assert xckpt.validate(wd / name, deep=True).ok
        for sharding in (NamedSharding(c_mesh, P(None, "x")), SingleDeviceSharding(gpus[0])):
            like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in want.items()}
            out = xckpt.load(wd / name, like={**like, "step": 0})
            assert out["step"] == 3
            for k, v in want.items():
                assert out[k].sharding == sharding, (k, out[k].sharding)
                np.testing.assert_array_equal(bits(np.asarray(out[k])), bits(v), err_msg=f"{name} {k} {sharding}")

    cross = cross_data()
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(g_mesh, P(None, "x")))
            for k, v in cross.items()}
    got = xckpt.load(wd / "t2j", like=like)
    for k, v in cross.items():
        assert got[k].devices() == {gpus[0]}
        np.testing.assert_array_equal(bits(np.asarray(got[k])), bits(v), err_msg=f"t2j {k}")
    negated = jax.jit(lambda t: jax.tree.map(jnp.negative, t))(got)
    xckpt.save(negated, wd / "j2t")
    print("jax gpu ok")


if __name__ == "__main__":
    if sys.argv[1] == "jax":
        jax_main(Path(sys.argv[2]))
