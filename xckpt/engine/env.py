"""xckpt's settings from the environment (``XCKPT_*``), parsed in one place: a value that is not what its
variable takes is a ``config.env`` error naming the variable, not a traceback from deep inside a save."""

from __future__ import annotations

import math
import os

from xckpt.errors import XckptError


def number(name: str, default: float, *, minimum: float = 0.0, integer: bool = False) -> float:
    """The environment variable ``name`` as a number of at least ``minimum`` (an integer with ``integer``);
    ``default`` when it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        kind = "an integer" if integer else "a number"
        raise XckptError(f"the environment variable {name}={raw!r} must be {kind} of at least {minimum:g}",
                         code="config.env")
    return value


def flag(name: str) -> bool:
    """The environment variable ``name`` as a switch: ``1``, ``true``, ``yes`` or ``on`` (any case) turn it on;
    unset, empty, ``0``, ``false``, ``no`` or ``off`` leave it off; anything else is ``config.env``."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise XckptError(f"the environment variable {name}={raw!r} must be 1 or 0 (true or false)", code="config.env")
