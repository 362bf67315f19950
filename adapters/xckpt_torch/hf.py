"""The torch model a Hugging Face ``config.json`` describes, built on the meta device.

It is the target a mapping renames a checkpoint for (``xckpt convert --to safetensors
--hf-config``): its parameter names, shapes and layer classes, with nothing allocated and
nothing read. Only a local file is read; nothing is downloaded.
"""

from __future__ import annotations

import os

import torch

from xckpt.errors import UnsupportedError, XckptError
from xckpt.format.jsonobj import parse_json

#: The most bytes a ``config.json`` may have (real ones have a few KiB).
MAX_CONFIG_BYTES = 16 << 20


def _architectures(path: str) -> list[str]:
    """The ``architectures`` of the configuration file ``path``, checked: a JSON object whose
    ``architectures``, when given, is a list of class names (``convert.hf_config`` otherwise)."""
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise XckptError(f"{path}: more than {MAX_CONFIG_BYTES} bytes, not a Hugging Face config.json",
                         code="convert.hf_config", file=path)
    with open(path, "rb") as f:
        obj = parse_json(f.read(), "config.json", code="convert.hf_config", file=path)
    if not isinstance(obj, dict):
        raise XckptError(f"{path}: a JSON {type(obj).__name__}, not the object of a Hugging Face configuration",
                         code="convert.hf_config", file=path)
    names = obj.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise XckptError(f"{path}: architectures is {names!r}, not a list of class names", code="convert.hf_config",
                         file=path)
    return names


def model_from_config(path: str) -> torch.nn.Module:
    """The model of the Hugging Face configuration file ``path`` (a ``config.json``) on the meta device: the
    class its ``architectures`` names, else the causal LM of its model type.

    A file transformers cannot read, or whose values build no model, raises ``convert.hf_config`` naming it.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if not os.path.isfile(path):
        raise XckptError(f"{path}: no Hugging Face config.json there", code="convert.hf_config", file=path)
    names = _architectures(path)
    try:
        cfg = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise XckptError(f"{path}: not a Hugging Face configuration transformers reads ({exc})",
                         code="convert.hf_config", file=path) from None
    cls = getattr(transformers, names[0], None) if names else None
    if names and (cls is None or not isinstance(cls, type) or not issubclass(cls, torch.nn.Module)):
        raise UnsupportedError(f"{path}: transformers {transformers.__version__} has no torch model class "
                               f"{names[0]!r}", code="convert.hf_config", file=path)
    if cls is None:
        try:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
        except KeyError:
            raise UnsupportedError(f"{path}: names no architecture, and {cfg.model_type!r} has no causal LM "
                                   f"class", code="convert.hf_config", file=path) from None
    with torch.device("meta"):
        try:
            return cls(cfg)
        except Exception as exc:  # noqa: BLE001 - whatever this configuration's values make the model raise
            raise XckptError(f"{path}: its values build no {cls.__name__} ({type(exc).__name__}: "
                             f"{str(exc)[:300]})", code="convert.hf_config", file=path) from None
