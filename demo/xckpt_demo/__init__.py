"""The main job behind ``xckpt demo``."""

from __future__ import annotations

import argparse
import os
import shutil
import time

import numpy as np

import xckpt


def numpy_round_trip(out: str) -> int:
    """Save a small sharded model state, inspect, validate and load it back; 0 when all agrees."""
    from xckpt.regions import Region
    from xckpt.registry import ArraySource, Shard

    path = os.path.join(out, "numpy_ckpt")
    shutil.rmtree(path, ignore_errors=True)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((1024, 256)).astype(np.float32)
    shards = [Shard(Region((r * 256, 0), (256, 256)), lambda r=r: emb[r * 256:(r + 1) * 256]) for r in range(4)]
    state = {"model": {"embed.weight": ArraySource(emb.shape, "float32", shards, {"num_shards": 4}),
                       "head.bias": rng.standard_normal(256).astype(np.float32)},
             "step": 1000, "data": {"epoch": 3, "offset": 12345}}
    t0 = time.perf_counter()
    xckpt.save(state, path)
    print(f"[1/4] saved {path} in {time.perf_counter() - t0:.2f} s")
    print("[2/4] inspect:")
    from xckpt.cli import main as cli
    cli(["inspect", path])
    print("[3/4] validate --deep:")
    rc = cli(["validate", "--deep", path])
    loaded = xckpt.load(path)
    same = (np.array_equal(loaded["model"]["embed.weight"], emb) and loaded["step"] == 1000
            and loaded["data"] == {"epoch": 3, "offset": 12345})
    region = xckpt.ReadSpec(region=(slice(300, 310), slice(0, 256)))
    part = xckpt.load(path, like={"model": {"embed.weight": region, "head.bias": None}})
    same = same and np.array_equal(part["model"]["embed.weight"], emb[300:310])
    print(f"[4/4] load: {'all values equal' if same else 'VALUES DIFFER'}")
    return 0 if same and rc == 0 else 1


def main(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code."""
    os.makedirs(args.out, exist_ok=True)
    return numpy_round_trip(args.out)
