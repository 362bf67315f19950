"""The same small GPT in flax (linen) + optax, and its parameter sharding on a ("data", "model") mesh.

Module names follow the PyTorch model through the usual flax conventions
(``blocks.0.attn.q`` -> ``blocks_0/attn/q``; weight -> kernel (in, out), scale,
embedding); the argument-free :func:`xckpt.mapping.torch_to_flax` pairs them up
against this tree. LayerNorm uses the exact two-pass variance and torch's epsilon,
GELU the tanh approximation, as the PyTorch model does.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import Config

#: Initialisers as in the PyTorch model (only the JAX-first direction uses them).
_KERNEL = nn.initializers.normal(0.02)
_EMBED = nn.initializers.normal(0.1)


def _dense(features: int, name: str) -> nn.Dense:
    return nn.Dense(features, kernel_init=_KERNEL, name=name)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v, o projections."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Attention of every position to itself and the positions before it."""
        cfg = self.cfg
        b, t, d = x.shape
        hd = d // cfg.n_heads

        def heads(y: jax.Array) -> jax.Array:
            return y.reshape(b, t, cfg.n_heads, hd).transpose(0, 2, 1, 3)

        q = heads(_dense(d, "q")(x))
        k = heads(_dense(d, "k")(x))
        v = heads(_dense(d, "v")(x))
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
        future = jnp.triu(jnp.ones((t, t), dtype=bool), 1)
        att = jax.nn.softmax(jnp.where(future, -jnp.inf, att), axis=-1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return _dense(d, "o")(y)


class MLP(nn.Module):
    """Dense, tanh-approximated GELU, dense."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """The block's feed-forward part."""
        h = jax.nn.gelu(_dense(self.cfg.d_mlp, "fc")(x), approximate=True)
        return _dense(self.cfg.d_model, "proj")(h)


def _norm(cfg: Config, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=cfg.ln_eps, use_fast_variance=False, name=name)


class Block(nn.Module):
    """Pre-norm transformer block."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """One block."""
        x = x + Attention(self.cfg, name="attn")(_norm(self.cfg, "ln1")(x))
        return x + MLP(self.cfg, name="mlp")(_norm(self.cfg, "ln2")(x))


class GPT(nn.Module):
    """The demo's language model: ids (batch, seq) -> logits (batch, seq, vocab)."""

    cfg: Config

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        """Logits of the next token at every position."""
        cfg = self.cfg
        x = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=_EMBED, name="tok_emb")(ids)
        x = x + nn.Embed(cfg.seq_len, cfg.d_model, embedding_init=_EMBED, name="pos_emb")(jnp.arange(ids.shape[1]))
        for i in range(cfg.n_layers):
            x = Block(cfg, name=f"blocks_{i}")(x)
        return _dense(cfg.vocab, "head")(_norm(cfg, "ln_f")(x))


def loss_fn(params: Any, model: GPT, ids: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy."""
    logits = model.apply({"params": params}, ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """``optax.adamw``: the same update as torch's AdamW (decoupled decay on every parameter)."""
    return optax.adamw(cfg.lr, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)


def param_spec(path: tuple[str, ...], ndim: int) -> P:
    """Megatron-style placement over "model": column-parallel outputs, row-parallel inputs, vocab rows."""
    module, leaf = path[-2], path[-1]
    if module in ("q", "k", "v", "fc", "head"):
        return P(None, "model") if leaf == "kernel" else P("model")
    if module in ("o", "proj"):
        return P("model", None) if leaf == "kernel" else P()
    if module == "tok_emb":
        return P("model", None)
    return P(*([None] * ndim))


def param_shardings(abstract: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every parameter of ``abstract`` (a tree of arrays or ShapeDtypeStructs)."""
    def one(path: Any, leaf: Any) -> NamedSharding:
        names = tuple(getattr(k, "key", str(k)) for k in path)
        return NamedSharding(mesh, param_spec(names, len(leaf.shape)))
    return jax.tree_util.tree_map_with_path(one, abstract)


def abstract_state(model: GPT, tx: optax.GradientTransformation, mesh: Mesh, cfg: Config) -> tuple[Any, Any]:
    """``(params, opt_state)`` as ShapeDtypeStructs with their shardings: the ``like`` of a load."""
    ids = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids)["params"])
    shard = param_shardings(shapes, mesh)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shard)
    opt_shapes = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, P())
    adam = opt_shapes[0]
    mu = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), adam.mu, shard)
    nu = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), adam.nu, shard)
    count = jax.ShapeDtypeStruct(adam.count.shape, adam.count.dtype, sharding=replicated)
    opt = (adam._replace(count=count, mu=mu, nu=nu),) + tuple(opt_shapes[1:])
    return params, opt
