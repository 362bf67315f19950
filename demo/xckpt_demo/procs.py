"""The demo's child processes: start them, watch them, and never leave one behind.

Each child runs in a session of its own, so a Ctrl-C in the terminal reaches only
the demo itself, which then ends every child (SIGTERM to its process group, then
SIGKILL). Children also ask the kernel to kill them if the demo dies
(``PR_SET_PDEATHSIG`` on Linux), so not even a ``kill -9`` of the demo strands
them. Children print progress to the demo's stdout; their stderr (library
warnings, gloo chatter) goes to a log file that is shown when they fail.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

#: The environment variable through which a child learns the demo's pid.
PARENT_ENV = "XCKPT_DEMO_PARENT_PID"

_live: list[subprocess.Popen] = []


class JobError(RuntimeError):
    """A child job failed or ran past its time limit."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def guard_parent() -> None:
    """In a child: die with the demo (PR_SET_PDEATHSIG), and exit now if it is already gone."""
    want = os.environ.get(PARENT_ENV)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if want and os.getppid() != int(want):
        os._exit(1)


def _end(procs: Sequence[subprocess.Popen], grace: float = 3.0) -> None:
    """SIGTERM each child's process group, then SIGKILL what is still running after ``grace`` seconds."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
    for p in procs:
        if p in _live:
            _live.remove(p)


def end_all() -> None:
    """End every child the demo started that is still running."""
    _end(list(_live))


atexit.register(end_all)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def run_group(label: str, argvs: Sequence[Sequence[str]], logs: Sequence[Path], *, env: dict[str, str] | None = None,
              timeout: float = 300.0) -> None:
    """Run the commands as one job (e.g. the ranks of a torch group); return when all exit 0.

    Raises :class:`JobError` with the failing child's log tail when one fails (the
    others are ended a few seconds later: they would wait on it forever) or when the
    job runs past ``timeout`` seconds. A KeyboardInterrupt ends every child, then
    propagates.
    """
    child_env = dict(os.environ if env is None else env)
    child_env[PARENT_ENV] = str(os.getpid())
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    procs: list[subprocess.Popen] = []
    try:
        for argv, log in zip(argvs, logs):
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "wb") as err:
                p = subprocess.Popen(list(argv), env=child_env, stdin=subprocess.DEVNULL, stderr=err,
                                     start_new_session=True)
            procs.append(p)
            _live.append(p)
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 5:
                break
            if time.monotonic() > deadline:
                _end(procs)
                raise JobError(f"{label}: still running after {timeout:.0f} s; ended it")
            time.sleep(0.05)
        _end(procs)
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            i, rc = bad[0]
            raise JobError(f"{label}: process {i} exited with code {rc}; its log ({logs[i]}):\n{_tail(logs[i])}")
    finally:
        _end(procs)


class interrupt_on_sigterm:
    """Within this context a SIGTERM of the demo raises KeyboardInterrupt (so children are ended too)."""

    def __enter__(self) -> interrupt_on_sigterm:
        def handler(signum: int, frame: object) -> None:
            raise KeyboardInterrupt
        try:
            self._old = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
