"""Helpers shared by the benchmark scripts: workloads, seeded data, memory and I/O probes, tables.

Nothing here imports torch or jax, so every script (and every spawned rank) can use it.
Not a benchmark itself; see ``bench_torch.py``, ``bench_jax.py``, ``bench_numpy.py``, ``run_all.py``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: Where the benchmarks' checkpoints go by default (a tmpfs: no disk in the measurement).
SHM = "/dev/shm"
#: Where they go in this run: ``--root`` (:func:`parse`), else :data:`SHM`.
ROOT = SHM
MiB = 1 << 20
GB = 1e9
STEP = 1000  #: the value of the int64 step in every workload


# ----------------------------------------------------------------------------- workloads

@dataclass(frozen=True)
class Workload:
    """A checkpoint tree: square fp32 matrices (sharded), fp32 vectors (replicated), an int64 step."""

    name: str
    title: str
    matrices: tuple[str, ...]
    side: int
    vectors: tuple[str, ...]
    vec_len: int

    def seed(self, key: str) -> int:
        """The seed of one leaf's values (its position in the tree, from 1)."""
        return self._seeds[key]

    @functools.cached_property
    def _seeds(self) -> dict[str, int]:
        """Every array leaf's seed."""
        return {k: i + 1 for i, k in enumerate(self.leaves())}

    def leaves(self) -> list[str]:
        """Every array leaf's key, matrices first, then vectors (the step is not listed)."""
        return list(self.matrices) + list(self.vectors)

    @property
    def matrix_bytes(self) -> int:
        """Bytes of all the matrices."""
        return len(self.matrices) * self.side * self.side * 4

    @property
    def vector_bytes(self) -> int:
        """Bytes of all the vectors (one copy)."""
        return len(self.vectors) * self.vec_len * 4

    @property
    def total_bytes(self) -> int:
        """Bytes of one copy of the whole tree (matrices, vectors, the 8-byte step)."""
        return self.matrix_bytes + self.vector_bytes + 8

    def need_bytes(self, processes: int) -> int:
        """Bytes that ``processes`` loading processes, together, need: each its share of the
        matrices plus its own copy of every replicated vector and of the step."""
        return self.matrix_bytes + processes * (self.vector_bytes + 8)


def _side(n: int, scale: float) -> int:
    """A matrix side scaled by ``scale``, a multiple of 8 (so it splits over 4 and 2 ranks)."""
    return max(8, int(round(n * scale / 8)) * 8)


def w1(scale: float = 1.0) -> Workload:
    """W1, "model + Adam": 8 layers x (weight, exp_avg, exp_avg_sq) fp32 3328x3328, 200 fp32[1024], step."""
    mats = tuple(f"layers.{i}.{k}" for i in range(8) for k in ("weight", "exp_avg", "exp_avg_sq"))
    vecs = tuple(f"vectors.{j}" for j in range(max(1, round(200 * scale))))
    return Workload("w1", "W1 model + Adam", mats, _side(3328, scale), vecs, 1024)


def w2(scale: float = 1.0) -> Workload:
    """W2, "many small tensors": 10,000 fp32[1024] (replicated), 3 fp32 1472x1472 (sharded), step."""
    mats = tuple(f"matrices.{i}" for i in range(3))
    vecs = tuple(f"vectors.{j}" for j in range(max(1, round(10_000 * scale))))
    return Workload("w2", "W2 many small tensors", mats, _side(1472, scale), vecs, 1024)


def workloads(which: str, scale: float) -> list[Workload]:
    """The workloads named by ``--workload`` (w1, w2 or all)."""
    return {"w1": [w1(scale)], "w2": [w2(scale)], "all": [w1(scale), w2(scale)]}[which]


_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def pattern(seed: int, shape: Sequence[int], index: Sequence[slice] | None = None) -> np.ndarray:
    """float32 values in [0, 1) of region ``index`` of the seeded array of ``shape``.

    Element (i, j, ...) is the top 24 bits of hash(seed, axis 0, i) ^ hash(seed, axis 1, j) ^ ...,
    so a region computed alone equals the same region of the whole array: every rank
    recomputes exactly the shard it should hold, whatever the layout, and a misplaced
    row, column or block shows up as different values.
    """
    shape = tuple(int(n) for n in shape)
    index = tuple(index) if index is not None else tuple(slice(None) for _ in shape)
    with np.errstate(over="ignore"):
        base = np.uint64(seed) * _GOLD
        out = _mix(np.array([base], np.uint64)).reshape(())
        for axis, (s, n) in enumerate(zip(index, shape)):
            idx = np.arange(*s.indices(n), dtype=np.uint64) + (base + np.uint64((axis + 1) << 48))
            h = _mix(idx).reshape((-1,) + (1,) * (len(shape) - 1 - axis))
            out = out ^ h
    return (np.asarray(out) >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def full_arrays(wl: Workload, matrices_only: bool = False) -> dict[str, np.ndarray]:
    """The whole tree of ``wl`` as numpy arrays (the step as an int64 0-d array)."""
    out = {k: pattern(wl.seed(k), (wl.side, wl.side)) for k in wl.matrices}
    if not matrices_only:
        out.update({k: pattern(wl.seed(k), (wl.vec_len,)) for k in wl.vectors})
        out["step"] = np.array(STEP, np.int64)
    return out


def check_equal(key: str, got: np.ndarray, want: np.ndarray, where: str) -> None:
    """Raise (loudly) unless ``got`` equals ``want`` element by element, with the same shape and dtype."""
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        bad = "shape/dtype" if got.shape != want.shape or got.dtype != want.dtype else \
            f"{int(np.sum(got != want))} of {want.size} elements"
        raise AssertionError(f"{where}: loaded {key!r} differs from what was saved ({bad}; "
                             f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)})")


# ----------------------------------------------------------------------------- probes

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size now, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def rchar() -> int:
    """Bytes this process has read through read-like system calls so far (/proc/self/io ``rchar``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _reset_peak() -> bool:
    """Reset the kernel's peak RSS of this process (``VmHWM``) to its RSS now; False where it cannot
    (not Linux, or /proc/self/clear_refs not writable)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kernel_peak_rss() -> int:
    """This process's peak RSS as the kernel counts it (``VmHWM`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class PeakRSS:
    """Context manager: the peak RSS of this process within the block.

    ``base`` is the RSS on entry, ``peak`` the largest RSS in the block. On Linux the kernel keeps the
    peak (its high-water mark is reset on entry and read on exit): exact, and nothing runs beside the
    measured code. Elsewhere a thread samples the RSS every ``interval`` seconds.
    """

    def __init__(self, interval: float = 0.001) -> None:
        """Sample every ``interval`` seconds (about 1 ms by default) where the kernel keeps no peak."""
        self.interval = interval
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakRSS":
        """Record the base RSS; reset the kernel's peak, or start sampling."""
        self.base = self.peak = rss_bytes()
        if _reset_peak():
            self._thread = None
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """The sampling loop."""
        while not self._stop.is_set():
            r = rss_bytes()
            if r > self.peak:
                self.peak = r
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        """Read the kernel's peak, or stop sampling and take one last sample."""
        if self._thread is None:
            self.peak = max(self.base, _kernel_peak_rss())
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        """Peak minus base."""
        return self.peak - self.base


@dataclass
class Sample:
    """One timed operation in one process."""

    seconds: float
    base_rss: int
    peak_rss: int
    rchar: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def growth(self) -> int:
        """Peak RSS growth during the operation."""
        return self.peak_rss - self.base_rss


def release_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc ``malloc_trim``), so that
    what earlier runs freed does not hide in, or inflate, the next run's RSS."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def measure(fn: Callable[[], Any], barrier: Callable[[], None] | None = None) -> tuple[Sample, Any]:
    """Run ``fn`` once and return its :class:`Sample` and result.

    Garbage is collected and freed memory trimmed first; with ``barrier`` (a collective operation) every
    process enters and leaves together, and only the call itself is timed. The
    peak RSS (:class:`PeakRSS`) is taken from just before the call to just after it; ``rchar`` is
    read around it.
    """
    release_memory()
    if barrier is not None:
        barrier()
    with PeakRSS() as mem:
        r0 = rchar()
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        r1 = rchar()
    if barrier is not None:
        barrier()
    return Sample(seconds, mem.base, mem.peak, r1 - r0), result


def rounds(methods: Sequence[str], repeats: int) -> Iterable[tuple[int | None, list[str]]]:
    """The rounds of a comparison, as ``(run, methods in the order they run)``: first an untimed
    warm-up round at full size (run None), then ``repeats`` timed runs.

    The warm-up lets every method meet memory the machine has already handed out once (on this
    VM, memory never touched before costs several times more to fault in, and it would fall on
    whichever method runs first); the order of the methods alternates from run to run, so no
    method is always first or always last.
    """
    yield None, list(methods)
    for rep in range(repeats):
        yield rep, list(methods) if rep % 2 == 0 else list(reversed(methods))


def run_name(rep: int | None) -> str:
    """How a log line names a round of :func:`rounds`."""
    return "warm-up" if rep is None else f"run {rep}"


def median(xs: Iterable[float]) -> float:
    """Median of the values (NaN when there are none)."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- files and processes

def fresh_dir(tag: str) -> str:
    """A new, empty directory under :data:`ROOT`."""
    return tempfile.mkdtemp(prefix=f"xckpt-bench-{tag}-", dir=ROOT)


def remove(path: str) -> None:
    """Delete a file or directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def count_files(path: str) -> int:
    """Number of files (not directories) in the tree under ``path``."""
    return sum(len(files) for _, _, files in os.walk(path))


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dump_json(path: str, obj: Any) -> None:
    """Write ``obj`` (dataclasses allowed) as JSON."""
    with open(path, "w") as f:
        json.dump(obj, f, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))


def log(msg: str) -> None:
    """Progress line on stderr (the tables go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def log_xckpt() -> None:
    """Log which xckpt is measured (its version and where it is imported from)."""
    import xckpt

    log(f"xckpt {xckpt.__version__} from {os.path.dirname(os.path.abspath(xckpt.__file__))}")


# ----------------------------------------------------------------------------- raw baseline

def raw_save(arrays: dict[str, np.ndarray], directory: str, threads: int = 2) -> None:
    """The raw baseline: one file per array, ``ndarray.tofile`` + flush + ``os.fsync``, ``threads`` threads."""
    os.makedirs(directory, exist_ok=True)

    def one(item: tuple[str, np.ndarray]) -> None:
        """Write one array to its file and fsync it."""
        key, a = item
        with open(os.path.join(directory, key + ".bin"), "wb") as f:
            a.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, arrays.items()))


def raw_load(like: dict[str, np.ndarray], directory: str, threads: int = 2) -> dict[str, np.ndarray]:
    """Read back what :func:`raw_save` wrote, with ``np.fromfile`` (shapes and dtypes from ``like``)."""

    def one(item: tuple[str, np.ndarray]) -> tuple[str, np.ndarray]:
        """Read one array's file back."""
        key, a = item
        return key, np.fromfile(os.path.join(directory, key + ".bin"), dtype=a.dtype).reshape(a.shape)

    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, like.items()))


# ----------------------------------------------------------------------------- tables

@dataclass
class Goal:
    """A target for one row: ``value op limit`` (``value`` defaults to the row's ratio)."""

    op: str
    limit: float
    text: str | None = None
    value: float | None = None

    def label(self) -> str:
        """What the goal column shows."""
        return self.text or f"{self.op}{self.limit:.2f}"

    def passed(self, ratio: float | None) -> bool | None:
        """Whether the goal is met (None when there is nothing to check)."""
        v = self.value if self.value is not None else ratio
        if v is None or math.isnan(v):
            return None
        return v <= self.limit if self.op == "<=" else v >= self.limit


@dataclass
class Row:
    """One line of a table."""

    label: str
    values: list[float | None]
    fmt: str = "{:.2f}"
    goal: Goal | None = None
    note: str = ""
    ratio: float | None = None


def _ratio_text(r: Row) -> str:
    """How the ratio column shows a row's ratio: two decimals, more (up to six) where fewer would read as the
    goal's own limit (0.2504 against <= 0.25 shows 0.2504 FAIL, not 0.25 FAIL)."""
    if r.ratio is None:
        return "-"
    if r.ratio >= 1000:
        return f"{r.ratio:.0f}"
    digits = 2
    if r.goal is not None and r.goal.value is None and r.ratio != r.goal.limit:
        while digits < 6 and f"{r.ratio:.{digits}f}" == f"{r.goal.limit:.{digits}f}":
            digits += 1
    return f"{r.ratio:.{digits}f}"


class Table:
    """Methods side by side, a ratio (first column / second) per row, the goal and PASS/FAIL."""

    def __init__(self, title: str, columns: Sequence[str]) -> None:
        """A table with these method columns (the first is xckpt, the second its peer)."""
        self.title = title
        self.columns = list(columns)
        self.rows: list[Row] = []

    def add(self, label: str, values: Sequence[float | None], fmt: str = "{:.2f}", goal: Goal | None = None,
            note: str = "") -> Row:
        """Add a row; the ratio is values[0] / values[1]."""
        vals = list(values) + [None] * (len(self.columns) - len(values))
        a, b = vals[0], vals[1] if len(vals) > 1 else None
        ratio = a / b if a is not None and b not in (None, 0) and not math.isnan(a) and not math.isnan(b) else None
        row = Row(label, vals, fmt, goal, note, ratio)
        self.rows.append(row)
        return row

    @property
    def failed(self) -> int:
        """Number of rows whose goal is not met."""
        return sum(1 for r in self.rows if r.goal is not None and r.goal.passed(r.ratio) is False)

    def render(self) -> str:
        """The table as text."""
        lw = max([len(r.label) for r in self.rows] + [20]) + 2
        cells = [[("-" if v is None or (isinstance(v, float) and math.isnan(v)) else r.fmt.format(v))
                  for v in r.values] for r in self.rows]
        cw = max([len(c) for c in self.columns] + [len(c) for row in cells for c in row] + [8]) + 2
        gw = max([len(r.goal.label()) for r in self.rows if r.goal] + [6]) + 2
        ratios = [_ratio_text(r) for r in self.rows]
        rw = max(len(x) for x in ratios + ["ratio"]) + 2
        head = " " * lw + "".join(c.rjust(cw) for c in self.columns) + "ratio".rjust(rw) + "  " + "goal".ljust(gw)
        lines = [self.title, head.rstrip()]
        for r, row_cells, ratio in zip(self.rows, cells, ratios):
            goal = r.goal.label() if r.goal else ""
            ok = r.goal.passed(r.ratio) if r.goal else None
            verdict = {True: "PASS", False: "FAIL", None: ""}[ok]
            line = (r.label.ljust(lw) + "".join(c.rjust(cw) for c in row_cells) + ratio.rjust(rw) + "  "
                    + goal.ljust(gw) + verdict.ljust(6) + r.note)
            lines.append(line.rstrip())
        return "\n".join(lines)

    def print(self) -> None:
        """Print the table to stdout, followed by a blank line."""
        print(self.render() + "\n", flush=True)


def common_args(description: str, workload: bool = True) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark has (--repeats, --scale, and --workload)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if workload:
        p.add_argument("--workload", choices=["w1", "w2", "all"], default="all", help="which workload(s) (default all)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per measurement; medians are reported (default 3)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="shrink matrix sides and vector counts by this factor for a quick check "
                   "(default 1 = full size)")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when a goal is not met "
                   "(without it, only errors, such as a load returning wrong data, make the exit status non-zero)")
    p.add_argument("--root", default=SHM, help=f"the directory the checkpoints are written under (default {SHM}, a "
                   "tmpfs; a directory on a disk measures that disk and file system too)")
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line with ``p`` (made by :func:`common_args`) and write checkpoints under its ``--root``."""
    global ROOT
    args = p.parse_args()
    if not os.path.isdir(args.root):
        p.error(f"--root {args.root}: not a directory")
    ROOT = os.path.abspath(args.root)
    return args


def size_note(wl: Workload) -> str:
    """A one-line description of the workload's size."""
    return (f"{len(wl.matrices)} x fp32 {wl.side}x{wl.side} + {len(wl.vectors)} x fp32[{wl.vec_len}] + int64 step"
            f" = {wl.total_bytes / GB:.3f} GB")
