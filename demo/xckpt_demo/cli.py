"""``xckpt demo``: the subcommand this package adds to the ``xckpt`` command line (entry point ``xckpt.commands``)."""

from __future__ import annotations

import argparse

from xckpt.registry import Command


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo_out", help="directory for checkpoints and the plot")


def _run(args: argparse.Namespace) -> int:
    from xckpt_demo import main  # torch and jax are imported only when the demo runs
    return int(main(args))


COMMAND = Command("demo", "run the main job: a training run moved from PyTorch to JAX and back", _arguments, _run)
