"""Where a checkpoint's bytes live, and how small files move: one job per function.

Every byte goes through a TensorStore key-value store, so the same code serves a
local directory and (through TensorStore's kvstore drivers) an object store. The
directory-level commit (write under a temporary name, then rename) applies to
local file systems only; elsewhere the manifest written last is the commit.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import tensorstore as ts

from xckpt.errors import XckptError


@dataclass(frozen=True)
class Location:
    """A checkpoint root: a local directory or a kvstore URL prefix."""

    url: str

    @classmethod
    def of(cls, path: "str | os.PathLike[str] | Location") -> "Location":
        """Normalise a path or URL into a Location."""
        if isinstance(path, Location):
            return path
        text = os.fspath(path)
        if "://" in text:
            return cls(text.rstrip("/"))
        return cls(os.path.abspath(text))

    @property
    def is_local(self) -> bool:
        """Whether this is a plain local directory."""
        return "://" not in self.url or self.url.startswith("file://")

    @property
    def local_path(self) -> str:
        """The local directory (only for local locations)."""
        return self.url[len("file://"):] if self.url.startswith("file://") else self.url

    def kvstore(self, sub: str = "") -> dict[str, Any]:
        """TensorStore kvstore spec of this root, or of ``sub`` under it (a directory)."""
        tail = sub.rstrip("/") + "/" if sub else ""
        if self.is_local:
            return {"driver": "file", "path": self.local_path.rstrip("/") + "/" + tail}
        if self.url.startswith("s3://"):
            return s3_spec(self.url, tail)
        return dict(ts.KvStore.Spec(self.url + "/" + tail).to_json())

    def child(self, name: str) -> "Location":
        """The location of ``name`` under this one."""
        return Location(self.url.rstrip("/") + "/" + name)

    def __str__(self) -> str:
        return self.url


def s3_spec(url: str, tail: str = "") -> dict[str, Any]:
    """The kvstore spec of an ``s3://bucket/prefix`` URL.

    The endpoint and region come from the standard AWS variables (``AWS_ENDPOINT_URL_S3``
    or ``AWS_ENDPOINT_URL``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``), so any
    S3-compatible store works; credentials come from the usual AWS sources.
    """
    bucket, _, prefix = url[len("s3://"):].partition("/")
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket,
                            "path": (prefix.strip("/") + "/" if prefix.strip("/") else "") + tail}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    return spec


_open_cache: dict[str, ts.KvStore] = {}


def _kv(loc: Location) -> ts.KvStore:
    key = json.dumps(loc.kvstore(), sort_keys=True)
    kv = _open_cache.get(key)
    if kv is None:
        kv = ts.KvStore.open(loc.kvstore()).result()
        if len(_open_cache) > 64:
            _open_cache.clear()
        _open_cache[key] = kv
    return kv


def read_bytes(loc: Location, name: str, byte_range: slice | None = None) -> bytes | None:
    """The bytes of ``name`` under ``loc`` (or of a byte range), None when missing."""
    try:
        res = _kv(loc).read(name, byte_range=byte_range).result()
    except ValueError as exc:
        raise XckptError(f"cannot read: {exc}", code="io.read", file=name) from exc
    return bytes(res.value) if res.state == "value" else None


def write_bytes(loc: Location, name: str, data: bytes) -> None:
    """Write ``name`` under ``loc`` (atomic on file systems and object stores alike)."""
    _kv(loc).write(name, data).result()


def exists(loc: Location, name: str) -> bool:
    """Whether ``name`` exists under ``loc``."""
    if loc.is_local:
        return os.path.isfile(os.path.join(loc.local_path, name))
    return read_bytes(loc, name, slice(0, 0)) is not None


def list_names(loc: Location, prefix: str = "") -> list[str]:
    """Every stored name under ``loc`` (below ``prefix``), sorted."""
    kv = _kv(loc)
    if prefix:
        rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
        keys = kv.list(rng).result()
    else:
        keys = kv.list().result()
    return sorted(k.decode() for k in keys)


def size_of(loc: Location, name: str) -> int | None:
    """The byte size of ``name`` under ``loc``, None when missing."""
    if loc.is_local:
        try:
            return os.stat(os.path.join(loc.local_path, name)).st_size
        except FileNotFoundError:
            return None
    data = read_bytes(loc, name)
    return None if data is None else len(data)


def temporary_sibling(loc: Location) -> Location:
    """A fresh temporary location beside ``loc`` to write into before the commit rename."""
    if not loc.is_local:
        return loc
    parent, name = os.path.split(loc.local_path.rstrip("/"))
    return Location(os.path.join(parent, f".{name}.xckpt-tmp-{uuid.uuid4().hex[:12]}"))


def publish(tmp: Location, final: Location, *, overwrite: bool) -> None:
    """Move a completely written checkpoint from ``tmp`` to ``final`` (local file systems).

    With ``overwrite``, an existing checkpoint at ``final`` is moved aside first and
    removed only after the new one is in place, so a crash leaves one of them whole.
    """
    if tmp == final:
        return
    target = final.local_path
    old = None
    if os.path.lexists(target):
        if not overwrite:
            raise XckptError(f"{target} already exists; pass overwrite=True to replace it",
                             code="save.exists", file=target)
        old = tmp.local_path + ".old"
        os.rename(target, old)
    try:
        os.rename(tmp.local_path, target)
    except OSError:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove(loc: Location) -> None:
    """Delete everything under ``loc`` (best effort; used to clean up a failed save)."""
    if loc.is_local:
        shutil.rmtree(loc.local_path, ignore_errors=True)
        return
    try:
        ts.KvStore.open(loc.kvstore()).result().delete_range(ts.KvStore.KeyRange()).result()
    except Exception:  # noqa: BLE001 - cleanup is best effort
        pass
