"""Applying a mapping to an opened checkpoint: a virtual checkpoint with the target's keys.

:meth:`Mapping.apply` resolves every rule against the stored manifest (no array
data is read), checks shapes, conflicts and unmatched rules, and returns a
:class:`MappedCheckpoint`, a :class:`~xckpt.sources.base.Source` whose manifest lists the target keys with their shapes and dtypes after the transforms
and whose arrays are lazy TensorStore views of the stored ones.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence, Union, runtime_checkable

import tensorstore as ts

from xckpt.engine.read import ReadRequest, placeholder
from xckpt.engine.views import read_views
from xckpt.format import dtypes
from xckpt.format.manifest import ArrayEntry, Entry, Manifest, ValueEntry
from xckpt.format.regions import Region
from xckpt.format.tree import Key, Node, key_str
from xckpt.mapping.errors import MappingError
from xckpt.mapping.patterns import render
from xckpt.mapping.rules import Rule
from xckpt.mapping.target import Target
from xckpt.mapping.transforms import Layout, Transform, TransformError
from xckpt.mapping.virtual import same_view
from xckpt.sources.detect import open_checkpoint


@dataclass
class Expansion:
    """What a rule source gives for one load: its rules, in order, the target keys it leaves to the
    target where the checkpoint has nothing for them (e.g. an optax hyperparameter torch lacks), and the
    stored keys it answers for: those no rule uses are reported, never passed through (a Hugging Face
    checkpoint's tensors are each a top-level key of their own)."""

    rules: list[Rule]
    optional: set[Key] = field(default_factory=set)
    claimed: set[Key] = field(default_factory=set)


@runtime_checkable
class RuleSource(Protocol):
    """Something that yields rules for a stored manifest and a load target (a preset, a :class:`Mapping`)."""

    def expand(self, manifest: Manifest, target: Target | None = None) -> Expansion:
        """The rules to apply to ``manifest`` (loading into ``target``, None: the whole checkpoint)."""
        ...


@dataclass
class Planned:
    """How one target leaf is made: its source leaves, the rule, the transforms."""

    index: int
    entry: Entry
    sources: tuple[int, ...]
    rule: Rule
    transforms: tuple[Transform, ...]
    concat_axis: int | None

    def origin(self, leaves: Sequence[Entry]) -> str:
        """``from model/x.weight by rule '...' (transpose(1, 0))``."""
        src = " + ".join(key_str(leaves[i].key) for i in self.sources)
        steps = ", ".join(str(t) for t in self.transforms)
        return f"from {src} by rule {self.rule.label!r}" + (f" ({steps})" if steps else "")


class MappedCheckpoint:
    """A checkpoint seen through a mapping: target keys, transformed lazy arrays."""

    def __init__(self, base: Any, manifest: Manifest, plans: list[Planned], unused: list[int],
                 related: dict[Any, set[Any]]) -> None:
        self.base = base
        self.loc = base.loc
        self.format = base.format
        self.manifest = manifest
        self._plans = {p.entry.key: p for p in plans}
        self._unused = unused
        self._related = related
        #: Target keys the mapping leaves to the target where the checkpoint has nothing for them.
        self.optional: set[Key] = set()
        #: Unused stored leaves (indices) a preset answers for: reported whatever the target selects.
        self.claimed: set[int] = set()

    def values(self) -> dict[int, Any]:
        """Value leaves by (target) leaf index."""
        base_values = self.base.values()
        return {p.index: base_values[p.sources[0]] for p in self._plans.values()
                if isinstance(p.entry, ValueEntry)}

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """Start opening the transformed view of a target array leaf."""
        plan = self._plans[entry.key]
        base_leaves = self.base.manifest.leaves
        futures = [self.base.open_array(base_leaves[i]) for i in plan.sources]

        def build(stores: list[ts.TensorStore]) -> ts.TensorStore:
            store = stores[0]
            if plan.rule.same and len(stores) > 1:
                store = same_view(stores, [key_str(base_leaves[i].key) for i in plan.sources])
            elif plan.concat_axis is not None:
                if plan.rule.stack:
                    stores = [s[ts.newaxis, ...] for s in stores]
                store = ts.concat(stores, axis=plan.concat_axis)
                store = store[ts.d[:].translate_to[0]]
            for t in plan.transforms:
                store = t.view(store)
            return store

        return _when_all(futures, build)

    def read(self, requests: Sequence[ReadRequest], *, precheck: bool = False) -> int:
        """Fill each request's output from the transformed views (the stored arrays' objects are checked
        to be plain files when each view is opened)."""
        read_views(requests, self.open_array, lambda e: self.origin(e.key) or str(self.loc))
        return sum(r.out.nbytes for r in requests)

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Check, in the stored checkpoint, every array the requests' views are made of (whole: a transform may
        read any part of it), as the stored checkpoint checks its own (see :meth:`Source.check`)."""
        base_leaves = self.base.manifest.leaves
        used = dict.fromkeys(i for r in requests for i in self._plans[r.entry.key].sources)
        self.base.check([ReadRequest(e, Region.full(e.shape), placeholder(e.shape, dtypes.numpy_dtype(e.storage_dtype)))
                         for e in (base_leaves[i] for i in used) if isinstance(e, ArrayEntry)])

    def replaced(self) -> bool:
        """Whether the stored checkpoint was replaced since it was opened."""
        return self.base.replaced()

    def close(self) -> None:
        """Close the stored checkpoint."""
        self.base.close()

    def origin(self, key: Key) -> str:
        """Where a target leaf comes from (for messages); empty for an unknown key."""
        plan = self._plans.get(tuple(key))
        return plan.origin(self.base.manifest.leaves) if plan else ""

    def unused_sources(self, selected: Iterable[Any] | None = None) -> list[str]:
        """Stored leaves that no rule used, in the subtrees the rules map from.

        With ``selected`` (the target's top-level keys), only those in source subtrees that
        feed one of them are listed, and those a preset answers for (:attr:`Expansion.claimed`).
        """
        base_leaves = self.base.manifest.leaves
        if selected is None:
            return [key_str(base_leaves[i].key) for i in self._unused]
        tops = set()
        for t in selected:
            tops |= self._related.get(t, set())
        return [key_str(base_leaves[i].key) for i in self._unused if i in self.claimed or
                base_leaves[i].key[:1] and base_leaves[i].key[0] in tops]

    def describe(self) -> str:
        """One line per target leaf: where it comes from; then the unused stored leaves."""
        lines = [f"{key_str(p.entry.key)} <- {p.origin(self.base.manifest.leaves)}" for p in self._plans.values()]
        lines += [f"unused: {k}" for k in self.unused_sources()]
        return "\n".join(lines)


def _when_all(futures: list[Any], fn: Callable[[list[Any]], Any]) -> "ts.Future[Any]":
    """A future of ``fn(results)`` once every future is done (errors passed on)."""
    promise, future = ts.Promise.new()
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            promise.set_result(fn([f.result() for f in futures]))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting reader
            promise.set_exception(exc)

    for f in futures:
        f.add_done_callback(done)
    return future


Part = Union[Rule, RuleSource]


class Mapping(RuleSource):
    """An ordered set of rules and presets, applied to a checkpoint at load time.

    ``xckpt.load(path, like, mapping=m)``. Rules earlier in the list take precedence:
    a stored leaf is used by the first rule that matches it, so put your own rules
    before a preset to override it. Stored leaves in top-level subtrees that no rule
    touches pass through under their own keys when ``passthrough`` is true (e.g. a
    ``step`` counter); leaves in touched subtrees that no rule uses are reported.
    """

    def __init__(self, *parts: Part | Sequence[Part], passthrough: bool = True) -> None:
        flat: list[Part] = []
        for p in parts:
            if isinstance(p, (list, tuple)):
                flat.extend(p)
            else:
                flat.append(p)
        for p in flat:
            if not isinstance(p, (Rule, RuleSource)):
                raise MappingError(f"{p!r} is not a mapping rule or preset", code="mapping.rule")
        self.parts = flat
        self.passthrough = passthrough

    def __add__(self, other: "Mapping | Part") -> "Mapping":
        """A mapping with this one's rules first, then ``other``'s."""
        return Mapping(self, other, passthrough=self.passthrough)

    def expand(self, manifest: Manifest, target: Target | None = None) -> Expansion:
        """Every rule, presets expanded for ``manifest`` and ``target``, and the keys they leave to the target."""
        out = Expansion([])
        for p in self.parts:
            if isinstance(p, Rule):
                out.rules.append(p)
            else:
                part = p.expand(manifest, target)
                out.rules.extend(part.rules)
                out.optional |= part.optional
                out.claimed |= part.claimed
        return out

    def apply(self, ckpt: Any, target: Target | None = None) -> MappedCheckpoint:
        """The checkpoint seen through this mapping, loading into ``target``; raises :class:`MappingError`
        before any data is read."""
        try:
            expansion = self.expand(ckpt.manifest, target)
        except MappingError as exc:  # a preset knows the leaves, the checkpoint its file
            raise exc.at(file=str(ckpt.loc)) from None
        mapped = resolve(ckpt, expansion.rules, passthrough=self.passthrough, claimed=expansion.claimed)
        mapped.optional = expansion.optional
        return mapped

    def plan(self, path: Any, like: Any = None) -> MappedCheckpoint:
        """Open the checkpoint at ``path`` and apply the mapping for loading into ``like`` (to inspect it:
        ``.describe()``)."""
        from xckpt.load import describe_target

        return self.apply(open_checkpoint(path), None if like is None else describe_target(like))


@dataclass
class Match:
    """One firing of a rule: the captures and the source leaf indices (first, then concat partners)."""

    rule: Rule
    captures: dict[str, str]
    sources: tuple[int, ...]


def match_rules(leaves: Sequence[Entry], rules: Sequence[Rule], file: str = "") -> tuple[list[Match], dict[int, Rule]]:
    """Match rules in order; a leaf is used by the first rule that matches it. Checks matches only."""
    by_text: dict[str, list[int]] = {}
    for i, e in enumerate(leaves):
        by_text.setdefault(render(e.key), []).append(i)
    used: dict[int, Rule] = {}
    matches: list[Match] = []
    for rule in rules:
        first = rule.sources[0]
        candidates: Iterable[int] = by_text.get(first.text, []) if first.is_literal else range(len(leaves))
        matched = False
        for i in candidates:
            caps = None if i in used else first.match(leaves[i].key)
            if caps is None:
                continue
            srcs = [i]
            for p in rule.sources[1:]:
                want = p.format(caps)
                j = next((j for j in by_text.get(render(want), []) if p.match(leaves[j].key) is not None), None)
                if j is None:
                    raise MappingError(f"rule {rule.label!r} matched {key_str(leaves[i].key)} but its source "
                                       f"{key_str(want)} is not in the checkpoint", code="mapping.no_match",
                                       file=file, leaf=key_str(leaves[i].key))
                if j in used or j in srcs:
                    raise MappingError(f"rule {rule.label!r} needs {key_str(want)}, already used by rule "
                                       f"{used[j].label if j in used else rule.label!r}",
                                       code="mapping.conflict", file=file, leaf=key_str(want))
                srcs.append(j)
            matched = True
            for j in srcs:
                used[j] = rule
            matches.append(Match(rule, caps, tuple(srcs)))
        if not matched and rule.required:
            raise MappingError(f"rule {rule.label!r} matches no leaf of the checkpoint "
                               f"(or only leaves an earlier rule used)", code="mapping.no_match", file=file)
    return matches, used


def resolve(ckpt: Any, rules: Sequence[Rule], *, passthrough: bool = True,
            claimed: set[Key] | frozenset[Key] = frozenset()) -> MappedCheckpoint:
    """Match ``rules`` against the stored manifest and build the virtual checkpoint; a stored leaf no rule
    uses passes through unless its top-level subtree is used or it is ``claimed`` (then it is unused)."""
    leaves = ckpt.manifest.leaves
    file = str(ckpt.loc)
    matches, used = match_rules(leaves, rules, file)
    made: list[tuple[Key, tuple[int, ...], Rule, Layout | None, tuple[Transform, ...]]] = []
    for mt in matches:
        rule, srcs, src = mt.rule, mt.sources, leaves[mt.sources[0]]
        base = _source_layout(rule, [leaves[j] for j in srcs], file)
        _check_split_total(rule, src, base, file)
        for out in rule.outputs:
            tkey = out.target.format(mt.captures)
            layout = base
            if base is None and out.transforms:
                raise MappingError(f"rule {rule.label!r} transforms {key_str(src.key)}, which is a value, not an "
                                   f"array", code="mapping.shape", file=file, leaf=key_str(src.key))
            for t in out.transforms:
                try:
                    layout = t.apply(layout)  # type: ignore[arg-type]
                except TransformError as exc:
                    raise MappingError(f"rule {rule.label!r}: {exc} (source {key_str(src.key)}, target "
                                       f"{key_str(tkey)})", code="mapping.shape", file=file,
                                       leaf=key_str(src.key)) from None
            made.append((tkey, srcs, rule, layout, out.transforms))
    ruled_tops = {leaves[i].key[0] for i in used if leaves[i].key}
    unused: list[int] = []
    for i, e in enumerate(leaves):
        if i in used:
            continue
        if e.key and e.key[0] in ruled_tops or not passthrough or e.key in claimed:
            unused.append(i)
        else:
            layout = Layout(e.shape, e.dtype, e.chunk_shape, e.inner_chunk_shape, e.sharding) \
                if isinstance(e, ArrayEntry) else None
            made.append((e.key, (i,), _PASS, layout, ()))
    mapped = _build(ckpt, made, unused, file)
    mapped.claimed = {i for i in unused if leaves[i].key in claimed}
    return mapped


_PASS = Rule((), (), None, False, "passthrough")


def _source_layout(rule: Rule, srcs: list[Entry], file: str) -> Layout | None:
    first = srcs[0]
    if isinstance(first, ValueEntry):
        if len(srcs) > 1:
            raise MappingError(f"rule {rule.label!r} combines {key_str(first.key)}, which is a value, "
                               f"not an array, with other leaves", code="mapping.shape", file=file,
                               leaf=key_str(first.key))
        return None
    layout = Layout(first.shape, first.dtype, first.chunk_shape, first.inner_chunk_shape, first.sharding)
    if rule.same or rule.stack:  # several leaves of one shape and dtype
        for e in srcs[1:]:
            if not isinstance(e, ArrayEntry) or e.shape != first.shape or e.dtype != first.dtype:
                what = f"{key_str(e.key)} ({list(e.shape)} {e.dtype})" if isinstance(e, ArrayEntry) else \
                    f"{key_str(e.key)} (a value)"
                how = f" cannot stack {what} with " if rule.stack else f": {what} must match "
                raise MappingError(f"rule {rule.label!r}{how}{key_str(first.key)} ({list(first.shape)} {first.dtype})",
                                   code="mapping.shape", file=file, leaf=key_str(e.key))
        if rule.same:
            return layout
        return Layout((len(srcs),) + first.shape, first.dtype, (1,) + first.chunk_shape,
                      (1,) + first.inner_chunk_shape, None)
    if rule.concat_axis is None:
        return layout
    axis = rule.concat_axis
    rank = len(first.shape)
    if not -rank <= axis < rank:
        raise MappingError(f"rule {rule.label!r}: concat axis {axis} does not fit rank {rank}",
                           code="mapping.shape", file=file, leaf=key_str(first.key))
    axis %= rank
    total = 0
    for e in srcs:
        if not isinstance(e, ArrayEntry) or e.dtype != first.dtype or len(e.shape) != rank or \
                any(a != b for d, (a, b) in enumerate(zip(e.shape, first.shape)) if d != axis):
            what = f"{list(e.shape)} {e.dtype}" if isinstance(e, ArrayEntry) else "a value"
            raise MappingError(f"rule {rule.label!r} cannot concatenate {key_str(e.key)} ({what}) with "
                               f"{key_str(first.key)} ({list(first.shape)} {first.dtype}) along axis {axis}",
                               code="mapping.shape", file=file, leaf=key_str(e.key))
        total += e.shape[axis]
    shape = list(first.shape)
    shape[axis] = total
    chunk = list(first.chunk_shape)
    inner = list(first.inner_chunk_shape)
    chunk[axis] = min(chunk[axis], total) or 1
    inner[axis] = max(1, math.gcd(inner[axis], chunk[axis]))
    return Layout(tuple(shape), first.dtype, tuple(chunk), tuple(inner), None)


def _check_split_total(rule: Rule, src: Entry, layout: Layout | None, file: str) -> None:
    total = rule.extra.get("split_total")
    if total is None or layout is None:
        return
    axis = rule.extra["split_axis"] % max(1, len(layout.shape))
    if layout.shape[axis] != total:
        raise MappingError(f"rule {rule.label!r} splits axis {axis} into parts of {total} elements in all, "
                           f"but {key_str(src.key)} has {layout.shape[axis]} there (shape {list(layout.shape)})",
                           code="mapping.shape", file=file, leaf=key_str(src.key))


def _build(ckpt: Any, specs: list[tuple[Key, tuple[int, ...], Rule, Layout | None, tuple[Transform, ...]]],
           unused: list[int], file: str) -> MappedCheckpoint:
    base_leaves = ckpt.manifest.leaves
    specs.sort(key=lambda s: s[1][0])
    seen: dict[Key, Rule] = {}
    plans: list[Planned] = []
    related: dict[Any, set[Any]] = {}
    for tkey, srcs, rule, layout, transforms in specs:
        if tkey in seen:
            raise MappingError(f"two rules make target {key_str(tkey)}: {seen[tkey].label!r} and {rule.label!r}",
                               code="mapping.conflict", file=file, leaf=key_str(tkey))
        seen[tkey] = rule
        src = base_leaves[srcs[0]]
        if layout is None:
            entry: Entry = ValueEntry(tkey, src.type, None)  # type: ignore[union-attr]
        else:
            entry = ArrayEntry(tkey, src.path, layout.shape, layout.dtype,  # type: ignore[union-attr]
                               dtypes.storage_name(layout.dtype), layout.chunk_shape, layout.inner_chunk_shape,
                               src.compression, layout.sharding)  # type: ignore[union-attr]
        plans.append(Planned(len(plans), entry, srcs, rule,
                             transforms, rule.concat_axis))
        if tkey and src.key:
            related.setdefault(tkey[0], set()).add(src.key[0])
    tree = _tree([p.entry.key for p in plans], file)
    m = ckpt.manifest
    manifest = Manifest(tree=tree, leaves=[p.entry for p in plans], producer=m.producer, values=m.values,
                        metadata=m.metadata, version=m.version)
    return MappedCheckpoint(ckpt, manifest, plans, unused, related)


def _tree(keys: list[Key], file: str) -> Node:
    """The tree structure of the target keys: dicts, and lists where keys are 0..n-1."""
    root: dict[Any, Any] = {}
    for idx, key in enumerate(keys):
        if not key:
            if len(keys) > 1:
                raise MappingError("a target key is the root, but there are other targets",
                                   code="mapping.conflict", file=file)
            return {"kind": "leaf", "index": 0}
        node = root
        for depth, k in enumerate(key[:-1]):
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise MappingError(f"target {key_str(key)} lies below target {key_str(key[:depth + 1])}, "
                                   f"which is a leaf", code="mapping.conflict", file=file, leaf=key_str(key))
            node = nxt
        if key[-1] in node:
            raise MappingError(f"target {key_str(key)} is both a leaf and a subtree", code="mapping.conflict",
                               file=file, leaf=key_str(key))
        node[key[-1]] = idx
    return _node(root)


def _node(obj: Any) -> Node:
    if isinstance(obj, int):
        return {"kind": "leaf", "index": obj}
    keys = list(obj)
    if keys and all(isinstance(k, int) and not isinstance(k, bool) for k in keys) and \
            sorted(keys) == list(range(len(keys))):
        return {"kind": "list", "items": [_node(obj[i]) for i in range(len(keys))]}
    return {"kind": "dict", "items": [[k, _node(v)] for k, v in obj.items()]}
