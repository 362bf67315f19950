"""The error a wrong mapping raises."""

from __future__ import annotations

from xckpt.errors import TreeError


class MappingError(TreeError):
    """A mapping does not fit: a bad pattern, a rule that matches nothing, two rules for one
    target, a shape that does not fit. Raised when the mapping is built or applied to the
    manifest, before any array data is read.
    """

    code = "mapping.invalid"
