"""numpy data inside the values of a stock DCP checkpoint, parsed rather than run.

DCP stores every non-tensor value of a state dict (``np.random.get_state()``, a data
loader's state, a numpy scalar) as a pickle, read back here by ``torch.load(weights_only=True)``.
A pickled ndarray, numpy scalar or dtype names numpy's own rebuild functions
(``numpy._core.multiarray._reconstruct``, ``numpy.dtype``, ``numpy._core.multiarray.scalar``;
``numpy.core`` where numpy 1.x wrote it), which torch's restricted unpickler refuses and
which are not called here either: :data:`GLOBALS` maps those names onto the small parsers
below, which check every field of the pickled state (a known dtype code and byte order,
a shape of non-negative integers whose element count matches the raw bytes, nothing but
bytes for the data) and build the array from the bytes themselves. Anything else (object
arrays, structured or string dtypes, a state numpy would not write) is ``convert.dcp_value``.

An ndarray is rebuilt in two pickle steps (``_reconstruct`` makes an empty array, ``BUILD``
gives it its state), so the first step yields a :class:`PickledArray` holder, and
:func:`xckpt_torch.dcp_planners.plain_value` swaps each holder for its array once the value is loaded,
recorded as numpy data of a DCP value (:data:`VALUE_ARRAY`), which ``XckptStorageReader`` gives back to a
DCP load as DCP stored it: as a value, numpy, not a tensor.
"""

from __future__ import annotations

import math
import reprlib
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from xckpt.engine.copy import LazySource, lazy_array
from xckpt.errors import UnsupportedError
from xckpt.format import dtypes

#: Pickled dtype codes admitted (numpy's ``dtype.str`` without the byte order): xckpt's native dtypes.
_CODES = {"b1": "bool", "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64", "u1": "uint8", "u2": "uint16",
          "u4": "uint32", "u8": "uint64", "f2": "float16", "f4": "float32", "f8": "float64", "c8": "complex64",
          "c16": "complex128"}
#: Byte orders a pickled dtype state may give ('|' for one-byte types, '=' native).
_ORDERS = {"<": "<", ">": ">", "|": "<", "=": "="}
#: Dimensions a pickled array may have (numpy's limit).
MAX_DIMS = 64


def _refuse(what: str) -> UnsupportedError:
    return UnsupportedError(f"a numpy {what} in a DCP value, which xckpt does not rebuild", code="convert.dcp_value")


def _text(value: Any, depth: int = 0) -> str:
    """A short description of pickled data for a message, bounded before it is built (a crafted state may hold a
    gigabyte of bytes, whose whole repr would be four)."""
    if isinstance(value, (bytes, bytearray, str)):
        return repr(value[:16]) + ("..." if len(value) > 16 else "")
    if isinstance(value, (tuple, list)):
        inner = "..." if depth >= 2 else ", ".join(_text(v, depth + 1) for v in value[:5])
        more = ", ..." if len(value) > 5 and depth < 2 else ""
        return ("(%s%s)" if isinstance(value, tuple) else "[%s%s]") % (inner, more)
    if isinstance(value, dict):
        inner = "..." if depth >= 2 else ", ".join(f"{_text(k, depth + 1)}: {_text(v, depth + 1)}"
                                                   for k, v in list(value.items())[:3])
        return "{%s%s}" % (inner, ", ..." if len(value) > 3 and depth < 2 else "")
    if type(value) is int and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return reprlib.repr(value)


class PickledDtype:
    """What ``numpy.dtype(code, align, copy)`` and its ``BUILD`` state describe; :attr:`dtype` once built."""

    _code: str | None = None  # class defaults: an object made by NEWOBJ, never initialised, stays unbuilt
    _order: str | None = None

    def __init__(self, code: Any = None, align: Any = False, copy: Any = True) -> None:
        if type(code) is not str or code not in _CODES or type(align) is not bool or type(copy) is not bool:
            raise _refuse(f"dtype {_text(code)} (only {', '.join(_CODES.values())})")
        self._code = code

    def __setstate__(self, state: Any) -> None:
        """Take numpy's dtype state ``(3, byte order, None, None, None, -1, -1, flags)``."""
        if type(state) is not tuple or len(state) != 8 or state[0] != 3 or type(state[1]) is not str \
                or state[1] not in _ORDERS \
                or state[2:] != (None, None, None, -1, -1, 0):
            raise _refuse(f"dtype state {_text(state)}")
        if self._code is None or self._order is not None:
            raise _refuse("dtype built other than by numpy.dtype(code), then its state once")
        self._order = _ORDERS[state[1]]

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype (native byte order where the pickle gave none)."""
        if self._code is None:
            raise _refuse("dtype made without a type code")
        return np.dtype((self._order or "=") + self._code)


_budget = threading.local()


@contextmanager
def data_budget(nbytes: int) -> Iterator[None]:
    """While it is open, the arrays rebuilt on this thread may hold ``nbytes`` of data in all (a value's stored
    bytes: each array's data lies in its pickle, so arrays holding more are made from one pickled state that many
    arrays share, each of which would copy it: ``convert.dcp_value``)."""
    _budget.left = nbytes
    try:
        yield
    finally:
        del _budget.left


def _data(dtype: Any, shape: tuple[int, ...], raw: Any, fortran: bool = False) -> np.ndarray:
    """A new array of ``dtype`` (a built :class:`PickledDtype`) and ``shape`` from the bytes ``raw``, little-endian."""
    if not isinstance(dtype, PickledDtype):
        raise _refuse(f"array whose dtype is {_text(dtype)}")
    dt = dtype.dtype
    if type(raw) is not bytes:
        raise _refuse(f"array whose data is a {type(raw).__name__}, not bytes")
    if len(raw) != math.prod(shape) * dt.itemsize:
        raise _refuse(f"array of shape {shape} and dtype {dt} given {len(raw)} bytes of data")
    left = getattr(_budget, "left", None)
    if left is not None:
        if len(raw) > left:
            raise _refuse("arrays holding more data than the value stores (one pickled array state shared by many "
                          "arrays)")
        _budget.left = left - len(raw)
    flat = np.frombuffer(raw, dtype=dt)
    return flat.reshape(shape, order="F" if fortran else "C").astype(dt.newbyteorder("<"), order="C")


class PickledArray:
    """An ndarray being rebuilt (``_reconstruct`` makes it, ``BUILD`` gives it its state), or a numpy scalar
    (``scalar`` makes it whole); :meth:`leaf` once built."""

    _array: np.ndarray | None = None
    _scalar = False

    def __setstate__(self, state: Any) -> None:
        """Take numpy's array state ``(1, shape, dtype, is_fortran, raw bytes)``."""
        if type(state) is not tuple or len(state) != 5 or state[0] != 1:
            raise _refuse(f"array state {_text(state)}")
        _, shape, dtype, fortran, raw = state
        if type(shape) is not tuple or len(shape) > MAX_DIMS or any(type(n) is not int or n < 0 for n in shape):
            raise _refuse(f"array shape {_text(shape)}")
        if type(fortran) is not bool:
            raise _refuse(f"array order flag {_text(fortran)}")
        if self._array is not None:
            raise _refuse("array given its state twice")
        self._array = _data(dtype, shape, raw, fortran)

    @property
    def array(self) -> np.ndarray:
        """The rebuilt array (0-d for a scalar; ``convert.dcp_value`` when the pickle never gave it a state)."""
        if self._array is None:
            raise _refuse("array the pickle never gave its data")
        return self._array

    def leaf(self) -> LazySource:
        """The array as a leaf to save, recorded as numpy data of a DCP value (:func:`value_array_sharding`)."""
        arr = self.array
        return lazy_array(arr.shape, dtypes.logical_name(arr.dtype), lambda r: arr[r.slices()],
                          sharding=value_array_sharding(arr[()] if self._scalar else arr))


class _NdarrayClass:
    """What the pickle's ``numpy.ndarray`` stands for: the class argument of ``_reconstruct``, nothing more."""

    def __init__(self, *args: Any) -> None:
        raise _refuse("ndarray made other than by _reconstruct")


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> PickledArray:
    """``numpy._core.multiarray._reconstruct(ndarray, (0,), b'b')``, as numpy pickles every plain ndarray."""
    if cls is not _NdarrayClass or shape != (0,) or typecode != b"b":
        raise _refuse(f"_reconstruct({_text(cls)}, {_text(shape)}, {_text(typecode)})")
    return PickledArray()


def _scalar(dtype: Any, raw: Any) -> PickledArray:
    """``numpy._core.multiarray.scalar(dtype, raw bytes)``: a numpy scalar, held as a 0-d array (as
    ``xckpt.save`` stores one)."""
    out = PickledArray()
    out._array, out._scalar = _data(dtype, (), raw), True
    return out


#: ``torch.serialization.safe_globals`` entries: numpy's names mapped onto the parsers above.
GLOBALS: list[tuple[Any, str]] = [
    *((_reconstruct, f"{m}.multiarray._reconstruct") for m in ("numpy._core", "numpy.core")),
    *((_scalar, f"{m}.multiarray.scalar") for m in ("numpy._core", "numpy.core")),
    (_NdarrayClass, "numpy.ndarray"),
    (PickledDtype, "numpy.dtype"),
    # BUILD gives state only to objects of admitted classes; these names occur in no numpy pickle
    (PickledArray, "xckpt_torch.dcp_numpy.PickledArray"),
]


# -- numpy data DCP held as a value, stored by xckpt as an array -----------------------------------

#: The manifest's ``sharding`` of an array that was numpy data inside a DCP value (DCP pickles such data,
#: so a DCP load expects it back as a value, not as a tensor); ``"numpy": "scalar"`` for a numpy scalar.
VALUE_ARRAY = {"framework": "numpy", "via": "torch.distributed.checkpoint", "dcp": "value"}


def value_array_sharding(data: np.ndarray | np.generic) -> dict[str, str]:
    """The ``sharding`` to record for numpy data found inside a DCP value (:data:`VALUE_ARRAY`)."""
    return {**VALUE_ARRAY, "numpy": "scalar"} if isinstance(data, np.generic) else dict(VALUE_ARRAY)


def is_value_array(sharding: Any) -> bool:
    """Whether an array's recorded ``sharding`` says it was numpy data inside a DCP value."""
    return isinstance(sharding, dict) and sharding.get("dcp") == "value" and sharding.get("framework") == "numpy"


def as_dcp_value(data: np.ndarray, sharding: Any) -> np.ndarray | np.generic:
    """What a DCP load gets back for a stored array that was numpy data inside a value: the array, or the
    numpy scalar it was."""
    if isinstance(sharding, dict) and sharding.get("numpy") == "scalar" and data.shape == ():
        return data[()]
    return data
