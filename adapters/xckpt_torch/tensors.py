"""torch dtypes <-> xckpt logical dtypes, and moving tensor data to and from numpy.

CPU tensors are handed over zero-copy (``.numpy()`` of a detached contiguous
tensor); dtypes numpy lacks (bfloat16, the float8 family) travel as their raw
bits and are re-viewed as the ``ml_dtypes`` type. CUDA tensors go through
:mod:`xckpt_torch.staging` (pinned host buffers, non-blocking copies).
"""

from __future__ import annotations

import numpy as np
import torch

from xckpt.format import dtypes as xdtypes
from xckpt.errors import UnsupportedError

_BY_NAME: dict[str, torch.dtype] = {
    "bool": torch.bool, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "complex64": torch.complex64, "complex128": torch.complex128, "bfloat16": torch.bfloat16,
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
              "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name) and _name in xdtypes.LOGICAL_DTYPES:
        _BY_NAME[_name] = getattr(torch, _name)
_BY_TORCH: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}
#: dtypes numpy cannot hold natively: moved as raw bits of this torch dtype.
_RAW_VIEW: dict[str, torch.dtype] = {"bfloat16": torch.int16}
_RAW_VIEW.update({n: torch.uint8 for n in _BY_NAME if n.startswith("float8")})


def logical_dtype(dtype: torch.dtype) -> str:
    """The xckpt logical dtype name of a torch dtype."""
    name = _BY_TORCH.get(dtype)
    if name is None:
        raise UnsupportedError(f"torch dtype {dtype} has no xckpt dtype; supported: {sorted(_BY_NAME)}",
                               code="dtype.unsupported")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an xckpt logical dtype name."""
    dt = _BY_NAME.get(name)
    if dt is None:
        raise UnsupportedError(f"xckpt dtype {name!r} has no torch dtype in torch {torch.__version__}",
                               code="dtype.unsupported")
    return dt


def cpu_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with a CPU tensor (copied only when not contiguous)."""
    t = t.detach().resolve_conj().resolve_neg()
    return cpu_view(t if t.is_contiguous() else t.contiguous())


def cpu_view(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a CPU tensor's memory, strides kept (nothing is copied)."""
    t = t.detach()
    name = logical_dtype(t.dtype)
    raw = _RAW_VIEW.get(name)
    if raw is None:
        return t.numpy()
    return t.view(raw).numpy().view(xdtypes.numpy_dtype(name))


def from_numpy(arr: np.ndarray, name: str | None = None) -> torch.Tensor:
    """A CPU tensor sharing memory with ``arr`` (of logical dtype ``name``, default: arr's)."""
    arr = np.asarray(arr)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    name = name or xdtypes.logical_name(arr.dtype)
    if not arr.flags.writeable:
        arr = arr.copy()
    raw = _RAW_VIEW.get(name)
    if raw is None:
        return torch.from_numpy(arr)
    np_raw = {torch.int16: np.int16, torch.uint8: np.uint8}[raw]
    return torch.from_numpy(arr.view(np_raw)).view(torch_dtype(name))


def copy_into(dst: torch.Tensor, arr: np.ndarray) -> None:
    """Copy host data into ``dst`` (any device, any dtype: cast by ``copy_``), without autograd."""
    src = from_numpy(arr)
    if tuple(src.shape) != tuple(dst.shape):
        raise UnsupportedError(f"cannot copy data of shape {tuple(src.shape)} into a tensor of shape "
                               f"{tuple(dst.shape)}", code="shape.mismatch")
    with torch.no_grad():
        dst.detach().copy_(src, non_blocking=False)
