"""``xckpt diff``: what differs between two checkpoints, leaf by leaf.

:func:`diff_manifests` compares two manifests (pure: which leaves were added, removed, or
changed in kind, shape, dtype, value type or sharding); :func:`compare_values` compares the
stored data of two opened checkpoints, streaming each array in pieces of a bounded size
(:func:`pieces`), so that the memory used does not grow with the arrays. :func:`diff` does
both on two paths and returns one JSON-able report.

The two checkpoints may be in different formats: anything :func:`~xckpt.sources.detect.open_checkpoint`
opens (xckpt, Orbax, Hugging Face safetensors, PyTorch DCP directories).
"""

from __future__ import annotations

import math
import warnings
from contextlib import ExitStack
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from xckpt.format import dtypes
from xckpt.format.manifest import ArrayEntry, Entry, Manifest
from xckpt.format.regions import Region
from xckpt.format.tree import key_str

__all__ = ["PIECE_BYTES", "SHARDING_LAYOUT_KEYS", "diff", "diff_manifests", "compare_values", "pieces",
           "compare_pieces", "values_equal", "sharding_layout"]

#: Largest piece of one array, per side, that a value comparison holds at a time (bytes).
PIECE_BYTES = 16 << 20
#: Elements compared at a time inside a piece (bounds the float64 temporaries).
_BLOCK = 1 << 20
#: The members of a manifest's ``sharding`` entry that describe how an array is split; others
#: (framework versions, which library wrote it) are not a change of sharding.
SHARDING_LAYOUT_KEYS = ("mesh_shape", "axis_names", "dim_axes")
#: Members describing how the stored array is split into objects; compared only where both sides have them.
_STORAGE_KEYS = ("shard_shape", "num_shards")

#: ``progress(done, total)``: bytes compared so far and in all (both sides counted).
Progress = Callable[[int, int], None]


# -- manifests ------------------------------------------------------------------------------------


def _describe(e: Entry) -> dict[str, Any]:
    """One leaf as the report shows it."""
    if isinstance(e, ArrayEntry):
        return {"key": key_str(e.key), "kind": "array", "shape": list(e.shape), "dtype": e.dtype,
                "bytes": e.nbytes, "sharding": e.sharding}
    return {"key": key_str(e.key), "kind": "value", "type": e.type}


def sharding_layout(sharding: dict[str, Any] | None) -> dict[str, Any]:
    """The part of a ``sharding`` entry that says how the array is split over a mesh."""
    return {k: sharding[k] for k in SHARDING_LAYOUT_KEYS if k in (sharding or {})}  # type: ignore[index]


def _sharding_changed(a: dict[str, Any] | None, b: dict[str, Any] | None, same_shape: bool) -> bool:
    """Whether the layout differs; the stored shard shape and count too, for arrays of one shape where
    both record them (they follow the shape otherwise)."""
    if sharding_layout(a) != sharding_layout(b):
        return True
    a, b = a or {}, b or {}
    return same_shape and any(k in a and k in b and a[k] != b[k] for k in _STORAGE_KEYS)


def _by_key(m: Manifest) -> dict[str, Entry]:
    return {key_str(e.key): e for e in m.leaves}


def diff_manifests(a: Manifest, b: Manifest) -> dict[str, Any]:
    """Compare the leaves of two manifests, matched by key (``model/layers/0/w``).

    Returns ``{"added": [...], "removed": [...], "changed": [...], "unchanged": n}``: ``added``
    are leaves only in ``b``, ``removed`` only in ``a`` (each described by key, kind, and shape,
    dtype, bytes and sharding or value type); each ``changed`` item is ``{"key", "a", "b",
    "changes"}`` where ``changes`` names what differs among ``kind``, ``shape``, ``dtype``,
    ``type`` (of a value leaf) and ``sharding`` (its layout: mesh shape, axis names, dimension
    axes; for arrays of one shape, also the shard shape and count where both record them).
    """
    ka, kb = _by_key(a), _by_key(b)
    added = [_describe(e) for k, e in kb.items() if k not in ka]
    removed = [_describe(e) for k, e in ka.items() if k not in kb]
    changed = []
    unchanged = 0
    for k, ea in ka.items():
        eb = kb.get(k)
        if eb is None:
            continue
        what: list[str] = []
        if ea.kind != eb.kind:
            what.append("kind")
        elif isinstance(ea, ArrayEntry) and isinstance(eb, ArrayEntry):
            if ea.shape != eb.shape:
                what.append("shape")
            if ea.dtype != eb.dtype:
                what.append("dtype")
            if _sharding_changed(ea.sharding, eb.sharding, ea.shape == eb.shape):
                what.append("sharding")
        elif getattr(ea, "type", None) != getattr(eb, "type", None):
            what.append("type")
        if what:
            changed.append({"key": k, "changes": what, "a": _describe(ea), "b": _describe(eb)})
        else:
            unchanged += 1
    return {"added": added, "removed": removed, "changed": changed, "unchanged": unchanged}


# -- values ---------------------------------------------------------------------------------------


def pieces(shape: Sequence[int], itemsize: int, piece_bytes: int = PIECE_BYTES,
           align: Sequence[int] | None = None) -> Iterator[Region]:
    """Regions tiling an array of ``shape`` in row-major order, each at most ``piece_bytes`` (at least one element).

    The array is cut along the first dimension whose trailing block fits; ``align`` (a chunk
    shape) rounds the cut down to whole chunks along that dimension where that leaves at least one.
    """
    shape = tuple(int(s) for s in shape)
    if 0 in shape:
        return
    if not shape:
        yield Region((), ())
        return
    limit = max(1, piece_bytes // max(1, itemsize))
    d = 0  # the dimension cut in runs; every dimension before it is taken one index at a time
    while d < len(shape) - 1 and math.prod(shape[d + 1:]) > limit:
        d += 1
    inner = math.prod(shape[d + 1:])
    run = max(1, min(shape[d], limit // max(1, inner)))
    if align is not None and len(align) == len(shape) and 0 < align[d] <= run:
        run -= run % align[d]
    for outer in np.ndindex(*shape[:d]):
        for start in range(0, shape[d], run):
            size = min(run, shape[d] - start)
            yield Region(tuple(int(i) for i in outer) + (start,) + (0,) * (len(shape) - d - 1),
                         (1,) * d + (size,) + shape[d + 1:])


def _common(a: np.dtype, b: np.dtype) -> tuple[np.dtype, bool]:
    """The dtype two arrays are compared in, and whether it is exact integer arithmetic (a signed
    array and a uint64 one never come here: :func:`_accumulate_signed_unsigned` compares them)."""
    if all(t.kind in "biu" for t in (a, b)):
        if a == b:
            return (np.dtype(np.uint8) if a.kind == "b" else a), True
        return np.dtype(np.uint64 if np.dtype(np.uint64) in (a, b) else np.int64), True
    if a.kind == "c" or b.kind == "c":
        return np.dtype(np.complex128), False
    return np.dtype(np.float64), False


class _Stats:
    """Running totals of one array comparison."""

    def __init__(self) -> None:
        self.elements = 0
        self.differing = 0
        self.max_abs: float | int | None = None
        self.max_rel: float | None = None

    def add_max(self, abs_max: float | int | None, rel_max: float | None) -> None:
        if abs_max is not None and (self.max_abs is None or abs_max > self.max_abs):
            self.max_abs = abs_max
        if rel_max is not None and (self.max_rel is None or rel_max > self.max_rel):
            self.max_rel = rel_max


def _nanmax(x: np.ndarray) -> float | None:
    x = x[~np.isnan(x)]
    return float(x.max()) if x.size else None


def compare_pieces(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Compare two arrays of the same shape element by element: ``{"elements", "differing",
    "max_abs_diff", "max_rel_diff", "equal"}`` (the maxima over the differing elements, None
    when none; an infinite one as the string ``"inf"``).

    Two NaNs in the same place are equal, and so are ``0.0`` and ``-0.0``. The relative
    difference is ``|a - b| / max(|a|, |b|)`` (symmetric, at most 2). Integers (and booleans)
    are compared exactly, with an exact absolute difference; pairs involving a NaN count as
    differing but give no difference.
    """
    st = _Stats()
    _accumulate(a, b, st)
    return _stats_json(st)


def _accumulate(a: np.ndarray, b: np.ndarray, st: _Stats) -> None:
    """Add the comparison of ``a`` and ``b`` (see :func:`compare_pieces`) to the running totals ``st``."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} and {b.shape}")
    if {a.dtype.kind, b.dtype.kind} == {"i", "u"} and np.dtype(np.uint64) in (a.dtype, b.dtype):
        _accumulate_signed_unsigned(a, b, st)  # no common numpy type holds both exactly
        return
    if {a.dtype.kind, b.dtype.kind} in ({"i", "f"}, {"u", "f"}) and max(a.dtype.itemsize, b.dtype.itemsize) == 8 \
            and (a if a.dtype.kind != "f" else b).dtype.itemsize == 8:
        _accumulate_int64_float(a, b, st)  # float64 does not hold every 64-bit integer
        return
    work, exact = _common(a.dtype, b.dtype)
    fa, fb = a.reshape(-1), b.reshape(-1)
    st.elements += fa.size
    with np.errstate(all="ignore"):
        for s in range(0, fa.size, _BLOCK):
            x = fa[s:s + _BLOCK].astype(work, copy=False)
            y = fb[s:s + _BLOCK].astype(work, copy=False)
            ne = x != y if exact else ~_nan_equal(x, y)
            n = int(np.count_nonzero(ne))
            if n == 0:
                continue
            st.differing += n
            x, y = x[ne], y[ne]
            if exact:
                hi, lo = np.maximum(x, y), np.minimum(x, y)
                # exact even for 64-bit integers: the true difference is below 2**64 and wraps into uint64
                d = hi.astype(np.uint64) - lo.astype(np.uint64)
                den = np.maximum(np.abs(x.astype(np.float64)), np.abs(y.astype(np.float64)))
                st.add_max(int(d.max()), _nanmax(d.astype(np.float64) / den))
            else:
                d = np.abs(x - y).astype(np.float64)
                den = np.maximum(np.abs(x), np.abs(y)).astype(np.float64)
                # each side scaled first: x - y overflows for huge values of opposite signs, the ratio never does
                st.add_max(_nanmax(d), _nanmax(np.abs(x / den - y / den).astype(np.float64)))


def _nan_equal(x: Any, y: Any) -> Any:
    """Element by element, whether ``x`` equals ``y`` counting NaN equal to NaN, part by part for complex
    numbers (``nan+1j`` is not ``nan+2j``, which numpy's ``equal_nan`` calls equal)."""
    if np.iscomplexobj(x) or np.iscomplexobj(y):
        return _nan_equal(np.real(x), np.real(y)) & _nan_equal(np.imag(x), np.imag(y))
    with np.errstate(invalid="ignore"):
        return (x == y) | (np.isnan(x) & np.isnan(y))


def _accumulate_signed_unsigned(a: np.ndarray, b: np.ndarray, st: _Stats) -> None:
    """:func:`_accumulate` of a signed integer array and a uint64 one, exactly: a negative element differs from
    every unsigned one; the others compare as uint64. Differences are exact Python integers."""
    swap = a.dtype.kind == "u"
    fs, fu = (b, a) if swap else (a, b)
    fs, fu = fs.reshape(-1), fu.reshape(-1)
    st.elements += fs.size
    for s in range(0, fs.size, _BLOCK):
        x, y = fs[s:s + _BLOCK].astype(np.int64), fu[s:s + _BLOCK]
        neg = x < 0
        ne = neg | (x.astype(np.uint64) != y)
        n = int(np.count_nonzero(ne))
        if n == 0:
            continue
        st.differing += n
        pos = ne & ~neg  # both in the uint64 range: the difference is exact in uint64
        if pos.any():
            xp, yp = x[pos].astype(np.uint64), y[pos]
            d = np.maximum(xp, yp) - np.minimum(xp, yp)
            st.add_max(int(d.max()), _nanmax(d.astype(np.float64) / np.maximum(xp, yp).astype(np.float64)))
        if neg.any():  # the difference can pass 2**64: Python integers
            xn, yn = x[neg].astype(object), y[neg].astype(object)
            d = yn - xn
            st.add_max(int(d.max()), float((d / np.maximum(-xn, yn)).max()))


def _accumulate_int64_float(a: np.ndarray, b: np.ndarray, st: _Stats) -> None:
    """:func:`_accumulate` of a 64-bit integer array and a float one, exactly: an element is equal only when the
    float is that very integer (``2**53 + 1`` is not ``2.0**53``, which it is in float64). The absolute difference
    is exact (as a float) where the float is an integer in the integer type's range."""
    ints, floats = (a, b) if b.dtype.kind == "f" else (b, a)
    fi, ff = ints.reshape(-1), floats.reshape(-1)
    lo, hi = (0.0, 2.0**64) if fi.dtype.kind == "u" else (-(2.0**63), 2.0**63)
    st.elements += fi.size
    with np.errstate(all="ignore"):
        for s in range(0, fi.size, _BLOCK):
            x, y = fi[s:s + _BLOCK], ff[s:s + _BLOCK].astype(np.float64)
            whole = np.isfinite(y) & (y == np.floor(y)) & (y >= lo) & (y < hi)  # y converts to x's type exactly
            yi = np.where(whole, y, 0).astype(fi.dtype)
            ne = ~whole | (yi != x)
            n = int(np.count_nonzero(ne))
            if n == 0:
                continue
            st.differing += n
            x, y, yi, whole = x[ne], y[ne], yi[ne], whole[ne]
            xf = x.astype(np.float64)
            d = np.abs(xf - y)
            # exact even for 64-bit integers: the true difference is below 2**64 and wraps into uint64
            d[whole] = (np.maximum(x[whole], yi[whole]).astype(np.uint64)
                        - np.minimum(x[whole], yi[whole]).astype(np.uint64)).astype(np.float64)
            big = np.isfinite(y) & (y == np.floor(y)) & ~whole  # a whole float beyond the integer type: Python ints
            if big.any():
                d[big] = [float(abs(int(p) - int(q))) for p, q in zip(x[big].tolist(), y[big].tolist())]
            st.add_max(_nanmax(d), _nanmax(d / np.maximum(np.abs(xf), np.abs(y))))


def _num(x: float | int | None) -> float | int | str | None:
    """A number for JSON: infinities as the strings ``"inf"``."""
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _stats_json(st: _Stats) -> dict[str, Any]:
    return {"elements": st.elements, "differing": st.differing, "max_abs_diff": _num(st.max_abs),
            "max_rel_diff": _num(st.max_rel), "equal": st.differing == 0}


def values_equal(x: Any, y: Any) -> bool:
    """Whether two value leaves hold the same value: containers item by item (a list equals a tuple
    with the same items), numbers by value (``1 == 1.0``, NaN equals NaN), numpy arrays and
    scalars by shape and elements."""
    if isinstance(x, dict) or isinstance(y, dict):
        return isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys() and \
            all(values_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) or isinstance(y, (list, tuple)):
        return isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y) and \
            all(values_equal(p, q) for p, q in zip(x, y))
    if isinstance(x, (np.ndarray, np.generic)) or isinstance(y, (np.ndarray, np.generic)):
        try:
            ax, ay = np.asarray(x), np.asarray(y)
            if ax.shape != ay.shape:
                return False
            if ax.dtype.kind in "fc" or ay.dtype.kind in "fc":
                return bool(np.all(_nan_equal(ax, ay)))
            return bool(np.array_equal(ax, ay))
        except (TypeError, ValueError):
            return False
    if isinstance(x, (float, complex)) and isinstance(y, (float, complex)):
        return bool(_nan_equal(x, y))
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - an odd value's __eq__; unequal then
        return False


def _short(v: Any, limit: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def compare_values(a: Any, b: Any, keys: Sequence[str] | None = None, *, piece_bytes: int = PIECE_BYTES,
                   progress: Progress | None = None) -> dict[str, Any]:
    """Compare the data of the leaves two opened checkpoints (:class:`~xckpt.sources.base.Source`) both hold.

    ``keys``: the leaves to compare (default: every key both have). Arrays of equal shapes are
    read in :func:`pieces` of at most ``piece_bytes`` per side (through the sources' ``read``),
    so memory stays bounded whatever their size; their dtypes may differ (both are widened).
    Value leaves are compared with :func:`values_equal`. Returns ``{"leaves": [...],
    "skipped": [...], "compared": n, "differing": n, "bytes_read": n}``: one item per leaf
    compared (arrays: :func:`compare_pieces`'s counts; values: ``equal`` and both values,
    abbreviated), and one ``{"key", "reason"}`` per leaf not compared (kind or shape changed).
    """
    from xckpt.engine.copy import piece_bytes_for, read_region

    ka, kb = _by_key(a.manifest), _by_key(b.manifest)
    if keys is None:
        keys = [k for k in ka if k in kb]
    index_a = {key_str(e.key): i for i, e in enumerate(a.manifest.leaves)}
    index_b = {key_str(e.key): i for i, e in enumerate(b.manifest.leaves)}
    leaves: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    arrays: list[tuple[str, ArrayEntry, ArrayEntry]] = []
    values_a = values_b = None
    for k in keys:
        ea, eb = ka[k], kb[k]
        if ea.kind != eb.kind:
            skipped.append({"key": k, "reason": f"{ea.kind} in A, {eb.kind} in B"})
        elif isinstance(ea, ArrayEntry) and isinstance(eb, ArrayEntry):
            if ea.shape != eb.shape:
                skipped.append({"key": k, "reason": f"shape {list(ea.shape)} in A, {list(eb.shape)} in B"})
            else:
                arrays.append((k, ea, eb))
        else:
            if values_a is None:
                values_a, values_b = a.values(), b.values()
            va, vb = values_a[index_a[k]], values_b[index_b[k]]  # type: ignore[index]
            leaves.append({"key": k, "kind": "value", "equal": values_equal(va, vb), "a": _short(va), "b": _short(vb)})
    total = sum(ea.nbytes + eb.nbytes for _, ea, eb in arrays)
    done = 0
    if progress is not None:
        progress(0, total)
    for k, ea, eb in arrays:
        st = _Stats()
        size = max(dtypes.itemsize(ea.dtype), dtypes.itemsize(eb.dtype))
        for region in pieces(ea.shape, size, piece_bytes_for(ea, size, piece_bytes), ea.inner_chunk_shape):
            _accumulate(read_region(a, ea, region), read_region(b, eb, region), st)
            done += region.numel * (dtypes.itemsize(ea.dtype) + dtypes.itemsize(eb.dtype))
            if progress is not None:
                progress(done, total)
        item = {"key": k, "kind": "array", "dtype": ea.dtype if ea.dtype == eb.dtype else [ea.dtype, eb.dtype],
                "shape": list(ea.shape)}
        item.update(_stats_json(st))
        leaves.append(item)
    order = {k: i for i, k in enumerate(keys)}
    leaves.sort(key=lambda item: order[item["key"]])
    return {"leaves": leaves, "skipped": skipped, "compared": len(leaves),
            "differing": sum(not item["equal"] for item in leaves), "bytes_read": done}


# -- opening --------------------------------------------------------------------------------------


def _open(path: Any, stack: ExitStack) -> tuple[Any, str]:
    """Open ``path`` for reading (:func:`xckpt.sources.detect.open_checkpoint`); returns the source and the
    format to report."""
    from xckpt.sources.detect import open_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = open_checkpoint(path)
    stack.callback(src.close)
    return src, src.format


def _side(src: Any, path: Any, fmt: str) -> dict[str, Any]:
    m = src.manifest
    return {"path": str(path), "format": fmt, "leaves": len(m.leaves), "arrays": len(m.arrays()),
            "bytes": sum(e.nbytes for e in m.arrays())}


def diff(a: Any, b: Any, *, values: bool = False, progress: Progress | None = None,
         piece_bytes: int = PIECE_BYTES) -> dict[str, Any]:
    """Compare the checkpoints at ``a`` and ``b`` (any formats ``xckpt`` reads).

    Returns a JSON-able report: ``a`` and ``b`` (path, format, leaf and array counts, bytes),
    :func:`diff_manifests`'s ``added``, ``removed``, ``changed`` and ``unchanged``, ``values``
    (with ``values=True``, :func:`compare_values` over the leaves both hold; else None), and
    ``identical``: no leaf added, removed or changed, and (with ``values``) none differing.
    ``progress(done, total)`` is called as array bytes are compared (``values`` only).
    """
    with ExitStack() as stack:
        src_a, fmt_a = _open(a, stack)
        src_b, fmt_b = _open(b, stack)
        out: dict[str, Any] = {"a": _side(src_a, a, fmt_a), "b": _side(src_b, b, fmt_b)}
        out.update(diff_manifests(src_a.manifest, src_b.manifest))
        out["values"] = None
        if values:
            out["values"] = compare_values(src_a, src_b, piece_bytes=piece_bytes, progress=progress)
    out["identical"] = not (out["added"] or out["removed"] or out["changed"]) and \
        (out["values"] is None or out["values"]["differing"] == 0)
    return out
