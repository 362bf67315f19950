"""xckpt: a framework-neutral distributed checkpoint format (Zarr v3 + a JSON manifest).

The public API lives in the top-level modules (:mod:`xckpt.save`, :mod:`xckpt.load`,
:mod:`xckpt.validate`, :mod:`xckpt.inspect`, :mod:`xckpt.convert`, :mod:`xckpt.gc`); the layers below are
:mod:`xckpt.format` (the on-disk format), :mod:`xckpt.engine` (how bytes move),
:mod:`xckpt.sources` (stored checkpoints opened for reading) and :mod:`xckpt.interop`.
The PyTorch and JAX adapters plug in through :mod:`xckpt.registry` and are reachable as
``xckpt.torch`` and ``xckpt.jax``.
"""

from __future__ import annotations

import importlib
from typing import Any

from xckpt import convert, mapping  # noqa: F401 - xckpt.convert.convert, xckpt.mapping
from xckpt import registry
from xckpt._version import __version__
from xckpt.engine.collective import Coordinator, LocalCoordinator
from xckpt.errors import CollectiveError, CollectiveLoadError, KeyMismatchError, XckptError, XckptWarning
from xckpt.format.manifest import Manifest
from xckpt.format.regions import Region
from xckpt.format.tree import Default, Value
from xckpt.gc import gc
from xckpt.host import ReadSpec
from xckpt.inspect import inspect
from xckpt.load import load
from xckpt.manager import CheckpointManager, StepInfo, list_steps
from xckpt.save import SaveHandle, release_buffers, save, save_async
from xckpt.validate import validate

__all__ = ["save", "save_async", "SaveHandle", "release_buffers", "load", "inspect", "validate", "gc", "Value",
           "Default", "ReadSpec", "Region", "Manifest", "Coordinator", "LocalCoordinator", "XckptError",
           "CollectiveError", "CollectiveLoadError", "KeyMismatchError", "XckptWarning", "CheckpointManager", "StepInfo", "list_steps",
           "__version__"]


def __getattr__(name: str) -> Any:
    """``xckpt.torch`` and ``xckpt.jax``: the adapters, imported on first use."""
    module_name = registry.adapters().get(name)
    if module_name is not None:
        module = importlib.import_module(module_name)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'xckpt' has no attribute {name!r}")


# The adapters of the frameworks this process imported already load with xckpt, not inside its first save or
# load: a training script imports its framework first, and its first checkpoint then pays no imports.
registry.autoload()
