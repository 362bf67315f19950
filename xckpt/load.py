"""Loading: match a target tree to the manifest, read only the regions asked for, build results.

Nothing is returned until every read has succeeded: a load never yields half-filled
state (see :func:`load` for targets loaded in place).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from xckpt import registry
from xckpt.engine.gcpause import paused_gc
from xckpt.engine.read import ReadRequest, empty, placeholder
from xckpt.errors import KeyMismatchError, ResourceError, ShapeError, XckptError, XckptWarning
from xckpt.format import dtypes
from xckpt.format.manifest import ArrayEntry, Entry, ValueEntry
from xckpt.format.regions import Region
from xckpt.format.tree import Default, Key, is_namedtuple, key_str, unflatten
from xckpt.host import full_target
from xckpt.mapping.target import Target, TargetLeaf, shape_of
from xckpt.registry import ArrayTarget
from xckpt.save import wait_pending_for
from xckpt.sources.base import Source
from xckpt.sources.detect import open_checkpoint

#: How often a load starts again when another save replaced the checkpoint while it was read.
REPLACED_RETRIES = 3
#: In-place targets up to this many bytes are left untouched by a failed load (see :func:`load`).
MAX_STAGING_BYTES = 256 << 20
#: A load that would allocate more than this first checks every object it will read (present, its
#: index and place tag), so a small checkpoint declaring huge arrays cannot make it allocate them.
CHECK_AHEAD_BYTES = 1 << 30


@dataclass
class _Request:
    key: Key
    like: Any
    optional: bool = False


#: Marks an empty container in a target: a stored None at its key counts as matched
#: (Orbax records optax's ``EmptyState()`` and other empty nodes as None leaves).
_EMPTY = object()


def _plan_like(like: Any, key: Key, requests: list[_Request], optional: bool = False,
               notes: dict[Key, dict[str, Any]] | None = None) -> Callable[[dict[Key, Any]], Any]:
    """Collect the leaves of a target tree; return a function that rebuilds it from results.

    ``notes`` collects what the adapters note about the custom containers met, by key."""
    if isinstance(like, Default):
        return _plan_like(like.value, key, requests, True, notes)
    if like is None:
        requests.append(_Request(key, None))
        return lambda res: None
    if not isinstance(like, (dict, list, tuple)):
        view = registry.load_view(like)
        if view is not None:
            plain, rebuild = view
            said = registry.notes_for(like) if notes is not None else None
            if said:
                notes[key] = said  # type: ignore[index]
            inner = _plan_like(plain, key, requests, optional, notes)
            return lambda res: _restored(like, key, rebuild, inner(res))
    if isinstance(like, (dict, list, tuple)) and not like:
        requests.append(_Request(key, _EMPTY))
    if isinstance(like, dict):
        parts = {k: _plan_like(v, key + (k,), requests, optional, notes) for k, v in like.items()}
        return lambda res: _rebuild_dict(like, parts, res)
    if is_namedtuple(like):
        fields = type(like)._fields
        subs = [_plan_like(v, key + (f,), requests, optional, notes) for f, v in zip(fields, like)]
        return lambda res: type(like)(*[s(res) for s in subs])
    if isinstance(like, (list, tuple)):
        subs = [_plan_like(v, key + (i,), requests, optional, notes) for i, v in enumerate(like)]
        return lambda res: type(like)(s(res) for s in subs)
    requests.append(_Request(key, like, optional))
    return lambda res: res.get(key, like)


def describe_target(like: Any) -> Target:
    """What a load target looks like to a mapping: its leaves' keys and shapes, its empty nodes, and the
    adapters' notes on its containers (nothing is read or changed)."""
    registry.autoload()
    requests: list[_Request] = []
    notes: dict[Key, dict[str, Any]] = {}
    _plan_like(like, (), requests, notes=notes)
    return _target(requests, notes)


def _target(requests: list[_Request], notes: dict[Key, dict[str, Any]]) -> Target:
    leaves = [TargetLeaf(r.key, None if r.like is _EMPTY else shape_of(r.like), r.like is _EMPTY, r.optional)
              for r in requests if r.like is not None]
    return Target(leaves, notes)


def _restored(like: Any, key: Key, rebuild: Callable[[Any], Any], plain: Any) -> Any:
    """``rebuild(plain)``: a target object restoring its own state (``load_state_dict``); what it raises names
    the leaf (``load.restore``: the arrays read before it are already in their in-place targets)."""
    try:
        return rebuild(plain)
    except XckptError as exc:
        raise exc.at(leaf=key_str(key)) from exc
    except Exception as exc:  # noqa: BLE001 - the object's own code
        raise XckptError(f"{type(like).__name__} could not restore its state: {type(exc).__name__}: {exc}",
                         code="load.restore", leaf=key_str(key)) from exc


def _rebuild_dict(like: dict, parts: dict[Any, Callable[[dict[Key, Any]], Any]], res: dict[Key, Any]) -> dict:
    out = {k: f(res) for k, f in parts.items()}
    try:
        return type(like)(out)
    except TypeError:
        return out


def load(path: Any, like: Any = None, *, strict: bool = True, partial: bool = False, max_bytes: int | None = None,
         mapping: Any = None, max_staging_bytes: int = MAX_STAGING_BYTES) -> Any:
    """Load a checkpoint (xckpt, or one written by Orbax).

    Without ``like``: the whole tree, arrays as numpy. With ``like``: a tree whose
    leaves say what to produce (numpy arrays, :class:`~xckpt.ReadSpec`, framework
    arrays and shardings through the adapters, Python values; ``None`` skips a leaf).
    A dict at the root selects which top-level entries to load; below that, keys must
    match exactly, or with ``strict=False`` differences are warned about and the
    target's own leaves are kept. ``partial=True`` makes the target one part of the
    checkpoint (a pipeline stage loading its own layers): stored leaves it does not name are
    not an error, while every leaf it names must be stored. ``mapping`` (see
    :mod:`xckpt.mapping`) renames keys and transforms layouts lazily between the stored arrays
    and the target.

    Arrays are read straight into their destination: new arrays, or the memory of targets
    loaded in place (tensors, DTensors). A failed load returns nothing; in-place targets are
    left untouched when they total at most ``max_staging_bytes`` (read into staging memory
    first, copied in once every read succeeded). Larger in-place loads check every stored
    object's index before writing anything and then read in place, so that only a corrupt
    inner chunk can stop them half way (the error names it). ``max_bytes`` bounds the bytes
    a load may bring into memory.

    A load reads one checkpoint: on a file system, every file is opened through the directory
    it opened first, so a save that replaces the checkpoint meanwhile cannot mix two of them;
    when the replacement removed files the load still needed, it starts again on the new
    checkpoint (up to :data:`REPLACED_RETRIES` times, then ``load.replaced``). A pending
    :func:`~xckpt.save_async` of this process to the same path is waited for first.
    """
    registry.autoload()
    wait_pending_for(path)
    requests: list[_Request] = []
    notes: dict[Key, dict[str, Any]] | None = {} if mapping is not None else None  # only a mapping reads them
    build = _plan_like(like, (), requests, notes=notes) if like is not None else None
    target = _target(requests, notes or {}) if like is not None and mapping is not None else None
    with paused_gc():
        for attempt in range(REPLACED_RETRIES + 1):
            stored: Source | None = None
            try:
                stored = open_checkpoint(path)
                mapped = mapping.apply(stored, target) if mapping is not None else None
                return _load(mapped or stored, mapped, like, requests, build, strict, partial, max_bytes,
                             max_staging_bytes)
            except XckptError as exc:
                if exc.code != "load.replaced" and (stored is None or not stored.replaced()):
                    raise
                if attempt == REPLACED_RETRIES:
                    raise XckptError(f"the checkpoint at {path} was replaced while it was being loaded, "
                                     f"{attempt + 1} times in a row; nothing was returned", code="load.replaced",
                                     file=str(path)) from exc
            finally:
                if stored is not None:
                    stored.close()
    raise AssertionError("unreachable")


def _load(ckpt: Source, mapped: Any, like: Any, requests: list[_Request], build: Any, strict: bool, partial: bool,
          max_bytes: int | None, staging: int) -> Any:
    m = ckpt.manifest
    if like is None:
        unused_all = mapped.unused_sources(None) if mapped is not None else []
        if unused_all:
            warnings.warn(f"checkpoint {ckpt.loc}: no mapping rule uses {unused_all[:20]}", XckptWarning,
                          stacklevel=3)
        results = _read(ckpt, [(i, full_target(e.shape)) for i, e in enumerate(m.leaves)
                                if isinstance(e, ArrayEntry)], max_bytes, staging)
        vals = ckpt.values()
        return unflatten(m.tree, [results[i] if i in results else vals[i] for i in range(len(m.leaves))])
    by_key = m.by_key()
    kept = mapped.optional if mapped is not None else set()
    index = {e.key: i for i, e in enumerate(m.leaves)}
    missing, mismatched, jobs = [], [], []
    value_reqs: list[tuple[Key, int, Any]] = []
    for req in requests:
        if req.like is None or req.like is _EMPTY:
            continue
        entry = by_key.get(req.key)
        if entry is None:
            if not req.optional and req.key not in kept:
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
                origin = mapped.origin(req.key) if mapped is not None else ""
                mismatched.append(f"{key_str(req.key)}: stored {list(entry.shape)}"
                                  f"{f' ({origin})' if origin else ''}, target {list(target.shape)}")
                continue
            jobs.append((i, target))
        else:
            value_reqs.append((req.key, i, make(req.like, _value_entry_as_array(entry)) if make else None))
    unexpected = [] if partial else _unexpected(like, requests, m.leaves)
    if mapped is not None and not partial:
        unused = mapped.unused_sources(set(like) if isinstance(like, dict) else None)
        unexpected += [f"{k} (stored; no mapping rule uses it)" for k in unused]
    if missing or unexpected or mismatched:
        message = (f"checkpoint {ckpt.loc} and the load target differ: "
                   f"missing {missing[:20]}, unexpected {unexpected[:20]}, mismatched {mismatched[:20]}")
        if strict:
            raise KeyMismatchError(message, missing=missing, unexpected=unexpected, mismatched=mismatched,
                                   file=str(ckpt.loc))
        warnings.warn(message, XckptWarning, stacklevel=3)
    vals = ckpt.values() if value_reqs else {}
    results_by_leaf = _read(ckpt, jobs, max_bytes, staging)
    results: dict[Key, Any] = {m.leaves[i].key: r for i, r in results_by_leaf.items()}
    for key, i, target in value_reqs:
        v = vals[i]
        results[key] = target.build([np.asarray(v, dtype=dtypes.numpy_dtype(target.dtype))]) \
            if target is not None and target.dtype else v
    return build(results)


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


@dataclass
class _Part:
    """One region of one job: where it is read to, and where it ends up."""

    leaf: int
    entry: ArrayEntry
    region: Region
    dtype: str  # the target's logical dtype
    out: np.ndarray | None  # the target's own memory (in place), or None: a new array


def _storage(arr: np.ndarray, e: ArrayEntry) -> np.ndarray:
    """An array of the entry's logical dtype viewed as its storage dtype."""
    return arr.view(dtypes.numpy_dtype(e.storage_dtype)) if dtypes.is_raw(e.dtype) else arr


def _logical(raw: np.ndarray, e: ArrayEntry, dtype: str) -> np.ndarray:
    """Raw storage data as the target's logical dtype (a view, or a cast copy)."""
    arr = raw.view(dtypes.numpy_dtype(e.dtype)) if dtypes.is_raw(e.dtype) else raw
    return arr if dtype == e.dtype else arr.astype(dtypes.numpy_dtype(dtype))


def _read(ckpt: Source, jobs: list[tuple[int, ArrayTarget]], max_bytes: int | None, staging: int) -> dict[int, Any]:
    """Read every region of every job, then build each result (see :func:`load` for the guarantees)."""
    m = ckpt.manifest
    limit = _memory_limit() if max_bytes is None else max_bytes
    total = 0
    parts: dict[int, list[_Part]] = {}
    for i, t in jobs:
        e = m.leaves[i]
        assert isinstance(e, ArrayEntry)
        dtype = t.dtype or e.dtype
        for k, r in enumerate(t.regions):
            if not r.within(e.shape):
                raise ShapeError(f"requested region {r.offsets}+{r.sizes} lies outside shape {list(e.shape)}",
                                 leaf=key_str(e.key))
            out = t.out(k) if t.out is not None else None
            if out is not None and (tuple(out.shape) != r.sizes or dtypes.logical_name(out.dtype) != dtype):
                raise ShapeError(f"the target offers {out.shape} {out.dtype} for region {r.offsets}+{r.sizes} "
                                 f"of {dtype}", leaf=key_str(e.key))
            total += r.numel * max(dtypes.itemsize(e.dtype), dtypes.itemsize(dtype))
            parts.setdefault(i, []).append(_Part(i, e, r, dtype, out))
    if total > limit:
        raise ResourceError(f"load would read {total} bytes into memory, more than the limit {limit}",
                            file=str(ckpt.loc))
    if total > CHECK_AHEAD_BYTES:  # a manifest may declare far more than its objects hold: look before allocating
        ckpt.check([ReadRequest(p.entry, p.region,
                                placeholder(p.region.sizes, dtypes.numpy_dtype(p.entry.storage_dtype)))
                    for ps in parts.values() for p in ps])
    in_place = sum(p.region.numel * dtypes.itemsize(p.entry.dtype) for ps in parts.values() for p in ps
                   if p.out is not None)
    atomic = in_place <= staging
    results: dict[int, list[np.ndarray]] = {i: [None] * len(t.regions) for i, t in jobs}  # type: ignore[misc]
    direct: list[ReadRequest] = []
    later: list[tuple[_Part, int, np.ndarray]] = []  # staged in-place parts: (part, position, raw)
    casts: list[tuple[_Part, int]] = []
    for i, ps in parts.items():
        for k, p in enumerate(ps):
            same = p.dtype == p.entry.dtype
            if p.out is None and same:
                raw = empty(p.region.sizes, dtypes.numpy_dtype(p.entry.storage_dtype))
                direct.append(ReadRequest(p.entry, p.region, raw))
                results[i][k] = _logical(raw, p.entry, p.dtype)
            elif p.out is not None and atomic:
                raw = np.empty(p.region.sizes, dtype=dtypes.numpy_dtype(p.entry.storage_dtype))
                direct.append(ReadRequest(p.entry, p.region, raw))
                later.append((p, k, raw))
            elif p.out is not None and same:
                direct.append(ReadRequest(p.entry, p.region, _storage(p.out, p.entry)))
                results[i][k] = p.out
            else:
                casts.append((p, k))
    ckpt.read(direct, precheck=not atomic and in_place > 0)
    for batch in _batches(casts):
        raws = [np.empty(p.region.sizes, dtype=dtypes.numpy_dtype(p.entry.storage_dtype)) for p, _ in batch]
        ckpt.read([ReadRequest(p.entry, p.region, raw) for (p, _), raw in zip(batch, raws)])
        for (p, k), raw in zip(batch, raws):
            value = _logical(raw, p.entry, p.dtype)
            if p.out is not None:
                np.copyto(p.out, value)
                value = p.out
            results[p.leaf][k] = value
    for p, k, raw in later:  # every read succeeded: now the in-place targets change
        np.copyto(p.out, _logical(raw, p.entry, p.dtype))
        results[p.leaf][k] = p.out  # type: ignore[assignment]
    return {i: t.build(results[i]) for i, t in jobs}


def _batches(casts: list[tuple[_Part, int]], limit: int = 64 << 20) -> list[list[tuple[_Part, int]]]:
    """Cast reads grouped so that each group's raw buffers stay near ``limit`` bytes."""
    out: list[list[tuple[_Part, int]]] = []
    size = limit
    for item in casts:
        n = item[0].region.numel * dtypes.itemsize(item[0].entry.dtype)
        if size + n > limit and (not out or out[-1]):
            out.append([])
            size = 0
        out[-1].append(item)
        size += n
    return out
