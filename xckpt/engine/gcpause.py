"""Pausing Python's cyclic garbage collector while a save or load builds its many small objects.

A tree of ten thousand leaves makes hundreds of thousands of objects that all stay alive
until the operation ends; the collector would traverse them again and again for nothing
(it found no cycle to free in our measurements, and cost a third of such a save's time).
Reference counting still frees everything as usual; only the cycle search waits.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic garbage collector for the block (restored, and nested pauses allowed)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
