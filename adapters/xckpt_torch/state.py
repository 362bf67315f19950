"""Modules, optimizers and other stateful objects as plain xckpt containers.

* ``nn.Module``: its state dict from ``torch.distributed.checkpoint.state_dict``
  (``get_model_state_dict``: FSDP2 and tensor-parallel parameters stay DTensors);
  loading copies into that state dict in place, then ``set_model_state_dict``.
* ``torch.optim.Optimizer``: ``get_optimizer_state_dict(model, optimizer)``, whose
  state is keyed by parameter name, not by id, so it loads into a job with another
  world size or sharding. Its ``param_groups`` are loaded where the checkpoint has them
  and kept otherwise (state mapped from optax has none). The optimizer's model is the one bound with :func:`bind`,
  else a module met in the same tree, else the live module owning its parameters.
* Anything else with ``state_dict()`` and ``load_state_dict()`` (LR schedulers,
  data-loader state): its state dict, restored with ``load_state_dict``.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import torch
from torch import nn

from xckpt.errors import TreeError, UnsupportedError, XckptError
from xckpt.format.tree import Default

_bound: "weakref.WeakKeyDictionary[torch.optim.Optimizer, nn.Module]" = weakref.WeakKeyDictionary()
_seen: list["weakref.ref[nn.Module]"] = []


def bind(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Say which model an optimizer's parameters belong to (names its state by parameter FQN)."""
    _bound[optimizer] = model


def _remember(model: nn.Module) -> None:
    alive = [r for r in _seen if r() is not None and r() is not model]
    alive.append(weakref.ref(model))
    _seen[:] = alive[-32:]


def _owns(model: nn.Module, params: set[int]) -> bool:
    return params <= {id(p) for p in model.parameters()}


def model_of(optimizer: torch.optim.Optimizer) -> nn.Module:
    """The model whose parameters ``optimizer`` updates."""
    if optimizer in _bound:
        return _bound[optimizer]
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for ref in reversed(_seen):
        m = ref()
        if m is not None and _owns(m, params):
            return m
    owners = [o for o in gc.get_objects() if issubclass(type(o), nn.Module) and _owns(o, params)]
    if owners:
        return max(owners, key=lambda m: (sum(1 for _ in m.parameters()), sum(1 for _ in m.modules())))
    raise TreeError("cannot find the model of this optimizer: no live nn.Module holds all its parameters; "
                    "call xckpt.torch.bind(optimizer, model)", code="torch.optimizer_model")


def _guard(what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; turn a torch error into an XckptError so a save fails on every rank alike."""
    try:
        return fn()
    except XckptError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised as a specific xckpt error
        raise TreeError(f"cannot get the state of {what}: {type(exc).__name__}: {exc}",
                        code="torch.state_dict") from exc


def _state_dict() -> Any:
    """``torch.distributed.checkpoint.state_dict``, imported where a module or optimizer is met (importing
    it costs a tenth of a second or more, which a save of plain tensors need not pay)."""
    import torch.distributed.checkpoint.state_dict as sd

    return sd


def module_save_view(model: nn.Module) -> dict[str, Any]:
    """A module's (possibly sharded) state dict, keyed by parameter FQN."""
    _remember(model)
    return _guard(type(model).__name__, lambda: _state_dict().get_model_state_dict(model))


def module_load_view(model: nn.Module) -> tuple[dict[str, Any], Callable[[Any], nn.Module]]:
    """Load in place into the module's state dict, then hand it to ``set_model_state_dict``."""
    _remember(model)
    like = _guard(type(model).__name__, lambda: _state_dict().get_model_state_dict(model))
    # (a module on the meta device describes a target well: an export's mapping resolves against one)
    meta = next((name for name, t in like.items() if isinstance(t, torch.Tensor) and t.is_meta), None)

    def rebuild(loaded: dict[str, Any]) -> nn.Module:
        _state_dict().set_model_state_dict(model, loaded)
        return model

    def refuse() -> None:  # torch would copy into it as a no-op: the load would succeed and load nothing
        raise UnsupportedError(f"the {type(model).__name__}'s {meta} (and maybe more) is on the meta device, "
                               "which holds no data to load into; materialize the module first "
                               "(module.to_empty(device=...)), or load its state dict and assign it",
                               code="tensor.meta")

    if meta is not None:
        rebuild.before_reading = refuse  # type: ignore[attr-defined]  # (registry.register_container)

    return like, rebuild


def _layer_kind(module: nn.Module) -> str | None:
    """How a layer lays out its weight, for the torch <-> flax presets (None: not a standard layer)."""
    name = type(module).__name__
    if isinstance(module, nn.Linear):
        return "linear"
    if name == "Conv1D" and type(module).__module__.startswith("transformers"):
        return "linear_in_out"  # Hugging Face's GPT-2 style layer: weight (in, out)
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.modules.conv._ConvNd) and not isinstance(module, nn.modules.conv._ConvTransposeNd):
        return "conv"
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)) or \
            name.endswith(("LayerNorm", "RMSNorm", "GroupNorm")):
        return "norm"
    return None


def module_notes(model: nn.Module) -> dict[str, Any]:
    """What a save records and a mapping sees about a module: each layer's class and kind (by module name)
    and the parameters tied to another one (by parameter name)."""
    classes, kinds = {}, {}
    for fqn, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None:
            continue
        classes[fqn] = f"{type(module).__module__}.{type(module).__qualname__}"
        kind = _layer_kind(module)
        if kind is not None:
            kinds[fqn] = kind
    first: dict[int, str] = {}
    tied = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[fqn] = first[id(p)]
        else:
            first[id(p)] = fqn
    return {"torch": "module", "classes": classes, "kinds": kinds, "tied": tied}


def optimizer_save_view(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state dict keyed by parameter FQN (``get_optimizer_state_dict``)."""
    model = model_of(optimizer)
    return _guard(type(optimizer).__name__, lambda: _state_dict().get_optimizer_state_dict(model, optimizer))


def optimizer_load_view(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """Load into the optimizer's (initialised) state, then ``set_optimizer_state_dict``."""
    model = model_of(optimizer)
    like = _guard(type(optimizer).__name__, lambda: _state_dict().get_optimizer_state_dict(model, optimizer))
    if "param_groups" in like:  # state from optax carries no param_groups: keep the optimizer's own
        like = dict(like, param_groups=Default(like["param_groups"]))

    def rebuild(loaded: dict[str, Any]) -> torch.optim.Optimizer:
        _state_dict().set_optimizer_state_dict(model, optimizer, loaded)
        return optimizer

    return like, rebuild


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()`` (and is no tensor or class)."""
    if isinstance(obj, (type, torch.Tensor, nn.Module, torch.optim.Optimizer)):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def stateful_save_view(obj: Any) -> Any:
    """The object's ``state_dict()``."""
    return _guard(type(obj).__name__, obj.state_dict)


def stateful_load_view(obj: Any) -> tuple[Any, Callable[[Any], Any]]:
    """Its ``state_dict()`` as the target; the loaded one goes to ``load_state_dict``."""
    like = _guard(type(obj).__name__, obj.state_dict)

    def rebuild(loaded: Any) -> Any:
        obj.load_state_dict(loaded)
        return obj

    return like, rebuild
