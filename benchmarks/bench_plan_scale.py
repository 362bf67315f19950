"""Planning a save at scale: a Llama-70B-like training state on 64, 1,024 and 8,192 simulated ranks.

The state: 80 layers of (q, k, v, o, gate, up, down, two norms), embeddings, final norm
and output head (723 parameters), each with AdamW's ``exp_avg``, ``exp_avg_sq`` and
per-parameter ``step``: 2,892 leaves (the steps are plain 0-d tensors every rank holds). The
mesh is (dp, tp) with tp = 8: FSDP2 shards every parameter over dp, tensor parallelism
splits q/k/v/gate/up/embeddings/head by rows (``Shard(0)``, so FSDP2 shards them with
``_StridedShard``) and o/down by columns (``Shard(1)``); norms are replicated over tp.

It runs the very code a collective save runs, :func:`xckpt.engine.protocol.prepare`, for
rank 0 (the coordinating process) and rank 1 (a typical one), each on a thread with a
coordinator that stands in for the transport: the other ranks' messages are rank 1's,
which is what they send (every rank of this job describes its leaves identically: a
layout, not its own regions). Nothing is written. Pinned to one core, it reports:

* the time of the whole planning step on the coordinating process, for a first save and
  for a second save of the same structure (which reuses the plan);
* the bytes rank 0 and rank 1 send and receive during planning: rank 1's stay the same at
  every world size (they grow with its own leaves), rank 0 receives one small message per rank.

Goal: a first save plans in at most 2 s at 8,192 ranks.

Run::

    .venv/bin/python benchmarks/bench_plan_scale.py
    .venv/bin/python benchmarks/bench_plan_scale.py --ranks 64 1024    # a quick check
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

import numpy as np

import _common as C

from xckpt.engine import protocol
from xckpt.engine.commit import SaveOptions
from xckpt.engine.layout import mesh, mesh_layout
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard

TP = 8
HIDDEN, FFN, KV, VOCAB, LAYERS = 8192, 28672, 1024, 128256, 80


def parameters() -> list[tuple[str, tuple[int, ...], int | None]]:
    """``(name, shape, tensor-parallel dimension or None)`` of every parameter of the model."""
    out: list[tuple[str, tuple[int, ...], int | None]] = [("embed_tokens.weight", (VOCAB, HIDDEN), 0)]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), 0), (p + "self_attn.k_proj.weight", (KV, HIDDEN), 0),
                (p + "self_attn.v_proj.weight", (KV, HIDDEN), 0), (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), 1),
                (p + "mlp.gate_proj.weight", (FFN, HIDDEN), 0), (p + "mlp.up_proj.weight", (FFN, HIDDEN), 0),
                (p + "mlp.down_proj.weight", (HIDDEN, FFN), 1), (p + "input_layernorm.weight", (HIDDEN,), None),
                (p + "post_attention_layernorm.weight", (HIDDEN,), None)]
    return out + [("norm.weight", (HIDDEN,), None), ("lm_head.weight", (VOCAB, HIDDEN), 0)]


def _never() -> np.ndarray:
    raise AssertionError("planning fetched shard data")


def state(world: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s training state: its shards of every parameter and moment, and the steps."""
    on = mesh((world // TP, TP), tuple(range(world)))
    info = {"framework": "simulated", "mesh_shape": [world // TP, TP], "axis_names": ["dp", "tp"]}
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for name, shape, tp_dim in parameters():
        if tp_dim == 0:  # FSDP2 over a dimension tensor parallelism already splits: strided
            placements = (("SS", 0, TP), ("S", 0))
        elif tp_dim == 1:
            placements = (("S", 0), ("S", 1))
        else:
            placements = (("S", 0), ("R",))
        lay = mesh_layout(shape, on, placements)
        shards = [Shard(region, _never) for region, _ in lay.pieces_of(rank)]
        model[name] = ArraySource(shape, "bfloat16", shards, info, lay)
        moments = ArraySource(shape, "float32", shards, info, lay)
        optim[name] = {"exp_avg": moments, "exp_avg_sq": moments,
                       "step": ArraySource((), "float32", [Shard(Region((), ()), _never)])}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95)}]},
            "step": 1000}


class Link:
    """The transport of the simulated job: rank 0 and rank 1 run for real, ranks 2.. send what rank 1 sends."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Any] = [None, None]
        self.barrier = threading.Barrier(2)
        self.sent = [0, 0]
        self.received = [0, 0]

    def exchange(self, rank: int, data: Any) -> tuple[Any, Any]:
        """Hand ``data`` to the other side and wait for its: both sides' data, rank 0's first."""
        self.barrier.wait()
        self.slots[rank] = data
        self.barrier.wait()
        out = (self.slots[0], self.slots[1])
        self.barrier.wait()
        return out


class SimulatedCoordinator:
    """Rank 0 or rank 1 of a :class:`Link`: the Coordinator protocol, counting the bytes that cross it."""

    def __init__(self, link: Link, rank: int) -> None:
        self.link = link
        self.rank = rank
        self.world_size = link.world

    def _count(self, sent: int, received: int) -> None:
        self.link.sent[self.rank] += sent
        self.link.received[self.rank] += received

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Everyone's data (ranks 2.. send what rank 1 sends)."""
        zero, one = self.link.exchange(self.rank, data)
        out = [zero] + [one] * (self.world_size - 1)
        self._count(len(data), sum(len(b) for b in out) - len(data))
        return out

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Rank 0's data (counted once for rank 0: a broadcast goes down a tree)."""
        zero, _ = self.link.exchange(self.rank, data)
        self._count(len(zero) if self.rank == 0 else 0, 0 if self.rank == 0 else len(zero))
        return zero

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Everyone's data, on rank 0."""
        zero, one = self.link.exchange(self.rank, data)
        if self.rank == 0:
            out = [zero] + [one] * (self.world_size - 1)
            self._count(0, len(one) * (self.world_size - 1))
            return out
        self._count(len(data), 0)
        return None

    def scatter_bytes(self, items: Sequence[bytes] | None, root: int = 0) -> bytes:
        """``items[rank]`` of rank 0 (a broadcast when all ranks get the same bytes, as the real
        coordinators do)."""
        zero, _ = self.link.exchange(self.rank, list(items) if items is not None else None)
        same = all(b is zero[0] for b in zero)
        if self.rank == 0:
            self._count(len(zero[1]) if same else sum(len(b) for b in zero[1:]), 0)
        else:
            self._count(0, len(zero[1]))
        return zero[self.rank]

    def barrier(self) -> None:
        """Both real ranks meet."""
        self.link.barrier.wait()


def plan_once(world: int, trees: list[Any], path: str) -> dict[str, Any]:
    """Run the planning step on rank 0 and rank 1; return rank 0's time, both ranks' bytes and the plans."""
    link = Link(world)
    out: dict[str, Any] = {}

    def run(rank: int) -> None:
        try:
            started = time.perf_counter()
            p = protocol.prepare(trees[rank], path, coordinator=SimulatedCoordinator(link, rank),
                                 options=SaveOptions())
            out[rank] = (time.perf_counter() - started, p)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out[f"error{rank}"] = exc
            link.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in (0, 1):
        if f"error{rank}" in out:
            raise out[f"error{rank}"]
    out["sent"], out["received"] = link.sent, link.received
    return out


def check(p: Any, world: int) -> None:
    """The plan is sound: every leaf planned, rank 1 writes only boxes it holds, and about its share."""
    assert p.plan is None or len(p.plan.keys) == len(p.descs.leaves)
    written = sum(t.box.numel for t in p.local.tasks)
    held = {(t.leaf, t.piece) for t in p.local.tasks}
    for pos, piece in held:
        d = p.descs.leaves[pos]
        assert d.layout is None or piece in {r for r, _ in d.layout.pieces_of(p.coord.rank)}
    assert written > 0


def main(argv: Sequence[str] | None = None) -> int:
    """Plan at each world size; print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 8192])
    ap.add_argument("--goal-s", type=float, default=2.0, help="planning time goal at the largest world size")
    args = ap.parse_args(argv)
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        cores = "1 core"
    except (AttributeError, OSError):
        cores = f"{os.cpu_count()} cores"
    n_leaves = len(parameters()) * 4 + 2
    table = C.Table(f"Planning the save of a Llama-70B-like state ({n_leaves} leaves; mesh dp x tp, tp = {TP}), "
                    f"{cores}, the code of xckpt.save's planning step", ["first save", "plan reused"])
    root = tempfile.mkdtemp(prefix="xckpt-plan-")
    try:
        for world in args.ranks:
            C.log(f"{world} ranks: building rank 0's and rank 1's trees")
            trees = [state(world, 0), state(world, 1)]
            first = plan_once(world, trees, os.path.join(root, f"w{world}"))
            again = plan_once(world, trees, os.path.join(root, f"w{world}b"))
            for rank in (0, 1):
                check(first[rank][1], world)
            assert not first[0][1].stats["plan_reused"] and again[0][1].stats["plan_reused"]
            goal = C.Goal("<=", args.goal_s, text=f"<={args.goal_s:g} s", value=first[0][0]) \
                if world == max(args.ranks) else None
            table.add(f"{world:>5} ranks: planning s (rank 0)", [first[0][0], again[0][0]], goal=goal)
            for rank, who in ((0, "rank 0 (coordinating)"), (1, "rank 1")):
                table.add(f"{world:>5} ranks: {who} sends bytes", [first["sent"][rank], again["sent"][rank]],
                          "{:.0f}")
                table.add(f"{world:>5} ranks: {who} receives bytes", [first["received"][rank],
                                                                      again["received"][rank]], "{:.0f}")
            writes = sum(t.box.numel for t in first[1][1].local.tasks)
            C.log(f"{world} ranks: rank 1 writes {len(first[1][1].local.tasks)} chunk objects, {writes} elements")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
