"""Deterministic training batches, identical in every framework and on every process.

The tokens follow a fixed random Markov chain (each token has a few likely
successors), so a small model learns something in a few steps. Batch ``step`` is
a pure function of ``(data_seed, step)``: a resumed job, in either framework,
sees exactly the batches the uninterrupted job would have seen.
"""

from __future__ import annotations

import numpy as np

from .config import Config


def transition_table(cfg: Config) -> np.ndarray:
    """The chain's ``(vocab, vocab)`` row-stochastic transition matrix (peaked on 4 successors per token)."""
    rng = np.random.default_rng([cfg.data_seed, 0])
    logits = rng.standard_normal((cfg.vocab, cfg.vocab)) * 0.5
    for t in range(cfg.vocab):
        logits[t, rng.choice(cfg.vocab, 4, replace=False)] += 4.0
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


def batch(cfg: Config, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets of global batch ``step``: two int32 arrays of shape (batch, seq_len)."""
    table = np.cumsum(transition_table(cfg), axis=1)
    rng = np.random.default_rng([cfg.data_seed, 1, step])
    tokens = np.empty((cfg.batch, cfg.seq_len + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, cfg.vocab, cfg.batch)
    u = rng.random((cfg.batch, cfg.seq_len))
    for t in range(cfg.seq_len):
        rows = table[tokens[:, t]]
        tokens[:, t + 1] = np.minimum((rows < u[:, t:t + 1]).sum(axis=1), cfg.vocab - 1)
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)
