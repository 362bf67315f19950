"""Loading: match a target tree to the manifest, read only the regions asked for, build results.

Nothing is returned until every read has succeeded: a load never yields
half-filled state.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from xckpt.format import dtypes
from xckpt import registry
from xckpt.errors import XckptWarning, KeyMismatchError, ResourceError, ShapeError, XckptError
from xckpt.format.manifest import ArrayEntry, Entry, ValueEntry
from xckpt.sources.native import Checkpoint, open_checkpoint, translate
from xckpt.host import full_target
from xckpt.registry import ArrayTarget
from xckpt.engine.regions import Region
from xckpt.format.tree import Default, Key, is_namedtuple, key_str, unflatten


@dataclass
class _Request:
    key: Key
    like: Any
    optional: bool = False


#: Marks an empty container in a target: a stored None at its key counts as matched
#: (Orbax records optax's ``EmptyState()`` and other empty nodes as None leaves).
_EMPTY = object()


def _plan_like(like: Any, key: Key, requests: list[_Request], optional: bool = False
               ) -> Callable[[dict[Key, Any]], Any]:
    """Collect the leaves of a target tree; return a function that rebuilds it from results."""
    if isinstance(like, Default):
        return _plan_like(like.value, key, requests, True)
    if like is None:
        requests.append(_Request(key, None))
        return lambda res: None
    if not isinstance(like, (dict, list, tuple)):
        view = registry.load_view(like)
        if view is not None:
            plain, rebuild = view
            inner = _plan_like(plain, key, requests, optional)
            return lambda res: rebuild(inner(res))
    if isinstance(like, (dict, list, tuple)) and not like:
        requests.append(_Request(key, _EMPTY))
    if isinstance(like, dict):
        parts = {k: _plan_like(v, key + (k,), requests, optional) for k, v in like.items()}
        return lambda res: _rebuild_dict(like, parts, res)
    if is_namedtuple(like):
        fields = type(like)._fields
        subs = [_plan_like(v, key + (f,), requests, optional) for f, v in zip(fields, like)]
        return lambda res: type(like)(*[s(res) for s in subs])
    if isinstance(like, (list, tuple)):
        subs = [_plan_like(v, key + (i,), requests, optional) for i, v in enumerate(like)]
        return lambda res: type(like)(s(res) for s in subs)
    requests.append(_Request(key, like, optional))
    return lambda res: res.get(key, like)


def _rebuild_dict(like: dict, parts: dict[Any, Callable[[dict[Key, Any]], Any]], res: dict[Key, Any]) -> dict:
    out = {k: f(res) for k, f in parts.items()}
    try:
        return type(like)(out)
    except TypeError:
        return out


def load(path: Any, like: Any = None, *, strict: bool = True, max_bytes: int | None = None,
         mapping: Any = None) -> Any:
    """Load a checkpoint (xckpt, or one written by Orbax).

    Without ``like``: the whole tree, arrays as numpy. With ``like``: a tree whose
    leaves say what to produce (numpy arrays, :class:`~xckpt.ReadSpec`, framework
    arrays and shardings through the adapters, Python values; ``None`` skips a leaf).
    A dict at the root selects which top-level entries to load; below that, keys must
    match exactly, or with ``strict=False`` differences are warned about and the
    target's own leaves are kept. ``mapping`` (see :mod:`xckpt.mapping`) renames keys and
    transforms layouts lazily between the stored arrays and the target.
    """
    registry.autoload()
    ckpt = open_checkpoint(path)
    if mapping is not None:
        ckpt = mapping.apply(ckpt)
    m = ckpt.manifest
    if like is None:
        unused_all = getattr(ckpt, "unused_sources", lambda tops: [])(None)  # a mapping's unused stored leaves
        if unused_all:
            warnings.warn(f"checkpoint {ckpt.loc}: no mapping rule uses {unused_all[:20]}", XckptWarning,
                          stacklevel=2)
        results = _read(ckpt, [(i, full_target(e.shape)) for i, e in enumerate(m.leaves)
                                if isinstance(e, ArrayEntry)], max_bytes)
        vals = ckpt.values()
        return unflatten(m.tree, [results[i] if i in results else vals[i] for i in range(len(m.leaves))])
    requests: list[_Request] = []
    build = _plan_like(like, (), requests)
    by_key = m.by_key()
    index = {e.key: i for i, e in enumerate(m.leaves)}
    missing, mismatched, jobs = [], [], []
    value_reqs: list[tuple[Key, int, Any]] = []
    for req in requests:
        if req.like is None or req.like is _EMPTY:
            continue
        entry = by_key.get(req.key)
        if entry is None:
            if not req.optional:
                missing.append(key_str(req.key))
            continue
        i = index[req.key]
        make = registry.target_for(req.like)
        if isinstance(entry, ArrayEntry):
            if make is None:
                if isinstance(req.like, (bool, int, float, complex)) and entry.shape == ():
                    jobs.append((i, ArrayTarget((), None, [Region.full(())],
                                                lambda p, t=type(req.like): t(p[0].item()))))
                    continue
                mismatched.append(f"{key_str(req.key)}: stored array {list(entry.shape)} {entry.dtype}, "
                                  f"target is {type(req.like).__name__}")
                continue
            target = make(req.like, entry)
            if tuple(target.shape) != tuple(entry.shape):
                mismatched.append(f"{key_str(req.key)}: stored {list(entry.shape)}{_origin(ckpt, req.key)}, "
                                  f"target {list(target.shape)}")
                continue
            jobs.append((i, target))
        else:
            value_reqs.append((req.key, i, make(req.like, _value_entry_as_array(entry)) if make else None))
    unexpected = _unexpected(like, requests, m.leaves)
    unused_of = getattr(ckpt, "unused_sources", None)  # set by a mapping: stored leaves no rule uses
    unused = unused_of(set(like) if isinstance(like, dict) else None) if unused_of is not None else []
    unexpected += [f"{k} (stored; no mapping rule uses it)" for k in unused]
    if missing or unexpected or mismatched:
        message = (f"checkpoint {ckpt.loc} and the load target differ: "
                   f"missing {missing[:20]}, unexpected {unexpected[:20]}, mismatched {mismatched[:20]}")
        if strict:
            raise KeyMismatchError(message, missing=missing, unexpected=unexpected, mismatched=mismatched,
                                   file=str(ckpt.loc))
        warnings.warn(message, XckptWarning, stacklevel=2)
    results_by_leaf = _read(ckpt, jobs, max_bytes)
    vals = ckpt.values() if value_reqs else {}
    results: dict[Key, Any] = {m.leaves[i].key: r for i, r in results_by_leaf.items()}
    for key, i, target in value_reqs:
        v = vals[i]
        results[key] = target.build([np.asarray(v, dtype=dtypes.numpy_dtype(target.dtype))]) \
            if target is not None and target.dtype else v
    return build(results)


def _origin(ckpt: Any, key: Key) -> str:
    """Where a mapped leaf comes from, for messages (empty without a mapping)."""
    origin = getattr(ckpt, "origin", None)
    text = origin(key) if origin is not None else ""
    return f" ({text})" if text else ""


def _value_entry_as_array(e: ValueEntry) -> ArrayEntry:
    return ArrayEntry(e.key, "", (), "float64", "float64", (), (), "none", None)


def _unexpected(like: Any, requests: list[_Request], leaves: list[Entry]) -> list[str]:
    asked_set = {r.key for r in requests if r.like is not _EMPTY}
    empty = {r.key for r in requests if r.like is _EMPTY}
    skipped = [r.key for r in requests if r.like is None]
    tops = set(like) if isinstance(like, dict) else None
    out = []
    for e in leaves:
        if e.key in asked_set or any(e.key[:len(s)] == s for s in skipped):
            continue
        if e.key in empty and isinstance(e, ValueEntry) and e.type == "none":
            continue
        if tops is not None and (not e.key or e.key[0] not in tops):
            continue
        out.append(key_str(e.key))
    return out


def _memory_limit() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


def _read(ckpt: Checkpoint, jobs: list[tuple[int, ArrayTarget]], max_bytes: int | None) -> dict[int, Any]:
    """Read every region of every job concurrently, then build each result."""
    m = ckpt.manifest
    limit = _memory_limit() if max_bytes is None else max_bytes
    total = 0
    for i, t in jobs:
        e = m.leaves[i]
        assert isinstance(e, ArrayEntry)
        for r in t.regions:
            if not r.within(e.shape):
                raise ShapeError(f"requested region {r.offsets}+{r.sizes} lies outside shape {list(e.shape)}",
                                 leaf=key_str(e.key))
            total += r.numel * max(dtypes.itemsize(e.dtype), dtypes.itemsize(t.dtype or e.dtype))
    if total > limit:
        raise ResourceError(f"load would read {total} bytes into memory, more than the limit {limit}",
                            file=str(ckpt.loc))
    opened: dict[int, Any] = {}
    refuse_links = getattr(ckpt, "refuse_links", None)  # native local checkpoints: no symbolic links
    for i, t in jobs:
        if refuse_links is not None:
            refuse_links(m.leaves[i], t.regions)
        if i not in opened:
            opened[i] = ckpt.open_array(m.leaves[i])  # type: ignore[arg-type]
    futures: list[tuple[int, ArrayTarget, list[Any]]] = []
    for i, t in jobs:
        e = m.leaves[i]
        try:
            store = opened[i].result()
            futures.append((i, t, [store[r.slices()].read() if not r.is_empty() else None for r in t.regions]))
        except Exception as exc:  # noqa: BLE001 - translated to a specific xckpt error
            raise translate(exc, e, _array_file(ckpt, e)) from exc  # type: ignore[arg-type]
    out: dict[int, Any] = {}
    for i, t, futs in futures:
        e = m.leaves[i]
        assert isinstance(e, ArrayEntry)
        parts = []
        try:
            for r, f in zip(t.regions, futs):
                raw = np.empty(r.sizes, dtype=dtypes.numpy_dtype(e.storage_dtype)) if f is None else f.result()
                parts.append(_convert(np.asarray(raw), e, t.dtype))
        except XckptError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise translate(exc, e, _array_file(ckpt, e)) from exc
        out[i] = parts
    return {i: t.build(out[i]) for i, t in jobs}


def _array_file(ckpt: Checkpoint, e: ArrayEntry) -> str:
    return str(ckpt.loc.child(e.path)) if e.path else str(ckpt.loc)


def _convert(raw: np.ndarray, e: ArrayEntry, dtype: str | None) -> np.ndarray:
    arr = raw.view(dtypes.numpy_dtype(e.dtype)) if dtypes.is_raw(e.dtype) else raw
    if dtype is not None and dtype != e.dtype:
        arr = arr.astype(dtypes.numpy_dtype(dtype))
    return arr
