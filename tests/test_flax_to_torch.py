"""Flax/optax <-> PyTorch with the default presets (``M.flax_to_torch()``, ``M.torch_to_flax()``, no arguments).

A. A Hugging Face ``FlaxGPT2LMHeadModel`` trained two steps in a flax ``TrainState`` (optax.adamw), saved
   by Orbax's own ``CheckpointManager`` (async, OCDBT), loads in one ``xckpt.load`` into a fresh torch
   ``GPT2LMHeadModel`` and a fresh ``AdamW``. The oracle is transformers' own converter
   (``load_flax_weights_in_pytorch_model``) applied to the params and to mu and nu; then the torch
   logits equal flax's and one more step in torch equals one more optax step.
B. One torch AdamW checkpoint loads into flax targets whose optax state is adamw (in a TrainState), adam,
   a chain with gradient clipping, inject_hyperparams, a weight-decay mask, two masked Adam states (adamw
   on the kernels, adam on the rest) and a learning-rate schedule (torch SGD with momentum into
   optax.sgd): mu/nu/trace and every count are checked, and both continue equally. The reverse direction
   (a TrainState and an inject_hyperparams state written by xckpt.save into a fresh torch AdamW).
C. Scanned layers: a linen model whose blocks are an ``nn.scan`` (params stacked on a leading layer axis)
   against a torch model with an ``nn.ModuleList``, both directions, through xckpt.save and Orbax.
D. Batch statistics: a Hugging Face ResNet (convolutions, BatchNorm) trained in torch with SGD momentum
   loads into ``FlaxResNetForImageClassification``'s params and batch_stats and an optax.sgd trace, exact
   against transformers' converter, logits within 1e-5; and back into a fresh torch model.
E. Parameter sets that differ: Hugging Face models whose torch side holds what flax computes (Marian's and
   RoFormer's sinusoidal position tables, an older checkpoint's ``position_ids``) or names it otherwise
   (Wav2Vec2's weight-normalized convolution: ``parametrizations.weight.original0/1`` <-> ``weight_g/v``),
   both ways, exact against transformers' own converters, logits within 1e-5.

Everything is real (transformers, flax, optax, orbax, torch); arrays are compared element by element,
and the expected layouts come from tables written out here (or from transformers), not from xckpt.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import copy  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flax import linen  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from torch import nn  # noqa: E402
from transformers import FlaxGPT2LMHeadModel, GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.modeling_flax_pytorch_utils import load_flax_weights_in_pytorch_model  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import xckpt  # noqa: E402
from xckpt import mapping as M  # noqa: E402

pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")

logging.getLogger("absl").setLevel(logging.ERROR)
hf_logging.set_verbosity_error()

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.95, 1e-8, 0.1
RTOL = 1e-5
ATOL = 1e-5


def _np(tree: Any) -> Any:
    """Torch tensors and jax arrays to numpy arrays (any pytree: dicts, lists, tuples, namedtuples kept)."""
    def leaf(x: Any) -> Any:
        """One leaf to numpy."""
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().numpy().copy()
        if isinstance(x, jax.Array):
            return np.array(jax.device_get(x))
        return x
    return jax.tree.map(leaf, tree)


def _params_np(module: nn.Module) -> dict[str, np.ndarray]:
    """A torch module's parameters (no buffers, tied ones once) as numpy, by name."""
    return {k: _np(p) for k, p in module.named_parameters()}


def _state_np(module: nn.Module, opt: torch.optim.Optimizer, field: str) -> dict[str, np.ndarray]:
    """One field (``exp_avg``, ``step``, ...) of a torch optimizer's state, as numpy by parameter name."""
    return {k: _np(opt.state[p][field]) for k, p in module.named_parameters()}


def _assert_trees_equal(actual: Any, expected: Any, what: str) -> None:
    """Same structure and every leaf equal element by element (and same shape and dtype)."""
    a, b = _np(actual), _np(expected)
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert [jax.tree_util.keystr(k) for k, _ in la] == [jax.tree_util.keystr(k) for k, _ in lb], what
    for (k, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (what, jax.tree_util.keystr(k), x.shape, y.shape,
                                                           x.dtype, y.dtype)
        np.testing.assert_array_equal(x, y, err_msg=f"{what}{jax.tree_util.keystr(k)}")


def _flat(tree: Any) -> dict[str, np.ndarray]:
    """A pytree's leaves as numpy, by key path (``['layers_0']['kernel']``); empty nodes (optax.MaskedNode) vanish."""
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(_np(tree))[0]}


def _assert_dicts_equal(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], what: str) -> None:
    """Two flat dicts of arrays: same keys, every array equal element by element."""
    assert sorted(actual) == sorted(expected), what
    for k in expected:
        assert actual[k].shape == expected[k].shape and actual[k].dtype == expected[k].dtype, (what, k)
        np.testing.assert_array_equal(actual[k], expected[k], err_msg=f"{what} {k}")


def _assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Within RTOL relative to the array's scale (and ATOL absolute), element by element."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=max(ATOL, RTOL * scale), err_msg=what)


def _of_class(tree: Any, cls: type) -> list[Any]:
    """Every node of ``tree`` that is an instance of ``cls`` (e.g. optax.ScaleByAdamState)."""
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, cls)) if isinstance(x, cls)]


def _counts(tree: Any) -> dict[str, np.ndarray]:
    """Every leaf of an optax state whose last key is ``count``, by its key path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        last = path[-1]
        name = getattr(last, "name", getattr(last, "key", None))
        if name == "count":
            out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def _assert_counts(tree: Any, step: int, expected_paths: int) -> None:
    """Every ``count`` in an optax chain is an int32 equal to the torch step, and there are as many as expected."""
    counts = _counts(tree)
    assert len(counts) == expected_paths, counts
    for path, c in counts.items():
        assert c.dtype == np.int32 and c.shape == (), (path, c.dtype, c.shape)
        assert int(c) == step, (path, int(c))


def _lm_loss_torch(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (mean), torch."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _lm_loss_jax(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Next-token cross entropy (mean), jax: the same maths as :func:`_lm_loss_torch`."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()


def _compiled(net: linen.Module, width: int) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """A linen model's init (params for ids of ``width``), apply and next-token-loss gradient, each compiled
    once for the module."""
    init = jax.jit(lambda key: net.init(key, jnp.zeros((2, width), jnp.int32))["params"])
    apply = jax.jit(lambda params, ids: net.apply({"params": params}, ids))
    grad = jax.jit(lambda params, ids: jax.grad(lambda p: _lm_loss_jax(net.apply({"params": p}, ids), ids))(params))
    return init, apply, grad


def _torch_adamw(params: Any, lr: float = LR, weight_decay: float = WD) -> torch.optim.AdamW:
    """torch AdamW with this file's hyperparameters."""
    return torch.optim.AdamW(params, lr=lr, betas=(B1, B2), eps=EPS, weight_decay=weight_decay)


def _optax_adamw(**kw: Any) -> optax.GradientTransformation:
    """optax.adamw with this file's hyperparameters (``kw`` overrides)."""
    args = dict(learning_rate=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    args.update(kw)
    return optax.adamw(**args)


#: the plain optax.adamw of this file, one object (its compiled update step is reused)
ADAMW = _optax_adamw()


def _torch_step(net: nn.Module, opt: torch.optim.Optimizer, ids: np.ndarray,
                before_step: Callable[[nn.Module], None] | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """One torch training step on ``ids``: (loss before the step, gradients by parameter name)."""
    opt.zero_grad(set_to_none=True)
    t = torch.from_numpy(ids)
    loss = _lm_loss_torch(_logits_torch(net, t), t)
    loss.backward()
    grads = {k: _np(p.grad) for k, p in net.named_parameters()}
    if before_step is not None:
        before_step(net)
    opt.step()
    return float(loss.detach()), grads


def _logits_torch(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a Hugging Face causal LM or of this file's torch models."""
    out = net(ids)
    return out.logits if hasattr(out, "logits") else out


# ==== A. HF GPT-2: flax TrainState saved by Orbax's CheckpointManager -> torch GPT2LMHeadModel + AdamW ====

GPT2 = dict(vocab_size=50, n_positions=12, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True)


def _gpt2_config() -> GPT2Config:
    """A tiny GPT-2 configuration (no dropout, tied embeddings)."""
    return GPT2Config(**GPT2)


def _oracle_torch(flax_tree: Any) -> dict[str, np.ndarray]:
    """transformers' own flax -> PyTorch conversion of a params-shaped tree (params, mu or nu), by torch name."""
    ref = GPT2LMHeadModel(_gpt2_config())
    load_flax_weights_in_pytorch_model(ref, _np(flax_tree))
    return _params_np(ref)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two flax training steps of FlaxGPT2LMHeadModel in a TrainState, saved by Orbax's CheckpointManager."""
    cfg = _gpt2_config()
    model = FlaxGPT2LMHeadModel(cfg, seed=0, dtype=jnp.float32)
    apply_fn = model.__call__
    state = TrainState.create(apply_fn=apply_fn, params=model.params, tx=ADAMW)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, (3, 8)) for _ in range(3)]

    def loss_fn(params: Any, ids: jax.Array) -> jax.Array:
        """The flax model's next-token loss."""
        return _lm_loss_jax(apply_fn(ids, params=params, train=False).logits, ids)

    @jax.jit
    def train_step(st: TrainState, ids: jax.Array) -> tuple[TrainState, jax.Array, Any]:
        """One optax step: (new state, loss before it, gradients)."""
        loss, grads = jax.value_and_grad(loss_fn)(st.params, ids)
        return st.apply_gradients(grads=grads), loss, grads

    for ids in batches[:2]:
        state, _, _ = train_step(state, jnp.asarray(ids))
    root = tmp_path_factory.mktemp("orbax_run") / "run"
    mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions())
    assert mngr.save(2, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    mngr.close()
    assert (root / "2" / "default" / "manifest.ocdbt").is_file()  # OCDBT, as Orbax's defaults write it
    return SimpleNamespace(cfg=cfg, state=state, batches=batches, root=root, train_step=train_step)


def _check_gpt2_torch_against_flax(run: SimpleNamespace, model: GPT2LMHeadModel, opt: torch.optim.AdamW) -> None:
    """The torch model and AdamW hold the flax TrainState (oracle: transformers' converter), and both continue alike."""
    state = run.state
    (adam,) = _of_class(state.opt_state, optax.ScaleByAdamState)
    assert int(adam.count) == 2 and int(state.step) == 2
    _assert_dicts_equal(_params_np(model), _oracle_torch(state.params), "params")
    assert len(opt.state) == len(list(model.parameters()))
    _assert_dicts_equal(_state_np(model, opt, "exp_avg"), _oracle_torch(adam.mu), "exp_avg")
    _assert_dicts_equal(_state_np(model, opt, "exp_avg_sq"), _oracle_torch(adam.nu), "exp_avg_sq")
    for name, step in _state_np(model, opt, "step").items():
        assert step.shape == () and float(step) == int(adam.count), (name, step)
    # still tied: the head is the embedding
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    # same logits
    ids = run.batches[2]
    with torch.no_grad():
        torch_logits = model(torch.from_numpy(ids)).logits.numpy()
    flax_logits = np.asarray(state.apply_fn(jnp.asarray(ids), params=state.params, train=False).logits)
    _assert_close(torch_logits, flax_logits, "logits")
    # one more step on each side
    model.train()
    torch_loss, _ = _torch_step(model, opt, ids)
    new_state, flax_loss, flax_grads = run.train_step(state, jnp.asarray(ids))
    assert abs(torch_loss - float(flax_loss)) <= RTOL * abs(float(flax_loss)), (torch_loss, float(flax_loss))
    # every element, those with an exactly-zero gradient too (wpe rows past the sequence: mu = nu = 0)
    assert not np.asarray(flax_grads["transformer"]["wpe"]["embedding"])[ids.shape[1]:].any()
    expected = _oracle_torch(new_state.params)
    for name, value in _params_np(model).items():
        _assert_close(value, expected[name], f"after one more step: {name}")
    assert float(opt.state[model.transformer.wte.weight]["step"]) == 3


def test_gpt2_oracle_harness(gpt2_run: SimpleNamespace) -> None:
    """The comparison itself is sound: the TrainState put into torch by transformers' converter and torch's
    own ``load_state_dict`` passes every check (so a failure below is xckpt's)."""
    state = gpt2_run.state
    (adam,) = _of_class(state.opt_state, optax.ScaleByAdamState)
    model = GPT2LMHeadModel(gpt2_run.cfg)
    load_flax_weights_in_pytorch_model(model, _np(state.params))
    opt = _torch_adamw(model.parameters())
    mu, nu = _oracle_torch(adam.mu), _oracle_torch(adam.nu)
    names = [k for k, _ in model.named_parameters()]
    opt.load_state_dict({"state": {i: {"step": torch.tensor(float(adam.count)), "exp_avg": torch.from_numpy(mu[k]),
                                       "exp_avg_sq": torch.from_numpy(nu[k])} for i, k in enumerate(names)},
                         "param_groups": opt.state_dict()["param_groups"]})
    _check_gpt2_torch_against_flax(gpt2_run, model, opt)


@pytest.mark.parametrize("where", ["step", "item"])
def test_orbax_manager_trainstate_to_torch_gpt2(gpt2_run: SimpleNamespace, where: str) -> None:
    """One ``xckpt.load`` of the step directory (``run/2``, as README says to pass) or of its ``default``
    item puts the flax TrainState into a fresh torch GPT2LMHeadModel and a fresh (stateless) AdamW."""
    path = gpt2_run.root / "2" if where == "step" else gpt2_run.root / "2" / "default"
    torch.manual_seed(1)
    model = GPT2LMHeadModel(gpt2_run.cfg)
    opt = _torch_adamw(model.parameters())
    assert not opt.state
    out = xckpt.load(path, like={"model": model, "optim": opt}, mapping=M.flax_to_torch())
    assert out["model"] is model and out["optim"] is opt
    _check_gpt2_torch_against_flax(gpt2_run, model, opt)


# ==== B. optimizer chains: one torch checkpoint into every optax state shape, and back ====================

VOCAB = 11


class TorchNet(nn.Module):
    """Embedding -> Linear (square) -> gelu -> Linear -> LayerNorm -> Linear head."""

    def __init__(self) -> None:
        """The modules, named as a flax user would name them."""
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 6)])
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits."""
        x = F.gelu(self.layers[0](self.embed(ids)))
        return self.head(self.norm(self.layers[1](x)))


class FlaxNet(linen.Module):
    """The same maths in linen (``layers_0``, ``layers_1`` from a list attribute)."""

    def setup(self) -> None:
        """The modules."""
        self.embed = linen.Embed(VOCAB, 8)
        self.layers = [linen.Dense(8), linen.Dense(6)]
        self.norm = linen.LayerNorm(epsilon=1e-5)
        self.head = linen.Dense(VOCAB)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Logits."""
        x = jax.nn.gelu(self.layers[0](self.embed(ids)), approximate=False)
        return self.head(self.norm(self.layers[1](x)))


#: torch parameter -> (flax module, flax leaf, transpose?)
NET_LAYOUT = {
    "embed.weight": ("embed", "embedding", False),
    "layers.0.weight": ("layers_0", "kernel", True), "layers.0.bias": ("layers_0", "bias", False),
    "layers.1.weight": ("layers_1", "kernel", True), "layers.1.bias": ("layers_1", "bias", False),
    "norm.weight": ("norm", "scale", False), "norm.bias": ("norm", "bias", False),
    "head.weight": ("head", "kernel", True), "head.bias": ("head", "bias", False),
}


def _net_to_flax(tree: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Torch names/layouts -> the linen params tree (written out, independent of xckpt)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for fqn, (mod, leaf, t) in NET_LAYOUT.items():
        out.setdefault(mod, {})[leaf] = np.ascontiguousarray(tree[fqn].T if t else tree[fqn])
    return out


def _net_to_torch(params: Any) -> dict[str, np.ndarray]:
    """The linen params tree -> torch names/layouts."""
    params = _np(params)
    return {fqn: np.ascontiguousarray(params[mod][leaf].T if t else params[mod][leaf])
            for fqn, (mod, leaf, t) in NET_LAYOUT.items()}


def _ids(seed: int, vocab: int = VOCAB) -> list[np.ndarray]:
    """Three token batches."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (2, 6)) for _ in range(3)]


def _decay_mask(params: Any) -> Any:
    """Weight decay on Dense kernels only."""
    return {m: {leaf: leaf == "kernel" for leaf in v} for m, v in params.items()}


SCHEDULE = optax.linear_schedule(0.02, 0.002, 10)


@functools.cache
def _variant(kind: str) -> tuple[optax.GradientTransformation, Callable[[nn.Module], torch.optim.Optimizer],
                                 Callable[[nn.Module], None] | None, int]:
    """(optax transform, the torch optimizer doing the same next step, a torch pre-step hook, how many counts);
    cached, so that each transformation's compiled update is reused."""
    def decay_groups(net: nn.Module) -> torch.optim.Optimizer:
        """AdamW decaying only the Linear weights (the optax mask)."""
        decay = [p for k, p in net.named_parameters() if k.endswith("weight") and not k.startswith(("embed", "norm"))]
        rest = [p for k, p in net.named_parameters() if all(p is not q for q in decay)]
        return _torch_adamw([{"params": decay}, {"params": rest, "weight_decay": 0.0}])

    def clip(net: nn.Module) -> None:
        """torch's own global-norm clipping."""
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)

    if kind == "adamw":
        return ADAMW, lambda n: _torch_adamw(n.parameters()), None, 1
    if kind == "adam":
        return (optax.adam(LR, b1=B1, b2=B2, eps=EPS), lambda n: _torch_adamw(n.parameters(), weight_decay=0.0),
                None, 1)
    if kind == "clip_adamw":
        return (optax.chain(optax.clip_by_global_norm(1.0), _optax_adamw()),
                lambda n: _torch_adamw(n.parameters()), clip, 1)
    if kind == "inject_adamw":
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
        return tx, lambda n: _torch_adamw(n.parameters()), None, 2
    if kind == "masked_decay":
        return _optax_adamw(mask=_decay_mask), decay_groups, None, 1
    if kind == "masked_adam":
        # adamw on the Linear kernels, adam on the rest: two Adam states, each holding part of the parameters
        def others(params: Any) -> Any:
            """The complement of the decay mask."""
            return jax.tree.map(lambda m: not m, _decay_mask(params))

        tx = optax.chain(optax.masked(_optax_adamw(), _decay_mask),
                         optax.masked(optax.adam(LR, b1=B1, b2=B2, eps=EPS), others))
        return tx, decay_groups, None, 2
    if kind == "schedule":
        # the third update uses the schedule at count 2
        return (_optax_adamw(learning_rate=SCHEDULE), lambda n: _torch_adamw(n.parameters(), lr=float(SCHEDULE(2))),
                None, 2)
    raise AssertionError(kind)


_flax_init_jit, _flax_apply, _flax_grad = _compiled(FlaxNet(), 6)


def _flax_init(seed: int) -> dict:
    """FlaxNet params (jax arrays)."""
    return _flax_init_jit(jax.random.PRNGKey(seed))


def _flax_logits(params: Any, ids: np.ndarray) -> np.ndarray:
    """FlaxNet logits."""
    return np.asarray(_flax_apply(params, jnp.asarray(ids)))


@functools.partial(jax.jit, static_argnums=0)
def _optax_step(tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
    """One optax update with given gradients (compiled once per transformation)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _continue_torch(net: nn.Module, opt: torch.optim.Optimizer, make: Callable[[nn.Module], torch.optim.Optimizer],
                    hook: Callable[[nn.Module], None] | None, ids: np.ndarray) -> tuple[nn.Module, float, dict]:
    """A copy of (net, opt) continued one step with the torch optimizer ``make`` builds (state copied per param)."""
    net2 = copy.deepcopy(net)
    opt2 = make(net2)
    for p, p2 in zip(net.parameters(), net2.parameters()):
        opt2.state[p2] = {k: v.clone() for k, v in opt.state[p].items()}
    loss, grads = _torch_step(net2, opt2, ids, hook)
    return net2, loss, grads


@pytest.fixture(scope="module")
def torch_adamw_ckpt(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A torch TorchNet + AdamW after two steps, saved with ``xckpt.save({"model": m, "optim": opt}, p)``."""
    torch.manual_seed(10)
    net = TorchNet()
    opt = _torch_adamw(net.parameters())
    ids = _ids(1)
    for x in ids[:2]:
        _torch_step(net, opt, x)
    path = tmp_path_factory.mktemp("torch_adamw") / "ckpt"
    xckpt.save({"model": net, "optim": opt}, path)
    assert xckpt.validate(path, deep=True).ok
    return SimpleNamespace(net=net, opt=opt, ids=ids, path=path)


@pytest.mark.parametrize("kind", ["adamw", "adam", "clip_adamw", "inject_adamw", "masked_decay", "masked_adam",
                                  "schedule"])
def test_torch_adamw_into_optax_chains(torch_adamw_ckpt: SimpleNamespace, kind: str) -> None:
    """The same torch AdamW checkpoint fills params, mu, nu and every count of each optax state shape; then one
    more step in optax equals one more in torch (with the torch optimizer that does the same maths)."""
    ck = torch_adamw_ckpt
    tx, make_torch, hook, n_counts = _variant(kind)
    params0 = _flax_init(3)
    if kind == "adamw":  # a TrainState as the target
        like: Any = TrainState.create(apply_fn=FlaxNet().apply, params=params0, tx=tx)
    else:
        like = {"params": params0, "opt_state": tx.init(params0)}
    out = xckpt.load(ck.path, like, mapping=M.torch_to_flax())
    if kind == "adamw":
        assert isinstance(out, TrainState) and int(out.step) == 2  # the TrainState's step continues torch's
        params, opt_state = out.params, out.opt_state
    else:
        params, opt_state = out["params"], out["opt_state"]
    assert type(opt_state) is type(tx.init(params0))
    _assert_trees_equal(params, _net_to_flax(_params_np(ck.net)), "params")
    assert jax.tree.structure(opt_state) == jax.tree.structure(tx.init(params0))
    adams = _of_class(opt_state, optax.ScaleByAdamState)
    assert len(adams) == (2 if kind == "masked_adam" else 1)
    for field, torch_field in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        expected = _flat(_net_to_flax(_state_np(ck.net, ck.opt, torch_field)))
        seen: list[str] = []
        for adam in adams:  # with masks each state holds some parameters (optax.MaskedNode for the others)
            for key, value in _flat(getattr(adam, field)).items():
                np.testing.assert_array_equal(value, expected[key], err_msg=f"{field}{key}")
                assert value.dtype == expected[key].dtype, (field, key)
                seen.append(key)
        assert sorted(seen) == sorted(expected), (field, seen)
    _assert_counts(opt_state, 2, n_counts)
    if kind == "inject_adamw":
        hp = opt_state.hyperparams
        for name, value in dict(learning_rate=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD).items():
            np.testing.assert_allclose(np.asarray(hp[name]), np.float32(value), rtol=1e-6, err_msg=name)
    ids = ck.ids[2]
    _assert_close(_flax_logits(params, ids), _logits_torch(ck.net, torch.from_numpy(ids)).detach().numpy(), "logits")
    net2, _, grads = _continue_torch(ck.net, ck.opt, make_torch, hook, ids)
    new_params, new_state = _optax_step(tx, params, opt_state, _net_to_flax(grads))
    expected = _net_to_flax(_params_np(net2))
    jax.tree.map(lambda a, b: _assert_close(np.asarray(a), b, f"{kind}: after one more step"), new_params, expected)
    _assert_counts(new_state, 3, n_counts)


def test_torch_sgd_momentum_into_optax_sgd(tmp_path: Path) -> None:
    """torch SGD(momentum=0.9) -> optax.sgd(lr, momentum=0.9): trace == momentum_buffer, and both continue alike."""
    torch.manual_seed(11)
    net = TorchNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ids = _ids(2)
    for x in ids[:2]:
        _torch_step(net, opt, x)
    path = tmp_path / "sgd"
    xckpt.save({"model": net, "optim": opt}, path)
    tx = optax.sgd(0.1, momentum=0.9)
    params0 = _flax_init(4)
    out = xckpt.load(path, {"params": params0, "opt_state": tx.init(params0)}, mapping=M.torch_to_flax())
    _assert_trees_equal(out["params"], _net_to_flax(_params_np(net)), "params")
    (trace,) = _of_class(out["opt_state"], optax.TraceState)
    _assert_trees_equal(trace.trace, _net_to_flax(_state_np(net, opt, "momentum_buffer")), "trace")
    net2, _, grads = _continue_torch(net, opt, lambda n: torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9),
                                     None, ids[2])
    new_params, _ = _optax_step(tx, out["params"], out["opt_state"], _net_to_flax(grads))
    jax.tree.map(lambda a, b: _assert_close(np.asarray(a), b, "sgd: after one more step"), new_params,
                 _net_to_flax(_params_np(net2)))


@pytest.mark.parametrize("kind", ["adamw", "inject_adamw"])
def test_optax_state_into_torch_adamw(tmp_path: Path, kind: str) -> None:
    """A flax/optax state written by ``xckpt.save`` (a TrainState for adamw, a dict for inject_hyperparams) loads
    into a fresh torch model and a fresh AdamW; then both continue alike."""
    tx, make_torch, hook, _ = _variant(kind)
    params = _flax_init(5)
    state = TrainState.create(apply_fn=FlaxNet().apply, params=params, tx=tx)
    ids = _ids(3)
    for x in ids[:2]:
        state = state.apply_gradients(grads=_flax_grad(state.params, jnp.asarray(x)))
    path = tmp_path / "flax"
    xckpt.save(state if kind == "adamw" else {"params": state.params, "opt_state": state.opt_state}, path)

    torch.manual_seed(12)
    net = TorchNet()
    opt = _torch_adamw(net.parameters())
    out = xckpt.load(path, like={"model": net, "optim": opt}, mapping=M.flax_to_torch())
    assert out["model"] is net and out["optim"] is opt and len(opt.state) == len(list(net.parameters()))
    (adam,) = _of_class(state.opt_state, optax.ScaleByAdamState)
    _assert_dicts_equal(_params_np(net), _net_to_torch(state.params), "params")
    _assert_dicts_equal(_state_np(net, opt, "exp_avg"), _net_to_torch(adam.mu), "exp_avg")
    _assert_dicts_equal(_state_np(net, opt, "exp_avg_sq"), _net_to_torch(adam.nu), "exp_avg_sq")
    for name, step in _state_np(net, opt, "step").items():
        assert step.shape == () and float(step) == 2.0, (name, step)
    _assert_close(_logits_torch(net, torch.from_numpy(ids[2])).detach().numpy(), _flax_logits(state.params, ids[2]),
                  "logits")
    _, grads = _torch_step(net, opt, ids[2], hook)
    new_params, _ = _optax_step(tx, state.params, state.opt_state, _net_to_flax(grads))
    expected = _net_to_torch(new_params)
    for name, value in _params_np(net).items():
        _assert_close(value, expected[name], f"{kind}: after one more step: {name}")


# ==== C. scanned layers: nn.scan-stacked flax params <-> torch nn.ModuleList ===============================

SV, SD, SL = 13, 8, 3  # vocabulary, width, layers


class Attention(linen.Module):
    """Single-head causal self-attention: Dense q, k, v, o."""

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Attention output."""
        q, k, v = (linen.Dense(SD, name=n)(x) for n in "qkv")
        s = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(SD)
        s = jnp.where(jnp.tril(jnp.ones((x.shape[-2], x.shape[-2]), bool)), s, -1e9)
        return linen.Dense(SD, name="o")(jax.nn.softmax(s, axis=-1) @ v)


class Mlp(linen.Module):
    """Dense up -> gelu -> Dense down."""

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """MLP output."""
        return linen.Dense(SD, name="down")(jax.nn.gelu(linen.Dense(2 * SD, name="up")(x), approximate=False))


class Block(linen.Module):
    """Pre-norm transformer block, scan-shaped (carry, _) -> (carry, None)."""

    @linen.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        """One block."""
        x = x + Attention(name="attn")(linen.LayerNorm(epsilon=1e-5, name="ln1")(x))
        x = x + Mlp(name="mlp")(linen.LayerNorm(epsilon=1e-5, name="ln2")(x))
        return x, None


class ScanNet(linen.Module):
    """Embed -> nn.scan(Block) (params stacked on a leading layer axis) -> LayerNorm -> Dense head."""

    @linen.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        """Logits."""
        x = linen.Embed(SV, SD, name="embed")(ids)
        stack = linen.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=SL)
        x, _ = stack(name="layers")(x, None)
        return linen.Dense(SV, name="head")(linen.LayerNorm(epsilon=1e-5, name="norm")(x))


class TorchAttention(nn.Module):
    """The torch twin of :class:`Attention`."""

    def __init__(self) -> None:
        """q, k, v, o."""
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(SD, SD) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention output."""
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(SD)
        mask = torch.tril(torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool))
        return self.o(torch.softmax(torch.where(mask, s, torch.tensor(-1e9)), dim=-1) @ self.v(x))


class TorchMlp(nn.Module):
    """The torch twin of :class:`Mlp`."""

    def __init__(self) -> None:
        """up, down."""
        super().__init__()
        self.up, self.down = nn.Linear(SD, 2 * SD), nn.Linear(2 * SD, SD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MLP output."""
        return self.down(F.gelu(self.up(x)))


class TorchBlock(nn.Module):
    """The torch twin of :class:`Block`."""

    def __init__(self) -> None:
        """ln1, attn, ln2, mlp."""
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(SD), TorchAttention(), nn.LayerNorm(SD), TorchMlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchLayered(nn.Module):
    """The torch twin of :class:`ScanNet`, one module per layer: ``layers.{i}.attn.q.weight``."""

    def __init__(self) -> None:
        """embed, layers, norm, head."""
        super().__init__()
        self.embed = nn.Embedding(SV, SD)
        self.layers = nn.ModuleList([TorchBlock() for _ in range(SL)])
        self.norm = nn.LayerNorm(SD)
        self.head = nn.Linear(SD, SV)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits."""
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


#: per-layer torch suffix -> (flax path under ``layers``, transpose?)
BLOCK_LAYOUT = {
    "ln1.weight": (("ln1", "scale"), False), "ln1.bias": (("ln1", "bias"), False),
    "ln2.weight": (("ln2", "scale"), False), "ln2.bias": (("ln2", "bias"), False),
    **{f"attn.{n}.weight": (("attn", n, "kernel"), True) for n in "qkvo"},
    **{f"attn.{n}.bias": (("attn", n, "bias"), False) for n in "qkvo"},
    **{f"mlp.{n}.weight": (("mlp", n, "kernel"), True) for n in ("up", "down")},
    **{f"mlp.{n}.bias": (("mlp", n, "bias"), False) for n in ("up", "down")},
}
#: torch parameter outside the layers -> (flax path, transpose?)
TOP_LAYOUT = {"embed.weight": (("embed", "embedding"), False), "norm.weight": (("norm", "scale"), False),
              "norm.bias": (("norm", "bias"), False), "head.weight": (("head", "kernel"), True),
              "head.bias": (("head", "bias"), False)}


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    """``tree[p0][p1]...``."""
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    """``tree[p0][p1]... = value``, making dicts on the way."""
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _scan_to_torch(params: Any) -> dict[str, np.ndarray]:
    """Stacked flax params -> per-layer torch names/layouts: layer i is slice ``[i]`` (transposed for kernels)."""
    params = _np(params)
    out = {fqn: np.ascontiguousarray(_get(params, fp).T if t else _get(params, fp))
           for fqn, (fp, t) in TOP_LAYOUT.items()}
    for i in range(SL):
        for suffix, (fp, t) in BLOCK_LAYOUT.items():
            a = _get(params["layers"], fp)[i]
            out[f"layers.{i}.{suffix}"] = np.ascontiguousarray(a.T if t else a)
    return out


def _torch_to_scan(tree: dict[str, np.ndarray]) -> dict:
    """Per-layer torch names/layouts -> stacked flax params (``np.stack`` over the layers)."""
    out: dict = {}
    for fqn, (fp, t) in TOP_LAYOUT.items():
        _set(out, fp, np.ascontiguousarray(tree[fqn].T if t else tree[fqn]))
    for suffix, (fp, t) in BLOCK_LAYOUT.items():
        layers = [tree[f"layers.{i}.{suffix}"] for i in range(SL)]
        _set(out, ("layers",) + fp, np.stack([a.T if t else a for a in layers]))
    return out


_scan_init_jit, _scan_apply, _scan_grad = _compiled(ScanNet(), 5)


def _scan_init(seed: int) -> dict:
    """ScanNet params (jax arrays), stacked: ``layers/attn/q/kernel`` has shape (SL, SD, SD)."""
    params = _scan_init_jit(jax.random.PRNGKey(seed))
    assert params["layers"]["attn"]["q"]["kernel"].shape == (SL, SD, SD)
    assert params["layers"]["mlp"]["up"]["kernel"].shape == (SL, SD, 2 * SD)
    return params


def _scan_logits(params: Any, ids: np.ndarray) -> np.ndarray:
    """ScanNet logits."""
    return np.asarray(_scan_apply(params, jnp.asarray(ids)))


def test_scan_harness_layouts_agree() -> None:
    """The written-out stacked <-> per-layer layout is right: torch with converted flax params gives flax's logits."""
    params = _scan_init(0)
    net = TorchLayered()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in _scan_to_torch(params).items()})
    ids = _ids(4, SV)[0]
    _assert_close(_logits_torch(net, torch.from_numpy(ids)).detach().numpy(), _scan_logits(params, ids), "logits")
    _assert_trees_equal(_torch_to_scan(_params_np(net)), _np(params), "round trip")


@pytest.mark.parametrize("writer", ["xckpt", "orbax"])
def test_scanned_flax_into_torch_layers(tmp_path: Path, writer: str) -> None:
    """Stacked flax params + optax.adamw (written by xckpt.save, or by Orbax's CheckpointManager) load into a
    torch model with an nn.ModuleList and a fresh AdamW: each layer is its slice, logits agree, steps agree."""
    tx = ADAMW
    params = _scan_init(1)
    opt_state = tx.init(params)
    ids = _ids(5, SV)
    for x in ids[:2]:
        params, opt_state = _optax_step(tx, params, opt_state, _scan_grad(params, jnp.asarray(x)))
    tree = {"params": params, "opt_state": opt_state}
    if writer == "xckpt":
        path = tmp_path / "flax"
        xckpt.save(tree, path)
    else:
        root = tmp_path / "orbax_run"
        with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions()) as mngr:
            mngr.save(2, args=ocp.args.StandardSave(tree))
            mngr.wait_until_finished()
        path = root / "2"

    torch.manual_seed(13)
    net = TorchLayered()
    opt = _torch_adamw(net.parameters())
    out = xckpt.load(path, like={"model": net, "optim": opt}, mapping=M.flax_to_torch())
    assert out["model"] is net and out["optim"] is opt and len(opt.state) == len(list(net.parameters()))
    (adam,) = _of_class(opt_state, optax.ScaleByAdamState)
    loaded = _params_np(net)
    _assert_dicts_equal(loaded, _scan_to_torch(params), "params")
    for i in range(SL):  # spelled out once more for the stacked kernels: torch layer i == flax [i].T
        np.testing.assert_array_equal(loaded[f"layers.{i}.attn.q.weight"],
                                      np.asarray(params["layers"]["attn"]["q"]["kernel"])[i].T)
    _assert_dicts_equal(_state_np(net, opt, "exp_avg"), _scan_to_torch(adam.mu), "exp_avg")
    _assert_dicts_equal(_state_np(net, opt, "exp_avg_sq"), _scan_to_torch(adam.nu), "exp_avg_sq")
    for name, step in _state_np(net, opt, "step").items():
        assert step.shape == () and float(step) == 2.0, (name, step)
    _assert_close(_logits_torch(net, torch.from_numpy(ids[2])).detach().numpy(), _scan_logits(params, ids[2]),
                  "logits")
    _, grads = _torch_step(net, opt, ids[2])
    new_params, _ = _optax_step(tx, params, opt_state, _torch_to_scan(grads))
    expected = _scan_to_torch(new_params)
    for name, value in _params_np(net).items():
        _assert_close(value, expected[name], f"after one more step: {name}")


def test_torch_layers_into_scanned_flax(tmp_path: Path) -> None:
    """A torch nn.ModuleList model + AdamW (xckpt.save) loads into stacked flax params + optax.adamw state:
    each stacked array is the per-layer tensors stacked (transposed for kernels), logits and steps agree."""
    torch.manual_seed(14)
    net = TorchLayered()
    opt = _torch_adamw(net.parameters())
    ids = _ids(6, SV)
    for x in ids[:2]:
        _torch_step(net, opt, x)
    path = tmp_path / "torch"
    xckpt.save({"model": net, "optim": opt}, path)

    tx = ADAMW
    params0 = _scan_init(2)
    out = xckpt.load(path, {"params": params0, "opt_state": tx.init(params0)}, mapping=M.torch_to_flax())
    _assert_trees_equal(out["params"], _torch_to_scan(_params_np(net)), "params")
    q = np.asarray(out["params"]["layers"]["attn"]["q"]["kernel"])
    for i in range(SL):
        np.testing.assert_array_equal(q[i], _np(net.layers[i].attn.q.weight).T)
    (adam,) = _of_class(out["opt_state"], optax.ScaleByAdamState)
    _assert_trees_equal(adam.mu, _torch_to_scan(_state_np(net, opt, "exp_avg")), "mu")
    _assert_trees_equal(adam.nu, _torch_to_scan(_state_np(net, opt, "exp_avg_sq")), "nu")
    _assert_counts(out["opt_state"], 2, 1)
    _assert_close(_scan_logits(out["params"], ids[2]), _logits_torch(net, torch.from_numpy(ids[2])).detach().numpy(),
                  "logits")
    _, grads = _torch_step(net, opt, ids[2])
    new_params, _ = _optax_step(tx, out["params"], out["opt_state"], _torch_to_scan(grads))
    jax.tree.map(lambda a, b: _assert_close(np.asarray(a), b, "after one more step"), new_params,
                 _torch_to_scan(_params_np(net)))


# ---------------------------------------------------------------------------------------------------- D


def _resnet() -> tuple[Any, Any]:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2], num_labels=3, layer_type="basic")
    torch.manual_seed(0)
    return ResNetForImageClassification(cfg), cfg


def _resnet_to_flax(tree: dict[str, np.ndarray]) -> dict[str, Any]:
    """The flax ResNet's leaves from torch's, by the table of how transformers names both (transformers'
    own converter names the blocks ``layer/0`` where the flax model has ``layer/layer_0``)."""
    out: dict[str, Any] = {}
    for name, v in tree.items():
        parts = name.split(".")
        if "layer" in parts[:-2] and parts[0] == "resnet":
            i = parts.index("layer", 4)
            parts[i + 1] = f"layer_{parts[i + 1]}"
        root, leaf = "params", parts[-1]
        if leaf == "num_batches_tracked":
            continue
        if leaf in ("running_mean", "running_var"):
            root, leaf = "batch_stats", leaf[len("running_"):]
        elif leaf == "weight" and v.ndim == 4:
            leaf, v = "kernel", v.transpose(2, 3, 1, 0)
        elif leaf == "weight" and v.ndim == 2:
            leaf, v = "kernel", v.T
        elif leaf == "weight":
            leaf = "scale"
        node = out.setdefault(root, {})
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def test_resnet_batch_stats_both_ways(tmp_path: Path) -> None:
    """Conv kernels OIHW <-> HWIO, BatchNorm running_mean/var <-> batch_stats mean/var (a linen list
    attribute inside a module of the same name, ``layer/layer_0``, is torch's ``layer.0``), SGD momentum
    buffers <-> optax trace; num_batches_tracked, which flax does not keep, keeps the target's own."""
    from transformers import FlaxResNetForImageClassification

    net, cfg = _resnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net.train()
    for i in range(2):  # moves the running statistics and fills the momentum buffers
        x = torch.from_numpy(np.random.default_rng(i).standard_normal((4, 3, 32, 32)).astype(np.float32))
        opt.zero_grad()
        net(x).logits.square().mean().backward()
        opt.step()
    net.eval()
    xckpt.save({"model": net, "optim": opt}, str(tmp_path / "torch"))

    fnet = FlaxResNetForImageClassification(cfg, _do_init=True)
    expect = _resnet_to_flax({k: v.numpy() for k, v in net.state_dict().items()})
    assert sorted(_flat(expect)) == sorted(_flat(fnet.params))  # the table names the model's own leaves
    tx = optax.sgd(0.1, momentum=0.9)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, fnet.params)
    like = {"model": {"params": zeros["params"], "batch_stats": zeros["batch_stats"]},
            "opt_state": tx.init(zeros["params"])}
    got = xckpt.load(str(tmp_path / "torch"), like=like, mapping=M.torch_to_flax())
    _assert_trees_equal(got["model"], expect, "resnet params and batch_stats")
    traces = {name: opt.state[p]["momentum_buffer"].numpy() for name, p in net.named_parameters()}
    want_trace = _resnet_to_flax(traces)
    _assert_trees_equal(_of_class(got["opt_state"], optax.TraceState)[0].trace, want_trace["params"], "trace")
    x = np.random.default_rng(9).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        t_logits = net(torch.from_numpy(x)).logits.numpy()
    f_logits = np.asarray(fnet(x, params=got["model"], train=False).logits)
    _assert_close(f_logits, t_logits, "logits")

    xckpt.save({"model": got["model"], "opt_state": got["opt_state"]}, str(tmp_path / "flax"))
    back, _ = _resnet()
    with torch.no_grad():
        for name, b in back.named_buffers():
            if name.endswith("num_batches_tracked"):
                b.fill_(7)
    back_opt = torch.optim.SGD(back.parameters(), lr=0.1, momentum=0.9)
    xckpt.load(str(tmp_path / "flax"), like={"model": back, "optim": back_opt}, mapping=M.flax_to_torch())
    for name, v in net.state_dict().items():
        got_v = back.state_dict()[name]
        if name.endswith("num_batches_tracked"):
            assert int(got_v) == 7, name  # the target's own
        else:
            np.testing.assert_array_equal(got_v.numpy(), v.numpy(), err_msg=name)
    for (name, p), q in zip(net.named_parameters(), back.parameters()):
        np.testing.assert_array_equal(back_opt.state[q]["momentum_buffer"].numpy(), traces[name], err_msg=name)


# ---------------------------------------------------------------------------------------------
# E. parameter sets that differ between torch and flax


def _differing(family: str) -> tuple[Any, Any, Any, dict[str, np.ndarray]]:
    """(config, torch class, flax class, inputs) of a small Hugging Face model of ``family``."""
    import transformers as T

    rng = np.random.default_rng(3)
    ids, dec = rng.integers(1, 60, (2, 8)), rng.integers(1, 60, (2, 5))
    if family == "marian":
        cfg = T.MarianConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=63,
                             decoder_start_token_id=63, max_position_embeddings=32)
        return cfg, T.MarianMTModel, T.FlaxMarianMTModel, {"input_ids": ids, "decoder_input_ids": dec}
    if family == "roformer":
        cfg = T.RoFormerConfig(vocab_size=64, embedding_size=32, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=4, intermediate_size=64, max_position_embeddings=32)
        return cfg, T.RoFormerForMaskedLM, T.FlaxRoFormerForMaskedLM, {"input_ids": ids}
    cfg = T.Wav2Vec2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                           num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, do_stable_layer_norm=True,
                           feat_extract_norm="layer")
    return cfg, T.Wav2Vec2ForCTC, T.FlaxWav2Vec2ForCTC, {"input_values": rng.standard_normal((2, 400)).astype(np.float32)}


@pytest.mark.parametrize("family", ["marian", "roformer", "wav2vec2"])
def test_torch_and_flax_parameter_sets_that_differ(tmp_path: Path, family: str) -> None:
    """torch -> flax drops the sinusoidal tables flax computes and renames weight normalization; flax -> torch
    keeps the target's own tables: each direction equals transformers' own converter element by element."""
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    cfg, torch_cls, flax_cls, x = _differing(family)
    torch.manual_seed(0)
    model = torch_cls(cfg).eval()
    xckpt.save({"model": model}, str(tmp_path / "torch"))
    fmodel = flax_cls(cfg, seed=1)
    got = xckpt.load(str(tmp_path / "torch"), like={"params": fmodel.params}, mapping=M.torch_to_flax())["params"]
    want = _flat(convert_pytorch_state_dict_to_flax({k: v.numpy() for k, v in model.state_dict().items()}, fmodel))
    _assert_dicts_equal(_flat(got), {k: want[k] for k in _flat(fmodel.params)}, f"{family} torch -> flax")
    with torch.no_grad():
        t_out = model(**{k: torch.from_numpy(v) for k, v in x.items()}).logits.numpy()
    _assert_close(np.asarray(fmodel(**x, params=got).logits), t_out, f"{family} logits")

    other = flax_cls(cfg, seed=5)
    xckpt.save({"params": other.params}, str(tmp_path / "flax"))
    torch.manual_seed(9)
    back = torch_cls(cfg).eval()
    xckpt.load(str(tmp_path / "flax"), like={"model": back}, mapping=M.flax_to_torch())
    torch.manual_seed(9)
    want_back = load_flax_weights_in_pytorch_model(torch_cls(cfg).eval(), jax.device_get(other.params))
    _assert_dicts_equal({k: v.numpy() for k, v in back.state_dict().items()},
                        {k: v.numpy() for k, v in want_back.state_dict().items()}, f"{family} flax -> torch")
    with torch.no_grad():
        t_out = back(**{k: torch.from_numpy(v) for k, v in x.items()}).logits.numpy()
    _assert_close(t_out, np.asarray(other(**x).logits), f"{family} logits back")


def test_an_older_checkpoint_s_position_ids_into_flax(tmp_path: Path) -> None:
    """A Hugging Face directory written before ``position_ids`` stopped being saved (BERT, RoBERTa) loads into
    the flax model: the buffer, which flax computes, is left out instead of failing the load."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel, FlaxBertModel
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=32)
    torch.manual_seed(0)
    model = BertModel(cfg).eval()
    tensors = dict(model.state_dict(), **{"embeddings.position_ids": torch.arange(32).unsqueeze(0)})
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    fmodel = FlaxBertModel(cfg, seed=1)
    got = xckpt.load(str(tmp_path / "hf"), like={"params": fmodel.params}, mapping=M.torch_to_flax())["params"]
    want = _flat(convert_pytorch_state_dict_to_flax({k: v.numpy() for k, v in model.state_dict().items()}, fmodel))
    _assert_dicts_equal(_flat(got), {k: want[k] for k in _flat(fmodel.params)}, "bert params")


def test_a_dcp_checkpoint_loads_into_sharded_jax_arrays(tmp_path: Path) -> None:
    """A directory torch DCP saved loads in place into JAX arrays with shardings of their own (a (2, 4) mesh,
    another placement per leaf), element by element, bfloat16 too: no conversion first."""
    import ml_dtypes
    from torch.distributed.checkpoint import save as dcp_save
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7
    b = (np.arange(16) - 8).astype(ml_dtypes.bfloat16)
    dcp_save({"w": torch.from_numpy(w.copy()), "b": torch.from_numpy(b.view(np.int16).copy()).view(torch.bfloat16),
              "step": 3}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    like = {"w": jax.ShapeDtypeStruct((8, 16), np.float32, sharding=NamedSharding(mesh, P("y", "x"))),
            "b": jax.ShapeDtypeStruct((16,), ml_dtypes.bfloat16, sharding=NamedSharding(mesh, P(("x", "y")))),
            "step": 0}
    out = xckpt.load(tmp_path / "dcp", like=like)
    assert out["w"].sharding == like["w"].sharding and out["b"].sharding == like["b"].sharding
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    np.testing.assert_array_equal(np.asarray(out["b"]).view(np.int16), b.view(np.int16))
    assert out["step"] == 3
    for s in out["w"].addressable_shards:  # each device holds its own block
        np.testing.assert_array_equal(np.asarray(s.data), w[s.index])
