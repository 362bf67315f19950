"""The main job, ``xckpt demo``: end to end in a subprocess, its Ctrl-C clean-up, and its parts.

The end-to-end run is the real thing: 4 spawned gloo ranks, a JAX process with 8
host devices, 2 more gloo ranks, real checkpoints, the validator and the plot.
The unit tests check, in one process, that the PyTorch and flax models compute
the same loss on the same weights (moved through the demo's mapping) and that
AdamW and optax.adamw then take the same step.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

from xckpt_demo import data
from xckpt_demo.config import Config

import xckpt

RTOL = 1e-5


def _demo_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the demo sets up its own JAX process
    return env


def _children_of(out: Path) -> list[str]:
    """Command lines of running processes that belong to the demo writing into ``out``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(a.decode(errors="replace") for a in args)
        if "xckpt_demo.train" in line and str(out) in line:
            found.append(line)
    return found


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess, float]:
    out = tmp_path_factory.mktemp("demo") / "out"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "xckpt", "demo", "--out", str(out)], capture_output=True,
                          text=True, timeout=500, env=_demo_env(), check=False)
    return out, proc, time.monotonic() - t0


def test_demo_passes_end_to_end(demo_run):
    out, proc, took = demo_run
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = proc.stdout
    cfg = Config()
    # progress was shown while it worked: every step of every job
    for tag in ("[torch 4 ranks, mesh dp=2 x tp=2] step", "[jax 8 devices, mesh data=4 x model=2] torch ckpt -> step",
                "[jax 8 devices, mesh data=4 x model=2] step", "[jax 8 devices, mesh data=4 x model=2] jax ckpt -> step",
                "[torch 2 ranks, mesh dp=1 x tp=2] torch ckpt -> step",
                "[torch 2 ranks, mesh dp=1 x tp=2] jax ckpt -> step"):
        every = 5 if tag.endswith("2] step") else 1  # before the checkpoint: every 5th step and the last
        steps = cfg.pretrain_steps if every == 5 else cfg.continue_steps
        want = len([s for s in range(steps) if (s + 1) % every == 0 or s == steps - 1])
        assert text.count(tag) == want, tag
    # both directions: printed max relative differences within float32 tolerance
    found = re.findall(r"(PyTorch|JAX) checkpoint: max relative difference ([0-9.e+-]+) \(tolerance", text)
    assert [o for o, _ in found] == ["PyTorch", "JAX"], found
    assert all(float(v) <= RTOL for _, v in found), found
    assert "PASS: both directions agree" in text
    # both moves went through the argument-free presets, which showed how they resolved the names
    assert re.search(r"xckpt\.mapping\.torch_to_flax\(\) on \S+: \d+ target leaves", text)
    assert "params/blocks_0/attn/q/kernel <- model/blocks.0.attn.q.weight  [transpose(1, 0)]" in text
    assert re.search(r"xckpt\.mapping\.flax_to_torch\(\) on \S+: \d+ target leaves", text)
    # the side-by-side tables agree with the recorded losses, step by step
    record = json.loads((out / "losses.json").read_text())
    for d, (_, printed_max) in zip(record["directions"], found):
        steps = list(range(d["start"], d["start"] + cfg.continue_steps))
        assert d["start"] == cfg.pretrain_steps and len(d["torch"]) == len(d["jax"]) == cfg.continue_steps
        assert len(d["pretrain"]) == cfg.pretrain_steps
        rel = [abs(a - b) / abs(a) for a, b in zip(d["torch"], d["jax"])]
        assert max(rel) <= RTOL and math.isclose(max(rel), float(printed_max), rel_tol=1e-3, abs_tol=1e-12)
        for s, a, b in zip(steps, d["torch"], d["jax"]):
            assert re.search(rf"^\s+{s}\s+{a:.8f}\s+{b:.8f}\s", text, re.MULTILINE), (s, a, b)
        assert np.mean(d["torch"]) < d["pretrain"][0] - 0.5, "the model should have learned something"
    # validator ran on both checkpoints and passed; the checkpoints are really there
    for name in (f"torch_step{cfg.pretrain_steps}", f"jax_step{cfg.pretrain_steps}"):
        assert f"$ xckpt validate --deep {out / name}" in text
        assert re.search(rf"^OK: {re.escape(str(out / name))} \(", text, re.MULTILINE), name
        assert xckpt.validate(out / name, deep=True).ok
    # the PNG exists and decodes
    png = out / "losses.png"
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR" and raw[-8:-4] == b"IEND"
    import matplotlib.image
    img = matplotlib.image.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600
    assert not _children_of(out), "the demo left processes behind"
    print(f"demo wall time: {took:.1f} s")


def _torch_reference(cfg: Config) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """The demo's PyTorch pre-training (same seed, same global batches, same AdamW) in one process, unsharded:
    parameters and AdamW moments by name."""
    from xckpt_demo import model_torch
    torch.manual_seed(cfg.init_seed)
    net = model_torch.GPT(cfg)
    opt = model_torch.make_optimizer(net, cfg)
    for s in range(cfg.pretrain_steps):
        ids, tg = data.batch(cfg, s)
        loss = model_torch.loss_fn(net, torch.from_numpy(ids), torch.from_numpy(tg))
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = dict(net.named_parameters())
    return ({k: p.detach().numpy() for k, p in params.items()},
            {k: {m: opt.state[p][m].numpy() for m in ("exp_avg", "exp_avg_sq")} for k, p in params.items()})


def _near_reference(got: np.ndarray, want: np.ndarray, frac: float, what: str) -> None:
    """``got`` within ``frac`` of ``want``'s largest magnitude, element by element. The 4-rank run sums in another
    order (FSDP reduce-scatter, tensor-parallel partial sums): float32 noise of ~1e-4 of that scale after 30 steps
    (6e-4 for parameters); a shard in the wrong place, a swapped moment or a stale value is off by the scale."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=frac * float(np.abs(want).max()), err_msg=what)


def test_demo_checkpoints_hold_what_was_trained(demo_run):
    """The PyTorch checkpoint was written by the 2 x 2 mesh, the JAX one by the 4 x 2 mesh; both hold step and state."""
    out, proc, _ = demo_run
    assert proc.returncode == 0
    cfg = Config()
    t = xckpt.load(out / f"torch_step{cfg.pretrain_steps}")
    assert t["step"] == cfg.pretrain_steps
    assert set(t["optim"]["state"]) == set(t["model"])
    for fqn, st in t["optim"]["state"].items():
        assert float(st["step"]) == cfg.pretrain_steps
        assert st["exp_avg"].shape == t["model"][fqn].shape
    assert t["rng"]["torch_cpu"].shape[0] == 4
    (group,) = t["optim"]["param_groups"]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == \
        (cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay)
    ref_params, ref_moments = _torch_reference(cfg)
    assert group["params"] == list(ref_params) and set(t["model"]) == set(ref_params)
    for fqn, want in ref_params.items():
        st = t["optim"]["state"][fqn]
        if fqn.endswith("attn.k.bias"):
            # softmax ignores a key bias (it adds the same q . b_k to every key of a query): its gradient is 0
            # up to rounding, which AdamW normalises into a random walk of the bias itself in either run
            assert np.abs(st["exp_avg"]).max() < 1e-9 and np.abs(st["exp_avg_sq"]).max() < 1e-18, fqn
            continue
        _near_reference(t["model"][fqn], want, 5e-3, fqn)
        for m in ("exp_avg", "exp_avg_sq"):
            _near_reference(st[m], ref_moments[fqn][m], 2e-3, f"{fqn} {m}")
    info = {e["key"]: e for e in xckpt.inspect(out / f"torch_step{cfg.pretrain_steps}")["leaves"]}
    q = info["model/blocks.0.attn.q.weight"]["sharding"]
    assert q["mesh_shape"] == [2, 2] and q["dim_axes"] == [["dp", "tp"], []]
    j = xckpt.load(out / f"jax_step{cfg.pretrain_steps}")
    assert j["step"] == cfg.pretrain_steps and int(j["opt_state"][0].count) == cfg.pretrain_steps
    assert j["params"]["blocks_0"]["attn"]["q"]["kernel"].shape == (cfg.d_model, cfg.d_model)
    info = {e["key"]: e for e in xckpt.inspect(out / f"jax_step{cfg.pretrain_steps}")["leaves"]}
    assert info["params/blocks_0/attn/q/kernel"]["sharding"]["mesh_shape"] == [4, 2]
    # the demo's own JAX trainer, rerun here on the same 4 x 2 mesh of host devices: the same compiled steps,
    # so the same bits as the state the demo saved
    from xckpt_demo import train_jax
    from xckpt_demo.config import JAX_MESH
    trainer = train_jax.Trainer(cfg, JAX_MESH)
    key, init_key = jax.random.split(jax.random.PRNGKey(cfg.init_seed))
    params, opt_state = trainer.init(init_key)
    params, opt_state, _ = trainer.run(params, opt_state, 0, cfg.pretrain_steps, "[reference]", every=5)
    want = {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(key)}
    got = {"params": j["params"], "opt_state": j["opt_state"], "rng": j["rng"]}
    # loaded without a target, optax's namedtuples come back as look-alikes of the same name and fields
    leaves = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(want)}
    loaded = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(got)}
    assert list(loaded) == list(leaves) and len(leaves) > 3 * len(jax.tree.leaves(params))  # params, mu, nu, ...
    for where, w in leaves.items():
        assert loaded[where].dtype == w.dtype, where
        np.testing.assert_array_equal(loaded[where], w, err_msg=where)


def test_demo_ends_its_processes_on_ctrl_c(tmp_path):
    """Ctrl-C while the 4 PyTorch ranks are training: exit code 130, and none of them is left running."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "xckpt", "demo", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_demo_env())
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("4 ranks, mesh dp=2 x tp=2] step  4 " in x for x in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.05)
        assert len(_children_of(out)) == 4, "the 4 PyTorch ranks should be running now"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert proc.returncode == 130, "".join(lines)[-3000:]
    assert "interrupted" in "".join(lines)
    deadline = time.monotonic() + 5
    while _children_of(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _children_of(out), _children_of(out)


# ---- the parts, in one process --------------------------------------------------------------


def test_batches_are_deterministic_and_shared():
    cfg = Config()
    a, b = data.batch(cfg, 3), data.batch(cfg, 3)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[0].shape == a[1].shape == (cfg.batch, cfg.seq_len) and a[0].dtype == np.int32
    np.testing.assert_array_equal(a[0][:, 1:], a[1][:, :-1])  # targets are the next tokens
    assert a[0].min() >= 0 and a[1].max() < cfg.vocab
    assert not np.array_equal(data.batch(cfg, 4)[0], a[0])


def test_torch_and_flax_models_agree_on_the_same_weights(tmp_path):
    """3 AdamW steps in PyTorch, saved; loaded into flax + optax through the demo's mapping; same loss and
    logits on the same weights, then one step each: the same parameters and the same next loss."""
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, Mesh
    from xckpt import mapping as M
    from xckpt_demo import model_flax, model_torch

    cfg = Config()
    torch.manual_seed(0)
    net = model_torch.GPT(cfg)
    opt = model_torch.make_optimizer(net, cfg)
    for s in range(3):
        ids, tg = data.batch(cfg, s)
        loss = model_torch.loss_fn(net, torch.from_numpy(ids), torch.from_numpy(tg))
        opt.zero_grad()
        loss.backward()
        opt.step()
    xckpt.save({"model": net, "optim": opt, "step": 3}, tmp_path / "t")

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    gpt, tx = model_flax.GPT(cfg), model_flax.make_optimizer(cfg)
    p_like, o_like = model_flax.abstract_state(gpt, tx, mesh, cfg)
    got = xckpt.load(tmp_path / "t", {"params": p_like, "opt_state": o_like, "step": 0},
                     mapping=M.torch_to_flax())
    params, state = got["params"], got["opt_state"]
    assert got["step"] == 3 and int(state[0].count) == 3
    np.testing.assert_array_equal(np.asarray(params["blocks_1"]["mlp"]["fc"]["kernel"]),
                                  net.blocks[1].mlp.fc.weight.detach().numpy().T)
    np.testing.assert_array_equal(np.asarray(state[0].nu["tok_emb"]["embedding"]),
                                  opt.state[net.tok_emb.weight]["exp_avg_sq"].numpy())

    ids, tg = data.batch(cfg, 3)
    with torch.no_grad():
        logits_t = net(torch.from_numpy(ids)).numpy()
    logits_j = np.asarray(gpt.apply({"params": params}, jnp.asarray(ids)))
    np.testing.assert_allclose(logits_j, logits_t, rtol=1e-5, atol=2e-6)

    loss_t = model_torch.loss_fn(net, torch.from_numpy(ids), torch.from_numpy(tg))
    opt.zero_grad()
    loss_t.backward()
    opt.step()
    loss_j, grads = jax.value_and_grad(model_flax.loss_fn)(params, gpt, jnp.asarray(ids), jnp.asarray(tg))
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    assert abs(float(loss_j) - loss_t.item()) <= RTOL * abs(loss_t.item())
    np.testing.assert_allclose(np.asarray(params["blocks_0"]["attn"]["o"]["kernel"]),
                               net.blocks[0].attn.o.weight.detach().numpy().T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(params["head"]["bias"]), net.head.bias.detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    # and the next loss agrees too
    ids, tg = data.batch(cfg, 4)
    with torch.no_grad():
        nxt_t = model_torch.loss_fn(net, torch.from_numpy(ids), torch.from_numpy(tg)).item()
    nxt_j = float(model_flax.loss_fn(params, gpt, jnp.asarray(ids), jnp.asarray(tg)))
    assert abs(nxt_j - nxt_t) <= RTOL * abs(nxt_t)


def test_report_flags_disagreement_and_missing_steps():
    from xckpt_demo.report import Direction, table
    good = Direction("t", "s", "PyTorch", [4.0], [3.0, 2.0], [3.0, 2.0 * (1 + 5e-6)], 1)
    assert good.max_rel_diff() == pytest.approx(5e-6, rel=1e-6)
    assert "agree" in table(good, RTOL) and "DISAGREE" not in table(good, RTOL)
    bad = Direction("t", "s", "JAX", [4.0], [3.0, 2.0], [3.0, 2.0 * (1 + 2e-5)], 1)
    assert bad.max_rel_diff() > RTOL and "DISAGREE" in table(bad, RTOL)
    assert Direction("t", "s", "JAX", [], [3.0, float("nan")], [3.0, 3.0], 0).max_rel_diff() == math.inf
    assert Direction("t", "s", "JAX", [], [3.0, 2.0], [3.0], 0).max_rel_diff() == math.inf
    assert Direction("t", "s", "JAX", [], [], [], 0).max_rel_diff() == math.inf
