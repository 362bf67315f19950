"""Bodies of the multi-process PyTorch tests: real torch.distributed (gloo), spawned processes.

:func:`run_group` spawns ``world`` processes on a free port; each initialises a gloo
process group and runs one body function of this module. Every check is made
inside the workers (values compared element by element); a body returns a small
JSON-able result for the test to look at. A failing rank's traceback fails the
test; a group that runs past its timeout is killed (gloo collectives time out
too), so nothing hangs.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import importlib
import json
import math
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from spawn import free_port

import ml_dtypes
import numpy as np

# ---------------------------------------------------------------------------------------------
# harness


def run_group(world: int, body: str, workdir: Path, *, timeout: float = 240, backend: str = "gloo",
              **kwargs: Any) -> list[Any]:
    """Run ``body(rank, world, workdir, **kwargs)`` on ``world`` spawned ranks of a ``backend`` process
    group; return their results.

    ``body`` names a function of this module, or of another test module as ``"module:function"``."""
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world, port, body, str(workdir), json.dumps(kwargs), backend),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    first_failure = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
            first_failure = time.monotonic()
        if first_failure is not None and time.monotonic() - first_failure > 15:
            break  # the others had time to report; they are stuck in a collective
        time.sleep(0.05)
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    results, errors = [], []
    for r in range(world):
        f = Path(workdir) / f"{body.replace(':', '.')}.rank{r}.json"
        fault = f.with_suffix(".fault")
        rep = json.loads(f.read_text()) if f.exists() else {
            "error": f"no report (exit code {procs[r].exitcode}{', killed' if r in stuck else ''})\n"
                     + (fault.read_text()[-4000:] if fault.exists() else "")}
        if rep.get("error"):
            errors.append(f"----- rank {r} -----\n{rep['error']}")
        results.append(rep.get("result"))
    if errors or stuck:
        why = f" (ranks {stuck} still running after {timeout:.0f}s or a peer's failure)" if stuck else ""
        raise AssertionError(f"{body} on {world} ranks failed{why}:\n" + "\n".join(errors))
    return results


def _entry(rank: int, world: int, port: int, body: str, workdir: str, kwargs: str, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    warnings.filterwarnings("ignore")
    fault = open(Path(workdir) / f"{body.replace(':', '.')}.rank{rank}.fault", "w")
    faulthandler.enable(fault)  # a crash in native code leaves its Python stack for the test to show
    report: dict[str, Any]
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(0)  # every rank of a test shares the one GPU
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        module, _, name = body.rpartition(":")
        fn = getattr(importlib.import_module(module), name) if module else globals()[name]
        report = {"result": fn(rank, world, Path(workdir), **json.loads(kwargs))}
    except BaseException:  # noqa: BLE001 - reported to the test
        report = {"error": traceback.format_exc()}
    (Path(workdir) / f"{body.replace(':', '.')}.rank{rank}.json").write_text(json.dumps(report))
    if "error" in report:
        sys.stdout.flush()
        os._exit(1)
    try:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------------------------------------
# the data every group agrees on

#: name -> (global shape, dtype, placements on the (2, 2) ("dp", "tp") mesh of the saving job)
ARRAYS: dict[str, tuple[tuple[int, ...], str, str]] = {
    "w": ((8, 12), "float32", "S0 S1"),
    "rep": ((6, 5), "float64", "R R"),
    "half": ((10, 4), "float32", "S0 R"),
    "uneven": ((7, 5), "float32", "S0 S0"),
    "empty": ((3, 2), "int32", "S0 S0"),
    "strided": ((8, 4), "float32", "SS0/2 S0"),
    "strided_cols": ((3, 12), "float64", "SS1/2 S1"),
    "strided_last": ((8, 3), "float32", "S0 SS0/2"),
    "bf": ((8, 6), "bfloat16", "S1 S0"),
    "scalar": ((), "float32", "R R"),
    # a GPT-2-sized vocabulary split unevenly twice (nested Shard, and FSDP2 + TP's _StridedShard)
    "vocab": ((50257, 8), "float32", "S0 S0"),
    "vocab_strided": ((50257, 8), "float32", "SS0/2 S0"),
}

#: Pipeline stages of the saving job: stage -> its layers (each a (6, 4) float32 weight on the stage's ranks).
STAGES = {0: [0, 1], 1: [2, 3]}


def layer(i: int) -> np.ndarray:
    """The weight of pipeline layer ``i``."""
    return (np.arange(24, dtype=np.float32).reshape(6, 4) + 100 * i)


def full(name: str) -> np.ndarray:
    """The global value of array ``name`` (exactly representable in its dtype)."""
    shape, dtype, _ = ARRAYS[name]
    salt = sorted(ARRAYS).index(name)
    a = (np.arange(math.prod(shape), dtype=np.float64).reshape(shape) * 0.5 - 3 + salt)
    return a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def placements(text: str) -> list[Any]:
    """``"S0 SS1/3 R"`` -> [Shard(0), _StridedShard(1, split_factor=3), Replicate()]."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    out: list[Any] = []
    for p in text.split():
        if p == "R":
            out.append(Replicate())
        elif p.startswith("SS"):
            d, sf = p[2:].split("/")
            out.append(_StridedShard(int(d), split_factor=int(sf)))
        else:
            out.append(Shard(int(p[1:])))
    return out


def torch_full(name: str, dtype: Any = None) -> Any:
    """``full(name)`` as a CPU tensor (bfloat16 through its bits)."""
    from xckpt_torch import from_numpy
    t = from_numpy(full(name)).clone()
    return t if dtype is None else t.to(dtype)


def dtensor_of(name: str, mesh: Any) -> Any:
    """Array ``name`` as a DTensor on ``mesh``: ``distribute_tensor``, or, for a strided split that torch
    only builds itself when a dimension divides (FSDP2 + TP makes such parameters from local shards),
    ``DTensor.from_local`` of the local shard the layout gives this rank."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from xckpt.engine.layout import mesh as engine_mesh, mesh_layout
    from xckpt_torch.dtensor import placement
    shape, _, text = ARRAYS[name]
    places = placements(text)
    if "SS" not in text or all(n % 4 == 0 for n in shape):
        return distribute_tensor(torch_full(name), mesh, places)
    ranks = mesh.mesh
    lay = mesh_layout(shape, engine_mesh(tuple(ranks.shape), tuple(ranks.reshape(-1).tolist())),
                      tuple(placement(p) for p in places))
    coord = tuple(mesh.get_coordinate())
    local = np.empty(lay.local_shape(coord), dtype=full(name).dtype)
    for region, sl in lay.pieces(coord):
        local[sl] = full(name)[region.slices()]
    return DTensor.from_local(torch.from_numpy(local), mesh, places, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


def check_dtensor(d: Any, want: np.ndarray) -> None:
    """Every box this rank holds of ``d`` equals ``want``'s box, element by element."""
    from xckpt_torch.dtensor import dtensor_pieces
    from xckpt_torch import to_host
    _, pieces, local = dtensor_pieces(d)
    assert pieces or local.numel() == 0
    for region, sl in pieces:
        np.testing.assert_array_equal(to_host(local[sl]), want[region.slices()],
                                      err_msg=f"{region} of a DTensor {d.placements}")


def make_mlp(seed: int) -> Any:
    """The small float64 model of the training tests."""
    import torch
    from torch import nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).double()


def fsdp(model: Any, mesh: Any) -> Any:
    """FSDP2 (``fully_shard``) every Linear, then the root."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optim_for(model: Any) -> tuple[Any, Any]:
    """AdamW and a StepLR schedule."""
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train_step(model: Any, opt: Any, sched: Any, step: int, rank: int, world: int) -> float:
    """One step on this rank's slice of global batch ``step`` (12 rows); returns the global loss."""
    import torch
    import torch.distributed as dist
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(12, 16, generator=g, dtype=torch.float64)
    y = torch.randn(12, 8, generator=g, dtype=torch.float64)
    n = 12 // world
    loss = ((model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def full_state(model: Any, opt: Any) -> dict[str, np.ndarray]:
    """Every parameter and optimizer tensor gathered whole (test verification only; collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor
    msd, osd = get_state_dict(model, opt)
    out = {}
    for k, v in msd.items():
        out[f"model.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
    return out


def compare_state(model: Any, opt: Any, want: dict[str, np.ndarray]) -> int:
    """Check ``model``/``opt`` against ``full_state`` output; returns the number of tensors compared."""
    got = full_state(model, opt)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    return len(want)


def rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS every half millisecond while active."""

    def __enter__(self) -> "PeakRSS":
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.0005)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


# ---------------------------------------------------------------------------------------------
# bodies


def memory_save(rank: int, world: int, wd: Path, *, tensors: int = 12, rows: int = 1024, cols: int = 1024,
                inflight: int = 8 << 20) -> dict[str, int]:
    """Save a model ``world`` times larger than this rank's shard; report peak RSS growth during the save."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import xckpt
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    model = {f"t{i}": DTensor.from_local(torch.randn(rows, cols, generator=g), mesh, [Shard(0)], run_check=False)
             for i in range(tensors)}
    xckpt.save({"warm": DTensor.from_local(torch.ones(4, 4), mesh, [Shard(0)], run_check=False)}, wd / "mem_warm")
    gc.collect()
    with PeakRSS() as probe:  # the sampler does see a transient 32 MiB allocation
        np.ones(32 << 20, dtype=np.uint8).sum()
    assert probe.peak - rss() > 24 << 20, "RSS sampling missed a 32 MiB allocation"
    gc.collect()
    before = rss()
    with PeakRSS() as peak:
        xckpt.save({"model": model}, wd / "mem", max_inflight_bytes=inflight)
    shard = tensors * rows * cols * 4
    return {"shard_bytes": shard, "model_bytes": shard * world, "rss_before": before,
            "peak_growth": peak.peak - before, "inflight": inflight}


def save4(rank: int, world: int, wd: Path) -> dict[str, Any]:
    """4 ranks, (2, 2) mesh: the main checkpoint, error cases, FSDP2 training, TP + FSDP2, DCP writes."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import xckpt
    import xckpt.registry
    from xckpt.engine import protocol
    from xckpt.errors import CollectiveError
    from xckpt_torch import TorchCoordinator, XckptStorageWriter
    assert world == 4
    res: dict[str, Any] = {"memory": memory_save(rank, world, wd)}

    coord = xckpt.registry.default_coordinator()
    assert isinstance(coord, TorchCoordinator) and (coord.rank, coord.world_size) == (rank, 4)
    assert coord.all_gather_bytes(b"x" * rank) == [b"", b"x", b"xx", b"xxx"]
    assert coord.broadcast_bytes(b"\x00from2" if rank == 2 else None, root=2) == b"\x00from2"
    assert coord.gather_bytes(b"y" * rank, root=1) == ([b"", b"y", b"yy", b"yyy"] if rank == 1 else None)
    assert coord.scatter_bytes([b"", b"a", b"bb", b"c"] if rank == 2 else None, root=2) == [b"", b"a", b"bb", b"c"][rank]
    # messages longer than a slot: the rest follows in a second operation (ranks 2 and 3 here)
    from xckpt_torch.coordinator import INLINE_BYTES

    def long(r: int) -> bytes:
        return bytes((r * 7 + i) % 251 for i in range(r * (INLINE_BYTES // 2 + 3)))
    assert coord.all_gather_bytes(long(rank)) == [long(r) for r in range(4)]
    assert coord.gather_bytes(long(rank), root=3) == ([long(r) for r in range(4)] if rank == 3 else None)
    assert coord.broadcast_bytes(long(3) if rank == 1 else None, root=1) == long(3)
    same = long(3)
    assert coord.scatter_bytes([same] * 4 if rank == 0 else None, root=0) == same
    assert coord.scatter_bytes([long(r) for r in range(4)] if rank == 0 else None, root=0) == long(rank)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    arrays = {n: dtensor_of(n, mesh) for n in ARRAYS}
    for n, d in arrays.items():  # the index maths agrees with how torch itself distributed them
        check_dtensor(d, full(n))
    torch.manual_seed(100 + rank)
    state = {"arrays": arrays, "plain": torch.arange(15, dtype=torch.int64).reshape(5, 3), "step": 1000,
             "name": "run-a", "rng": xckpt.torch.rng_state()}
    p = protocol.prepare(state, wd / "main")
    protocol.write(p)
    protocol.commit(p)
    res["rand_after_save"] = torch.rand(4).tolist()
    res["bytes"] = p.bytes_written
    res["bytes_per_rank"] = p.stats.get("bytes_per_rank")  # the coordinating rank's view
    res["writes"] = sorted({"/".join(map(str, p.descs.leaves[t.leaf].key)) for t in p.local.tasks})
    if p.plan is not None:
        res["regions"] = {"/".join(map(str, a.key)): a.n_pieces for a in p.plan.arrays.values()}

    # disagreement about a plain tensor fails on every rank with every failing rank's error, nothing is
    # left behind, nothing hangs
    res["disagree"] = []
    for bad in ({"x": torch.zeros(3 if rank == 1 else 4)},
                {"x": torch.zeros(4, dtype=torch.float32 if rank == 2 else torch.float64)}):
        try:
            xckpt.save(bad, wd / "bad")
            res["disagree"].append(None)
        except CollectiveError as exc:
            res["disagree"].append(str(exc))
        assert not (wd / "bad").exists()
    # a key only some ranks hold (pipeline stages) is saved from them
    xckpt.save({"x": torch.zeros(4), **({"extra": torch.full((2,), 3.0)} if rank == 3 else {})}, wd / "partial")

    # failures on several ranks: every rank raises one error naming each failing rank and its error
    res["failures"] = []
    from xckpt.registry import ArraySource, Shard

    def boom() -> Any:
        raise RuntimeError(f"device {rank} lost")
    for bad in ({"x": object() if rank in (1, 3) else torch.zeros(4)},  # describing fails on ranks 1 and 3
                {"x": ArraySource((4,), "float32", [Shard(xckpt.Region((rank,), (1,)), boom if rank in (0, 2) else
                                                          lambda: np.zeros(1, np.float32))])}):  # writing, on 0 and 2
        try:
            xckpt.save(bad, wd / "bad")
            res["failures"].append(None)
        except CollectiveError as exc:
            res["failures"].append({"ranks": sorted(exc.failures), "text": str(exc)})
        assert not (wd / "bad").exists()

    # pipeline parallelism: each stage (2 ranks) holds its own layers, sharded over its ranks; the
    # embedding only on stage 0, the head only on stage 1; one save of the whole model
    pp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = rank // 2
    model = {f"layers.{i}.w": distribute_tensor(torch.from_numpy(layer(i)), pp["dp"], placements("S0"))
             for i in STAGES[stage]}
    if stage == 0:
        model["embed"] = torch.full((3, 4), 7.0)
    else:
        model["head"] = distribute_tensor(torch.arange(10.0).reshape(5, 2), pp["dp"], placements("S1"))
    xckpt.save({"model": model, "step": 42}, wd / "pipeline")

    # save_async of one structure again and again stages while the ranks agree on the plan; when
    # another rank's leaves change (rank 3 holds an extra leaf in round 1), the plan rank 0 cached is
    # not the job's plan, and staging from it is dropped
    res["async_speculated"] = []
    for i, extra in enumerate((False, True, False, False)):
        tree = {"model": model, "step": 42 + i, **({"extra": torch.full((64,), float(i))} if extra and rank == 3
                                                   else {})}
        handle = xckpt.save_async(tree, wd / f"async{i}")
        handle.wait()
        res["async_speculated"].append(handle.stats["staged_during_planning"])

    # FSDP2 + AdamW + StepLR: 3 steps, save, 3 more steps (the uninterrupted reference)
    m = fsdp(make_mlp(0), init_device_mesh("cpu", (4,)))
    opt, sched = optim_for(m)
    losses = [train_step(m, opt, sched, s, rank, world) for s in range(3)]
    xckpt.save({"model": m, "optim": opt, "sched": sched, "step": 3, "rng": xckpt.torch.rng_state()}, wd / "fsdp")
    want = full_state(m, opt)
    if rank == 0:
        np.savez(wd / "fsdp_expected.npz", **want)
    res["losses_before"] = losses
    res["ref_losses"] = [train_step(m, opt, sched, s, rank, world) for s in range(3, 6)]

    # the same model state through torch DCP: our StorageWriter, and stock DCP for `convert --from dcp`
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(m, opt)
    dstate = {"model": msd, "optim": osd, "arrays": {k: arrays[k] for k in ("w", "uneven", "strided", "bf")},
              "plain": torch.arange(6.0), "step": 6, "name": "dcp-run", "betas": (0.5, 0.25),
              # numpy data DCP pickles inside values; one value only on rank 3, which is not the coordinator
              "np_rng": np.random.RandomState(7).get_state(), "lr": np.float32(0.125),
              **({"stage3": (np.arange(5, dtype=np.int16) * 3, torch.full((2,), 2.5), "x")} if rank == 3 else {})}
    dcp.save(dstate, storage_writer=XckptStorageWriter(wd / "dcp_x"))
    dcp.save(dstate, storage_writer=dcp.FileSystemWriter(wd / "dcp_stock"))
    # each rank its own metadata file (__<rank>.metadata), no coordination: xckpt merges them
    dcp.save(dstate, storage_writer=dcp.FileSystemWriter(wd / "dcp_ranks"), use_collectives=False)
    want6 = full_state(m, opt)
    if rank == 0:
        np.savez(wd / "fsdp6_expected.npz", **want6)

    # tensor parallel + FSDP2 on the (2, 2) mesh: _StridedShard parameters
    torch.manual_seed(1)
    tp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    parallelize_module(tp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    from torch.distributed.fsdp import fully_shard
    fully_shard(tp, mesh=mesh["dp"])
    tp_opt = torch.optim.AdamW(tp.parameters(), lr=0.1)
    tp(torch.randn(3, 4, generator=torch.Generator().manual_seed(5))).pow(2).sum().backward()
    tp_opt.step()
    res["tp_placements"] = {n: str(q.placements) for n, q in tp.named_parameters()}
    xckpt.save({"model": tp, "optim": tp_opt}, wd / "tp")
    tp_want = full_state(tp, tp_opt)
    if rank == 0:
        np.savez(wd / "tp_expected.npz", **tp_want)

    # for Orbax: a DTensor, plain tensors (one bf16), a step
    emb = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)
    xckpt.save({"params": {"w": arrays["w"], "b": torch.arange(12, dtype=torch.float32) / 4 - 1, "emb": emb}, "step": 5},
               wd / "orbax_src")
    dist.barrier()
    return res


def load2(rank: int, world: int, wd: Path, rand_after_save: list[list[float]]) -> dict[str, Any]:
    """2 ranks: the 4-rank checkpoints into [Shard(1)] DTensors, a plain FSDP2 model, and through DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import xckpt
    from xckpt_torch import XckptStorageReader
    assert world == 2
    mesh = init_device_mesh("cpu", (2,))

    def fresh(n: str, place: list[Any], dtype: Any = None) -> Any:
        shape, dt, _ = ARRAYS[n]
        tdt = dtype or xckpt.torch.torch_dtype(dt)
        return distribute_tensor(torch.full(shape, -7, dtype=tdt), mesh, place)

    like = {n: fresh(n, [Shard(1)] if len(ARRAYS[n][0]) == 2 else [Replicate()], torch.float32 if n == "bf" else None)
            for n in ARRAYS}
    state = {"arrays": like, "plain": torch.zeros(5, 3, dtype=torch.int64), "step": 0, "name": "",
             "rng": xckpt.torch.rng_state()}
    out = xckpt.load(wd / "main", like=state)
    for n, d in like.items():
        assert out["arrays"][n] is d  # loaded in place
        check_dtensor(d, full(n).astype(np.float32) if n == "bf" else full(n))
    np.testing.assert_array_equal(state["plain"].numpy(), np.arange(15).reshape(5, 3))
    assert (out["step"], out["name"]) == (1000, "run-a")
    assert torch.rand(4).tolist() == rand_after_save[rank], "rank's RNG stream not restored"

    # a collective load: rank 1's target names a key the checkpoint lacks. Both ranks raise one
    # CollectiveLoadError naming it, before either writes in place (staged, and straight in place)
    for staging in (256 << 20, 0):
        probe = fresh("w", [Shard(1)])
        tgt = {"arrays": {"w": probe}} if rank == 0 else {"arrays": {"w": probe, "nope": torch.zeros(2)}}
        try:
            xckpt.load(wd / "main", like=tgt, partial=True, max_staging_bytes=staging)
        except xckpt.CollectiveLoadError as exc:
            assert sorted(exc.failures) == [1] and exc.code == "tree.key_mismatch", exc
            assert "arrays/nope" in exc.failures[1]["message"], exc
        else:
            raise AssertionError(f"a load whose target differs on rank 1 returned on rank {rank}")
        assert (probe.to_local() == -7).all(), "an in-place target changed although the load failed"

    # TP + FSDP2 checkpoint (4 ranks, _StridedShard) into a plain FSDP2 model on 2 ranks
    torch.manual_seed(77)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    from torch.distributed.fsdp import fully_shard
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=0.5)
    xckpt.load(wd / "tp", like={"model": m, "optim": opt})
    n_tp = compare_state(m, opt, dict(np.load(wd / "tp_expected.npz")))
    assert opt.param_groups[0]["lr"] == 0.1

    # torch DCP load through XckptStorageReader, into other placements
    sd = {"arrays": {n: fresh(n, [Shard(0)], torch.float32 if n == "bf" else None)
                     for n in ("w", "uneven", "strided", "bf")},
          "plain": torch.zeros(6), "step": 0, "name": "", "betas": (0.0, 0.0)}
    dcp.load(sd, storage_reader=XckptStorageReader(wd / "dcp_x"))
    for n, d in sd["arrays"].items():
        check_dtensor(d, full(n).astype(np.float32) if n == "bf" else full(n))
    np.testing.assert_array_equal(sd["plain"].numpy(), np.arange(6.0))
    assert (sd["step"], sd["name"], sd["betas"]) == (6, "dcp-run", (0.5, 0.25)), (sd["step"], sd["name"], sd["betas"])

    # a Hugging Face safetensors directory (sharded, with its index) straight into DTensors on this mesh
    hf = {"w": fresh("w", [Shard(1)]), "uneven": fresh("uneven", [Shard(0)]), "vocab": fresh("vocab", [Shard(0)])}
    xckpt.load(wd / "hf", like=hf)
    for n, d in hf.items():
        check_dtensor(d, full(n))

    # rank 1 comes late to a load: rank 0 warns that it waits (naming the load and the way to load
    # alone), then both finish; rank 1, which found rank 0 there, does not warn
    import time
    import warnings
    os.environ["XCKPT_WAIT_WARN_S"] = "0.5"
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if rank == 1:
                time.sleep(2.0)
            late = xckpt.load(wd / "main", like={"plain": torch.zeros(5, 3, dtype=torch.int64)}, partial=True)
    finally:
        del os.environ["XCKPT_WAIT_WARN_S"]
    np.testing.assert_array_equal(late["plain"].numpy(), np.arange(15).reshape(5, 3))
    waited = [str(w.message) for w in seen if issubclass(w.category, xckpt.XckptWarning)]
    if rank == 0:
        assert len(waited) == 1 and waited[0].startswith("rank 0 has waited 0.5 s for the other 1 process in load of "), waited
    else:
        assert not waited, waited
    return {"tp_tensors": n_tp}


def load3(rank: int, world: int, wd: Path, ref_losses: list[float]) -> dict[str, Any]:
    """3 ranks: uneven and empty shards, FSDP2 resume on another world size, DCP into FSDP2, a 3-rank save."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import xckpt
    from xckpt_torch import XckptStorageReader
    assert world == 3
    mesh = init_device_mesh("cpu", (3,))

    # uneven torch.chunk splits, and an empty local shard ("empty" has 2 columns over 3 ranks)
    place = {"w": [Shard(0)], "rep": [Shard(1)], "half": [Shard(0)], "uneven": [Shard(1)], "empty": [Shard(1)],
             "strided": [Shard(0)], "strided_cols": [Shard(1)], "strided_last": [Shard(0)], "bf": [Shard(0)],
             "scalar": [Replicate()], "vocab": [Shard(0)], "vocab_strided": [Shard(1)]}
    like = {n: distribute_tensor(torch.zeros(ARRAYS[n][0], dtype=xckpt.torch.torch_dtype(ARRAYS[n][1])), mesh, p)
            for n, p in place.items()}
    xckpt.load(wd / "main", like={"arrays": like})
    for n, d in like.items():
        check_dtensor(d, full(n))
    empty_here = like["empty"].to_local().numel() == 0

    # FSDP2 resume on 3 ranks (uneven parameter shards) from the 4-rank checkpoint
    m = fsdp(make_mlp(99), mesh)
    opt, sched = optim_for(m)
    state = {"model": m, "optim": opt, "sched": sched, "step": 0, "rng": xckpt.torch.rng_state()}
    out = xckpt.load(wd / "fsdp", like=state)
    start = out["step"]
    assert start == 3 and sched.last_epoch == 3 and out["model"] is m
    n_fsdp = compare_state(m, opt, dict(np.load(wd / "fsdp_expected.npz")))
    losses = [train_step(m, opt, sched, s, rank, world) for s in range(start, start + 3)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12, atol=0)
    control = fsdp(make_mlp(99), mesh)
    c_opt, c_sched = optim_for(control)
    c_losses = [train_step(control, c_opt, c_sched, s, rank, world) for s in range(3, 6)]
    assert not np.allclose(c_losses, ref_losses, rtol=1e-3), "the control run should differ"

    # torch DCP: the 6-step state, written by XckptStorageWriter on 4 ranks, into FSDP2 on 3 ranks
    m6 = fsdp(make_mlp(5), mesh)
    opt6, _ = optim_for(m6)
    msd, osd = get_state_dict(m6, opt6)
    values = {"model": msd, "optim": osd, "np_rng": np.random.RandomState(0).get_state(), "lr": np.float32(0),
              "stage3": (np.zeros(5, np.int16), torch.zeros(2), "")}
    dcp.load(values, storage_reader=XckptStorageReader(wd / "dcp_x"))  # values: replaced in this dict
    set_state_dict(m6, opt6, model_state_dict=msd, optim_state_dict=osd)
    # numpy data inside DCP values comes back as DCP gives it: numpy (a scalar as a scalar), tensors as tensors
    want_rng = np.random.RandomState(7).get_state()
    assert values["np_rng"][0] == want_rng[0] and values["np_rng"][2:] == want_rng[2:]
    assert type(values["np_rng"][1]) is np.ndarray and values["np_rng"][1].dtype == np.uint32
    np.testing.assert_array_equal(values["np_rng"][1], want_rng[1])
    assert type(values["lr"]) is np.float32 and values["lr"] == np.float32(0.125)
    arr, t, tag = values["stage3"]
    assert type(arr) is np.ndarray and arr.dtype == np.int16 and isinstance(t, torch.Tensor) and tag == "x"
    np.testing.assert_array_equal(arr, np.arange(5, dtype=np.int16) * 3)
    np.testing.assert_array_equal(t.numpy(), np.full((2,), 2.5, np.float32))
    n_dcp = compare_state(m6, opt6, dict(np.load(wd / "fsdp6_expected.npz")))

    # the pipeline checkpoint on another stage split: rank 0 layers 0 and the embedding, rank 1
    # layers 1 and 2, rank 2 layer 3 and the head; each rank loads only its own part
    mine = {0: [0], 1: [1, 2], 2: [3]}[rank]
    part = {"model": {f"layers.{i}.w": torch.zeros(6, 4) for i in mine}, "step": 0}
    if rank == 0:
        part["model"]["embed"] = torch.zeros(3, 4)
    if rank == 2:
        part["model"]["head"] = torch.zeros(5, 2)
    got = xckpt.load(wd / "pipeline", like=part, partial=True)
    assert got["step"] == 42
    for i in mine:
        np.testing.assert_array_equal(part["model"][f"layers.{i}.w"].numpy(), layer(i))
    if rank == 0:
        np.testing.assert_array_equal(part["model"]["embed"].numpy(), np.full((3, 4), 7.0, np.float32))
    if rank == 2:
        np.testing.assert_array_equal(part["model"]["head"].numpy(), np.arange(10.0, dtype=np.float32).reshape(5, 2))

    # a 3-rank save with an empty shard on rank 2 (2 rows over 3 ranks)
    u = distribute_tensor(torch.arange(10, dtype=torch.float32).reshape(2, 5), mesh, [Shard(0)])
    xckpt.save({"u": u, "v": like["uneven"]}, wd / "from3")
    return {"losses": losses, "control": c_losses, "empty_here": empty_here, "fsdp_tensors": n_fsdp,
            "dcp_tensors": n_dcp, "u_local": list(u.to_local().shape)}
