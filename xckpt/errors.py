"""Every error xckpt raises derives from :class:`XckptError`.

Each error carries a stable ``code`` (the same codes the validator reports and
the spec lists), and where known the ``file`` and ``leaf`` it concerns.
"""

from __future__ import annotations

from typing import Any


class XckptError(Exception):
    """Base class of every xckpt error."""

    code: str = "error"

    def __init__(self, message: str, *, code: str | None = None, file: str | None = None,
                 leaf: str | None = None) -> None:
        self.code = code or type(self).code
        self.file = file
        self.leaf = leaf
        where = []
        if leaf is not None:
            where.append(f"leaf {leaf!r}")
        if file is not None:
            where.append(f"file {file}")
        suffix = f" ({', '.join(where)})" if where else ""
        super().__init__(f"[{self.code}] {message}{suffix}")
        self.message = message

    def at(self, *, file: str | None = None, leaf: str | None = None) -> "XckptError":
        """This error with its ``file`` and ``leaf`` filled in where they were not known yet."""
        if (self.file or not file) and (self.leaf or not leaf):
            return self
        return self._copy(self.message, self.file or file, self.leaf or leaf)

    def naming(self, file: str, message: str | None = None) -> "XckptError":
        """This error naming ``file`` instead of its own (and saying ``message``, where given); code and leaf stay."""
        if file == self.file and (message is None or message == self.message):
            return self
        return self._copy(self.message if message is None else message, file, self.leaf)

    def _copy(self, message: str, file: str | None, leaf: str | None) -> "XckptError":
        """A copy of this error (same type, code and extra attributes) with this message, file and leaf."""
        err = type(self).__new__(type(self))
        XckptError.__init__(err, message, code=self.code, file=file, leaf=leaf)
        err.__dict__.update({k: v for k, v in self.__dict__.items() if k not in err.__dict__})
        return err

    def to_json(self) -> dict[str, Any]:
        """The error as a JSON-able finding."""
        return {"code": self.code, "message": self.message, "file": self.file, "leaf": self.leaf}

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the same error (torch.distributed.checkpoint sends a rank's exception to the others)."""
        return (_restore, (type(self), self.args, self.__dict__.copy()))


def _restore(cls: type, args: tuple[Any, ...], state: dict[str, Any]) -> XckptError:
    """An unpickled :class:`XckptError`: its message and attributes, without calling ``__init__``."""
    err = cls.__new__(cls, *args)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class NotACheckpointError(XckptError):
    """The path holds no committed checkpoint (no manifest)."""

    code = "manifest.missing"


class ManifestError(XckptError):
    """The manifest is unreadable or does not conform to the schema."""

    code = "manifest.invalid"


class VersionError(XckptError):
    """The manifest names a format version this reader does not support."""

    code = "manifest.version"


class UnsafePathError(XckptError):
    """A stored path would leave the checkpoint (``..``, absolute, link)."""

    code = "path.unsafe"


class ShapeError(XckptError):
    """A shape is invalid, absurdly large, or does not match."""

    code = "shape.invalid"


class DataError(XckptError):
    """Array data is missing, truncated or inconsistent with its metadata."""

    code = "chunk.missing"


class IntegrityError(XckptError):
    """A checksum does not match."""

    code = "checksum.mismatch"


class TreeError(XckptError):
    """The tree given to save or load cannot be handled (bad key, collision, mismatch)."""

    code = "tree.invalid"


class KeyMismatchError(TreeError):
    """Keys requested by a load target and keys stored in the checkpoint differ."""

    code = "tree.key_mismatch"

    def __init__(self, message: str, *, missing: list[str] | None = None,
                 unexpected: list[str] | None = None, mismatched: list[str] | None = None,
                 file: str | None = None, leaf: str | None = None) -> None:
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.mismatched = list(mismatched or [])
        super().__init__(message, file=file, leaf=leaf)


class SaveError(XckptError):
    """A save failed; the target path is left as it was before the save."""

    code = "save.failed"


class RankFailures(XckptError):
    """A collective step failed on one or more processes; ``failures`` holds each one's error by rank
    (as :func:`xckpt.engine.collective.describe` gives it), and every process raises the same.

    Its ``code`` is the failing processes' code when they all share one, else ``collective.failed``;
    its ``file`` and ``leaf`` are those of a single failure. A save raises :class:`CollectiveError`,
    a load :class:`CollectiveLoadError`.
    """

    code = "collective.failed"

    def __init__(self, what: str, failures: dict[int, dict[str, Any]]) -> None:
        self.failures = dict(sorted(failures.items()))
        one = self.failures[next(iter(self.failures))] if len(self.failures) == 1 else None
        parts = []
        for rank, f in self.failures.items():
            where = "" if one else ", ".join(x for x in (f"leaf {f['leaf']!r}" if f.get("leaf") else "",
                                                          f"file {f['file']}" if f.get("file") else "") if x)
            label = f.get("type") if f.get("code") == "error" else f.get("code")  # another exception: its type
            parts.append(f"rank {rank}: [{label}] {f.get('message')}" + (f" ({where})" if where else ""))
        codes = {f.get("code") for f in self.failures.values()}
        XckptError.__init__(self, f"{what} failed on {'rank' if one else 'ranks'} {sorted(self.failures)}: "
                            + "; ".join(parts), code=codes.pop() if len(codes) == 1 and None not in codes else None,
                            file=one.get("file") if one else None, leaf=one.get("leaf") if one else None)


class CollectiveError(RankFailures, SaveError):
    """A step of a collective save failed on one or more processes (see :class:`RankFailures`). Nothing was
    committed."""


class CollectiveLoadError(RankFailures):
    """A collective load failed on one or more processes (see :class:`RankFailures`): none returns anything,
    so a job never goes on with some processes restored and others not (``tree.key_mismatch`` when each
    rank's target differs)."""


class CoordinationError(XckptError):
    """Processes taking part in a collective save or load disagree."""

    code = "coord.mismatch"


class ResourceError(XckptError):
    """A load would need more memory than allowed."""

    code = "resource.too_large"


class UnsupportedError(XckptError):
    """A value, dtype or feature that this version of xckpt does not handle."""

    code = "unsupported"


class XckptWarning(UserWarning):
    """A problem reported instead of raised (a non-strict load, a missing commit marker)."""
