"""Which casts a load may make, and which stored values a narrower target cannot hold (pure functions).

A load casts stored data to its target's dtype where they differ; a cast is refused when numpy (with
ml_dtypes) cannot make it or would drop an imaginary part (:func:`cast_refusal`), and, where the target
does not hold every value of the stored dtype (:func:`narrows`), every stored value is checked first
(:func:`unfit`): one beyond the target's finite range (an int64 of 2**40 into int32 would wrap, a float64
of 1e39 would become infinity in float32), a NaN or infinity where the target has none (any integer;
``float8_e4m3fn`` makes infinity a NaN, ``float4_e2m1fn`` makes it 6), a number other than 0 and 1 into a
bool. Rounding (1.5 into an integer, float64 into float32) is the cast's business, not refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from xckpt.format import dtypes

#: Elements checked at a time (converted to float32 where needed): bounded memory for any region.
CHECK_PIECE = 1 << 20


@dataclass(frozen=True)
class Holds:
    """The values a number dtype holds: the finite range, whether only integers (rounding aside), whether
    infinity and NaN, and whether only 0 and 1 (a bool)."""

    lowest: Any
    highest: Any
    integer: bool
    inf: bool
    nan: bool
    flag: bool = False


@lru_cache(maxsize=None)
def holds(name: str) -> Holds | None:
    """What the logical dtype ``name`` holds (floats, complex by their parts, ml_dtypes' bfloat16, float8,
    float4, int4, uint4, int2 and uint2 included); None for a dtype without a range of numbers."""
    dst = np.dtype(dtypes.numpy_dtype(name))
    if dst.kind == "b":
        return Holds(0, 1, True, False, False, flag=True)
    if dst.kind in "iu":
        info = np.iinfo(dst)
        return Holds(int(info.min), int(info.max), True, False, False)
    if dst.kind == "V" and name in dtypes.SUBBYTE_DTYPES and "int" in name:
        sub = ml_dtypes.iinfo(dst)
        return Holds(int(sub.min), int(sub.max), True, False, False)
    if dst.kind not in "fcV":
        return None
    try:  # ml_dtypes' finfo knows numpy's floats too, and float8_e5m2, whose kind is "f" but numpy's finfo not
        finfo = ml_dtypes.finfo(dst)
    except (ValueError, TypeError, KeyError):  # a structured or raw dtype: no range
        return None
    part = np.dtype(finfo.dtype)  # a complex dtype's parts

    def kept(x: float, test: Any) -> bool:
        return bool(test(np.array([x], np.float64).astype(part).astype(np.float64))[0])

    return Holds(float(finfo.min), float(finfo.max), False, kept(np.inf, np.isinf) and kept(-np.inf, np.isinf),
                 kept(np.nan, np.isnan))


def cast_refusal(stored: str, wanted: str) -> str | None:
    """Why a cast from logical dtype ``stored`` to ``wanted`` cannot be made (numpy with ml_dtypes cannot make
    it, or a complex array into a real target would lose its imaginary part); None when it can."""
    src, dst = np.dtype(dtypes.numpy_dtype(stored)), np.dtype(dtypes.numpy_dtype(wanted))
    if src.kind == "c" and dst.kind != "c":
        return "its imaginary part would be lost"
    try:
        np.zeros(1, src).astype(dst)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def narrows(stored: str, wanted: str) -> bool:
    """Whether a cast from ``stored`` to ``wanted`` can meet values the target cannot hold: a number target
    that does not hold every value of the stored dtype (int64 into int32, float64 into float32 or bfloat16,
    floats into integers or bools, complex128 into complex64, float32 into float8_e4m3fn, float8_e4m3 with its
    infinities into float8_e4m3fn). numpy's casting table decides between its own dtypes; ml_dtypes calls
    every cast among its types safe (int4 into float4_e2m1fn turns 7 into 6), so for those the ranges decide."""
    h = holds(wanted)
    if h is None or stored == wanted:
        return False
    if stored in dtypes.NATIVE_DTYPES and wanted in dtypes.NATIVE_DTYPES:
        return not np.can_cast(dtypes.numpy_dtype(stored), dtypes.numpy_dtype(wanted), "safe")
    g = holds(stored)
    if g is None or (h.integer and not g.integer) or (h.flag and not g.flag):
        return True
    in_range = h.lowest <= g.lowest and g.highest <= h.highest
    return not (in_range and (h.inf or not g.inf) and (h.nan or not g.nan))


def unfit(arr: np.ndarray, wanted: str) -> str | None:
    """What in ``arr`` (stored values, in their logical dtype) the logical dtype ``wanted`` cannot hold, as a
    phrase ("holds inf", "holds values from -1e+39 to 2.0, outside -3.4e+38 to 3.4e+38"); None when every
    value fits (rounding aside)."""
    h = holds(wanted)
    if h is None or arr.size == 0:
        return None
    flat = arr.reshape(-1)
    for at in range(0, flat.size, CHECK_PIECE):
        piece = flat[at:at + CHECK_PIECE]
        for part in (piece.real, piece.imag) if piece.dtype.kind == "c" else (piece,):
            why = _unfit_part(part, h)
            if why is not None:
                return why
    return None


def _unfit_part(piece: np.ndarray, h: Holds) -> str | None:
    """:func:`unfit` of one real piece."""
    if piece.dtype.kind in "iub":
        low, high = int(piece.min()), int(piece.max())
    else:
        if piece.dtype.kind != "f":  # bfloat16, float8, float4: exact in float32
            piece = piece.astype(np.float32)
        finite = np.isfinite(piece)
        if not finite.all():
            bad = piece[~finite]
            for value, present in ((np.nan, np.isnan(bad)), (np.inf, np.isposinf(bad)), (-np.inf, np.isneginf(bad))):
                if present.any() and (h.integer or not (h.nan if np.isnan(value) else h.inf)):
                    return f"holds {value}"
        if h.flag:
            other = piece[finite & (piece != 0) & (piece != 1)]
            if other.size:
                return f"holds {other[0]}"
        low = float(np.min(piece, where=finite, initial=np.inf))
        high = float(np.max(piece, where=finite, initial=-np.inf))
        if low > high:  # none finite
            return None
    if low < h.lowest or high > h.highest:
        return f"holds values from {low} to {high}, outside {h.lowest} to {h.highest}"
    return None


def scalar_refusal(value: Any, kind: type) -> str | None:
    """Why a stored number ``value`` (a 0-d array's item) cannot become a Python ``kind`` without changing: only
    0 and 1 (and False, True) become a bool; None when it can (an int from 1.5 rounds, as a cast does)."""
    if kind is bool and not isinstance(value, (bool, np.bool_)):
        if isinstance(value, complex) or not (value == 0 or value == 1):
            return f"{value!r} is neither 0 nor 1"
    return None
