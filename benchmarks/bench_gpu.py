"""xckpt on a CUDA GPU against the copy limits of the same machine, DCP and Orbax.

W1's arrays (24 fp32 matrices, 200 fp32 vectors, an int64 step; 1.06 GB) live on the one GPU of one
process: plain CUDA tensors for PyTorch, arrays on the GPU for JAX. Each measurement runs in a fresh
process (``--one``), so that memory numbers start from the same place; a row is the median of
``--repeats`` runs after one warm-up run, which pays for first allocations (their time is printed apart).

* **copy limits**: one device-to-host copy of all the state's bytes as one buffer into page-locked
  memory (the limit), and the state's own tensors each copied into a page-locked buffer of its own,
  every copy queued before the first is waited for (the pure device-to-host copy of the state).
* **staging**: ``xckpt.save_async``'s blocking time against that pure copy (goal: <= 1.2 x), and its
  throughput against the limit (goal: >= 80 %); DCP's ``async_save`` beside it. For JAX, the blocking
  time against ``jax.device_put`` of every array to the ``pinned_host`` memory kind (goal: <= 1.2 x)
  and against JAX's own host copies (``copy_to_host_async``, then ``np.asarray``).
* **save / load**: ``xckpt.save`` and ``xckpt.load`` (into the preallocated CUDA tensors) against DCP's
  ``save`` / ``load`` (default ``FileSystemWriter``/``Reader``); for JAX, against Orbax's
  ``StandardCheckpointer`` (restoring onto the GPU). Every load is checked element by element.
* **memory**: the peak RSS growth of each save (host memory; for JAX, xckpt's against Orbax's) and the
  peak of torch's CUDA allocator over what the state holds (device memory).

    python benchmarks/bench_gpu.py [--repeats 5] [--root /dev/shm]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

import _common as C

HERE = os.path.dirname(os.path.abspath(__file__))


def _torch_state(wl: C.Workload) -> dict[str, Any]:
    import torch
    state: dict[str, Any] = {k: torch.from_numpy(C.pattern(wl.seed(k), (wl.side, wl.side))).cuda() for k in wl.matrices}
    state.update({k: torch.from_numpy(C.pattern(wl.seed(k), (wl.vec_len,))).cuda() for k in wl.vectors})
    state["step"] = torch.tensor(C.STEP, dtype=torch.int64)
    torch.cuda.synchronize()
    return state


def _check_torch(wl: C.Workload, state: dict[str, Any], where: str) -> None:
    for k in wl.matrices:
        C.check_equal(k, state[k].cpu().numpy(), C.pattern(wl.seed(k), (wl.side, wl.side)), where)
    for k in wl.vectors:
        C.check_equal(k, state[k].cpu().numpy(), C.pattern(wl.seed(k), (wl.vec_len,)), where)
    if int(state["step"]) != C.STEP:
        raise AssertionError(f"{where}: step {int(state['step'])}")


def _timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None],
           setup: Callable[[], None] | None = None) -> dict[str, Any]:
    """One warm-up run, then ``repeats`` timed ones (each with its peak RSS growth); what ``fn`` returns
    (a dict of numbers) is kept per run, the warm-up run's under ``first``."""
    out: dict[str, Any] = {"runs": [], "growth": []}
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        C.release_memory()
        sync()
        with C.PeakRSS() as mem:
            t0 = time.perf_counter()
            extra = fn()
            extra = extra if isinstance(extra, dict) else {}
            sync()
            dt = time.perf_counter() - t0
        if i == 0:
            out["first"] = {"seconds": dt, "rss": mem.growth, **extra}
            continue
        out["runs"].append(dt)
        out["growth"].append(mem.growth)
        for k, v in extra.items():
            out.setdefault(k, []).append(v)
    out["median"] = C.median(out["runs"])
    return out


def _paths(root: str, what: str) -> tuple[Callable[[], str], Callable[[], None]]:
    """``fresh()``: a new checkpoint path of this measurement; ``clean()``: remove those made so far
    (between runs, untimed)."""
    made: list[str] = []

    def fresh() -> str:
        made.append(os.path.join(root, f"gpu-{what}-{len(made)}"))
        C.remove(made[-1])
        return made[-1]

    def clean() -> None:
        for q in made:
            C.remove(q)
    return fresh, clean


def _save_async(state: Any, path: str) -> dict[str, float]:
    """``xckpt.save_async`` then ``wait()``: the time until it returned, and its planning and staging."""
    import xckpt
    t0 = time.perf_counter()
    h = xckpt.save_async(state, path)
    blocking = time.perf_counter() - t0
    h.wait()
    return {"blocking": blocking, "plan_s": h.stats["plan_s"], "stage_s": h.stats["stage_s"]}


def one_torch(what: str, wl: C.Workload, root: str, repeats: int) -> dict[str, Any]:
    """One measurement of PyTorch on CUDA, in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    import xckpt

    state = _torch_state(wl)
    tensors = [v for k, v in state.items() if k != "step"]
    nbytes = sum(t.nbytes for t in tensors)
    sync = torch.cuda.synchronize
    res: dict[str, Any] = {"bytes": nbytes, "gpu": torch.cuda.get_device_name()}
    if what == "limits":
        flat = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
        host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
        pageable = torch.empty(nbytes // 4, dtype=torch.float32)
        res["limit"] = _timed(lambda: host.copy_(flat, non_blocking=True), repeats, sync)
        res["pageable"] = _timed(lambda: pageable.copy_(flat), repeats, sync)
        registered = torch.empty(nbytes // 4, dtype=torch.float32)
        res["register_code"] = int(torch.cuda.cudart().cudaHostRegister(registered.data_ptr(), registered.nbytes, 0))
        res["registered"] = _timed(lambda: registered.copy_(flat, non_blocking=True), repeats, sync)
        bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

        def every_tensor() -> None:
            for b, t in zip(bufs, tensors):
                b.copy_(t, non_blocking=True)
        res["pure"] = _timed(every_tensor, repeats, sync)
        return res
    fresh, clean = _paths(root, what)

    torch.cuda.reset_peak_memory_stats()
    base_dev = torch.cuda.memory_allocated()
    if what == "xckpt_async":
        res["save"] = _timed(lambda: _save_async(state, fresh()), repeats, sync, clean)
        if os.environ.get("BENCH_PROFILE"):  # where one call's blocking time goes, for the JSON file
            import cProfile
            import io
            import pstats
            clean()
            prof = cProfile.Profile()
            prof.enable()
            h = xckpt.save_async(state, fresh())
            prof.disable()
            h.wait()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
            res["profile"] = text.getvalue()
    elif what == "dcp_async":
        def run() -> dict[str, float]:
            t0 = time.perf_counter()
            f = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(fresh()))
            blocking = time.perf_counter() - t0
            f.result()
            return {"blocking": blocking}
        res["save"] = _timed(run, repeats, sync, clean)
    elif what in ("xckpt_save", "dcp_save"):
        save = (lambda p: xckpt.save(state, p)) if what == "xckpt_save" else \
            (lambda p: dcp.save(state, storage_writer=dcp.FileSystemWriter(p)))
        res["save"] = _timed(lambda: save(fresh()), repeats, sync, clean)
    elif what in ("xckpt_load", "dcp_load"):
        p = fresh()
        if what == "xckpt_load":
            xckpt.save(state, p)
            load = lambda: xckpt.load(p, like=state)  # noqa: E731
        else:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(p))
            load = lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(p))  # noqa: E731

        def spoil_and_load() -> None:
            for v in tensors:
                v.fill_(float("nan"))
            state["step"].fill_(-1)
            load()
        res["load"] = _timed(spoil_and_load, repeats, sync)
        _check_torch(wl, state, what)
    res["device_peak_over_state"] = torch.cuda.max_memory_allocated() - base_dev
    clean()
    return res


def one_jax(what: str, wl: C.Workload, root: str, repeats: int) -> dict[str, Any]:
    """One measurement of JAX on the GPU, in this process."""
    import jax
    import orbax.checkpoint as ocp
    import xckpt
    from jax.sharding import SingleDeviceSharding

    gpu = jax.devices("gpu")[0]
    sharding = SingleDeviceSharding(gpu)
    state = {k: jax.device_put(C.pattern(wl.seed(k), (wl.side, wl.side)), gpu) for k in wl.matrices}
    state.update({k: jax.device_put(C.pattern(wl.seed(k), (wl.vec_len,)), gpu) for k in wl.vectors})
    jax.block_until_ready(state)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()}
    import jax.numpy as jnp
    live: dict[str, Any] = {}

    def renew() -> None:
        """Copies of the arrays on the GPU, made before each run: JAX keeps an array's host copy once it
        made one, which would make every later save of the same arrays skip the device-to-host copy."""
        clean()
        live.clear()
        live.update({k: jnp.copy(v) for k, v in state.items()})
        jax.block_until_ready(live)
    res: dict[str, Any] = {"bytes": sum(v.nbytes for v in state.values()), "gpu": str(gpu.device_kind)}
    fresh, clean = _paths(root, what)

    def nothing() -> None:
        return None

    if what == "jax_pure":
        def d2h() -> None:
            for v in live.values():
                v.copy_to_host_async()
            for v in live.values():
                np.asarray(v)
        res["pure"] = _timed(d2h, repeats, nothing, renew)
        pinned = sharding.with_memory_kind("pinned_host")

        def to_pinned() -> None:
            jax.block_until_ready([jax.device_put(v, pinned) for v in live.values()])
        res["pinned"] = _timed(to_pinned, repeats, nothing, renew)
    elif what == "jax_xckpt_async":
        res["save"] = _timed(lambda: _save_async(live, fresh()), repeats, nothing, renew)
    elif what == "jax_xckpt_save":
        res["save"] = _timed(lambda: xckpt.save(live, fresh()), repeats, nothing, renew)
    elif what == "jax_orbax_save":
        ckptr = ocp.StandardCheckpointer()

        def run() -> None:
            ckptr.save(fresh(), live)
            ckptr.wait_until_finished()
        res["save"] = _timed(run, repeats, nothing, renew)
    elif what in ("jax_xckpt_load", "jax_orbax_load"):
        p = fresh()
        if what == "jax_xckpt_load":
            xckpt.save(state, p)
            load = lambda: jax.block_until_ready(xckpt.load(p, like=abstract))  # noqa: E731
        else:
            ckptr = ocp.StandardCheckpointer()
            ckptr.save(p, state)
            ckptr.wait_until_finished()
            load = lambda: jax.block_until_ready(ckptr.restore(p, abstract))  # noqa: E731
        got: list[Any] = []

        def keep() -> None:
            got.append(load())
        res["load"] = _timed(keep, repeats, nothing)
        out = got[-1]
        for k in wl.matrices + wl.vectors:
            assert out[k].devices() == {gpu}, k
            want = C.pattern(wl.seed(k), (wl.side, wl.side) if k in wl.matrices else (wl.vec_len,))
            C.check_equal(k, np.asarray(out[k]), want, what)
    clean()
    return res


TORCH = ["limits", "xckpt_async", "dcp_async", "xckpt_save", "dcp_save", "xckpt_load", "dcp_load"]
JAX = ["jax_pure", "jax_xckpt_async", "jax_xckpt_save", "jax_orbax_save", "jax_xckpt_load", "jax_orbax_load"]


def _spawn(what: str, args: Any) -> dict[str, Any]:
    """Run one measurement in a fresh process; its results (``{"error": ...}`` when it failed)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JAX_PLATFORMS", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--one", what, "--repeats", str(args.repeats),
           "--scale", str(args.scale), "--root", C.ROOT]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if out.returncode != 0:
        print(f"{what} failed:\n{out.stderr[-3000:]}", file=sys.stderr, flush=True)
        return {"error": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


class _Results(dict):
    """Every measurement by name; a missing one (its process failed) reads as NaN."""

    def get_(self, what: str, *path: str) -> Any:
        node: Any = self.get(what, {})
        for k in path:
            if not isinstance(node, dict) or k not in node:
                return float("nan")
            node = node[k]
        return C.median(node) if isinstance(node, list) else node


def main() -> int:
    """Parse flags, run the measurements (each in a process of its own), print the tables."""
    p = C.common_args(__doc__, workload=False)
    p.add_argument("--one", help=argparse_hidden())
    p.add_argument("--json", help="also write every measurement to this file")
    p.add_argument("--only", help="comma-separated measurements to run (default: all; 'limits' always runs): "
                   + ", ".join(TORCH + JAX))
    args = C.parse(p)
    wl = C.w1(args.scale)
    if args.one:
        fn = one_jax if args.one.startswith("jax") else one_torch
        print(json.dumps(fn(args.one, wl, C.ROOT, args.repeats)))
        return 0
    chosen = [w for w in TORCH + JAX if not args.only or w == "limits" or w in args.only.split(",")]
    r = _Results({what: _spawn(what, args) for what in chosen})
    if args.json:
        C.dump_json(args.json, r)
    g = r.get_
    gb = r["limits"]["bytes"] / C.GB
    lim, pure, pageable = (g("limits", k, "median") for k in ("limit", "pure", "pageable"))
    print(f"GPU: {r['limits'].get('gpu')}; W1 on one GPU: {gb:.3f} GB of tensors; medians of {args.repeats} runs "
          f"after a warm-up run; checkpoints under {C.ROOT}\n")
    t = C.Table("Device-to-host copies (GB/s)", ["measured", "limit"])
    t.add("one buffer -> page-locked (limit)", [gb / lim, gb / lim])
    t.add("one buffer -> pageable memory", [gb / pageable, gb / lim])
    t.add("one buffer -> cudaHostRegister'ed", [gb / g("limits", "registered", "median"), gb / lim],
          note=f"cudaHostRegister returned {r['limits'].get('register_code')}")
    t.add("every tensor -> page-locked (pure copy)", [gb / pure, gb / lim])
    xa_block, da_block = g("xckpt_async", "save", "blocking"), g("dcp_async", "save", "blocking")
    t.add("xckpt.save_async staging", [gb / xa_block, gb / lim], goal=C.Goal(">=", 0.8))
    t.add("DCP async_save staging", [gb / da_block, gb / lim])
    t.print()
    t = C.Table("PyTorch, CUDA tensors (s)", ["xckpt", "peer"])
    t.add("save_async blocking vs pure copy", [xa_block, pure], fmt="{:.3f}", goal=C.Goal("<=", 1.2))
    t.add("save_async blocking vs DCP async_save", [xa_block, da_block], fmt="{:.3f}")
    t.add("save_async to commit vs DCP async_save", [g("xckpt_async", "save", "median"),
                                                      g("dcp_async", "save", "median")], fmt="{:.3f}")
    t.add("save_async first call (blocking)", [g("xckpt_async", "save", "first", "blocking"),
                                                g("dcp_async", "save", "first", "blocking")], fmt="{:.3f}",
          note="the warm-up run: allocates and page-locks its buffers")
    t.add("save vs DCP", [g("xckpt_save", "save", "median"), g("dcp_save", "save", "median")], fmt="{:.3f}")
    t.add("load (in place, CUDA) vs DCP", [g("xckpt_load", "load", "median"), g("dcp_load", "load", "median")],
          fmt="{:.3f}")
    t.print()
    mib = 1 << 20
    t = C.Table("PyTorch memory (MiB)", ["xckpt", "DCP"])
    t.add("host: peak RSS growth, save", [g("xckpt_save", "save", "growth") / mib,
                                           g("dcp_save", "save", "growth") / mib], fmt="{:.0f}")
    t.add("host: peak RSS growth, async (steady)", [g("xckpt_async", "save", "growth") / mib,
                                                     g("dcp_async", "save", "growth") / mib], fmt="{:.0f}")
    t.add("host: peak RSS growth, async (first)", [g("xckpt_async", "save", "first", "rss") / mib,
                                                    g("dcp_async", "save", "first", "rss") / mib], fmt="{:.0f}",
          note=f"the state: {gb * C.GB / mib:.0f} MiB")
    t.add("device: allocator peak over the state, save", [g("xckpt_save", "device_peak_over_state") / mib,
                                                           g("dcp_save", "device_peak_over_state") / mib], fmt="{:.0f}")
    t.add("device: allocator peak over the state, async", [g("xckpt_async", "device_peak_over_state") / mib,
                                                            g("dcp_async", "device_peak_over_state") / mib],
          fmt="{:.0f}")
    t.print()
    t = C.Table("JAX, arrays on the GPU (s)", ["xckpt", "peer"])
    j_block = g("jax_xckpt_async", "save", "blocking")
    t.add("save_async blocking vs copy to pinned_host", [j_block, g("jax_pure", "pinned", "median")], fmt="{:.3f}",
          goal=C.Goal("<=", 1.2), note="the peer: jax.device_put of every array to page-locked host memory")
    t.add("save_async blocking vs JAX's own D2H", [j_block, g("jax_pure", "pure", "median")], fmt="{:.3f}",
          note="the peer: copy_to_host_async, then np.asarray, of every array")
    t.add("save vs Orbax", [g("jax_xckpt_save", "save", "median"), g("jax_orbax_save", "save", "median")],
          fmt="{:.3f}")
    t.add("load onto the GPU vs Orbax", [g("jax_xckpt_load", "load", "median"), g("jax_orbax_load", "load", "median")],
          fmt="{:.3f}")
    t.print()
    t = C.Table("JAX memory (MiB)", ["xckpt", "Orbax"])
    t.add("host: peak RSS growth, save", [g("jax_xckpt_save", "save", "growth") / mib,
                                           g("jax_orbax_save", "save", "growth") / mib], fmt="{:.0f}")
    t.add("host: peak RSS growth, save_async (steady)", [g("jax_xckpt_async", "save", "growth") / mib, None],
          fmt="{:.0f}", note=f"the state: {gb * C.GB / mib:.0f} MiB")
    t.print()
    return 0


def argparse_hidden() -> str:
    """The help text that hides a flag (the one each measurement's process is started with)."""
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
