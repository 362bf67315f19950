"""How the ``xckpt`` command line shows things: ``rich`` tables on stdout, progress on stderr.

Everything here only renders what the commands computed (:mod:`xckpt.cli`). Tables keep
their natural width when stdout is not a terminal (nothing is cut or wrapped in a pipe or a
file) and carry no colour there; progress is shown only when stderr is a terminal.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import sys
from typing import Any, Callable, Iterator, TextIO

from rich import box
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

#: Colour of each finding severity.
SEVERITY_STYLES = {"error": "bold red", "warning": "yellow", "info": "cyan"}
#: Width given to output that is not a terminal: wide enough that a table is never wrapped.
_PIPE_WIDTH = 4096


def fmt_bytes(n: int | None) -> str:
    """``1.5 MiB``; ``-`` for None."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(n)


def fmt_time(t: float | None) -> str:
    """A time since the epoch as local ``YYYY-MM-DD HH:MM:SS``; ``-`` for None."""
    if t is None:
        return "-"
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def fmt_number(x: Any) -> str:
    """A difference for a table: integers as they are, floats with 6 significant digits, ``-`` for None."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def fmt_sharding(sh: dict[str, Any] | None, *, full: bool = False) -> str:
    """A short description of a manifest's ``sharding`` entry: the mesh and dimension axes, or the shards
    (a single shard only when ``full``; then ``none`` when nothing is recorded)."""
    sh = sh or {}
    parts = []
    if sh.get("mesh_shape"):
        axes = sh.get("dim_axes")
        parts.append(f"mesh {sh['mesh_shape']}" + (f" {axes}" if axes is not None else ""))
    n = sh.get("num_shards")
    if isinstance(n, int) and (n > 1 or (full and not parts)):
        parts.append(f"{n} shard{'s' if n != 1 else ''} of {sh.get('shard_shape')}")
    return ", ".join(parts) if parts or not full else "none"


def console(file: TextIO | None = None) -> Console:
    """A console on ``file`` (default: the current ``sys.stdout``), full width and uncoloured unless a terminal."""
    file = file if file is not None else sys.stdout
    tty = bool(getattr(file, "isatty", lambda: False)())
    return Console(file=file, highlight=False, markup=False, emoji=False, soft_wrap=False,
                   width=None if tty else _PIPE_WIDTH, force_terminal=None if tty else False)


def table(title: str, *columns: str, right: tuple[str, ...] = ()) -> Table:
    """A table with ``columns`` (those in ``right`` aligned right), titled on its left."""
    t = Table(title=title, title_justify="left", title_style="bold", header_style="bold", show_edge=False,
              pad_edge=False, box=box.SIMPLE_HEAD, min_width=len(title))  # the title is never wrapped
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", overflow="fold")
    return t


def show(out: Console, renderable: Any) -> None:
    """Print a table (or anything ``rich`` renders); off a terminal, without the padding at line ends."""
    if out.is_terminal:
        out.print(renderable)
        return
    with out.capture() as cap:
        out.print(renderable)
    out.file.write("".join(ln.rstrip() + "\n" for ln in cap.get().splitlines()))


def line(out: Console, text: str, style: str | None = None) -> None:
    """One line of plain text, never wrapped."""
    out.print(Text(text, style=style or ""), soft_wrap=True)


def styled(text: str, style: str) -> Text:
    """A table cell in ``style`` (shown only on a terminal)."""
    return Text(text, style=style)


def severity(sev: str) -> Text:
    """A severity, upper case, in its colour."""
    return Text(sev.upper(), style=SEVERITY_STYLES.get(sev, ""))


def progress_enabled(stream: TextIO | None = None) -> bool:
    """Whether to show progress: only when ``stream`` (default: the current ``sys.stderr``) is a terminal."""
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def progress_bar(description: str, enabled: bool | None = None) -> Iterator[Callable[[int, int], None] | None]:
    """A byte progress bar on stderr; yields ``update(done, total)``, or None when progress is not shown."""
    if not (progress_enabled() if enabled is None else enabled):
        yield None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                  TimeElapsedColumn(), TimeRemainingColumn(),
                  console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextlib.contextmanager
def spinner(description: str, enabled: bool | None = None) -> Iterator[None]:
    """A spinner with the elapsed time on stderr while the block runs (for work that reports no progress)."""
    if not (progress_enabled() if enabled is None else enabled):
        yield
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(file=sys.stderr), transient=True) as bar:
        bar.add_task(description, total=None)
        yield
