"""Starting the processes of multi-process tests: a free loopback port, and a group of worker scripts
run to completion with each one's output checked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    """A TCP port free on the loopback interface (for a coordinator or a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(argv: Callable[[int], list[str]], n: int, ok: Callable[[int], str], *, timeout: float = 180,
                  jax_devices: int | None = 4) -> list[str]:
    """Run ``python *argv(rank)`` for ranks ``0..n-1`` at once (with ``jax_devices`` host devices each, on
    CPU, and the tests directory importable); each must exit 0 and print ``ok(rank)``. Their outputs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    if jax_devices is not None:
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={jax_devices}", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, *argv(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(n)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and ok(r) in out, f"process {r} failed:\n{out[-6000:]}"
    return outputs
