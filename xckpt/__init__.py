"""xckpt: a framework-neutral distributed checkpoint format (Zarr v3 + a JSON manifest).

The numpy-level API is here; the PyTorch and JAX adapters plug in through
:mod:`xckpt.registry` and are reachable as ``xckpt.torch`` and ``xckpt.jax``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from xckpt.engine.collective import Coordinator, LocalCoordinator  # noqa: E402
from xckpt.errors import XckptError, XckptWarning  # noqa: E402
from xckpt.host import ReadSpec  # noqa: E402
from xckpt.load import load  # noqa: E402
from xckpt.format.manifest import Manifest  # noqa: E402
from xckpt.engine.regions import Region  # noqa: E402
from xckpt.save import save  # noqa: E402
from xckpt.save_async import SaveHandle, save_async  # noqa: E402
from xckpt.format.tree import Default, Value  # noqa: E402
from xckpt.inspect import inspect  # noqa: E402
from xckpt import mapping  # noqa: E402,F401 - xckpt.mapping: rename keys and transform layouts at load time
from xckpt.validate import validate  # noqa: E402

__all__ = ["save", "save_async", "SaveHandle", "load", "inspect", "validate", "Value", "Default", "ReadSpec", "Region", "Manifest",
           "Coordinator", "LocalCoordinator", "XckptError", "XckptWarning", "__version__"]

_ADAPTERS = {"torch": "xckpt_torch", "jax": "xckpt_jax"}


def __getattr__(name: str) -> Any:
    """``xckpt.torch`` and ``xckpt.jax``: the adapters, imported on first use."""
    if name in _ADAPTERS:
        module = importlib.import_module(_ADAPTERS[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'xckpt' has no attribute {name!r}")
