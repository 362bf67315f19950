"""The one Protocol every stored-checkpoint source implements."""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import tensorstore as ts

from xckpt.engine.read import ReadRequest
from xckpt.engine.storage import Location
from xckpt.format.manifest import ArrayEntry, Manifest


@runtime_checkable
class Source(Protocol):
    """A stored checkpoint opened for reading."""

    #: Where it is.
    loc: Location
    #: Who wrote it: ``"xckpt"``, ``"orbax"``.
    format: str
    #: Its leaves and tree (for other formats, built from their own metadata).
    manifest: Manifest

    def values(self) -> dict[int, Any]:
        """Its value leaves, by leaf index."""

    def read(self, requests: Sequence[ReadRequest], *, precheck: bool = False) -> int:
        """Fill each request's output (the entry's storage dtype) from the stored arrays; returns bytes read.

        ``precheck``: check every object it will read before writing any output, where it can.
        """

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Check what reading ``requests`` needs (objects there and well formed) without filling any output
        (they may be :func:`~xckpt.engine.read.placeholder` views), before a load allocates its outputs;
        a source that cannot check ahead does nothing (its reads still check)."""

    def open_array(self, entry: ArrayEntry) -> "ts.Future[ts.TensorStore]":
        """A TensorStore view of an array leaf, for lazy transforms."""

    def replaced(self) -> bool:
        """Whether its path now names another checkpoint (or none) than the one opened: every read
        still comes from the one opened, or fails (see :func:`xckpt.load`)."""

    def close(self) -> None:
        """Release what it holds open."""
