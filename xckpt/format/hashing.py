"""Hash crowding: many keys of a file that share one hash (pure functions).

Python's dicts and sets find a key by its hash; keys that share one are compared one by one, so
n of them cost n**2 comparisons. Strings hash differently in every process, but ints and tuples of
ints do not: ``-1`` and ``-2`` share a hash, and so does every multiple of ``2**61 - 1``, so a
crafted file of a few hundred kilobytes can make a reader spin for minutes on its keys. A reader
looks at the keys' hashes first (one pass) and refuses a file where too many share one.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Iterable

#: Most keys of one file that may share a hash: far above what chance gives, far below a slow lookup.
MAX_SHARED_HASH = 64


def crowded(keys: Iterable[Hashable], limit: int = MAX_SHARED_HASH) -> tuple[Hashable, int] | None:
    """A key whose hash more than ``limit`` of ``keys`` share, and how many do; None when none is that
    crowded. Computes each key's hash once and never compares keys."""
    counts: Counter[int] = Counter()
    first: dict[int, Hashable] = {}
    for key in keys:
        h = hash(key)
        counts[h] += 1
        first.setdefault(h, key)
    if not counts:
        return None
    h, n = counts.most_common(1)[0]
    return (first[h], n) if n > limit else None
