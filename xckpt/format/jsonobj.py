"""JSON objects as the format's readers take them: no member given twice (``json`` would silently keep
the last one, where another reader keeps the first)."""

from __future__ import annotations

from typing import Any


def unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An ``object_pairs_hook`` building one JSON object; a member named twice is a ``ValueError``."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"member {twice[:160]!r} appears twice in one object")
    return out
