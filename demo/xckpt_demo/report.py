"""What the demo shows: checkpoint and mapping summaries, validation, loss tables, and a PNG of the curves."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Direction:
    """One direction of the demo: a run trained in ``origin``, continued in both frameworks."""

    title: str
    short: str
    origin: str
    pretrain: list[float]
    torch: list[float]
    jax: list[float]
    start: int

    def rel_diffs(self) -> list[float]:
        """Per step ``|torch - jax| / |torch|`` (inf when a loss is missing or not finite)."""
        out = []
        for a, b in zip(self.torch, self.jax):
            ok = math.isfinite(a) and math.isfinite(b) and a != 0
            out.append(abs(a - b) / abs(a) if ok else math.inf)
        return out

    def max_rel_diff(self) -> float:
        """The largest relative difference; inf when the continuations differ in length or are empty."""
        diffs = self.rel_diffs()
        if not diffs or len(self.torch) != len(self.jax):
            return math.inf
        return max(diffs)


def table(d: Direction, rtol: float) -> str:
    """The side-by-side table of both continuations' losses, and the verdict line."""
    lines = [f"  {d.title}",
             f"  {'step':>6}  {'PyTorch loss':>14}  {'JAX loss':>14}  {'rel diff':>9}"]
    for i, (a, b, r) in enumerate(zip(d.torch, d.jax, d.rel_diffs())):
        lines.append(f"  {d.start + i:>6}  {a:>14.8f}  {b:>14.8f}  {r:>9.2e}")
    worst = d.max_rel_diff()
    verdict = "agree" if worst <= rtol else "DISAGREE"
    lines.append(f"  {d.origin} checkpoint: max relative difference {worst:.3e} "
                 f"(tolerance {rtol:.0e}): {verdict}")
    return "\n".join(lines)


def plot(directions: list[Direction], path: Path, rtol: float) -> None:
    """Per direction: the loss curves (top) and the per-step relative difference (bottom), as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(directions)
    fig, axes = plt.subplots(2, n, figsize=(6.2 * n, 6.4), squeeze=False, height_ratios=[3, 1.4], sharex="col")
    floor = 1e-10
    for col, d in enumerate(directions):
        ax, low = axes[0][col], axes[1][col]
        cont = list(range(d.start, d.start + len(d.torch)))
        ax.plot(range(len(d.pretrain)), d.pretrain, color="0.55", marker=".",
                label=f"trained in {d.origin}, saved at step {d.start}")
        ax.plot(cont, d.torch, color="tab:red", marker="o", markersize=7, linewidth=1.5, label="continued in PyTorch")
        ax.plot(cont, d.jax, color="tab:blue", marker="x", markersize=9, linestyle="--", linewidth=1.5,
                label="continued in JAX")
        for a in (ax, low):
            a.axvline(d.start - 0.5, color="0.6", linestyle=":", linewidth=1)
            a.grid(alpha=0.3)
        ax.set_title(f"{d.short}\nmax relative difference {d.max_rel_diff():.1e}", fontsize=11)
        ax.set_ylabel("training loss")
        ax.legend(fontsize=8)
        low.semilogy(cont, [max(r, floor) for r in d.rel_diffs()], color="tab:purple", marker="s", markersize=4,
                     linewidth=1, label="|PyTorch - JAX| / PyTorch (0 drawn at 1e-10)")
        low.axhline(rtol, color="tab:red", linewidth=1, label=f"tolerance {rtol:.0e}")
        low.set_ylim(floor / 3, rtol * 30)
        low.set_xlabel("step")
        low.set_ylabel("rel. diff")
        low.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def checkpoint_summary(path: Path) -> str:
    """One line about a checkpoint: leaves, bytes, and how one of its weights was sharded."""
    import xckpt
    info = xckpt.inspect(str(path))
    kib = info["total_bytes"] / 1024
    line = f"    {path.name}: {info['arrays']} arrays and {info['values']} values, {kib:.1f} KiB"
    for leaf in info["leaves"]:
        sh = leaf.get("sharding") or {}
        if leaf["kind"] == "array" and leaf["key"].endswith(("attn.q.weight", "attn/q/kernel")) and sh.get("mesh_shape"):
            line += (f"; e.g. {leaf['key']} {leaf['shape']} saved from mesh {sh['mesh_shape']} "
                     f"{sh.get('axis_names')}, dims split over {sh.get('dim_axes')}")
            break
    return line


def mapping_sample(name: str, planned: Any, targets: tuple[str, ...]) -> str:
    """How a mapping resolved a checkpoint against a load target (nothing read yet): counts and a few leaves."""
    path = Path(str(planned.loc))
    lines = planned.describe().splitlines()
    made = [x for x in lines if not x.startswith("unused:")]
    out = [f"    {name} on {path.name}: {len(made)} target leaves from {len(planned.base.manifest.leaves)} stored, e.g."]
    for want in targets:
        line = next((x for x in made if x.startswith(want + " ")), None)
        if line is None:
            continue
        m = re.match(r"^(\S+) <- from (.+?) by rule '.*'(?: \((.*)\))?$", line)
        if m is None:
            out.append(f"      {line}")
            continue
        sources = m.group(2).split(" + ")
        src = sources[0] if len(sources) == 1 else f"{sources[0]} and {len(sources) - 1} more, checked equal"
        out.append(f"      {m.group(1)} <- {src}" + (f"  [{m.group(3)}]" if m.group(3) else ""))
    return "\n".join(out)


def validate(path: Path) -> bool:
    """``xckpt validate --deep`` on ``path``, printed as the command prints it; True when valid."""
    from xckpt.cli import main as cli
    print(f"  $ xckpt validate --deep {path}", flush=True)
    return cli(["validate", "--deep", str(path)]) == 0
