"""JSON documents as the format's readers take them: no member given twice (``json`` would silently keep
the last one, where another reader keeps the first), and no ``NaN`` or ``Infinity`` (not JSON)."""

from __future__ import annotations

import json
import math
from typing import Any

#: The strings strict JSON holds the floats it has no literal for as (protobuf's JSON mapping writes them so).
NON_FINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An ``object_pairs_hook`` building one JSON object; a member named twice is a ``ValueError``."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"member {twice[:160]!r} appears twice in one object")
    return out


def _not_json(token: str) -> Any:
    """A ``parse_constant`` hook: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259)."""
    raise ValueError(f"{token} is not a JSON value (RFC 8259 has no NaN or Infinity)")


def loads(text: str) -> Any:
    """A JSON document as the format's readers take it: no member twice in one object, no ``NaN``,
    ``Infinity`` or ``-Infinity`` (Python's ``json`` accepts them; other readers refuse them). Any defect
    is a ``ValueError`` (a document nesting too deeply: ``RecursionError``)."""
    return json.loads(text, object_pairs_hook=unique_members, parse_constant=_not_json)


def finite(obj: Any) -> Any:
    """``obj`` (JSON-able: dicts, lists, numbers, strings) with every NaN or infinite float as the string
    ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (:data:`NON_FINITE`), so that it writes as strict JSON: a
    NaN metric in a manifest's metadata, a difference in ``xckpt diff --json``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if obj != obj else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


class _Constant(float):
    """A ``NaN``/``Infinity``/``-Infinity`` token a lenient parse met (see :func:`loads_marking_constants`)."""


def loads_marking_constants(text: str) -> Any:
    """:func:`loads`, except that ``NaN``, ``Infinity`` and ``-Infinity`` parse as floats marked as such
    (:func:`has_constant` finds them): for a reader that admits them in one free-form part of a document
    (older xckpt wrote a NaN metric into a manifest's ``metadata`` so) and nowhere else."""
    return json.loads(text, object_pairs_hook=unique_members, parse_constant=lambda t: _Constant(t.lower()
                      .replace("infinity", "inf")))


def has_constant(obj: Any) -> bool:
    """Whether ``obj`` (from :func:`loads_marking_constants`) holds a ``NaN`` or ``Infinity`` token (walked
    without recursion: a hostile document may nest as deep as the parser allows)."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, _Constant):
            return True
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False
