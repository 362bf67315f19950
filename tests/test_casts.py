"""The cast rules of a load (xckpt.format.casts), and loads that meet them: a value a target's dtype cannot hold
(beyond its range; a NaN or infinity where it has none; a number other than 0 or 1 into a bool; either part of
a complex) is refused naming its leaf, before any target is written; every value accepted keeps its value, up to
the cast's rounding."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import xckpt
from xckpt.format import dtypes
from xckpt.format.casts import cast_refusal, holds, narrows, scalar_refusal, unfit

SETTINGS = settings(max_examples=300, deadline=None)

#: Every logical dtype holding numbers, and a few values each kind of stored array may hold.
NUMBERS = [n for n in dtypes.LOGICAL_DTYPES if holds(n) is not None]
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.25, 1.5, 2.0, 3.0, 6.0, 100.0, 448.0, 449.0, 65504.0, 70000.0, 2.0**31, 2.0**40,
           1e39, -1e39, np.inf, -np.inf, np.nan, 1e-45, 5.9e-39]


def test_what_each_kind_of_dtype_holds() -> None:
    """Infinity and NaN as ml_dtypes casts them; integer ranges; bool only 0 and 1; complex by its parts."""
    for name, inf, nan in (("float32", True, True), ("bfloat16", True, True), ("float8_e5m2", True, True),
                           ("float8_e4m3fn", False, True), ("float8_e4m3fnuz", False, True),
                           ("float8_e8m0fnu", False, True), ("float4_e2m1fn", False, False),
                           ("complex64", True, True)):
        h = holds(name)
        assert h is not None and (h.inf, h.nan, h.integer) == (inf, nan, False), name
    assert holds("complex64").highest == float(np.finfo(np.float32).max)
    assert (holds("float4_e2m1fn").lowest, holds("float4_e2m1fn").highest) == (-6.0, 6.0)
    assert holds("float8_e8m0fnu").lowest > 0  # no zero, no negatives
    b = holds("bool")
    assert b is not None and (b.lowest, b.highest, b.integer, b.flag) == (0, 1, True, True)
    assert (holds("int4").lowest, holds("int4").highest) == (-8, 7)
    assert (holds("uint8").lowest, holds("uint8").highest) == (0, 255)


def test_which_casts_narrow_and_which_are_refused() -> None:
    """A safe cast never needs a check; an unsafe one into a number dtype does; a complex into a real target is
    refused outright."""
    assert not narrows("int32", "int64") and not narrows("float32", "float64") and not narrows("bool", "int8")
    for stored, wanted in (("int64", "int32"), ("float64", "float32"), ("complex128", "complex64"),
                           ("float32", "float8_e4m3fn"), ("int64", "bool"), ("float32", "bool"),
                           ("float64", "complex64"), ("float8_e5m2", "float8_e4m3fn"), ("bool", "float8_e8m0fnu")):
        assert narrows(stored, wanted), (stored, wanted)
    assert cast_refusal("complex64", "float64") == "its imaginary part would be lost"
    assert cast_refusal("float64", "complex64") is None and cast_refusal("int64", "bool") is None


def test_unfit_names_what_does_not_fit() -> None:
    """Each kind of value a target cannot hold, in words."""
    assert unfit(np.array([1.0, np.inf]), "float8_e4m3fn") == "holds inf"
    assert unfit(np.array([np.nan]), "float4_e2m1fn") == "holds nan"
    assert unfit(np.array([-np.inf]), "int32") == "holds -inf"
    assert unfit(np.array([0.0, 0.25]), "bool") == "holds 0.25"
    assert unfit(np.array([0, 1, 3], np.int64), "bool").startswith("holds values from 0 to 3")
    assert unfit(np.array([1 + 1e39j]), "complex64").startswith("holds values from 1e+39 to 1e+39")
    assert unfit(np.array([np.inf, np.nan, 1e38 - 2e38j]), "complex64") is None  # both parts fit
    assert unfit(np.array([0.0]), "float8_e8m0fnu") is not None  # no zero
    assert unfit(np.array([np.inf, -np.inf, np.nan]), "float8_e5m2") is None
    assert unfit(np.array([np.nan]), "float8_e4m3fn") is None
    assert unfit(np.array([0, 1], np.int8), "bool") is None and unfit(np.array([0.0, 1.0, -0.0]), "bool") is None
    assert unfit(np.zeros((0, 3)), "bool") is None
    assert scalar_refusal(2, bool) == "2 is neither 0 nor 1" and scalar_refusal(1.0, bool) is None
    assert scalar_refusal(1.5, int) is None and scalar_refusal(True, bool) is None


def _kept(x: np.ndarray, y: np.ndarray, wanted: str) -> np.ndarray:
    """Whether each stored value ``x`` (as float64 or complex128) kept its value, up to rounding, as ``y``."""
    if np.iscomplexobj(x):
        return _kept(x.real, y.real, wanted) & _kept(x.imag, y.imag, wanted)
    if holds(wanted).flag:
        return y == x
    return np.where(np.isnan(x), np.isnan(y), np.where(np.isinf(x), y == x, np.isfinite(y)))


@SETTINGS
@given(stored=st.sampled_from(NUMBERS), wanted=st.sampled_from(NUMBERS),
       values=st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(-1e6, 1e6), st.integers(-2**40, 2**40)),
                       min_size=1, max_size=8))
def test_an_accepted_cast_keeps_every_value(stored: str, wanted: str, values: list) -> None:
    """Whatever ``unfit`` accepts, the cast keeps (NaN a NaN, infinity the same infinity, a finite value finite,
    into a bool exactly 0 or 1); a safe cast always keeps it."""
    src, dst = dtypes.numpy_dtype(stored), dtypes.numpy_dtype(wanted)
    if cast_refusal(stored, wanted) is not None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        arr = np.array([v for v in values if np.isfinite(v) or np.dtype(src).kind in "fcV"], dtype=np.float64)
        if np.dtype(src).kind in "iub" or stored in ("int4", "uint4", "int2", "uint2"):
            h = holds(stored)
            arr = arr[np.isfinite(arr) & (arr >= h.lowest) & (arr <= h.highest)]
        arr = arr.astype(src)
        if not narrows(stored, wanted):
            assert unfit(arr, wanted) is None
        if unfit(arr, wanted) is not None:
            return
        out = arr.astype(dst)
        wide = np.complex128 if np.dtype(dst).kind == "c" or np.dtype(src).kind == "c" else np.float64
        x, y = _widened(arr, wide), _widened(out, wide)
    assert _kept(x, y, wanted).all(), (stored, wanted, arr, out)


def _widened(a: np.ndarray, wide: type) -> np.ndarray:
    """``a`` as ``wide`` (float64 or complex128); ml_dtypes' types through float32, which holds them exactly."""
    return (a if a.dtype.kind != "V" else a.astype(np.float32)).astype(wide)


@pytest.mark.parametrize("staging", [None, 0])
def test_a_target_without_room_for_a_value_is_refused_before_anything_is_written(tmp_path, staging) -> None:
    """complex128 into complex64 (either part beyond float32), infinity into float8_e4m3fn (which makes it a NaN),
    NaN into float4_e2m1fn (which has none), a 2 or a 0.25 into a bool: each refused naming its leaf, with no
    in-place target written; what fits loads exactly."""
    tree = {"c": np.array([1 + 1e39j, 2 - 1j]), "i": np.array([1.0, np.inf]), "n": np.array([np.nan, 1.0]),
            "b": np.array([0, 1, 2], np.int64), "q": np.array([0.0, 0.25, 1.0], np.float32),
            "ok": np.array([0, 1, 1], np.int64), "z": np.array([np.nan, np.inf, 1e38 + 1j])}
    xckpt.save(tree, tmp_path / "c")
    kw = {} if staging is None else {"max_staging_bytes": staging}
    for key, target, shown in (("c", np.zeros(2, np.complex64), "1e+39"),
                               ("i", np.zeros(2, ml_dtypes.float8_e4m3fn), "holds inf"),
                               ("n", np.zeros(2, ml_dtypes.float4_e2m1fn), "holds nan"),
                               ("b", np.zeros(3, bool), "0 to 2"), ("q", np.zeros(3, bool), "holds 0.25")):
        first = np.zeros(3, np.int64)
        with pytest.raises(xckpt.KeyMismatchError) as e:
            xckpt.load(tmp_path / "c", like={"ok": first, key: target}, partial=True, **kw)
        assert (e.value.leaf, e.value.file) == (key, str(tmp_path / "c")) and shown in str(e.value), str(e.value)
        assert e.value.code == "tree.key_mismatch"
        assert (first == 0).all() and np.all(target == 0)  # nothing written, to either target
        with pytest.raises(xckpt.KeyMismatchError):
            xckpt.load(tmp_path / "c", like={key: xckpt.ReadSpec(dtype=target.dtype)}, partial=True, **kw)
    out = xckpt.load(tmp_path / "c", like={"ok": np.zeros(3, bool), "z": np.zeros(3, np.complex64),
                                           "n": np.zeros(2, ml_dtypes.float8_e4m3fn)}, partial=True, **kw)
    np.testing.assert_array_equal(out["ok"], np.array([False, True, True]))
    np.testing.assert_array_equal(out["z"], tree["z"].astype(np.complex64))
    assert np.isnan(out["n"][0].astype(np.float32)) and out["n"][1].astype(np.float32) == 1.0


def test_stored_numbers_into_numbers_they_do_not_fit_are_refused(tmp_path) -> None:
    """A stored Python float into a narrower float array, a stored 2 into a Python bool: refused naming the leaf;
    what fits loads."""
    xckpt.save({"x": 1e39, "h": 70000.0, "s": np.array(2, np.int64), "t": np.array(1, np.int64), "y": 2.5},
               tmp_path / "c")
    for key, like in (("x", np.zeros((), np.float32)), ("x", xckpt.ReadSpec(dtype=ml_dtypes.bfloat16)),
                      ("h", np.zeros((), np.float16)), ("s", False)):
        with pytest.raises(xckpt.KeyMismatchError) as e:
            xckpt.load(tmp_path / "c", like={key: like}, partial=True)
        assert e.value.leaf == key and e.value.code == "tree.key_mismatch", str(e.value)
    out = xckpt.load(tmp_path / "c", like={"t": False, "y": np.zeros((), np.float16)}, partial=True)
    assert out["t"] is True and out["y"] == np.float16(2.5) and out["y"].dtype == np.float16


def test_numpy_scalars_load_as_the_scalars_they_were(tmp_path) -> None:
    """A tree holding numpy scalars loads with ``like=`` itself: each leaf the scalar type it was, its value
    exact; a stored 0-d array of another shape than a scalar's is a mismatch."""
    tree = {"f": np.float32(1.5), "d": np.float64(-2.25), "i": np.int64(-7), "b": np.bool_(True),
            "h": ml_dtypes.bfloat16(3.0), "u": np.uint8(200)}
    xckpt.save({**tree, "v": np.arange(3)}, tmp_path / "c")
    out = xckpt.load(tmp_path / "c", like=tree, partial=True)
    for k, v in tree.items():
        assert type(out[k]) is type(v) and out[k] == v, (k, out[k])
    with pytest.raises(xckpt.KeyMismatchError) as e:
        xckpt.load(tmp_path / "c", like={"v": np.int64(0)}, partial=True)
    assert e.value.leaf == "v"


def test_float4_bytes_keep_their_value_whatever_their_high_bits() -> None:
    """ml_dtypes reads a float4_e2m1fn byte with any of bits 3 to 7 set as negative: the stored form of each of
    the 256 bytes has its high bits clear and the same value (bit for bit, -0.0 included)."""
    raw = np.arange(256, dtype=np.uint8)
    stored = dtypes.canonical(raw, "float4_e2m1fn")
    assert stored.max() < 16
    before = raw.view(ml_dtypes.float4_e2m1fn).astype(np.float32).view(np.uint32)
    after = stored.view(ml_dtypes.float4_e2m1fn).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(after, before)
    np.testing.assert_array_equal(dtypes.canonical(raw, "int4"), raw & 0x0F)  # integers: high bits ignored


def test_a_float4_array_with_high_bits_set_saves_its_values(tmp_path) -> None:
    """An array built by viewing bytes (0x11 is -0.5 to ml_dtypes) loads with the values it held."""
    raw = np.arange(256, dtype=np.uint8)
    arr = raw.view(ml_dtypes.float4_e2m1fn)
    xckpt.save({"a": arr}, tmp_path / "c")
    got = xckpt.load(tmp_path / "c")["a"]
    np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32), arr.astype(np.float32).view(np.uint32))
