"""The torch model a Hugging Face ``config.json`` describes, built on the meta device.

It is the target a mapping renames a checkpoint for (``xckpt convert --to safetensors
--hf-config``): its parameter names, shapes and layer classes, with nothing allocated and
nothing read. Only a local file is read; nothing is downloaded.
"""

from __future__ import annotations

import os

import torch

from xckpt.errors import UnsupportedError, XckptError


def model_from_config(path: str) -> torch.nn.Module:
    """The model of the Hugging Face configuration file ``path`` (a ``config.json``) on the meta device: the
    class its ``architectures`` names, else the causal LM of its model type."""
    import transformers

    if not os.path.isfile(path):
        raise XckptError(f"{path}: no Hugging Face config.json there", code="convert.hf_config", file=path)
    try:
        cfg = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise XckptError(f"{path}: not a Hugging Face configuration transformers reads ({exc})",
                         code="convert.hf_config", file=path) from None
    names = list(getattr(cfg, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    if names and (cls is None or not isinstance(cls, type) or not issubclass(cls, torch.nn.Module)):
        raise UnsupportedError(f"{path}: transformers {transformers.__version__} has no torch model class "
                               f"{names[0]!r}", code="convert.hf_config", file=path)
    with torch.device("meta"):
        if cls is not None:
            return cls(cfg)
        try:
            return transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError as exc:
            raise UnsupportedError(f"{path}: names no architecture, and {cfg.model_type!r} has no causal LM "
                                   f"class ({exc})", code="convert.hf_config", file=path) from None
