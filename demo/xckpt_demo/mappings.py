"""The two mappings the demo loads through: PyTorch checkpoint -> flax/optax, and back.

Both are the ready-made presets; the only thing to say is that ``tok_emb`` and
``pos_emb`` are embeddings (a 2-D torch weight is otherwise taken for a Linear).
Everything else pairs up by name: ``blocks.0.attn.q.weight`` (out, in) <->
``blocks_0/attn/q/kernel`` (in, out), LayerNorm weight <-> scale, and the AdamW
state (``exp_avg``/``exp_avg_sq``/``step``) <-> optax ``ScaleByAdamState``
(``mu``/``nu``/``count``).
"""

from __future__ import annotations

from xckpt import mapping as M

#: torch module -> (flax module, kind) where the name alone does not tell.
MODULES = {"tok_emb": ("tok_emb", "embedding"), "pos_emb": ("pos_emb", "embedding")}


def torch_to_flax() -> M.Mapping:
    """Load a PyTorch checkpoint (``model``, ``optim``, ``step``) as ``params``, ``opt_state``, ``step``."""
    return M.torch_to_flax(MODULES, optimizer="adamw")


def flax_to_torch() -> M.Mapping:
    """Load a flax/optax checkpoint (``params``, ``opt_state``, ``step``) as ``model``, ``optim``, ``step``."""
    return M.flax_to_torch(MODULES, optimizer="adamw")
