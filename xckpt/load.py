"""Loading: match a target tree to the manifest, read only the regions asked for, build results.

Nothing is returned until every read has succeeded: a load never yields half-filled
state (see :func:`load` for targets loaded in place).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from xckpt import registry
from xckpt.engine import collective
from xckpt.engine.collective import Coordinator, LocalCoordinator
from xckpt.engine.gcpause import paused_gc
from xckpt.engine.read import ReadRequest, empty, memory_limit, placeholder
from xckpt.errors import (CollectiveLoadError, KeyMismatchError, ResourceError, ShapeError, XckptError,
                          XckptWarning)
from xckpt.format import dtypes
from xckpt.format.casts import cast_refusal, narrows, scalar_refusal, unfit
from xckpt.format.manifest import ArrayEntry, Entry, ValueEntry
from xckpt.format.regions import Region, memory_span, refuse_overlap
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
               notes: dict[Key, dict[str, Any]] | None = None,
               checks: list[Callable[[], None]] | None = None) -> Callable[[dict[Key, Any]], Any]:
    """Collect the leaves of a target tree; return a function that rebuilds it from results.

    ``notes`` collects what the adapters note about the custom containers met, by key; ``checks`` (a load's,
    not a description's) what their rebuild functions ask to run before anything is read
    (``rebuild.before_reading``: see :func:`xckpt.registry.register_container`)."""
    if isinstance(like, Default):
        return _plan_like(like.value, key, requests, True, notes, checks)
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
            check = getattr(rebuild, "before_reading", None)
            if check is not None and checks is not None:
                checks.append(functools.partial(_restored, like, key, lambda _: check(), None))
            inner = _plan_like(plain, key, requests, optional, notes, checks)
            return lambda res: _restored(like, key, rebuild, inner(res))
    if isinstance(like, (dict, list, tuple)) and not like:
        requests.append(_Request(key, _EMPTY))
    if isinstance(like, dict):
        parts = {k: _plan_like(v, key + (k,), requests, optional, notes, checks) for k, v in like.items()}
        return lambda res: _rebuild_dict(like, parts, res)
    if is_namedtuple(like):
        fields = type(like)._fields
        subs = [_plan_like(v, key + (f,), requests, optional, notes, checks) for f, v in zip(fields, like)]
        return lambda res: type(like)(*[s(res) for s in subs])
    if isinstance(like, (list, tuple)):
        subs = [_plan_like(v, key + (i,), requests, optional, notes, checks) for i, v in enumerate(like)]
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
         mapping: Any = None, max_staging_bytes: int = MAX_STAGING_BYTES,
         coordinator: Coordinator | None = None) -> Any:
    """Load a checkpoint (xckpt, or one written by Orbax); in a distributed job every process calls it.

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
    a load may bring into memory (by default the memory this process may use: the machine's, its
    address-space limit or its cgroup's, whichever is least; more is ``resource.too_large``).

    In a job of several processes (``coordinator``, by default the running ``torch.distributed``
    or ``jax.distributed`` job's, as for :func:`~xckpt.save`) the load is collective: the
    processes agree that each one's target matches the checkpoint, that they opened the same one,
    and that every object each will read is there and well formed (where the source checks ahead:
    xckpt checkpoints and mapped views of them; Orbax's are checked as they are read) before any
    writes in place; that every read succeeded before any copies its staged data in; and that every
    target object restored its own state. A failure anywhere raises one
    :class:`~xckpt.errors.CollectiveLoadError` on every process, listing each failing rank's error,
    and none returns. To load on one process of a job alone, pass
    ``coordinator=xckpt.LocalCoordinator()``.

    A load reads one checkpoint: on a file system, every file is opened through the directory
    it opened first, so a save that replaces the checkpoint meanwhile cannot mix two of them;
    when the replacement removed files the load still needed, it starts again on the new
    checkpoint (every process together; up to :data:`REPLACED_RETRIES` times, then
    ``load.replaced``). A pending :func:`~xckpt.save_async` of this process to the same path
    is waited for first.
    """
    registry.autoload()
    wait_pending_for(path)
    coord = coordinator or registry.default_coordinator() or LocalCoordinator()
    caller = sys._getframe(1)  # where the load's warnings point
    planned: list[tuple[list[_Request], Any, Target | None]] = []
    what = f"load of {path}"
    with paused_gc():
        for attempt in range(REPLACED_RETRIES + 1):
            opened: list[Source] = []
            loading: list[_Loading] = []

            def begin() -> dict[str, Any]:
                if not planned:  # the target is described once, inside the first step: its failure is shared
                    planned.append(_plan_target(like, mapping))
                requests, build, target = planned[0]
                stored = open_checkpoint(path)
                opened.append(stored)
                mapped = mapping.apply(stored, target) if mapping is not None else None
                with _naming(str(stored.loc)):
                    loading.append(_load(mapped or stored, mapped, like, requests, build, strict, partial, max_bytes,
                                         max_staging_bytes, caller))
                return {"generation": stored.manifest.generation, "unstaged": loading[0].unstaged}

            try:
                opening = _together(coord, f"{what} (opening it)", begin, opened)
                # where any process writes in place unstaged, every process first checks every object it will read
                if opening is not None and coord.world_size > 1 and any(o["unstaged"] for o in opening):
                    opening = _together(coord, f"{what} (checking it)", lambda: loading[0].check(), opened)
                if opening is not None and _together(coord, f"{what} (reading it)", lambda: loading[0].read(), opened):
                    if coord.world_size == 1:
                        return loading[0].finish()
                    result: list[Any] = []  # restoring runs on every process; only its success is exchanged
                    collective.all_step(coord, f"{what} (restoring it)", lambda: result.append(loading[0].finish()),
                                        CollectiveLoadError)
                    return result[0]
            finally:
                for stored in opened:
                    stored.close()
                loading.clear()  # a failed load's buffers are not kept alive by the error it raises
    raise XckptError(f"the checkpoint at {path} was replaced while it was being loaded, {REPLACED_RETRIES + 1} times "
                     "in a row; nothing was returned", code="load.replaced", file=str(path))


def _plan_target(like: Any, mapping: Any) -> tuple[list[_Request], Any, Target | None]:
    """The target's leaf requests, the function that rebuilds it from results, and (for a mapping) its
    description."""
    requests: list[_Request] = []
    notes: dict[Key, dict[str, Any]] | None = {} if mapping is not None else None  # only a mapping reads them
    checks: list[Callable[[], None]] = []
    build = _plan_like(like, (), requests, notes=notes, checks=checks) if like is not None else None
    for check in checks:  # a container that cannot be loaded into (a module on the meta device): before any read
        check()
    target = _target(requests, notes or {}) if like is not None and mapping is not None else None
    return requests, build, target


def _warn(caller: Any, message: str) -> None:
    """Warn at the line that called :func:`load` (however deep in a collective step this runs)."""
    registry_ = caller.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, XckptWarning, caller.f_code.co_filename, caller.f_lineno,
                           module=caller.f_globals.get("__name__"), registry=registry_,
                           module_globals=caller.f_globals)


def _together(coord: Coordinator, what: str, fn: Callable[[], dict[str, Any] | None],
              opened: list[Source]) -> list[dict[str, Any]] | None:
    """Run ``fn`` (one phase of a load) on every process: every process's report (``fn``'s, or ``{}``),
    when it succeeded everywhere on the same checkpoint (the ``generation`` each reports); None when a save
    replaced the checkpoint under any process (all start again). A failure anywhere raises
    :class:`~xckpt.errors.CollectiveLoadError` on every process (in a job of one process, the error itself)."""
    def run() -> dict[str, Any]:
        try:
            return fn() or {}
        except XckptError as exc:
            if exc.code == "load.replaced" or (opened and opened[0].replaced()):
                return {"replaced": True}
            raise

    outs = [run()] if coord.world_size == 1 else collective.all_step(coord, what, run, CollectiveLoadError)
    if any("replaced" in o for o in outs) or len({o.get("generation") for o in outs}) > 1:
        return None
    return outs


class _Loading:
    """A load whose target matched and whose values were read, in its remaining phases: :meth:`check`
    (where needed), :meth:`read` every region (staged in-place targets untouched), :meth:`finish` (copy
    staged data in, build)."""

    def __init__(self, reads: "_Reads", finish: Callable[[dict[int, Any]], Any]) -> None:
        self._reads, self._finish = reads, finish

    @property
    def unstaged(self) -> bool:
        """Whether it writes in place without staging (see :class:`_Reads`)."""
        return self._reads.unstaged

    def check(self) -> None:
        """Check every object it will read (:meth:`_Reads.check`)."""
        self._reads.check()

    def read(self) -> None:
        """Read every region."""
        with _naming(self._reads.file):
            self._reads.run()

    def finish(self) -> Any:
        """Copy the staged regions into their in-place targets; the result."""
        with _naming(self._reads.file):
            return self._finish(self._reads.finish())


@contextlib.contextmanager
def _naming(file: str) -> Iterator[None]:
    """Name ``file`` (the checkpoint loaded) in an XckptError that names no file: a target's refusal, say."""
    try:
        yield
    except XckptError as exc:
        named = exc.at(file=file)
        if named is exc:
            raise
        raise named.with_traceback(exc.__traceback__) from exc.__cause__


def _load(ckpt: Source, mapped: Any, like: Any, requests: list[_Request], build: Any, strict: bool, partial: bool,
          max_bytes: int | None, staging: int, caller: Any) -> _Loading:
    """Match the target to the checkpoint, read and convert its values, plan the reads (nothing read into a
    target yet); ``caller``: the frame warnings point at."""
    m = ckpt.manifest
    if like is None:
        unused_all = mapped.unused_sources(None) if mapped is not None else []
        if unused_all:
            _warn(caller, f"checkpoint {ckpt.loc}: no mapping rule uses {unused_all[:20]}")
        reads = _Reads(ckpt, [(i, full_target(e.shape)) for i, e in enumerate(m.leaves) if isinstance(e, ArrayEntry)],
                       max_bytes, staging)
        vals = ckpt.values()
        return _Loading(reads, lambda results: unflatten(
            m.tree, [results[i] if i in results else vals[i] for i in range(len(m.leaves))]))
    by_key = m.by_key()
    kept = mapped.optional if mapped is not None else set()
    index = {e.key: i for i, e in enumerate(m.leaves)}
    missing, mismatched, jobs = [], [], []
    early: set[int] = set()  # jobs whose result is made in the read step (a scalar's conversion may fail)
    named: list[str] = []  # the key of each difference (the error names it when it is the only one)
    value_reqs: list[tuple[Key, int, Any]] = []
    for req in requests:
        if req.like is None or req.like is _EMPTY:
            continue
        entry = by_key.get(req.key)
        if entry is None:
            if not req.optional and req.key not in kept:
                missing.append(key_str(req.key))
                named.append(key_str(req.key))
            continue
        i = index[req.key]
        make = registry.target_for(req.like)
        if isinstance(entry, ArrayEntry):
            if make is None:
                if isinstance(req.like, (bool, int, float, complex)) and entry.shape == () and \
                        (np.dtype(dtypes.numpy_dtype(entry.dtype)).kind != "c" or isinstance(req.like, complex)):
                    jobs.append((i, ArrayTarget((), None, [Region.full(())],
                                                lambda p, t=type(req.like), k=req.key: _scalar(p[0], t, k))))
                    early.add(i)
                    continue
                mismatched.append(f"{key_str(req.key)}: stored array {list(entry.shape)} {entry.dtype}, "
                                  f"target is {type(req.like).__name__}")
                named.append(key_str(req.key))
                continue
            target = _made(make, req.like, entry, req.key)
            if tuple(target.shape) != tuple(entry.shape):
                origin = mapped.origin(req.key) if mapped is not None else ""
                mismatched.append(f"{key_str(req.key)}: stored {list(entry.shape)}"
                                  f"{f' ({origin})' if origin else ''}, target {list(target.shape)}")
                named.append(key_str(req.key))
                continue
            jobs.append((i, target))
        else:
            made = _made(make, req.like, _value_entry_as_array(entry), req.key) if make else None
            value_reqs.append((req.key, i, made))
    unexpected = [] if partial else _unexpected(like, requests, m.leaves)
    named += unexpected
    if mapped is not None and not partial:
        unused = mapped.unused_sources(set(like) if isinstance(like, dict) else None)
        unexpected += [f"{k} (stored; no mapping rule uses it)" for k in unused]
        named += [str(k) for k in unused]
    if missing or unexpected or mismatched:
        message = (f"checkpoint {ckpt.loc} and the load target differ: "
                   f"missing {missing[:20]}, unexpected {unexpected[:20]}, mismatched {mismatched[:20]}")
        if strict:
            raise KeyMismatchError(message, missing=missing, unexpected=unexpected, mismatched=mismatched,
                                   file=str(ckpt.loc), leaf=named[0] if len(named) == 1 else None)
        _warn(caller, message)
    reads = _Reads(ckpt, jobs, max_bytes, staging, early)
    values: dict[Key, Callable[[], Any]] = {}
    if value_reqs:
        vals = ckpt.values()
        for key, i, target in value_reqs:
            values[key] = _value_as(vals[i], target, key, str(ckpt.loc))

    def finish(results_by_leaf: dict[int, Any]) -> Any:
        results: dict[Key, Any] = {m.leaves[i].key: r for i, r in results_by_leaf.items()}
        results.update((key, fill()) for key, fill in values.items())
        return build(results)
    return _Loading(reads, finish)


def _made(make: Callable[[Any, Any], ArrayTarget], like: Any, entry: ArrayEntry, key: Key) -> ArrayTarget:
    """The adapter's target for ``like``; its refusal names the leaf."""
    try:
        return make(like, entry)
    except XckptError as exc:
        raise exc.at(leaf=key_str(key)) from None


def _scalar(arr: np.ndarray, kind: type, key: Key) -> Any:
    """A stored 0-d array as the Python scalar type of its target (``int(nan)``, ``bool(2)`` are
    ``tree.key_mismatch``)."""
    try:
        why = scalar_refusal(arr.item(), kind)
        if why is not None:
            raise ValueError(why)
        return kind(arr.item())
    except (TypeError, ValueError, OverflowError) as exc:
        raise KeyMismatchError(f"the stored {arr.dtype} {arr.item()!r} cannot become a {kind.__name__}: {exc}",
                               mismatched=[key_str(key)], leaf=key_str(key)) from exc


def _value_as(v: Any, target: ArrayTarget | None, key: Key, file: str) -> Callable[[], Any]:
    """A stored value as its target asks (a framework scalar array, say), converted and checked now and
    written (into an in-place target) when called, once every read succeeded; a value that cannot become
    the target is ``tree.key_mismatch`` naming its leaf."""
    if target is None or not target.dtype:
        return lambda: v

    def mismatch(why: str) -> KeyMismatchError:
        return KeyMismatchError(f"the stored value {type(v).__name__} cannot become the target's "
                                f"{list(target.shape)} {target.dtype}: {why}", mismatched=[key_str(key)], file=file,
                                leaf=key_str(key))
    want = np.dtype(dtypes.numpy_dtype(target.dtype))
    try:
        kinds = _number_kinds(v)  # numpy would make None a NaN, '1.5' a 1.5 and 'abc' a True
        if kinds is None:
            raise TypeError("it is not a number (or nested lists of numbers)")
        if "c" in kinds and want.kind != "c":
            raise TypeError("its imaginary part would be lost")
        with warnings.catch_warnings():  # a float beyond the target's range: refused below, not warned of
            warnings.simplefilter("ignore", RuntimeWarning)
            arr = np.asarray(v, dtype=want)
        natural = np.asarray(v)
        if natural.dtype.kind == "O":  # an int beyond 64 bits (into a floating target: as float64)
            natural = np.asarray(v, dtype=np.float64)
        why = unfit(natural, target.dtype)
        if why is not None:
            raise ValueError(f"it {why}")
    except (TypeError, ValueError, OverflowError) as exc:
        raise mismatch(str(exc)) from exc
    if arr.shape != tuple(target.shape):
        raise mismatch(f"it has shape {list(arr.shape)}")
    parts = [arr[r.slices() + (Ellipsis,)] for r in target.regions]  # (Ellipsis: a 0-d array stays an array)
    outs = [_in_place(target, k, part.shape, target.dtype, key) for k, part in enumerate(parts)]

    def fill() -> Any:
        for part, out in zip(parts, outs):
            if out is not None:
                np.copyto(out, part)
        return target.build([part if out is None else out for part, out in zip(parts, outs)])
    return fill


def _number_kinds(v: Any) -> set[str] | None:
    """The numpy kinds (``b``, ``i``, ``f``, ``c``) of a stored number or nested lists of numbers; None for
    anything else (None, a string, bytes, a dict)."""
    if isinstance(v, (list, tuple)):
        kinds: set[str] = set()
        for x in v:
            k = _number_kinds(x)
            if k is None:
                return None
            kinds |= k
        return kinds
    if isinstance(v, (bool, np.bool_)):
        return {"b"}
    if isinstance(v, (int, float, complex, np.number)):
        return {np.asarray(v).dtype.kind if not isinstance(v, int) else "i"}
    return None


def _in_place(target: ArrayTarget, k: int, sizes: tuple[int, ...], dtype: str, key: Key) -> np.ndarray | None:
    """The memory ``target`` offers for its region ``k`` (of shape ``sizes``, read as ``dtype``), checked;
    None when it offers none (the result is a new array)."""
    out = target.out(k) if target.out is not None else None
    if out is None:
        return None
    if tuple(out.shape) != tuple(sizes) or dtypes.logical_name(out.dtype) != dtype:
        raise ShapeError(f"the target offers {out.shape} {out.dtype} for a region of shape {list(sizes)} "
                         f"{dtype}", leaf=key_str(key))
    refuse_overlap(out.shape, out.strides, out.itemsize, key_str(key))
    return out


#: The dtype a stored Python scalar has as an array (a bare sharding target takes the stored dtype).
_VALUE_DTYPES = {"bool": "bool", "int": "int64", "float": "float64", "complex": "complex128"}


def _value_entry_as_array(e: ValueEntry) -> ArrayEntry:
    """A stored value described as a 0-d array of its type's dtype, for a target made from the stored entry."""
    dtype = _VALUE_DTYPES.get(e.type, "float64")
    return ArrayEntry(e.key, "", (), dtype, dtype, (), (), "none", None)


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


@dataclass
class _Part:
    """One region of one job: where it is read to, and where it ends up."""

    leaf: int
    entry: ArrayEntry
    region: Region
    dtype: str  # the target's logical dtype
    out: np.ndarray | None  # the target's own memory (in place), or None: a new array


def _tied(parts: list[_Part]) -> list[list[_Part]]:
    """The in-place parts whose targets are one and the same memory (a tied weight under two keys), in
    groups of two or more; a target that shares some memory with another without being the same (overlapping
    views of one tensor) is refused as ``shape.mismatch``, naming both leaves: one would overwrite the other."""
    spans = []
    for p in parts:
        if p.out is not None and p.out.size:
            address = p.out.__array_interface__["data"][0]
            spans.append((*memory_span(address, p.out.shape, p.out.strides, p.out.itemsize), address, p))
    spans.sort(key=lambda s: s[0])
    groups: dict[int, list[_Part]] = {}  # by id of each group's first part
    group_of: dict[int, int] = {}
    open_: list[tuple[int, int, _Part]] = []  # (end, address, part) of the spans still open
    for low, high, address, p in spans:
        open_ = [o for o in open_ if o[0] > low]
        for _, other_address, q in open_:
            a, b = p.out, q.out
            assert a is not None and b is not None
            if address == other_address and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype:
                first = group_of.setdefault(id(q), id(q))
                groups.setdefault(first, [q]).append(p)
                group_of[id(p)] = first
                break
            if np.shares_memory(a, b):
                raise ShapeError(f"the targets of {key_str(q.entry.key)} and {key_str(p.entry.key)} share part of "
                                 "their memory (overlapping views of one tensor): one would overwrite the other; "
                                 "load into tensors of their own", code="shape.mismatch", leaf=key_str(p.entry.key))
        open_.append((high, address, p))
    return list(groups.values())


def _check_tied(group: list[_Part], raws: dict[int, np.ndarray]) -> None:
    """Refuse, before anything is read into a target, a group of :func:`_tied` parts whose stored values
    differ (compared bit for bit in the target's dtype): whichever came last would win unseen."""
    first = group[0]
    want = np.ascontiguousarray(_logical(raws[id(first)], first.entry, first.dtype)).view(np.uint8)
    for p in group[1:]:
        got = np.ascontiguousarray(_logical(raws[id(p)], p.entry, p.dtype)).view(np.uint8)
        if not np.array_equal(got, want):
            a, b = key_str(first.entry.key), key_str(p.entry.key)
            raise KeyMismatchError(f"{a} and {b} are loaded into one and the same tensor (tied), but the "
                                   "checkpoint holds different values for them; untie them in the target",
                                   mismatched=[a, b], leaf=b)


def _storage(arr: np.ndarray, e: ArrayEntry) -> np.ndarray:
    """An array of the entry's logical dtype viewed as its storage dtype."""
    return arr.view(dtypes.numpy_dtype(e.storage_dtype)) if dtypes.is_raw(e.dtype) else arr


def _logical(raw: np.ndarray, e: ArrayEntry, dtype: str) -> np.ndarray:
    """Raw storage data as the target's logical dtype (a view, or a cast copy)."""
    arr = raw.view(dtypes.numpy_dtype(e.dtype)) if dtypes.is_raw(e.dtype) else raw
    return arr if dtype == e.dtype else arr.astype(dtypes.numpy_dtype(dtype))


def _fits(raw: np.ndarray, p: "_Part") -> None:
    """:func:`_check_fits` of a part's raw storage data, where its cast narrows
    (:func:`xckpt.format.casts.narrows`)."""
    if p.dtype != p.entry.dtype and narrows(p.entry.dtype, p.dtype):
        stored = raw.view(dtypes.numpy_dtype(p.entry.dtype)) if dtypes.is_raw(p.entry.dtype) else raw
        _check_fits(stored, p.entry.dtype, p.dtype, p.entry.key)


class _Reads:
    """The reads of one load (see :func:`load` for the guarantees): planned and checked when made, then
    :meth:`check` where needed, :meth:`run` (every read; in-place targets up to the staging bound untouched),
    :meth:`finish` (staged regions copied in, each job's result built)."""

    def __init__(self, ckpt: Source, jobs: list[tuple[int, ArrayTarget]], max_bytes: int | None,
                 staging: int, early: set[int] | None = None) -> None:
        # early: jobs whose results are made by the read step, before any region is read into a target
        m = ckpt.manifest
        limit = memory_limit() if max_bytes is None else max_bytes
        total = 0
        parts: dict[int, list[_Part]] = {}
        for i, t in jobs:
            e = m.leaves[i]
            assert isinstance(e, ArrayEntry)
            dtype = t.dtype or e.dtype
            if dtype != e.dtype:
                _check_cast(e.dtype, dtype, e.key)
            for k, r in enumerate(t.regions):
                if not r.within(e.shape):
                    raise ShapeError(f"requested region {r.offsets}+{r.sizes} lies outside shape {list(e.shape)}",
                                     leaf=key_str(e.key))
                out = _in_place(t, k, r.sizes, dtype, e.key)
                total += r.numel * max(dtypes.itemsize(e.dtype), dtypes.itemsize(dtype))
                parts.setdefault(i, []).append(_Part(i, e, r, dtype, out))
        if total > limit:
            raise ResourceError(f"load would read {total} bytes into memory, more than the limit {limit}",
                                file=str(ckpt.loc))
        #: Groups of parts loaded into one and the same memory: staged and compared first, whatever their size.
        self._tied = _tied([p for ps in parts.values() for p in ps])
        in_place = sum(p.region.numel * dtypes.itemsize(p.entry.dtype) for ps in parts.values() for p in ps
                       if p.out is not None)
        self.atomic = in_place <= staging
        #: It writes in place without staging: every object is checked before any is read into a target.
        self.unstaged = not self.atomic and in_place > 0
        self._checked = False
        self._ckpt, self._jobs, self._parts, self._early = ckpt, jobs, parts, early or set()
        self.file = str(ckpt.loc)
        self._results: dict[int, list[Any]] = {}
        self._built: dict[int, Any] = {}  # the results of the ``early`` jobs, made by the read step
        self._later: list[tuple[_Part, int, np.ndarray]] = []  # staged in-place parts: (part, position, raw)
        if total > CHECK_AHEAD_BYTES:  # a manifest may declare far more than its objects hold: look before allocating
            self.check()

    def check(self) -> None:
        """Check every object the reads need, as far as the source checks ahead (:meth:`Source.check`), without
        reading into any target; the reads then check nothing more ahead (the objects stay those checked)."""
        if not self._checked:
            self._ckpt.check([ReadRequest(p.entry, p.region,
                                          placeholder(p.region.sizes, dtypes.numpy_dtype(p.entry.storage_dtype)))
                              for ps in self._parts.values() for p in ps])
            self._checked = True

    def run(self) -> None:
        """Read every region: into new arrays, staging memory, or (past the staging bound) in place."""
        ckpt = self._ckpt
        results: dict[int, list[Any]] = {i: [None] * len(t.regions) for i, t in self._jobs}
        direct: list[ReadRequest] = []
        first: list[ReadRequest] = []  # the ``early`` jobs' regions (new arrays, in their stored dtype)
        later: list[tuple[_Part, int, np.ndarray]] = []
        casts: list[tuple[_Part, int]] = []
        tied = {id(p) for group in self._tied for p in group}
        tied_reads: list[ReadRequest] = []
        tied_raws: dict[int, np.ndarray] = {}
        for i, ps in self._parts.items():
            for k, p in enumerate(ps):
                same = p.dtype == p.entry.dtype
                if p.out is None and same:
                    try:
                        raw = empty(p.region.sizes, dtypes.numpy_dtype(p.entry.storage_dtype))
                    except ResourceError as exc:
                        raise exc.at(file=str(ckpt.loc.child(p.entry.path)), leaf=key_str(p.entry.key)) from None
                    (first if i in self._early else direct).append(ReadRequest(p.entry, p.region, raw))
                    results[i][k] = _logical(raw, p.entry, p.dtype)
                elif p.out is not None and (self.atomic or id(p) in tied):
                    raw = np.empty(p.region.sizes, dtype=dtypes.numpy_dtype(p.entry.storage_dtype))
                    if id(p) in tied:
                        tied_reads.append(ReadRequest(p.entry, p.region, raw))
                        tied_raws[id(p)] = raw
                    else:
                        direct.append(ReadRequest(p.entry, p.region, raw))
                    later.append((p, k, raw))
                elif p.out is not None and same:
                    direct.append(ReadRequest(p.entry, p.region, _storage(p.out, p.entry)))
                    results[i][k] = p.out
                else:
                    casts.append((p, k))
        if first:
            # results that need no target of the caller's are made first, so that a failure among them (a stored
            # NaN for an int) comes before anything is read into a target, and is a failure of the read step,
            # which every process learns before any copies staged data in
            ckpt.read(first)
            self._built = {i: t.build(results[i]) for i, t in self._jobs if i in self._early}
        if tied_reads:  # tied targets: their stored values agree, and fit, before anything is read into a target
            ckpt.read(tied_reads)
            for group in self._tied:
                for p in group:
                    _fits(tied_raws[id(p)], p)
                _check_tied(group, tied_raws)
        if self.unstaged and casts:  # cast reads are not checked by the direct reads' own pass
            self.check()
            # nor their values: those a target cannot hold are found before anything is read into a target
            for batch in _batches([c for c in casts if narrows(c[0].entry.dtype, c[0].dtype)]):
                raws = [np.empty(p.region.sizes, dtype=dtypes.numpy_dtype(p.entry.storage_dtype)) for p, _ in batch]
                ckpt.read([ReadRequest(p.entry, p.region, raw) for (p, _), raw in zip(batch, raws)])
                for (p, _), raw in zip(batch, raws):
                    _fits(raw, p)
        ckpt.read(direct, precheck=self.unstaged and not self._checked)
        for p, _, raw in later:  # staged for in-place targets: every value fits before finish() copies any in
            if id(p) not in tied:
                _fits(raw, p)
        for batch in _batches(casts):
            raws = [np.empty(p.region.sizes, dtype=dtypes.numpy_dtype(p.entry.storage_dtype)) for p, _ in batch]
            ckpt.read([ReadRequest(p.entry, p.region, raw) for (p, _), raw in zip(batch, raws)])
            for (p, k), raw in zip(batch, raws):
                if not self.unstaged:  # (unstaged, every value was checked before the direct reads)
                    _fits(raw, p)
                value = _logical(raw, p.entry, p.dtype)
                if p.out is not None:
                    np.copyto(p.out, value)
                    value = p.out
                results[p.leaf][k] = value
        self._results, self._later = results, later

    def finish(self) -> dict[int, Any]:
        """Every read succeeded (on every process): build the results that are new objects (a framework's
        arrays put on their devices, which can fail), then copy the staged regions into their in-place
        targets and build those; each job's result, by leaf index. A failure to build a new result leaves
        every in-place target untouched."""
        staged = {p.leaf for p, _, _ in self._later}
        built = dict(self._built)
        for i, t in self._jobs:
            if i not in built and i not in staged:
                built[i] = t.build(self._results[i])
        for p, k, raw in self._later:
            np.copyto(p.out, _logical(raw, p.entry, p.dtype))
            self._results[p.leaf][k] = p.out
        self._later = []
        return {i: built[i] if i in built else t.build(self._results[i]) for i, t in self._jobs}


def _check_cast(stored: str, wanted: str, key: Key) -> None:
    """Refuse, before anything is read, a cast from ``stored`` to ``wanted`` that cannot be made
    (:func:`xckpt.format.casts.cast_refusal`)."""
    why = cast_refusal(stored, wanted)
    if why is not None:
        raise KeyMismatchError(f"the stored {stored} cannot be cast to the target's {wanted}: {why}",
                               mismatched=[key_str(key)], leaf=key_str(key))


def _check_fits(arr: np.ndarray, stored: str, wanted: str, key: Key) -> None:
    """Refuse stored values (``arr``, the stored logical dtype) that the target's ``wanted`` dtype cannot hold
    (:func:`xckpt.format.casts.unfit`)."""
    why = unfit(arr, wanted)
    if why is not None:
        raise KeyMismatchError(f"the stored {stored} {why}, which the target's {wanted} cannot hold; load into a "
                               f"wider dtype", mismatched=[key_str(key)], leaf=key_str(key))


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
