"""Mapping rules: which stored leaves become which target leaves, through which transforms.

A rule matches source keys with a :class:`~xckpt.mapping.patterns.Pattern` and
produces one or more outputs, each a target pattern and a list of transforms:

* :func:`rename` — one source, one target (optionally transformed);
* :func:`split` — one fused source (QKV), several targets, each a slice of it;
* :func:`concat` — several sources (matched together through shared captures)
  concatenated into one target;
* :func:`stack` — several leaves of one shape stacked along a new first axis
  (per-layer tensors -> one scanned array);
* :func:`same` — several sources that must hold the same value, one target
  (torch's per-parameter Adam ``step`` -> optax's ``count``; checked when read);
* :func:`drop` — consume sources without producing anything.

Rules are tried in order and a source leaf is used by the first rule that
matches it. A required rule (the default) that matches nothing is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping as TMapping, Sequence

import tensorstore as ts

from xckpt.format.tree import Key
from xckpt.mapping.errors import MappingError
from xckpt.mapping.patterns import Pattern, PatternLike
from xckpt.mapping.transforms import Layout, Slice, Transform, TransformError


@dataclass(frozen=True)
class Output:
    """One target of a rule: a target key pattern and the transforms leading to it."""

    target: Pattern
    transforms: tuple[Transform, ...] = ()


@dataclass(frozen=True)
class Rule:
    """A mapping rule (build one with :func:`rename`, :func:`split`, :func:`concat`, :func:`drop`)."""

    sources: tuple[Pattern, ...]
    outputs: tuple[Output, ...]
    concat_axis: int | None = None
    required: bool = True
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    same: bool = False  # several sources that must hold the same value (not concatenated)
    stack: bool = False  # sources stacked along a new axis ``concat_axis`` = 0 (per-layer -> scanned)

    @property
    def label(self) -> str:
        """How messages name the rule."""
        if self.name:
            return self.name
        src = " + ".join(p.text for p in self.sources)
        dst = ", ".join(o.target.text for o in self.outputs) or "(dropped)"
        return f"{src} -> {dst}"

    def rerooted(self, source: tuple[Key, Key, Key], target: tuple[Key, Key, Key],
                 name: str = "") -> "Rule | None":
        """The same rule moved to other subtrees (how optimizer state mirrors parameter rules).

        ``source`` and ``target`` are ``(old_prefix, new_prefix, suffix)`` each; None when a
        pattern does not start with its old prefix.
        """
        sources = [p.with_affixes(*source) for p in self.sources]
        outputs = []
        for o in self.outputs:
            t = o.target.with_affixes(*target)
            if t is None:
                return None
            outputs.append(Output(t, o.transforms))
        if any(s is None for s in sources):
            return None
        return Rule(tuple(sources), tuple(outputs), self.concat_axis, False,  # type: ignore[arg-type]
                    name or (f"{self.label} (mirrored)"), self.extra, self.same, self.stack)


def _transforms(transforms: Sequence[Transform]) -> tuple[Transform, ...]:
    flat: list[Transform] = []
    for t in transforms:
        if isinstance(t, (list, tuple)):
            flat.extend(t)
        elif isinstance(t, Transform):
            flat.append(t)
        else:
            raise MappingError(f"{t!r} is not a transform (use xckpt.mapping.transpose, cast, reshape)",
                            code="mapping.transform")
    return tuple(flat)


def rename(source: PatternLike, target: PatternLike, *transforms: Transform, required: bool = True,
           name: str = "") -> Rule:
    """Map each source leaf matching ``source`` to ``target``, through ``transforms`` in order."""
    src = Pattern(source)
    out = Pattern(target)
    _check_fields(src, [out])
    return Rule((src,), (Output(out, _transforms(transforms)),), None, required, name)


def split(source: PatternLike, parts: TMapping[PatternLike, int] | Sequence[PatternLike], *, axis: int = 0,
          then: Sequence[Transform] = (), required: bool = True, name: str = "") -> Rule:
    """Split a fused leaf along ``axis`` into several targets.

    ``parts`` maps each target pattern to its size along ``axis`` (in order), or lists
    targets that get equal shares. ``then`` transforms are applied to each part.
    """
    src = Pattern(source)
    items = list(parts.items()) if isinstance(parts, TMapping) else [(p, None) for p in parts]
    if not items:
        raise MappingError("split needs at least one part", code="mapping.pattern")
    outputs, start = [], 0
    sizes = [s for _, s in items]
    equal = all(s is None for s in sizes)
    if not equal and any(s is None for s in sizes):
        raise MappingError("split: give a size for every part, or for none", code="mapping.pattern")
    for i, (target, size) in enumerate(items):
        if equal:
            piece: Transform = _EqualSlice(axis, i, len(items))
        else:
            piece = Slice(axis, start, start + int(size))  # type: ignore[arg-type]
            start += int(size)  # type: ignore[arg-type]
        outputs.append(Output(Pattern(target), (piece,) + _transforms(then)))
    _check_fields(src, [o.target for o in outputs])
    return Rule((src,), tuple(outputs), None, required, name, {"split_total": None if equal else start,
                                                                "split_axis": axis})


def concat(sources: Sequence[PatternLike], target: PatternLike, *, axis: int = 0,
           then: Sequence[Transform] = (), required: bool = True, name: str = "") -> Rule:
    """Concatenate several leaves along ``axis`` into one target (fusing, e.g., q, k, v into qkv).

    Each match of the first source pattern selects the other sources by filling in
    the same captures; all of them must exist.
    """
    pats = tuple(Pattern(s) for s in sources)
    if len(pats) < 2:
        raise MappingError("concat needs at least two sources", code="mapping.pattern")
    out = Pattern(target)
    for p in pats[1:]:
        _check_fields(pats[0], [p])
    _check_fields(pats[0], [out])
    return Rule(pats, (Output(out, _transforms(then)),), axis, required, name)


def same(sources: Sequence[PatternLike], target: PatternLike, *transforms: Transform, required: bool = True,
         name: str = "") -> Rule:
    """One target from several leaves that must be equal (checked when read; a difference fails the load)."""
    pats, out = _one_from_many("same", sources, target)
    return Rule(pats, (Output(out, _transforms(transforms)),), None, required, name, same=True)


def stack(sources: Sequence[PatternLike], target: PatternLike, *, then: Sequence[Transform] = (),
          required: bool = True, name: str = "") -> Rule:
    """Stack several leaves of one shape along a new first axis (per-layer tensors -> one scanned array)."""
    pats, out = _one_from_many("stack", sources, target)
    return Rule(pats, (Output(out, _transforms(then)),), 0, required, name, stack=True)


def _one_from_many(what: str, sources: Sequence[PatternLike], target: PatternLike) -> tuple[tuple[Pattern, ...],
                                                                                               Pattern]:
    """The source patterns and target pattern of a rule making one leaf from several (fields checked)."""
    pats = tuple(Pattern(s) for s in sources)
    if not pats:
        raise MappingError(f"{what} needs at least one source", code="mapping.pattern")
    out = Pattern(target)
    for p in pats[1:] + (out,):
        _check_fields(pats[0], [p])
    return pats, out


def drop(source: PatternLike, *, required: bool = False, name: str = "") -> Rule:
    """Consume the leaves matching ``source`` without loading them anywhere."""
    return Rule((Pattern(source),), (), None, required, name)


def _check_fields(source: Pattern, targets: Sequence[Pattern]) -> None:
    for t in targets:
        extra = [f for f in t.fields if f not in source.fields]
        if extra:
            raise MappingError(f"target pattern {t.text!r} uses {extra}, which source pattern {source.text!r} "
                            f"does not capture", code="mapping.pattern")


@dataclass(frozen=True)
class _EqualSlice(Transform):
    """Part ``index`` of ``count`` equal parts along ``axis`` (sizes known only from the source)."""

    axis: int
    index: int
    count: int

    def resolve(self, shape: tuple[int, ...]) -> Slice:
        """The concrete slice for a source of ``shape``."""
        rank = len(shape)
        if not -rank <= self.axis < rank:
            raise TransformError(f"split along axis {self.axis} does not fit an array of rank {rank}")
        n = shape[self.axis % rank]
        if n % self.count:
            raise TransformError(f"axis {self.axis % rank} of size {n} (shape {list(shape)}) does not split "
                                 f"into {self.count} equal parts")
        step = n // self.count
        return Slice(self.axis, self.index * step, (self.index + 1) * step)

    def apply(self, layout: Layout) -> Layout:
        """See :meth:`resolve`."""
        return self.resolve(layout.shape).apply(layout)

    def view(self, store: ts.TensorStore) -> ts.TensorStore:
        """See :meth:`resolve`."""
        return self.resolve(tuple(store.shape)).view(store)

    def __str__(self) -> str:
        return f"split(axis={self.axis}, part {self.index + 1} of {self.count})"
