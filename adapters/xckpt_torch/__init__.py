"""PyTorch adapter of xckpt: tensors, DTensors, modules, optimizers, RNG, DCP interop.

Importing it registers with :mod:`xckpt.registry`:

* sources and targets for plain tensors and DTensors (any mesh, any placements);
* containers for ``nn.Module`` and optimizers (through
  ``torch.distributed.checkpoint.state_dict``), for anything with
  ``state_dict()``/``load_state_dict()``, and for :func:`rng_state`;
* the coordinator of a running ``torch.distributed`` job;
* the ``dcp`` <-> ``xckpt`` converters (through the ``xckpt.converters`` entry point).

The DCP storage classes and converters are imported when first used (``xckpt_torch.XckptStorageWriter``
and the rest): importing ``torch.distributed.checkpoint`` costs a tenth of a second or more, which a
save of tensors and DTensors need not pay.

Usage::

    import xckpt
    state = {"model": model, "optim": optimizer, "step": step, "rng": xckpt.torch.rng_state()}
    xckpt.save(state, "ckpt/step_1000")          # collective: every rank calls it
    xckpt.load("ckpt/step_1000", like=state)     # in place, on whatever mesh state lives on now
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from xckpt import registry

from . import dtensor, rng, state
from .coordinator import TorchCoordinator, default_coordinator
from .rng import RNGState, rng_state
from .state import bind
from .staging import to_host
from .tensors import from_numpy, logical_dtype, torch_dtype

registry.register_source(dtensor.is_plain_tensor, dtensor.tensor_source)
registry.register_source(dtensor.is_dtensor, dtensor.dtensor_source)
registry.register_source(lambda x: isinstance(x, rng.RankRow), rng.rank_row_source)
registry.register_target(dtensor.is_plain_tensor, dtensor.tensor_target)
registry.register_target(dtensor.is_dtensor, dtensor.dtensor_target)
registry.register_target(lambda x: isinstance(x, rng.RankRow), rng.rank_row_target)

registry.register_container(state.is_stateful, state.stateful_save_view, state.stateful_load_view)
registry.register_container(lambda x: isinstance(x, torch.optim.Optimizer), state.optimizer_save_view,
                            state.optimizer_load_view)
registry.register_container(lambda x: isinstance(x, nn.Module), state.module_save_view, state.module_load_view)
registry.register_notes(lambda x: isinstance(x, nn.Module), state.module_notes)
registry.register_container(lambda x: isinstance(x, RNGState), RNGState.save_view, RNGState.load_view)

registry.register_coordinator(default_coordinator)

#: Public names imported on first use, and their modules.
_LAZY = {"XckptStorageWriter": ".dcp", "XckptStorageReader": ".dcp", "XckptSavePlanner": ".dcp",
         "XckptLoadPlanner": ".dcp", "dcp_to_xckpt": ".dcp_convert", "xckpt_to_dcp": ".dcp_convert"}


def __getattr__(name: str) -> Any:
    """The DCP storage classes and converters, imported when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value

__all__ = ["rng_state", "RNGState", "bind", "TorchCoordinator", "XckptStorageWriter", "XckptStorageReader",
           "XckptSavePlanner", "XckptLoadPlanner", "dcp_to_xckpt", "xckpt_to_dcp", "to_host", "from_numpy",
           "logical_dtype", "torch_dtype"]
