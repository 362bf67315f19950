"""JSON documents as the format's readers take them: no member given twice (``json`` would silently keep
the last one, where another reader keeps the first), and no ``NaN`` or ``Infinity`` (not JSON); and the
JSON files other programs wrote, as Python's ``json`` reads them, every defect a specific error
(:func:`parse_json`)."""

from __future__ import annotations

import json
import math
from typing import Any

from xckpt.errors import ManifestError

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


def string_member(raw: bytes, name: str) -> str | None:
    """The string member ``name`` of the JSON object ``raw`` holds (a manifest's or a claim's ``generation``),
    read as Python's ``json`` reads it; None when ``raw`` is no JSON object or the member no string."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    found = obj.get(name) if isinstance(obj, dict) else None
    return found if isinstance(found, str) else None


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


def is_unicode(text: str) -> bool:
    """Whether ``text`` is valid Unicode: encodable as UTF-8 (JSON's ``\\ud800`` escapes can make a lone
    surrogate, which cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _strings_unicode(obj: Any) -> bool:
    """Whether every string of a parsed JSON document (keys too) is valid Unicode; walked without recursion."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not is_unicode(v):
                return False
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


def parse_json(raw: bytes, what: str, *, code: str, file: str, leaf: str | None = None) -> Any:
    """The JSON document ``raw`` that another program wrote (Orbax's files, a Hugging Face ``config.json``;
    ``what`` names it in errors), read as Python's own ``json`` reads it (which that program used).

    Not UTF-8, not JSON, a number beyond Python's digit limit, nesting too deep to parse, or a string that is
    not valid Unicode (a lone ``\\ud800`` escape, which nothing can print or store) raises
    :class:`~xckpt.errors.ManifestError` with ``code``, naming ``file`` (and ``leaf`` when given).
    """
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        why = "it nests too deeply to be parsed" if isinstance(exc, RecursionError) else str(exc)[:300]
        raise ManifestError(f"{what} is not valid JSON: {why}", code=code, file=file, leaf=leaf) from None
    if b"\\u" in raw and not _strings_unicode(obj):  # only a \\u escape makes a lone surrogate
        raise ManifestError(f"{what} holds a string that is not valid Unicode (a lone surrogate)", code=code,
                            file=file, leaf=leaf)
    return obj
