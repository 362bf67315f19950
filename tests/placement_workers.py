"""Bodies of the DTensor placement round-trip tests (``test_dtensor_placements.py``): real gloo groups.

Every job saves DTensors of many shapes, dtypes and placements on its meshes, and loads the
checkpoints of the jobs before it in place into DTensors of other meshes and placements. The
expected values never come from xckpt: each leaf's global value is :func:`full` (a seeded
permutation of ``arange``, so every element is distinct and a misplaced one shows), and each
rank's expected local tensor is what ``torch.distributed.tensor.distribute_tensor`` gives it;
``full_tensor()`` of every loaded DTensor is compared with :func:`full` too. Targets start
filled with a sentinel, so an element the load leaves alone shows as well.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from torch_workers import placements as parse_placements

#: Mesh shapes each job builds, by name.
MESHES: dict[int, dict[str, tuple[int, ...]]] = {
    4: {"4": (4,), "2x2": (2, 2)},
    3: {"3": (3,), "1x3": (1, 3)},
    6: {"6": (6,), "2x3": (2, 3), "3x2": (3, 2)},
    2: {"2": (2,)},
}

#: Global shapes saved on every mesh: 1-D, 2-D, 3-D, uneven, fewer rows than ranks, and 0-size.
SHAPES: tuple[tuple[int, ...], ...] = ((), (13,), (3,), (0,), (7, 5), (0, 3), (5, 3, 4), (2, 0, 3))

DTYPES = ("float32", "bfloat16", "int64")

#: Sentinel every target starts with (not a value :func:`full` produces).
SENTINEL = -77


def mesh_placements(mesh_shape: tuple[int, ...], ndim: int) -> list[str]:
    """Every placement text for a tensor of ``ndim`` dimensions on a mesh of ``mesh_shape``: each
    Shard/Replicate per mesh dimension, and, on 2-D meshes, FSDP2 + TP's ``[_StridedShard(d, sf), Shard(d)]``
    (``sf`` the size of the second mesh dimension, the only split factor torch decodes there)."""
    single = ["R"] + [f"S{d}" for d in range(ndim)]
    if len(mesh_shape) == 1:
        return single
    out = [f"{a} {b}" for a in single for b in single]
    out += [f"SS{d}/{mesh_shape[1]} S{d}" for d in range(ndim)]
    return out


def cases(world: int) -> dict[str, tuple[str, tuple[int, ...], str, str]]:
    """The leaves job ``world`` saves: name -> (mesh name, global shape, dtype, placement text)."""
    out: dict[str, tuple[str, tuple[int, ...], str, str]] = {}
    i = 0
    for mname, mshape in MESHES[world].items():
        for shape in SHAPES:
            for text in mesh_placements(mshape, len(shape)):
                name = f"w{world}-m{mname}-{'x'.join(map(str, shape))}-{text.replace(' ', '_').replace('/', 'f')}"
                out[name] = (mname, shape, DTYPES[i % len(DTYPES)], text)
                i += 1
    if world == 4:  # shards above the 4 MiB inner chunk: read back in parts of inner chunks
        out["w4-m2x2-big-S1_R"] = ("2x2", (1031, 2050), "float32", "S1 R")
        out["w4-m2x2-big-SS0f2_S0"] = ("2x2", (2053, 1030), "float32", "SS0/2 S0")
    return out


def spec_of(name: str) -> tuple[tuple[int, ...], str]:
    """The global shape and dtype of a saved leaf, from its name (any job's)."""
    world = int(name.split("-")[0][1:])
    _, shape, dtype, _ = cases(world)[name]
    return shape, dtype


def full(name: str) -> np.ndarray:
    """The global value of leaf ``name``: a seeded permutation of distinct values exact in its dtype."""
    import ml_dtypes
    shape, dtype = spec_of(name)
    n = math.prod(shape)
    perm = np.random.default_rng(zlib.crc32(name.encode())).permutation(n)
    if dtype == "bfloat16":  # integers below 256 are exact in bfloat16
        assert n <= 256, name
        return (perm - 128).astype(ml_dtypes.bfloat16).reshape(shape)
    if dtype == "int64":  # above 2**53: a trip through float64 would show
        return (perm.astype(np.int64) * 3 + (1 << 60)).reshape(shape)
    return (perm * 0.5 + 1000).astype(np.float32).reshape(shape)


def torch_full(name: str) -> Any:
    """:func:`full` as a CPU tensor (bfloat16 through its bits)."""
    from xckpt_torch import from_numpy
    return from_numpy(full(name)).clone()


def make_dtensor(value: Any, mesh: Any, text: str, *, scatter: bool = True) -> Any:
    """``value`` distributed by torch itself: ``distribute_tensor`` scattered from rank 0, or, for a
    ``_StridedShard`` (whose scatter needs even splits), split by torch on each rank (``src_data_rank=None``;
    every rank holds ``value``; also where ``scatter`` is false)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value, mesh, parse_placements(text),
                             src_data_rank=0 if scatter and "SS" not in text else None)


def target_like(name: str, mesh: Any, text: str, *, scatter: bool = True) -> Any:
    """A DTensor of leaf ``name``'s shape and dtype on ``mesh``, every element the sentinel."""
    import torch
    ref = torch_full(name)
    return make_dtensor(torch.full(ref.shape, SENTINEL, dtype=ref.dtype), mesh, text, scatter=scatter)


def check_loaded(name: str, got: Any, text: str, *, collective: bool = True) -> None:
    """``got`` (a loaded DTensor) holds, element by element, the local tensor ``distribute_tensor`` of
    :func:`full` gives this rank, and its ``full_tensor()`` is :func:`full` (collective; not for a
    ``_StridedShard``, which torch cannot gather when uneven, nor where ``collective`` is false)."""
    import torch
    want = make_dtensor(torch_full(name), got.device_mesh, text, scatter=collective)
    assert [str(p) for p in got.placements] == [str(p) for p in want.placements]
    a, b = got.to_local(), want.to_local()
    assert a.dtype == b.dtype and a.shape == b.shape, (name, text, a.shape, b.shape)
    assert torch.equal(a, b), f"{name} loaded as {text} on rank {torch.distributed.get_rank()}:\n{a}\nwant\n{b}"
    if collective and "SS" not in text:  # torch 2.13's redistribute of an uneven _StridedShard fails or hangs (gloo)
        assert torch.equal(got.full_tensor(), torch_full(name)), f"{name} as {text}: full_tensor differs"


def build_meshes(world: int) -> dict[str, Any]:
    """This job's device meshes, by name."""
    from torch.distributed.device_mesh import init_device_mesh
    return {m: init_device_mesh("cpu", s, mesh_dim_names=("dp", "tp") if len(s) == 2 else None)
            for m, s in MESHES[world].items()}


def targets_for(names: list[str], meshes: dict[str, Any], turn: int) -> dict[str, tuple[str, str]]:
    """For each stored leaf, the mesh and placements to load it into: every placement of every mesh of
    this job in rotation (``turn`` shifts it), so the loads cover every pairing over the passes."""
    options: dict[int, list[tuple[str, str]]] = {}
    out = {}
    for i, n in enumerate(names):
        ndim = len(spec_of(n)[0])
        opts = options.setdefault(ndim, [(m, t) for m, dm in meshes.items()
                                          for t in mesh_placements(tuple(dm.mesh.shape), ndim)])
        out[n] = opts[(i * 7 + turn) % len(opts)]
    return out


def save_own(world: int, wd: Path, meshes: dict[str, Any]) -> int:
    """Save every case of this job to ``wd/ckpt{world}`` (checking torch's own distribution first)."""
    import torch
    import xckpt
    state = {}
    for name, (mname, _, _, text) in cases(world).items():
        d = make_dtensor(torch_full(name), meshes[mname], text)
        if "SS" not in text:
            assert torch.equal(d.full_tensor(), torch_full(name)), name  # torch agrees with itself
        state[name] = d
    xckpt.save({"t": state}, wd / f"ckpt{world}")
    return len(state)


def load_into(world: int, wd: Path, meshes: dict[str, Any], source: int, turn: int) -> int:
    """Load job ``source``'s checkpoint in place into this job's DTensors (rotation ``turn``) and check
    every element; also a few leaves into plain tensors held whole by every rank."""
    import torch
    import xckpt
    names = list(cases(source))
    plan = targets_for(names, meshes, turn)
    like = {n: target_like(n, meshes[m], t) for n, (m, t) in plan.items()}
    out = xckpt.load(wd / f"ckpt{source}", like={"t": like})
    for n, (m, t) in plan.items():
        assert out["t"][n] is like[n]  # in place
        check_loaded(n, like[n], t)
    plain = {n: torch.full(spec_of(n)[0], SENTINEL, dtype=torch_full(n).dtype) for n in names[turn::9]}
    xckpt.load(wd / f"ckpt{source}", like={"t": plain}, partial=True)
    for n, t in plain.items():
        assert torch.equal(t, torch_full(n)), n
    return len(plan) + len(plain)


def job(rank: int, world: int, wd: Path, *, sources: list[int], turns: int, own_turns: int) -> dict[str, Any]:
    """Load each earlier job's checkpoint (``turns`` rotations each), save this job's own, and load
    that back into other placements (``own_turns`` rotations); the 4-rank job also checks refusals,
    strided local tensors and submeshes."""
    import time
    t0 = time.monotonic()
    meshes = build_meshes(world)
    loaded = {src: sum(load_into(world, wd, meshes, src, turn) for turn in range(turns)) for src in sources}
    res: dict[str, Any] = {"saved": save_own(world, wd, meshes), "loaded": loaded}
    loaded[world] = sum(load_into(world, wd, meshes, world, turn + 1) for turn in range(own_turns))
    if world == 4:
        res.update(refusals(rank, wd, meshes))
        res["noncontiguous"] = noncontiguous(wd, meshes)
        res["submesh"] = submesh(rank, wd, meshes)
        res["permuted"] = permuted(wd)
        res["transposed"] = transposed(wd, meshes)
    res["seconds"] = time.monotonic() - t0
    return res


def refusal(exc: Exception) -> dict[str, Any]:
    """What the test looks at of an error: its type, its code, each failing rank's code, its text."""
    from xckpt.errors import RankFailures
    ranks = [f.get("code") for f in exc.failures.values()] if isinstance(exc, RankFailures) else []
    return {"type": type(exc).__name__, "code": getattr(exc, "code", None), "rank_codes": ranks, "text": str(exc)}


def refusals(rank: int, wd: Path, meshes: dict[str, Any]) -> dict[str, Any]:
    """Partial placements: a save and a load refuse them on every rank, with a specific error."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    import xckpt
    from xckpt.errors import XckptError
    out: dict[str, Any] = {}
    mesh = meshes["2x2"]
    p = DTensor.from_local(torch.ones(4, 3), mesh, [Partial(), Shard(0)], run_check=False)
    try:
        xckpt.save({"p": p, "ok": torch.ones(2)}, wd / "partial")
        out["save"] = None
    except XckptError as exc:
        out["save"] = refusal(exc)
    assert not (wd / "partial").exists()
    name = next(n for n, c in cases(4).items() if c[1] == (7, 5))
    like = DTensor.from_local(torch.zeros(7, 5, dtype=torch_full(name).dtype), mesh, [Replicate(), Partial()],
                              run_check=False)
    try:
        xckpt.load(wd / "ckpt4", like={"t": {name: like}}, partial=True)
        out["load"] = None
    except XckptError as exc:
        out["load"] = refusal(exc)
    return out


def noncontiguous(wd: Path, meshes: dict[str, Any]) -> int:
    """Load into DTensors whose local tensors are transposed or strided views: the right elements land."""
    import torch
    from torch.distributed.tensor import DTensor
    import xckpt
    n_ok = 0
    for name, (_, shape, _, _) in cases(4).items():
        if shape != (7, 5):
            continue
        for mname, text in (("2x2", "S0 S1"), ("4", "S1"), ("2x2", "SS0/2 S0"), ("2x2", "R S0")):
            want = make_dtensor(torch_full(name), meshes[mname], text)
            ls = tuple(want.to_local().shape)
            base = torch.full((ls[1], ls[0] * 2), SENTINEL, dtype=want.dtype)
            local = base[:, ::2].T  # a view with strides (2, 2 * ls[0]) inside a larger buffer
            assert local.shape == ls and (min(ls) < 2 or not local.is_contiguous())
            d = DTensor.from_local(local, meshes[mname], parse_placements(text), run_check=False,
                                   shape=torch.Size(shape), stride=torch.empty(shape).stride())
            xckpt.load(wd / "ckpt4", like={"t": {name: d}}, partial=True)
            assert torch.equal(d.to_local(), want.to_local()), (name, text)
            assert torch.equal(base[:, 1::2], torch.full_like(base[:, 1::2], SENTINEL)), "wrote between the view"
            n_ok += 1
        break
    return n_ok


def submesh(rank: int, wd: Path, meshes: dict[str, Any]) -> int:
    """DTensors on a 1-D submesh of the (2, 2) mesh (tensor parallel without FSDP: each half of the job
    holds its own copy): saved, then loaded into the other submesh's placements."""
    import xckpt
    mesh = meshes["2x2"]
    names = [n for n, c in cases(4).items() if c[0] == "4"][:20]
    src = {}
    for i, n in enumerate(names):
        ndim = len(spec_of(n)[0])
        src[n] = (mesh["tp" if i % 2 else "dp"], f"S{i % ndim}" if ndim and i % 3 else "R")
    state = {n: make_dtensor(torch_full(n), m, t) for n, (m, t) in src.items()}
    xckpt.save({"t": state}, wd / "sub")
    like = {}
    for i, n in enumerate(names):
        ndim = len(spec_of(n)[0])
        sub = mesh["dp" if i % 2 else "tp"]
        text = f"S{(i + 1) % ndim}" if ndim and i % 4 else "R"
        like[n] = (sub, text, target_like(n, sub, text))
    xckpt.load(wd / "sub", like={"t": {n: v[2] for n, v in like.items()}})
    for n, (_, text, d) in like.items():
        check_loaded(n, d, text)
    return len(like)


def permuted(wd: Path) -> int:
    """A (2, 2) mesh whose ranks are not in order (``[[3, 1], [0, 2]]``): saved from, then loaded into
    the same mesh's other placements and into a 1-D mesh of ranks ``[2, 0, 3, 1]``; then DTensors on a
    mesh of ranks ``[3, 1]`` alone, loaded into ``[Replicate()]`` on ranks ``[0, 2]``. Torch 2.13's own
    collectives on such a mesh scatter and gather the wrong blocks (gloo), so here every rank splits
    the value itself (``src_data_rank=None``) and nothing is gathered."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    import xckpt
    grid = DeviceMesh("cpu", torch.tensor([[3, 1], [0, 2]]), mesh_dim_names=("a", "b"))
    line = DeviceMesh("cpu", torch.tensor([2, 0, 3, 1]))
    names = [n for n, c in cases(4).items() if c[0] == "2x2" and len(c[1]) >= 1][::2]
    state = {n: make_dtensor(torch_full(n), grid, cases(4)[n][3], scatter=False) for n in names}
    xckpt.save({"t": state}, wd / "permuted")
    whole = xckpt.load(wd / "permuted")["t"]
    for n in names:
        np.testing.assert_array_equal(whole[n], full(n), err_msg=n)
    for turn, meshes in enumerate(({"g": grid}, {"l": line})):
        plan = targets_for(names, meshes, turn + 1)
        like = {n: target_like(n, meshes[m], t, scatter=False) for n, (m, t) in plan.items()}
        xckpt.load(wd / "permuted", like={"t": like})
        for n, (_, t) in plan.items():
            check_loaded(n, like[n], t, collective=False)
    # a mesh of two of the four ranks: the others hold nothing of it (no coordinate) and write nothing
    pair = DeviceMesh("cpu", torch.tensor([3, 1]))
    outside = {n: make_dtensor(torch_full(n), pair, f"S{len(cases(4)[n][1]) - 1}", scatter=False) for n in names[:6]}
    xckpt.save({"t": outside}, wd / "outside")
    whole = xckpt.load(wd / "outside")["t"]
    for n in outside:
        np.testing.assert_array_equal(whole[n], full(n), err_msg=n)
    other = DeviceMesh("cpu", torch.tensor([0, 2]))
    like = {n: target_like(n, other, "R", scatter=False) for n in outside}
    xckpt.load(wd / "outside", like={"t": like})
    for n in outside:
        check_loaded(n, like[n], "R", collective=False)
    return len(names)


def transposed(wd: Path, meshes: dict[str, Any]) -> int:
    """Save DTensors whose local tensors are strided views (the transpose of a sharded DTensor, and a
    column-sliced local), then check the checkpoint element by element."""
    import torch
    from torch.distributed.tensor import DTensor
    import xckpt
    names = [n for n, c in cases(4).items() if c[1] == (7, 5)][:12]
    state = {}
    for n in names:
        mname, _, _, text = cases(4)[n]
        d = make_dtensor(torch_full(n).T.contiguous(), meshes[mname], text).T  # global value: full(n)
        state[n] = d
        want = make_dtensor(torch_full(n), meshes[mname], " ".join(
            p if p[0] == "R" or "SS" in p else f"S{1 - int(p[1])}" for p in text.split()))
        if "SS" not in text:
            assert torch.equal(d.to_local(), want.to_local()), n
    local = torch.full((7, 10), SENTINEL, dtype=torch.float32)[:, ::2]
    local.copy_(torch.arange(35.0).reshape(7, 5) + 100 * torch.distributed.get_rank())
    state["sliced"] = DTensor.from_local(local, meshes["4"], parse_placements("S0"), run_check=False)
    xckpt.save({"t": state}, wd / "transposed")
    whole = xckpt.load(wd / "transposed")["t"]
    for n in names:
        np.testing.assert_array_equal(whole[n], full(n), err_msg=n)
    np.testing.assert_array_equal(whole["sliced"], np.concatenate(
        [np.arange(35.0, dtype=np.float32).reshape(7, 5) + 100 * r for r in range(4)]))
    return len(names)
