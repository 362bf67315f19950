"""xckpt against torch Distributed Checkpoint (DCP) on gloo ranks, and xckpt's save_async.

Save/load (``--only torch``), per workload (``--workload w1|w2|all``), two process groups
spawned side by side (each its own default gloo group, ``torch.set_num_threads(1)``):

* 4 saving ranks hold the tree as DTensors on a 1-D mesh of 4: matrices ``[Shard(0)]``,
  vectors ``[Replicate()]``, the step a plain int64 0-d tensor;
* 2 loading ranks hold preallocated DTensors ``[Shard(1)]`` on a 1-D mesh of 2 (vectors
  Replicate, a plain int64 step), filled with NaN (step -1) before every load, untimed.

An untimed warm-up round at full size comes first, then ``--repeats`` timed runs, the
methods alternating in order (xckpt, DCP; DCP, xckpt; ...: ``_common.rounds``). Per run and
method: the 4 ranks save into a fresh directory, ``xckpt.save(state, path)`` or
``dcp.save(state, storage_writer=FileSystemWriter(path))`` (defaults); the 2 ranks load it
in place, ``xckpt.load(path, like=state)`` or ``dcp.load(state,
storage_reader=FileSystemReader(path))``, then recompute the expected shard of every leaf
from the seeded pattern and compare element by element (a mismatch raises, and the
benchmark fails); then the directory is deleted, so the root holds one checkpoint at a
time. (On this VM, memory that was not touched recently costs several times more to
fault in than recycled memory, so letting checkpoints pile up skews later runs.)

Raw reference (the ``raw`` column, no goal): the same tree as numpy arrays in this
process, one file per array written by 2 threads with ``tofile`` + flush + ``os.fsync``
and read back with ``np.fromfile``.

Each call is timed on every rank between barriers and the max over ranks is taken (the
wall time of the collective); tables show medians over the runs. Peak RSS is each
process's high-water mark as the kernel keeps it, reset before the call (no thread samples
beside the measured code); "peak RSS all procs" sums each process's peak. "bytes read" sums
the /proc/self/io ``rchar`` deltas around the load call over the loading processes.
Checkpoints live under ``--root`` (default /dev/shm, a tmpfs).

save_async (``--only async``, on W1): the 4 saving ranks alternate ``xckpt.save`` and
``xckpt.save_async(state, path)`` + ``handle.wait()``; reports the blocking time (until
``save_async`` returns) and the total (until ``wait`` returns) against the synchronous
save of the same run, and the peak RSS growth. The 2 loading ranks load every checkpoint of
both kinds (untimed) and check it element by element.

First calls (``--only cold``, not part of ``all``): per run and method, a fresh saving group
saves once and a fresh loading group loads that checkpoint once (a job's restore is always
such a call); the packages are imported before the clock starts.

Run (full size, both workloads, then a quick reduced-size check)::

    .venv/bin/python benchmarks/bench_torch.py --workload all --repeats 3
    .venv/bin/python benchmarks/bench_torch.py --workload w1 --only torch --scale 0.1 --repeats 1
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

import _common as C

SAVE_WORLD, LOAD_WORLD = 4, 2
METHODS = ("xckpt", "DCP")
GROUP_TIMEOUT_S = 1800


# ----------------------------------------------------------------------------- inside a rank

def _init(rank: int, world: int, port: int) -> Any:
    """Join a gloo process group of ``world`` ranks and return a 1-D CPU mesh over it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return init_device_mesh("cpu", (world,))


def _dtensor(local: Any, mesh: Any, placement: Any, shape: tuple[int, ...]) -> Any:
    """A DTensor over ``local`` (no communication: the global shape and stride are given)."""
    import torch
    from torch.distributed.tensor import DTensor

    stride = tuple(int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(len(shape)))
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride)


def _source_state(wl: C.Workload, mesh: Any, rank: int, world: int) -> dict[str, Any]:
    """The tree to save: matrices ``[Shard(0)]`` over ``world`` ranks, vectors ``[Replicate()]``, plain int64 step."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    n, rows = wl.side, wl.side // world
    state: dict[str, Any] = {}
    for k in wl.matrices:
        local = torch.from_numpy(C.pattern(wl.seed(k), (n, n), (slice(rank * rows, (rank + 1) * rows), slice(None))))
        state[k] = _dtensor(local, mesh, Shard(0), (n, n))
    for k in wl.vectors:
        state[k] = _dtensor(torch.from_numpy(C.pattern(wl.seed(k), (wl.vec_len,))), mesh, Replicate(), (wl.vec_len,))
    state["step"] = torch.tensor(C.STEP, dtype=torch.int64)
    return state


def _target_state(wl: C.Workload, mesh: Any, world: int) -> dict[str, Any]:
    """Preallocated load targets: matrices ``[Shard(1)]`` over ``world`` ranks, vectors Replicate, int64 step."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    n = wl.side
    state: dict[str, Any] = {k: _dtensor(torch.empty(n, n // world), mesh, Shard(1), (n, n)) for k in wl.matrices}
    state.update({k: _dtensor(torch.empty(wl.vec_len), mesh, Replicate(), (wl.vec_len,)) for k in wl.vectors})
    state["step"] = torch.zeros((), dtype=torch.int64)
    return state


def _spoil(state: dict[str, Any]) -> None:
    """Fill every load target with a sentinel (NaN, step -1) so that a load that writes nothing fails the check."""
    for k, v in state.items():
        if k == "step":
            v.fill_(-1)
        else:
            v.to_local().fill_(float("nan"))


def _verify(wl: C.Workload, state: dict[str, Any], rank: int, world: int, where: str) -> None:
    """Compare every local shard of the loaded targets with the seeded pattern; raise on any difference."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    n, cols = wl.side, wl.side // world
    for k in wl.matrices:
        dt = state[k]
        if not isinstance(dt, DTensor) or tuple(dt.placements) != (Shard(1),):
            raise AssertionError(f"{where}: {k!r} is no longer a [Shard(1)] DTensor")
        want = C.pattern(wl.seed(k), (n, n), (slice(None), slice(rank * cols, (rank + 1) * cols)))
        C.check_equal(k, dt.to_local().numpy(), want, where)
    for k in wl.vectors:
        dt = state[k]
        if not isinstance(dt, DTensor) or tuple(dt.placements) != (Replicate(),):
            raise AssertionError(f"{where}: {k!r} is no longer a [Replicate()] DTensor")
        C.check_equal(k, dt.to_local().numpy(), C.pattern(wl.seed(k), (wl.vec_len,)), where)
    step = state["step"]
    if step.dtype != torch.int64 or int(step) != C.STEP:
        raise AssertionError(f"{where}: step is {step!r}, want {C.STEP}")


def _local_bytes(state: dict[str, Any]) -> int:
    """Bytes this rank holds of the tree (its shards, its replicas, the step)."""
    from torch.distributed.tensor import DTensor

    return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in state.values())


def _save(method: str) -> Callable[[dict[str, Any], str], Any]:
    """The save call of ``method`` (xckpt or DCP with its default FileSystemWriter)."""
    import torch.distributed.checkpoint as dcp

    import xckpt

    if method == "xckpt":
        return lambda state, path: xckpt.save(state, path)
    return lambda state, path: dcp.save(state, storage_writer=dcp.FileSystemWriter(path))


def _load(method: str) -> Callable[[dict[str, Any], str], Any]:
    """The in-place load call of ``method`` (xckpt or DCP with its default FileSystemReader)."""
    import torch.distributed.checkpoint as dcp

    import xckpt

    if method == "xckpt":
        return lambda state, path: xckpt.load(path, like=state)
    return lambda state, path: dcp.load(state, storage_reader=dcp.FileSystemReader(path))


def _warm_tree(mesh: Any, placement: Any, world: int, fill: bool) -> dict[str, Any]:
    """A small tree to warm up imports and thread pools before the timed runs."""
    import torch
    import torch.distributed as dist

    local = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    if placement.is_shard():
        local = local.chunk(world, dim=placement.dim)[dist.get_rank()].contiguous()
    if not fill:
        local = torch.zeros_like(local)
    return {"warm": _dtensor(local, mesh, placement, (64, 64))}


def _save_step(cmd: tuple[Any, ...], state: dict[str, Any], mesh: Any, rank: int, root: str) -> dict[str, Any]:
    """Run one command of the saving group (warm-up, a timed save, a timed save_async); return its sample."""
    import time

    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import xckpt

    if cmd[0] == "warm":
        warm = _warm_tree(mesh, Shard(0), SAVE_WORLD, fill=True)
        for m in METHODS:
            _save(m)(warm, os.path.join(root, f"warm-{m}"))
        return {}
    if cmd[0] == "save":
        _, method, path = cmd
        save = _save(method)  # its imports are done before the clock starts
        sample, _ = C.measure(lambda: save(state, path), dist.barrier)
    else:  # "save_async": the time until it returns, then the time until wait() returns
        _, path = cmd
        blocking: list[float] = []

        def save_async_and_wait() -> None:
            """save_async, note when it returns, then wait for the handle."""
            t0 = time.perf_counter()
            handle = xckpt.save_async(state, path)
            blocking.append(time.perf_counter() - t0)
            handle.wait()

        sample, _ = C.measure(save_async_and_wait, dist.barrier)
        sample.extra["blocking"] = blocking[0]
    if rank == 0:
        sample.extra["files"] = C.count_files(path)
    return asdict(sample)


def _load_step(cmd: tuple[Any, ...], state: dict[str, Any], mesh: Any, wl: C.Workload, rank: int,
               root: str) -> dict[str, Any]:
    """Run one command of the loading group (warm-up, or a timed in-place load then the check); return its sample."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    if cmd[0] == "warm":
        want = _warm_tree(mesh, Shard(1), LOAD_WORLD, fill=True)["warm"].to_local().numpy()
        for m in METHODS:
            warm = _warm_tree(mesh, Shard(1), LOAD_WORLD, fill=False)
            _load(m)(warm, os.path.join(root, f"warm-{m}"))
            C.check_equal("warm", warm["warm"].to_local().numpy(), want, f"{m} warm-up load")
        return {}
    _, method, path, where = cmd
    _spoil(state)
    load = _load(method)  # its imports are done before the clock starts
    sample, _ = C.measure(lambda: load(state, path), dist.barrier)
    _verify(wl, state, rank, LOAD_WORLD, f"{where}, rank {rank}")
    dist.barrier()
    return asdict(sample)


def _group_worker(rank: int, role: str, wl: C.Workload, port: int, root: str, commands: list[Any], done: Any) -> None:
    """One rank of the saving group (4 ranks, [Shard(0)]) or of the loading group (2 ranks, [Shard(1)]).

    It builds its state, then runs the commands the parent sends (every rank of the group
    gets the same ones) until "stop", answering each on ``done`` with (rank, sample).
    """
    world = SAVE_WORLD if role == "save" else LOAD_WORLD
    mesh = _init(rank, world, port)
    import torch.distributed as dist

    if role == "save":
        state = _source_state(wl, mesh, rank, world)
    else:
        state = _target_state(wl, mesh, world)
        _spoil(state)
    done.put((rank, {"local_bytes": _local_bytes(state)}))
    while True:
        cmd = commands[rank].get()
        if cmd[0] == "stop":
            break
        if role == "save":
            result = _save_step(cmd, state, mesh, rank, root)
        else:
            result = _load_step(cmd, state, mesh, wl, rank, root)
        done.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- in the parent

class _Group:
    """A process group of spawned ranks that runs the parent's commands one at a time."""

    def __init__(self, role: str, world: int, wl: C.Workload, root: str) -> None:
        """Spawn ``world`` ranks of ``role`` (save or load) on a fresh port; wait until their state is built."""
        import multiprocessing

        import torch.multiprocessing as mp

        ctx = multiprocessing.get_context("spawn")
        self.role, self.world = role, world
        self.commands = [ctx.Queue() for _ in range(world)]
        self.done = ctx.Queue()
        self.procs = mp.start_processes(_group_worker, args=(role, wl, C.free_port(), root, self.commands, self.done),
                                        nprocs=world, join=False, start_method="spawn")
        self.local_bytes = [r["local_bytes"] for r in self._collect()]

    def _collect(self) -> list[dict[str, Any]]:
        """One answer from every rank, in rank order; raises if a rank died."""
        import queue

        got: dict[int, dict[str, Any]] = {}
        while len(got) < self.world:
            try:
                rank, result = self.done.get(timeout=0.5)
                got[rank] = result
            except queue.Empty:
                if self.procs.join(timeout=0):  # raises (after stopping the others) if a rank failed
                    raise RuntimeError(f"the {self.role} ranks exited early")
        return [got[r] for r in range(self.world)]

    def run(self, *cmd: Any) -> list[dict[str, Any]]:
        """Send one command to every rank and return every rank's answer."""
        for q in self.commands:
            q.put(cmd)
        return self._collect()

    def stop(self) -> None:
        """Let the ranks leave their process group and exit."""
        for q in self.commands:
            q.put(("stop",))
        while not self.procs.join(timeout=1):
            pass

    def kill(self) -> None:
        """Terminate ranks that are still running (after an error elsewhere)."""
        for p in self.procs.processes:
            if p.is_alive():
                p.terminate()


def _collective(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One collective run over all ranks: max seconds, summed peak RSS and rchar, each rank's growth."""
    return {"seconds": max(s["seconds"] for s in runs), "peak_all": sum(s["peak_rss"] for s in runs),
            "rchar_all": sum(s["rchar"] for s in runs), "growth": [s["peak_rss"] - s["base_rss"] for s in runs],
            "growth_max": max(s["peak_rss"] - s["base_rss"] for s in runs),
            "blocking": max(s["extra"].get("blocking", float("nan")) for s in runs),
            "files": runs[0]["extra"].get("files", float("nan"))}


def _raw_reference(wl: C.Workload, repeats: int) -> dict[str, float]:
    """The raw baseline on the whole tree in this process (medians): save s, load s, rchar, peak RSS, files."""
    arrays = C.full_arrays(wl)
    runs = []
    for rep in range(repeats):
        d = C.fresh_dir(f"raw-{wl.name}")
        try:
            save, _ = C.measure(lambda: C.raw_save(arrays, d))
            files = C.count_files(d)
            load, got = C.measure(lambda: C.raw_load(arrays, d))
            for k, a in arrays.items():
                C.check_equal(k, got[k], a, f"{wl.name} raw load, run {rep}")
            del got
            runs.append({"save": save.seconds, "load": load.seconds, "rchar": load.rchar,
                         "save_peak": save.peak_rss, "load_peak": load.peak_rss, "files": files})
        finally:
            C.remove(d)
    return {k: C.median(r[k] for r in runs) for k in runs[0]}


def _with_groups(wl: C.Workload, root: str, body: Callable[[_Group, _Group], None]) -> None:
    """Start the saving and the loading group, warm both up, run ``body(saver, loader)``, stop them."""
    groups: list[_Group] = []
    try:
        C.log(f"{wl.name} torch: starting 4 saving ranks and 2 loading ranks ({C.size_note(wl)})")
        groups.append(_Group("save", SAVE_WORLD, wl, root))
        groups.append(_Group("load", LOAD_WORLD, wl, root))
        groups[0].run("warm")
        groups[1].run("warm")
        body(groups[0], groups[1])
        for g in groups:
            g.stop()
    finally:
        for g in groups:
            g.kill()


def run_saveload(wl: C.Workload, repeats: int) -> C.Table:
    """Measure ``wl``: 4 ranks save, 2 ranks load, xckpt against DCP, plus the raw reference; return the table.

    Per run and method: the saving group saves into a fresh directory, the loading group
    loads it in place and checks it, then the directory is deleted (so the root never holds
    more than one checkpoint, and every method sees the same memory footprint).
    """
    root = C.fresh_dir(f"torch-{wl.name}")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {"save": [], "load": []} for m in METHODS}
    sizes: dict[str, list[int]] = {}

    def body(saver: _Group, loader: _Group) -> None:
        """The interleaved runs."""
        sizes["load"] = loader.local_bytes
        for rep, order in C.rounds(METHODS, repeats):
            for m in order:
                path = os.path.join(root, f"{wl.name}-{m}-{rep}", "ckpt")
                try:
                    s = _collective(saver.run("save", m, path))
                    ld = _collective(loader.run("load", m, path, f"{wl.name} torch {m} load, {C.run_name(rep)}"))
                finally:
                    C.remove(os.path.dirname(path))
                if rep is not None:
                    runs[m]["save"].append(s)
                    runs[m]["load"].append(ld)
                C.log(f"{wl.name} torch {m:<5} {C.run_name(rep)}: save {s['seconds']:.2f} s, "
                      f"load {ld['seconds']:.2f} s (max over ranks), verified")

    try:
        _with_groups(wl, root, body)
    finally:
        C.remove(root)
    C.log(f"{wl.name} torch: raw reference (1 process, 2 threads)")
    raw = _raw_reference(wl, repeats)

    def med(m: str, op: str, key: str, i: int | None = None) -> float:
        """Median over runs of one aggregated quantity (element ``i`` of a per-rank list)."""
        return C.median(r[key] if i is None else r[key][i] for r in runs[m][op])

    t = C.Table(f"{wl.title} torch (4 ranks save [Shard(0)], 2 ranks load [Shard(1)]), {C.ROOT}, median of {repeats}\n"
                f"  {C.size_note(wl)}; raw = 1 process, 2 threads, tofile+fsync / fromfile (reference)",
                ["xckpt", "DCP", "raw"])
    t.add("save s", [med(m, "save", "seconds") for m in METHODS] + [raw["save"]], goal=C.Goal("<=", 0.6))
    t.add("load s", [med(m, "load", "seconds") for m in METHODS] + [raw["load"]], goal=C.Goal("<=", 0.6))
    if wl.name == "w2":
        t.add("files", [med(m, "save", "files") for m in METHODS] + [raw["files"]], fmt="{:.0f}")
        return t
    need = wl.need_bytes(LOAD_WORLD)
    rx, rd = (med(m, "load", "rchar_all") for m in METHODS)
    t.add("load: bytes read GB", [rx / C.GB, rd / C.GB, raw["rchar"] / C.GB], fmt="{:.3f}",
          goal=C.Goal("<=", 1.10, "<=1.10 x need", rx / need),
          note=f"need {need / C.GB:.3f} GB: xckpt {rx / need:.2f} x need, DCP {rd / need:.2f} x")
    for op in ("save", "load"):
        t.add(f"{op}: peak RSS all procs GB",
              [med(m, op, "peak_all") / C.GB for m in METHODS] + [raw[f"{op}_peak"] / C.GB])
    for r, shard in enumerate(sizes["load"]):
        gx, gd = (med(m, "load", "growth", r) for m in METHODS)
        limit = (shard + 256 * C.MiB) / C.MiB
        t.add(f"load rank {r}: peak RSS growth MiB", [gx / C.MiB, gd / C.MiB], fmt="{:.0f}",
              goal=C.Goal("<=", limit, f"<={limit:.0f} MiB", gx / C.MiB),
              note=f"own shard {shard / C.MiB:.0f} MiB (+256 MiB allowed)")
    return t


def run_async(wl: C.Workload, repeats: int) -> C.Table:
    """Measure save_async against save on the 4 saving ranks; return the table.

    After an untimed warm-up round, per run: a synchronous ``xckpt.save`` and ``save_async`` +
    ``wait`` (alternating which goes first), each into a fresh directory. The loading group
    (untimed) loads every checkpoint, synchronous and asynchronous, and checks it; then it is
    deleted. Loading both keeps the steps before each save the same: when only the asynchronous
    checkpoint was loaded, a save that came straight after a synchronous one (no load between)
    was often slow, up to twice as long, whichever kind it was; the first timed ``save_async``,
    which always came straight after a synchronous save, was slow in every run.
    """
    root = C.fresh_dir(f"torch-async-{wl.name}")
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    sizes: dict[str, list[int]] = {}

    def body(saver: _Group, loader: _Group) -> None:
        """The alternating runs."""
        sizes["save"] = saver.local_bytes
        for rep, order in C.rounds(["sync", "async"], repeats):
            got: dict[str, dict[str, Any]] = {}
            for kind in order:
                path = os.path.join(root, f"{kind}-{rep}", "ckpt")
                try:
                    if kind == "sync":
                        got[kind] = _collective(saver.run("save", "xckpt", path))
                    else:
                        got[kind] = _collective(saver.run("save_async", path))
                    # both checkpoints are loaded and checked, so that each save follows the same steps
                    loader.run("load", "xckpt", path, f"{wl.name} torch {kind} checkpoint, {C.run_name(rep)}")
                finally:
                    C.remove(os.path.dirname(path))
            if rep is not None:
                for kind, sample in got.items():
                    runs[kind].append(sample)
            a = got["async"]
            C.log(f"{wl.name} torch async {C.run_name(rep)}: sync save {got['sync']['seconds']:.2f} s, save_async "
                  f"blocking {a['blocking']:.2f} s, total {a['seconds']:.2f} s (max over ranks); checkpoint verified")

    try:
        _with_groups(wl, root, body)
    finally:
        C.remove(root)

    def med(kind: str, key: str) -> float:
        """Median over runs."""
        return C.median(r[key] for r in runs[kind])

    sync_s = med("sync", "seconds")
    t = C.Table(f"{wl.title} torch save_async (4 ranks [Shard(0)]), {C.ROOT}, median of {repeats}\n"
                f"  {C.size_note(wl)}; both columns xckpt; ratio = async / sync", ["save_async", "save (sync)"])
    t.add("blocking s (until it returns)", [med("async", "blocking"), sync_s], goal=C.Goal("<=", 0.25))
    t.add("total s (until wait returns)", [med("async", "seconds"), sync_s], goal=C.Goal("<=", 1.15))
    t.add("peak RSS growth MiB, max rank", [med("async", "growth_max") / C.MiB, med("sync", "growth_max") / C.MiB],
          fmt="{:.0f}", note=f"shard per rank {max(sizes['save']) / C.MiB:.0f} MiB")
    t.add("peak RSS all procs GB", [med("async", "peak_all") / C.GB, med("sync", "peak_all") / C.GB])
    return t


def run_cold(wl: C.Workload, repeats: int) -> C.Table:
    """Measure first calls: per run and method, a fresh saving group saves once, then a fresh loading
    group loads once in place and checks it (as a job's restore always is); return the table.

    The packages are imported before the clock starts; whatever a method does the first time it
    runs in a process (lazy imports, thread pools, a plan it cannot reuse) is timed. An untimed
    round comes first, as in the other comparisons, so neither method pays this machine's first
    touch of its memory.
    """
    root = C.fresh_dir(f"torch-cold-{wl.name}")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {"save": [], "load": []} for m in METHODS}
    C.log(f"{wl.name} torch cold: fresh groups of 4 saving and 2 loading ranks per call ({C.size_note(wl)})")
    try:
        for rep, order in C.rounds(METHODS, repeats):
            for m in order:
                path = os.path.join(root, f"{wl.name}-{m}-{rep}", "ckpt")
                where = f"{wl.name} torch {m} cold load, {C.run_name(rep)}"
                got: dict[str, dict[str, Any]] = {}
                try:
                    for role, world, cmd in (("save", SAVE_WORLD, ("save", m, path)),
                                             ("load", LOAD_WORLD, ("load", m, path, where))):
                        group = _Group(role, world, wl, root)
                        try:
                            got[role] = _collective(group.run(*cmd))
                            group.stop()
                        finally:
                            group.kill()
                finally:
                    C.remove(os.path.dirname(path))
                if rep is not None:
                    for op in ("save", "load"):
                        runs[m][op].append(got[op])
                C.log(f"{wl.name} torch cold {m:<5} {C.run_name(rep)}: first save {got['save']['seconds']:.2f} s, "
                      f"first load {got['load']['seconds']:.2f} s (max over ranks), verified")
    finally:
        C.remove(root)
    t = C.Table(f"{wl.title} torch, first calls in fresh processes (4 ranks save [Shard(0)], 2 ranks load "
                f"[Shard(1)]), {C.ROOT}, median of {repeats}\n  {C.size_note(wl)}", ["xckpt", "DCP"])
    for op in ("save", "load"):
        t.add(f"first {op} s", [C.median(r["seconds"] for r in runs[m][op]) for m in METHODS])
    return t


def main() -> int:
    """Parse flags, run the selected measurements, print one table each (exit 1 on a failed goal with --strict)."""
    p = C.common_args(__doc__.splitlines()[0])
    p.add_argument("--only", choices=["torch", "async", "all", "cold"], default="all",
                   help="torch: save/load against DCP; async: save_async on W1; all: both (default); cold: the "
                        "first save and load in fresh processes, against DCP's")
    args = C.parse(p)
    tables = []
    C.log_xckpt()
    if args.only in ("torch", "all"):
        for wl in C.workloads(args.workload, args.scale):
            tables.append(run_saveload(wl, args.repeats))
            tables[-1].print()
    if args.only in ("async", "all"):
        tables.append(run_async(C.w1(args.scale), args.repeats))
        tables[-1].print()
    if args.only == "cold":
        for wl in C.workloads(args.workload, args.scale):
            tables.append(run_cold(wl, args.repeats))
            tables[-1].print()
    return 1 if args.strict and any(t.failed for t in tables) else 0


if __name__ == "__main__":
    sys.exit(main())
