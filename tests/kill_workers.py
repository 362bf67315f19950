"""A zygote for the kill tests: one process that imports torch and xckpt once, then forks a 2-rank gloo job per request.

Run as a script (``python tests/kill_workers.py``) by ``test_commit_kill.py``. It reads one
JSON request a line on stdin and answers one JSON line on stdout:

``{"op": "group", "path": ..., "version": v, "overwrite": bool, "failpoints": spec or null,
"kill_survivors": bool, "no_renameat2": bool, "env": {...}, "timeout": s}`` (optional: "pg_timeout": the
process group's timeout in s, "delay": [point, rank, s] to make one rank sleep at a point) forks one process
per rank; each initialises a gloo process group on a fresh ``FileStore`` and saves
:func:`tree` of version ``v`` (a DTensor ``[Shard(0)]`` on a 1-D mesh, a replicated DTensor
and two values) with ``xckpt.save``, ``XCKPT_FAILPOINTS`` set to ``failpoints``. With
``kill_survivors``, once a rank has died the zygote SIGKILLs the others at once (as a
scheduler kills a job whose node died); otherwise survivors run on (their gloo collectives
fail when a peer's connection closes) and must end by ``timeout``, else they are killed and
reported as hung. Each rank's answer tells how it ended (exit status or signal, whether the
zygote killed it) and what it reported (``{"ok": true}`` or the error it raised).

Nothing here starts a thread before forking (TensorStore and gloo start theirs in the
children), every wait is bounded, every child is reaped, and children die with the zygote
(``PR_SET_PDEATHSIG``), which exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

WORLD = 2
#: Sharded arrays of the tree: name -> global shape (float32, split over the ranks along dim 0).
SHARDED = {f"t{i}": (256, 1024) for i in range(4)}
REPLICATED_SHAPE = (64, 48)


def tree(version: int) -> dict[str, Any]:
    """The global values a save of ``version`` holds, as numpy (exactly representable; every version differs)."""
    out: dict[str, Any] = {"w": {}}
    for i, (name, shape) in enumerate(SHARDED.items()):
        n = int(np.prod(shape))
        out["w"][name] = (np.arange(n, dtype=np.float64).reshape(shape) + 1_000_000 * version
                          + 100_000 * i).astype(np.float32)
    out["rep"] = np.arange(int(np.prod(REPLICATED_SHAPE)), dtype=np.float64).reshape(REPLICATED_SHAPE) * 0.25 - version
    out["step"] = 100 * version
    out["tag"] = f"v{version}"
    return out


# ---------------------------------------------------------------------------------------------
# in a forked rank


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort: the zygote also kills and reaps its children
        pass


def _rank_main(rank: int, req: dict[str, Any], store_path: str) -> dict[str, Any]:
    import datetime
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    import xckpt
    from xckpt.engine import atomic

    os.environ.update(req.get("env") or {})
    os.environ.pop("XCKPT_FAILPOINTS", None)
    if req.get("failpoints"):
        os.environ["XCKPT_FAILPOINTS"] = req["failpoints"]
    if req.get("no_renameat2"):
        os.environ["XCKPT_NO_RENAMEAT2"] = "1"
        atomic._renameat2 = atomic._load()  # read once at import, in the zygote: read it again here
        assert not atomic.supported()
    if req.get("delay"):  # a slow process (a stalled node, a slow file system): sleep at a point, then go on
        from xckpt.engine import failpoints
        point, slow_rank, seconds = req["delay"]
        hit = failpoints.hit

        def slow_hit(name: str, r: int = 0) -> None:
            if name == point and rank == slow_rank:
                time.sleep(float(seconds))
            hit(name, r)

        failpoints.hit = slow_hit
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=float(req.get("pg_timeout", 10))))
    mesh = init_device_mesh("cpu", (WORLD,))
    want = tree(int(req["version"]))
    local: dict[str, Any] = {}
    for name, arr in want["w"].items():
        rows = arr.shape[0] // WORLD
        local[name] = DTensor.from_local(torch.from_numpy(arr[rank * rows:(rank + 1) * rows].copy()), mesh,
                                         [Shard(0)], run_check=False)
    state = {"w": local, "rep": DTensor.from_local(torch.from_numpy(want["rep"].copy()), mesh, [Replicate()],
                                                   run_check=False),
             "step": want["step"], "tag": want["tag"]}
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", xckpt.XckptWarning)
            manifest = xckpt.save(state, req["path"], overwrite=bool(req.get("overwrite")))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "type": type(exc).__name__, "code": getattr(exc, "code", None),
                "error": str(exc)[:4000]}
    said = [str(w.message) for w in caught if issubclass(w.category, xckpt.XckptWarning)]
    try:  # both ranks are past the save's last collective before either closes its connections
        dist.barrier()
        dist.destroy_process_group()
        after = None
    except Exception as exc:  # noqa: BLE001 - the other rank may be gone (the test says when that is expected)
        after = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {"ok": True, "generation": getattr(manifest, "generation", None), "warnings": said, "after": after}


def _rank_entry(rank: int, req: dict[str, Any], store_path: str, wfd: int) -> None:
    code = 0
    try:
        _die_with_parent()
        try:
            result = _rank_main(rank, req, store_path)
        except BaseException as exc:  # noqa: BLE001 - the harness itself failed on this rank
            import traceback
            result = {"ok": False, "type": type(exc).__name__, "code": "harness",
                      "error": traceback.format_exc()[-4000:]}
        os.write(wfd, json.dumps(result).encode()[:60000])
    except BaseException:  # noqa: BLE001
        code = 3
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------------------------
# in the zygote


def run_group(req: dict[str, Any], ctl: str, serial: int, keep_fds: tuple[int, ...]) -> dict[str, Any]:
    """Fork one process per rank for ``req`` and wait for them (bounded); see the module docstring."""
    store_path = os.path.join(ctl, f"store-{os.getpid()}-{serial}")
    pipes = [os.pipe() for _ in range(WORLD)]
    pids: list[int] = []
    started = time.monotonic()
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            for fd in keep_fds:
                os.close(fd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)  # a rank never reads the zygote's requests
            os.close(devnull)
            for r, (rfd, wfd) in enumerate(pipes):
                os.close(rfd)
                if r != rank:
                    os.close(wfd)
            _rank_entry(rank, req, store_path, pipes[rank][1])
        pids.append(pid)
    for _, wfd in pipes:
        os.close(wfd)
    status: dict[int, int] = {}
    harness_killed: set[int] = set()
    hung: set[int] = set()
    deadline = started + float(req.get("timeout", 30))
    try:
        while len(status) < WORLD:
            for r, pid in enumerate(pids):
                if r not in status:
                    done, st = os.waitpid(pid, os.WNOHANG)
                    if done:
                        status[r] = st
            if req.get("kill_survivors") and status:
                for r, pid in enumerate(pids):
                    if r not in status and r not in harness_killed:
                        os.kill(pid, signal.SIGKILL)
                        harness_killed.add(r)
            if len(status) < WORLD and time.monotonic() > deadline:
                for r, pid in enumerate(pids):
                    if r not in status and r not in harness_killed:
                        os.kill(pid, signal.SIGKILL)
                        hung.add(r)
                        harness_killed.add(r)
            time.sleep(0.002)
    finally:
        for r, pid in enumerate(pids):  # never leave a child behind, whatever happened above
            if r not in status:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                status[r] = os.waitpid(pid, 0)[1]
    ranks = []
    for r in range(WORLD):
        chunks = []
        while True:
            data = os.read(pipes[r][0], 65536)
            if not data:
                break
            chunks.append(data)
        os.close(pipes[r][0])
        st = status[r]
        result = json.loads(b"".join(chunks)) if chunks else None
        ranks.append({"rank": r, "signal": os.WTERMSIG(st) if os.WIFSIGNALED(st) else None,
                      "exit": os.WEXITSTATUS(st) if os.WIFEXITED(st) else None,
                      "harness_killed": r in harness_killed, "hung": r in hung, "result": result})
    return {"ranks": ranks, "wall_s": round(time.monotonic() - started, 3)}


def _warm() -> None:
    """Import everything a rank would otherwise import lazily on each fork (torch._dynamo alone takes ~0.7 s)."""
    import torch
    import torch._dynamo  # imported lazily by DTensor.from_local
    import torch.distributed
    import torch.distributed.device_mesh
    import torch.distributed.tensor
    import xckpt
    import xckpt.registry
    import xckpt_torch  # noqa: F401
    xckpt.registry.autoload()
    xckpt.registry.adapters()
    torch.set_num_threads(1)


def main() -> None:
    """Answer requests from stdin until it closes."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what anything else prints goes to stderr, never into the answers
    _warm()
    ctl = os.environ.get("XCKPT_KILL_CTL") or os.getcwd()
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    serial = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        serial += 1
        try:
            reply = run_group(req, ctl, serial, (out.fileno(),))
        except Exception as exc:  # noqa: BLE001 - answered, so the test fails with the reason
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
