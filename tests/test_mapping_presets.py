"""Ready-made torch <-> flax/optax mappings, checked with the real libraries, value by value.

Modules: nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv1d, nn.Conv2d against flax linen
and nnx Dense/Linear, Embed, LayerNorm, Conv, both directions: the mapped arrays equal the
re-laid-out originals exactly and both modules give the same outputs. Optimizers: a few
torch AdamW/Adam/SGD-momentum steps, mapped to optax, then both continue on the same
gradients and must agree (and the reverse direction).

Torch tensors are saved as numpy (not through the torch adapter) and flax params through
``jax.device_get``, so these tests depend only on the core and the mapping layer.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from flax import linen, nnx  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # noqa: E402

import xckpt  # noqa: E402
from xckpt import mapping as M  # noqa: E402

pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")

ATOL = 2e-5


def _np(tree):
    """Torch tensors and jax arrays to numpy (containers kept)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy().copy()
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_np(v) for v in tree)
    if isinstance(tree, jax.Array):
        return np.asarray(jax.device_get(tree))
    return tree


def _zeros(tree):
    return jax.tree.map(lambda a: np.zeros(np.shape(a), np.asarray(a).dtype), tree)


# ---- modules --------------------------------------------------------------------------------

class TorchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.layers = nn.ModuleList([nn.Linear(8, 6), nn.Linear(6, 6, bias=False)])
        self.conv1 = nn.Conv1d(6, 5, 3)
        self.conv2 = nn.Conv2d(3, 4, (3, 2))


#: torch module -> flax module where these tests name them differently (the presets' only hint here).
MODULES = {"tok": "embed", "conv{n}": "conv_{n}d"}

#: torch parameter -> (flax path, how the torch array is laid out in flax).
LAYOUT = {
    "tok.weight": (("embed", "embedding"), lambda a: a),
    "norm.weight": (("norm", "scale"), lambda a: a),
    "norm.bias": (("norm", "bias"), lambda a: a),
    "layers.0.weight": (("layers_0", "kernel"), lambda a: a.T),
    "layers.0.bias": (("layers_0", "bias"), lambda a: a),
    "layers.1.weight": (("layers_1", "kernel"), lambda a: a.T),
    "conv1.weight": (("conv_1d", "kernel"), lambda a: a.transpose(2, 1, 0)),
    "conv1.bias": (("conv_1d", "bias"), lambda a: a),
    "conv2.weight": (("conv_2d", "kernel"), lambda a: a.transpose(2, 3, 1, 0)),
    "conv2.bias": (("conv_2d", "bias"), lambda a: a),
}


def _linen_modules() -> dict[str, linen.Module]:
    return {"embed": linen.Embed(11, 8), "norm": linen.LayerNorm(epsilon=1e-5), "layers_0": linen.Dense(6),
            "layers_1": linen.Dense(6, use_bias=False), "conv_1d": linen.Conv(5, (3,), padding="VALID"),
            "conv_2d": linen.Conv(4, (3, 2), padding="VALID")}


def _inputs():
    rng = np.random.default_rng(0)
    return {"ids": rng.integers(0, 11, (2, 5)), "x8": rng.standard_normal((2, 8)).astype(np.float32),
            "x6": rng.standard_normal((2, 6)).astype(np.float32),
            "seq": rng.standard_normal((2, 6, 7)).astype(np.float32),  # N, C, L (torch)
            "img": rng.standard_normal((2, 3, 6, 5)).astype(np.float32)}  # N, C, H, W (torch)


def _torch_outputs(net: TorchNet) -> dict[str, np.ndarray]:
    x = _inputs()
    with torch.no_grad():
        return {"embed": net.tok(torch.from_numpy(x["ids"])).numpy(),
                "norm": net.norm(torch.from_numpy(x["x8"])).numpy(),
                "layers_0": net.layers[0](torch.from_numpy(x["x8"])).numpy(),
                "layers_1": net.layers[1](torch.from_numpy(x["x6"])).numpy(),
                "conv_1d": net.conv1(torch.from_numpy(x["seq"])).numpy().transpose(0, 2, 1),
                "conv_2d": net.conv2(torch.from_numpy(x["img"])).numpy().transpose(0, 2, 3, 1)}


def _flax_inputs() -> dict[str, np.ndarray]:
    x = _inputs()
    return {"embed": x["ids"], "norm": x["x8"], "layers_0": x["x8"], "layers_1": x["x6"],
            "conv_1d": x["seq"].transpose(0, 2, 1), "conv_2d": x["img"].transpose(0, 2, 3, 1)}


def _linen_outputs(params: dict) -> dict[str, np.ndarray]:
    xs = _flax_inputs()
    return {name: np.asarray(mod.apply({"params": params[name]}, jnp.asarray(xs[name])))
            for name, mod in _linen_modules().items()}


def _linen_init(seed: int) -> dict:
    xs = _flax_inputs()
    keys = jax.random.split(jax.random.PRNGKey(seed), len(xs))
    return {name: _np(mod.init(k, jnp.asarray(xs[name]))["params"])
            for k, (name, mod) in zip(keys, _linen_modules().items())}


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _check_outputs(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=ATOL, rtol=1e-5, err_msg=name)


def test_torch_to_flax_linen_modules(tmp_path):
    torch.manual_seed(0)
    net = TorchNet()
    sd = _np(net.state_dict())
    path = str(tmp_path / "torch")
    xckpt.save({"model": sd, "step": 3}, path)
    like = {"params": _zeros(_linen_init(1)), "step": 0}
    out = xckpt.load(path, like, mapping=M.torch_to_flax(MODULES))
    assert out["step"] == 3
    for fqn, (fpath, lay) in LAYOUT.items():
        np.testing.assert_array_equal(_get(out["params"], fpath), lay(sd[fqn]), err_msg=fqn)
    _check_outputs(_torch_outputs(net), _linen_outputs(out["params"]))


def test_flax_linen_to_torch_modules(tmp_path):
    params = _linen_init(2)
    path = str(tmp_path / "flax")
    xckpt.save({"params": params}, path)
    net = TorchNet()
    like = {"model": _zeros(_np(net.state_dict()))}
    out = xckpt.load(path, like, mapping=M.flax_to_torch(MODULES))
    for fqn, (fpath, lay) in LAYOUT.items():
        np.testing.assert_array_equal(lay(out["model"][fqn]), _get(params, fpath), err_msg=fqn)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in out["model"].items()})
    _check_outputs(_torch_outputs(net), _linen_outputs(params))


def test_orbax_saved_flax_params_to_torch(tmp_path):
    """The mapping works on checkpoints written by Orbax too (read through xckpt's Orbax reader)."""
    import orbax.checkpoint as ocp
    params = _linen_init(7)
    path = str(tmp_path / "orbax")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": jax.tree.map(jnp.asarray, params)})
    net = TorchNet()
    out = xckpt.load(path, {"model": _zeros(_np(net.state_dict()))}, mapping=M.flax_to_torch(MODULES))
    for fqn, (fpath, lay) in LAYOUT.items():
        np.testing.assert_array_equal(lay(out["model"][fqn]), _get(params, fpath), err_msg=fqn)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in out["model"].items()})
    _check_outputs(_torch_outputs(net), _linen_outputs(params))


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, epsilon=1e-5, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(8, 6, rngs=rngs), nnx.Linear(6, 6, use_bias=False, rngs=rngs)])
        self.conv_1d = nnx.Conv(6, 5, (3,), padding="VALID", rngs=rngs)
        self.conv_2d = nnx.Conv(3, 4, (3, 2), padding="VALID", rngs=rngs)


def _nnx_outputs(model: NnxNet) -> dict[str, np.ndarray]:
    xs = _flax_inputs()
    mods = {"embed": model.embed, "norm": model.norm, "layers_0": model.layers[0], "layers_1": model.layers[1],
            "conv_1d": model.conv_1d, "conv_2d": model.conv_2d}
    return {name: np.asarray(m(jnp.asarray(xs[name]))) for name, m in mods.items()}


def _nnx_path(fpath: tuple) -> tuple:
    head = fpath[0]
    return ("layers", int(head[-1])) + fpath[1:] if head.startswith("layers_") else fpath


def test_torch_to_flax_nnx_modules(tmp_path):
    torch.manual_seed(3)
    net = TorchNet()
    sd = _np(net.state_dict())
    path = str(tmp_path / "torch")
    xckpt.save({"model": sd}, path)
    model = NnxNet(nnx.Rngs(0))
    like = {"state": _zeros(_np(nnx.state(model, nnx.Param).to_pure_dict()))}
    out = xckpt.load(path, like, mapping=M.torch_to_flax(MODULES))
    for fqn, (fpath, lay) in LAYOUT.items():
        np.testing.assert_array_equal(_get(out["state"], _nnx_path(fpath)), lay(sd[fqn]), err_msg=fqn)
    state = nnx.state(model, nnx.Param)
    state.replace_by_pure_dict(out["state"])
    nnx.update(model, state)
    _check_outputs(_torch_outputs(net), _nnx_outputs(model))


def test_flax_nnx_to_torch_modules(tmp_path):
    model = NnxNet(nnx.Rngs(4))
    pure = _np(nnx.state(model, nnx.Param).to_pure_dict())
    path = str(tmp_path / "nnx")
    xckpt.save({"state": pure}, path)
    net = TorchNet()
    out = xckpt.load(path, {"model": _zeros(_np(net.state_dict()))},
                     mapping=M.flax_to_torch(MODULES))
    for fqn, (fpath, lay) in LAYOUT.items():
        np.testing.assert_array_equal(lay(out["model"][fqn]), _get(pure, _nnx_path(fpath)), err_msg=fqn)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in out["model"].items()})
    _check_outputs(_torch_outputs(net), _nnx_outputs(model))


class Square(nn.Module):
    """Two square Linear layers: the shapes alone cannot tell (out, in) from (in, out)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)


def test_square_weight_without_layer_kind_is_an_error_naming_the_hint(tmp_path):
    net = Square()
    sd = _np(net.state_dict())
    plain, noted = str(tmp_path / "plain"), str(tmp_path / "noted")
    xckpt.save({"model": sd}, plain)  # numpy arrays: nothing records that these are nn.Linear
    xckpt.save({"model": net}, noted)  # the module: the adapter records each layer's class and kind
    like = {"params": {"a": {"kernel": np.zeros((4, 4), np.float32), "bias": np.zeros(4, np.float32)},
                       "b": {"kernel": np.zeros((4, 4), np.float32)}}}
    with pytest.raises(M.MappingError, match=r"torch_to_flax\(kinds=\{'a': 'linear'\}\)") as info:
        xckpt.load(plain, like, mapping=M.torch_to_flax())
    assert info.value.code == "mapping.ambiguous" and "as stored, transposed" in str(info.value)
    assert info.value.file == plain and info.value.leaf == "params/a/kernel"
    for path, mapping in ((plain, M.torch_to_flax(kinds={"{m}": "linear"})), (noted, M.torch_to_flax())):
        out = xckpt.load(path, like, mapping=mapping)
        np.testing.assert_array_equal(out["params"]["a"]["kernel"], sd["a.weight"].T)
        np.testing.assert_array_equal(out["params"]["b"]["kernel"], sd["b.weight"].T)
        np.testing.assert_array_equal(out["params"]["a"]["bias"], sd["a.bias"])
    # the other way, the target module tells the kind
    params = {"a": {"kernel": np.arange(16, dtype=np.float32).reshape(4, 4), "bias": np.ones(4, np.float32)},
              "b": {"kernel": -np.arange(16, dtype=np.float32).reshape(4, 4)}}
    back = str(tmp_path / "flax")
    xckpt.save({"params": params}, back)
    target = Square()
    xckpt.load(back, {"model": target}, mapping=M.flax_to_torch())
    np.testing.assert_array_equal(target.a.weight.detach().numpy(), params["a"]["kernel"].T)
    np.testing.assert_array_equal(target.b.weight.detach().numpy(), params["b"]["kernel"].T)


# ---- optimizers -----------------------------------------------------------------------------

class OptNet(nn.Module):
    """Linear, LayerNorm, Embedding and a fused qkv Linear (split into three flax Dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.emb = nn.Embedding(5, 4)
        self.qkv = nn.Linear(4, 6)
        self.conv = nn.Conv1d(2, 3, 2)


OPT_LAYOUT = {
    "lin.weight": [(("lin", "kernel"), lambda a: a.T)],
    "lin.bias": [(("lin", "bias"), lambda a: a)],
    "norm.weight": [(("norm", "scale"), lambda a: a)],
    "norm.bias": [(("norm", "bias"), lambda a: a)],
    "emb.weight": [(("emb", "embedding"), lambda a: a)],
    "qkv.weight": [((n, "kernel"), lambda a, i=i: a[2 * i:2 * i + 2].T) for i, n in enumerate("qkv")],
    "qkv.bias": [((n, "bias"), lambda a, i=i: a[2 * i:2 * i + 2]) for i, n in enumerate("qkv")],
    "conv.weight": [(("conv", "kernel"), lambda a: a.transpose(2, 1, 0))],
    "conv.bias": [(("conv", "bias"), lambda a: a)],
}
# the user's own rules for the fused tensor, handed to the preset (mirrored into the optimizer state)
SPLIT = [M.split("model/qkv.weight", ["params/q/kernel", "params/k/kernel", "params/v/kernel"], axis=0,
                 then=[M.transpose(1, 0)]),
         M.split("model/qkv.bias", ["params/q/bias", "params/k/bias", "params/v/bias"], axis=0)]
FUSE = [M.concat(["params/q/kernel", "params/k/kernel", "params/v/kernel"], "model/qkv.weight", axis=1,
                 then=[M.transpose(1, 0)]),
        M.concat(["params/q/bias", "params/k/bias", "params/v/bias"], "model/qkv.bias", axis=0)]


def _to_flax(torch_tree: dict[str, np.ndarray]) -> dict:
    out: dict = {}
    for fqn, parts in OPT_LAYOUT.items():
        for (mod, leaf), lay in parts:
            out.setdefault(mod, {})[leaf] = np.ascontiguousarray(lay(torch_tree[fqn]))
    return out


def _grads(net: nn.Module, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(42)
    return [{k: rng.standard_normal(tuple(p.shape)).astype(np.float32) for k, p in net.named_parameters()}
            for _ in range(n)]


def _torch_opt(kind: str, net: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    if kind == "adam":
        return torch.optim.Adam(net.parameters(), lr=0.05, betas=(0.9, 0.99), eps=1e-8)
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _optax(kind: str) -> optax.GradientTransformation:
    if kind == "adamw":
        return optax.adamw(0.05, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)
    if kind == "adam":
        return optax.adam(0.05, b1=0.9, b2=0.99, eps=1e-8)
    return optax.sgd(0.1, momentum=0.9)


def _torch_steps(net: nn.Module, opt: torch.optim.Optimizer, grads: list[dict]) -> None:
    params = dict(net.named_parameters())
    for g in grads:
        for k, p in params.items():
            p.grad = torch.from_numpy(g[k].copy())
        opt.step()


def _optax_steps(tx: optax.GradientTransformation, params: dict, state, grads: list[dict]):
    params = jax.tree.map(jnp.asarray, params)
    state = jax.tree.map(jnp.asarray, state)
    for g in grads:
        updates, state = tx.update(jax.tree.map(jnp.asarray, _to_flax(g)), state, params)
        params = optax.apply_updates(params, updates)
    return _np(params), state


STATE_FIELDS = {"adam": [("exp_avg", "mu"), ("exp_avg_sq", "nu")], "adamw": [("exp_avg", "mu"), ("exp_avg_sq", "nu")],
                "sgd": [("momentum_buffer", "trace")]}


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_torch_optimizer_to_optax_continues(tmp_path, kind):
    torch.manual_seed(5)
    net = OptNet()
    opt = _torch_opt(kind, net)
    grads = _grads(net, 5)
    _torch_steps(net, opt, grads[:2])
    path = str(tmp_path / "torch")
    osd = _np(get_optimizer_state_dict(net, opt))
    xckpt.save({"model": _np(net.state_dict()), "optim": osd, "step": 2}, path)

    tx = _optax(kind)
    params0 = _zeros(_to_flax(_np(net.state_dict())))
    like = {"params": params0, "opt_state": _zeros(_np(tx.init(params0))), "step": 0}
    mapping = M.torch_to_flax(rules=SPLIT)
    out = xckpt.load(path, like, mapping=mapping)
    assert out["step"] == 2
    # exact values: params and every optimizer field, laid out as flax
    np.testing.assert_equal(out["params"], _to_flax(_np(net.state_dict())))
    inner = out["opt_state"][0]
    for torch_field, optax_field in STATE_FIELDS[kind]:
        expected = _to_flax({k: v[torch_field] for k, v in osd["state"].items()})
        np.testing.assert_equal(getattr(inner, optax_field), expected)
    if kind != "sgd":
        assert inner.count.dtype == np.int32
        np.testing.assert_array_equal(inner.count, np.int32(2))
    # both continue on the same gradients
    _torch_steps(net, opt, grads[2:])
    flax_params, _ = _optax_steps(tx, out["params"], out["opt_state"], grads[2:])
    ref = _to_flax(_np(net.state_dict()))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), flax_params, ref)
    # and the state really mattered: restarting optax from scratch lands elsewhere
    fresh, _ = _optax_steps(tx, out["params"], tx.init(out["params"]), grads[2:])
    assert not np.allclose(fresh["lin"]["kernel"], ref["lin"]["kernel"], atol=1e-4)


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_optax_to_torch_optimizer_continues(tmp_path, kind):
    torch.manual_seed(6)
    net = OptNet()
    grads = _grads(net, 5)
    tx = _optax(kind)
    params = _to_flax(_np(net.state_dict()))
    params, state = _optax_steps(tx, params, tx.init(jax.tree.map(jnp.asarray, params)), grads[:2])
    path = str(tmp_path / "flax")
    xckpt.save({"params": params, "opt_state": _np(state)}, path)

    target = OptNet()
    fields = [t for t, _ in STATE_FIELDS[kind]] + (["step"] if kind != "sgd" else [])
    like = {"model": _zeros(_np(target.state_dict())),
            "optim": {"state": {k: {f: np.zeros(() if f == "step" else tuple(p.shape), np.float32) for f in fields}
                                for k, p in target.named_parameters()}}}
    mapping = M.flax_to_torch(rules=FUSE)
    out = xckpt.load(path, like, mapping=mapping)
    np.testing.assert_equal(_to_flax(out["model"]), params)
    for torch_field, optax_field in STATE_FIELDS[kind]:
        expected = _np(getattr(state[0], optax_field))
        np.testing.assert_equal(_to_flax({k: v[torch_field] for k, v in out["optim"]["state"].items()}), expected)
    if kind != "sgd":
        for k, v in out["optim"]["state"].items():
            assert v["step"].dtype == np.float32 and v["step"].shape == ()
            np.testing.assert_array_equal(v["step"], np.float32(2))
    # hand the loaded state to a fresh torch optimizer through torch's own API, then continue both
    target.load_state_dict({k: torch.from_numpy(v) for k, v in out["model"].items()})
    opt = _torch_opt(kind, target)
    groups = get_optimizer_state_dict(target, opt)["param_groups"]
    state_t = {k: {f: torch.from_numpy(np.array(a)) for f, a in v.items()} for k, v in out["optim"]["state"].items()}
    set_optimizer_state_dict(target, opt, {"state": state_t, "param_groups": groups})
    _torch_steps(target, opt, grads[2:])
    flax_params, _ = _optax_steps(tx, params, state, grads[2:])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 _to_flax(_np(target.state_dict())), flax_params)


def test_preset_errors_before_reading(tmp_path):
    net = OptNet()
    path = str(tmp_path / "torch")
    xckpt.save({"model": _np(net.state_dict())}, path)
    with pytest.raises(M.MappingError, match="resolves names and layouts against the load target") as info:
        M.torch_to_flax().plan(path)
    assert info.value.code == "mapping.target"
    with pytest.raises(M.MappingError, match="no target flax leaf names a parameter") as info:
        M.torch_to_flax().plan(path, {"params": {"other": np.zeros(3, np.float32)}})
    assert info.value.code == "mapping.no_match"
    with pytest.raises(M.MappingError, match="found no torch state dict"):
        M.flax_to_torch().plan(path, {"params": {"lin": {"bias": np.zeros(3, np.float32)}}})
    with pytest.raises(M.MappingError, match="kind 'linaer' of 'lin' is not one of"):
        M.torch_to_flax(kinds={"lin": "linaer"})
    with pytest.raises(M.MappingError, match="does not fit flax params/lin/kernel"):
        M.torch_to_flax().plan(path, {"params": {"lin": {"kernel": np.zeros((5, 5), np.float32)}}})
