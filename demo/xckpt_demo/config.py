"""The demo's fixed settings: model size, optimizer, steps, meshes. Both frameworks read the same ones."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Config:
    """Hyper-parameters shared by the PyTorch and the flax model, the optimizers and the jobs."""

    vocab: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    d_mlp: int = 128
    batch: int = 8
    ln_eps: float = 1e-5
    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    data_seed: int = 1234
    init_seed: int = 0
    #: steps trained before the checkpoint, then steps each continuation trains
    pretrain_steps: int = 30
    continue_steps: int = 10
    #: float32 agreement required between the two continuations, step by step
    rtol: float = 1e-5

    def to_json(self) -> dict[str, Any]:
        """The settings as a JSON-able dict (handed to the spawned jobs)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Config:
        """Settings from :meth:`to_json` output."""
        return cls(**data)


#: The PyTorch job that trains first: 4 ranks, FSDP2 over "dp", tensor parallel over "tp".
TORCH_TRAIN_MESH = {"dp": 2, "tp": 2}
#: The PyTorch job that continues (both directions): 2 ranks, tensor parallel only.
TORCH_RESUME_MESH = {"dp": 1, "tp": 2}
#: The JAX job: 8 host devices, batch over "data", Megatron-style parameter sharding over "model".
JAX_MESH = {"data": 4, "model": 2}
