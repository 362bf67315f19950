"""The small GPT of the demo in PyTorch, and how it is laid out on a ("dp", "tp") device mesh.

Token and position embeddings, ``n_layers`` pre-norm blocks (causal multi-head
attention with separate q, k, v, o projections; an MLP with tanh-approximated
GELU), a final LayerNorm and an untied output head. It computes exactly what
:mod:`xckpt_demo.model_flax` computes, in float32.

Parallel layout (:func:`parallelize`): tensor parallel over "tp" (q, k, v and
the MLP's first layer column-wise, o and the MLP's second layer row-wise, the
token embedding split by vocabulary rows, the head column-wise with replicated
logits), then FSDP2 over "dp" when it has more than one rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config


class Attention(nn.Module):
    """Causal multi-head self-attention; works on the local heads when q, k, v are column-sharded."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention of every position to itself and the positions before it."""
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)  # -1: the heads this rank holds

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o(y)


class MLP(nn.Module):
    """Linear, tanh-approximated GELU, linear."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.proj = nn.Linear(cfg.d_mlp, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's feed-forward part."""
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The demo's language model: ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        for name, p in self.named_parameters():  # GPT-2-like scale, so a few steps visibly learn
            if name.endswith("weight") and p.ndim == 2:
                nn.init.normal_(p, std=0.02 if "emb" not in name else 0.1)
            elif name.endswith("bias") and p.ndim == 1 and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of the next token at every position."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on every parameter (as ``optax.adamw`` without a mask)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=False)


def tp_plan(cfg: Config) -> dict[str, Any]:
    """The tensor-parallel plan: module FQN -> Colwise/RowwiseParallel style."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan: dict[str, Any] = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
                            "head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(cfg.n_layers):
        for name in ("q", "k", "v"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
    return plan


def parallelize(model: GPT, mesh: Any, cfg: Config) -> GPT:
    """Tensor parallel over the mesh's "tp" dimension, then FSDP2 over "dp" if it has more than one rank."""
    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(model, mesh["tp"], tp_plan(cfg))
    if mesh["dp"].size() > 1:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model
