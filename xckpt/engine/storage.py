"""Where a checkpoint's bytes live: a local directory or an object-store prefix, behind one :class:`Store`.

:class:`LocalStore` uses plain system calls: it opens every path component relative to
the checkpoint root without following symbolic links, opens files without blocking and
refuses anything but a regular file (a link or a FIFO in a checkpoint is an error, never
followed or waited on), reads straight into the caller's buffer, and fsyncs what it wrote.
One kind of link is followed: in a Hugging Face hub cache snapshot
(``<repo>/snapshots/<revision>/``), a file that links to its content in the repository's own
``<repo>/blobs/`` folder, as the hub's downloads lay them out (:func:`hub_blobs`).
:class:`KvStore` serves every other URL through a TensorStore key-value store (``s3://``
among them), so the same engine code writes and reads both.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import crc32c
import numpy as np
import tensorstore as ts

from xckpt.engine import env, hostcopy, threads
from xckpt.engine.atomic import start_writeback, sync_dir
from xckpt.errors import DataError, ResourceError, SaveError, UnsafePathError, UnsupportedError, XckptError
from xckpt.format import shard

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
#: TensorStore's storage generation of a missing key: a write conditioned on it only creates.
ABSENT = b"\x02"
#: Most bytes :meth:`Store.read` returns unless its caller names another limit: a larger object (a
#: manifest or an Orbax ``_METADATA`` read whole, say) is refused with ``resource.too_large``.
MAX_READ_BYTES = 256 << 20


def _dir_cache() -> int:
    """Directory descriptors one LocalStore keeps open: enough for a load to visit every leaf's two
    directories once (a leaf ``a`` reads ``a/zarr.json`` and ``a/c/0``) for a few hundred leaves, and at
    most a quarter of the process's descriptor limit."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        soft = 1024
    return max(32, min(1024, (soft if soft > 0 else 1 << 20) // 4))


#: Directory descriptors one LocalStore keeps open.
_DIR_CACHE = _dir_cache()


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
            scheme, sep, rest = text.partition("://")
            if scheme == "s3" and not rest.partition("/")[0]:
                raise UnsupportedError(f"{text!r} names no bucket: an object-store path is s3://bucket or "
                                       "s3://bucket/prefix", file=text)
            return cls(scheme + sep + rest.rstrip("/"))  # "s3://b/" is "s3://b"; never a local path
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
        try:
            return dict(ts.KvStore.Spec(self.url + "/" + tail).to_json())
        except ValueError as exc:
            raise UnsupportedError(f"{self.url} is neither a local path nor a URL of a store xckpt reads "
                                   f"(s3://bucket/prefix): {exc}", file=self.url) from None

    def child(self, name: str) -> "Location":
        """The location of ``name`` under this one."""
        return Location(self.url.rstrip("/") + "/" + name)

    def store(self, *, create: bool = False) -> "Store":
        """A store over this location (``create``: make a missing local root directory)."""
        return LocalStore(self.local_path, create=create) if self.is_local else KvStore(self)

    def __str__(self) -> str:
        return self.url


def s3_spec(url: str, tail: str = "") -> dict[str, Any]:
    """The kvstore spec of an ``s3://bucket/prefix`` URL.

    The endpoint and region come from the standard AWS variables (``AWS_ENDPOINT_URL_S3``
    or ``AWS_ENDPOINT_URL``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``), so any
    S3-compatible store works; credentials come from the usual AWS sources. ``AWS_MAX_ATTEMPTS``
    bounds the attempts of each request (TensorStore's default retries a failing request 32 times
    with a backoff of up to 32 s: a store that stays unreachable holds a save for a quarter of an hour).
    Every write of a save is conditioned on the object's absence (:class:`KvStore`): TensorStore sends it as one
    ``PUT`` with ``If-None-Match: *`` to Amazon's endpoints, and to others asks with a ``HEAD`` first (a store
    that ignores the header, as some Ceph versions do, then still refuses an object that is there); on a store
    known to honour it (MinIO, R2), ``XCKPT_S3_CONDITIONAL_PUT=1`` saves that round trip (TensorStore's
    ``use_conditional_write``).
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
    attempts = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if attempts.isdigit() and int(attempts) >= 1:
        spec["context"] = {"s3_request_retries": {"max_retries": int(attempts) - 1}}
    if env.flag("XCKPT_S3_CONDITIONAL_PUT"):
        spec["use_conditional_write"] = True
    return spec


class Blob(Protocol):
    """One stored object opened for reading."""

    name: str
    #: Its size in bytes (None where the store cannot tell without reading it all).
    size: int | None

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8, contiguous) with the bytes at ``offset``; a short object is an error."""

    def read_tail(self, n: int) -> np.ndarray:
        """The last ``n`` bytes."""

    def close(self) -> None:
        """Release the object."""


class Store(Protocol):
    """The objects under one checkpoint root (names are '/'-separated, relative to the root)."""

    location: Location
    #: Whether every request waits a round trip (an object store), so that reads gain from being sent
    #: at once; False where a small read costs less than handing it to another thread (a local directory).
    remote: bool
    #: The objects this store's writes created where another writer can reach the same names (an object store,
    #: written in place), each with the version (storage generation) it was created at; always empty for a local
    #: directory, where a save writes only into a directory of its own.
    created: dict[str, bytes]

    def open(self, name: str) -> Blob | None:
        """Open an object for reading; None when it does not exist."""

    def read(self, name: str, limit: int = MAX_READ_BYTES) -> bytes | None:
        """A whole (small) object, None when missing; one above ``limit`` bytes is refused
        (:class:`~xckpt.errors.ResourceError`, naming the file)."""

    def prefetch(self, names: Sequence[str], limit: int) -> dict[str, bytes]:
        """Of ``names``, the objects of at most ``limit`` bytes, read whole with every request sent at
        once, where that saves round trips (an object store); where it saves nothing (a local
        directory), none. What is missing, larger, or cannot be read is left out, for the caller to
        read its own way (:meth:`open`, :meth:`read`), which says what is wrong with it."""

    def write(self, name: str, data: Any, *, atomic: bool = False) -> None:
        """Create an object with ``data`` (a bytes-like object, or an iterable of them and of deferred
        parts, :data:`~xckpt.format.shard.Deferred`, written in order, each consumed before the next is
        asked for), durably once :meth:`sync` returns. A save writes each name once, into a directory or
        prefix it holds: where another writer could get there too (an object store, written in place), an
        object that exists already is ``save.conflict``, never replaced (see :class:`KvStore`).

        ``atomic``: a concurrent reader sees the old object or the whole new one, never a part.
        """

    def create(self, name: str, data: bytes) -> bool:
        """Write an object only if none is there, durably; False (nothing written) when one is."""

    def delete(self, name: str) -> None:
        """Delete an object (nothing happens when it is missing)."""

    def delete_created(self, created: Mapping[str, bytes]) -> None:
        """Delete each object of ``created`` (:attr:`created` of the stores a save wrote with) only while it is
        still the version that save created: never one another writer put there since. Best effort: one that
        cannot be deleted stops none of the others."""

    def exists(self, name: str) -> bool:
        """Whether an object exists."""

    def list(self, prefix: str = "") -> list[str]:
        """Every object name under ``prefix``, sorted (links and special files included, as names)."""

    def sync(self) -> None:
        """Make everything written so far durable (directories included)."""

    def replaced(self) -> bool:
        """Whether what this store reads is no longer at its location (another save replaced it)."""

    def kvstore(self, sub: str = "") -> dict[str, Any]:
        """The TensorStore kvstore spec of the directory ``sub`` of what this store reads, for reads
        handed to TensorStore."""

    def close(self) -> None:
        """Release what the store holds open."""


def entry_kind(entry: os.DirEntry[str]) -> str:
    """What a directory entry is (``link``, ``dir``, ``file``, ``fifo``, ``socket``, ``device`` or ``other``),
    from the listing or ``lstat``: a link is never followed, and an entry that cannot be looked at is ``other``."""
    try:
        if entry.is_symlink():
            return "link"
        if entry.is_dir(follow_symlinks=False):
            return "dir"
        if entry.is_file(follow_symlinks=False):
            return "file"
        mode = entry.stat(follow_symlinks=False).st_mode
    except OSError:
        return "other"
    return ("fifo" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode)
            else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "other")


def _file(root: str, name: str) -> str:
    return os.path.join(root, *name.split("/"))


def make_dirs(path: str) -> None:
    """Create the directory ``path`` and any missing parents: one ``mkdir`` when only the last is
    missing (``os.makedirs`` first looks at the parent, a system call per file of a save)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    except FileNotFoundError:  # a parent is missing too
        os.makedirs(path, exist_ok=True)


def _given(data: Any) -> Iterable[Any]:
    """The parts of what :meth:`Store.write` takes, as given: one bytes-like object, or an iterable of them
    and of deferred parts (:data:`~xckpt.format.shard.Deferred`)."""
    if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
        return (data,)
    return data


def _parts(data: Any) -> Iterable[Any]:
    """The parts of what :meth:`Store.write` takes, bytes-like only (a deferred part as its pieces)."""
    return shard.buffers(_given(data))


class LocalBlob:
    """A regular file opened through :class:`LocalStore`."""

    def __init__(self, name: str, root: str, fd: int, size: int) -> None:
        self.name = name
        self.size: int | None = size
        self._root = root
        self._fd = fd

    @property
    def path(self) -> str:
        """Its path, for messages."""
        return _file(self._root, self.name)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` from ``offset`` (preadv straight into the buffer)."""
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise DataError(f"object ends at byte {offset + done}, {len(view) - done} bytes short",
                                code="chunk.truncated", file=self.path)
            done += n

    def read_tail(self, n: int) -> np.ndarray:
        """The last ``n`` bytes."""
        assert self.size is not None
        out = np.empty(n, dtype=np.uint8)
        self.read_into(self.size - n, out)
        return out

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


def _check_size(size: int, limit: int, file: str) -> None:
    """Refuse to read a whole object of ``size`` bytes above ``limit``."""
    if size > limit:
        raise ResourceError(f"the file has {size} bytes, more than the {limit} a reader takes whole",
                            file=file)


def _write_all(fd: int, data: Any) -> None:
    """Write every part of ``data`` to the open file ``fd`` (a deferred part in one compiled call,
    :func:`~xckpt.engine.hostcopy.write_part`, where the helper takes it, else as its pieces)."""
    for part in _given(data):
        pieces: Iterable[Any] = (part,)
        if isinstance(part, shard.Deferred):
            if hostcopy.write_part(fd, part):
                continue
            pieces = part.pieces()
        for piece in pieces:
            view = memoryview(piece)
            if view.ndim != 1 or view.itemsize != 1:
                view = view.cast("B")
            done = os.write(fd, view)
            while done < view.nbytes:  # a short write: the rest
                done += os.write(fd, view[done:])


def _write_synced(fd: int, data: Any) -> None:
    """Write every part of ``data`` to the open file ``fd``, fsync and close it."""
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


#: Files a :class:`LocalStore` keeps open between writing them and fsyncing them; past this many, the
#: thread that writes one more fsyncs and closes all it holds.
MAX_UNSYNCED = 256


def fsync_all(files: list[tuple[int | None, str]]) -> None:
    """fsync and close every ``(descriptor, path)`` (a descriptor None: the directory ``path``, opened there), a
    few at once on :func:`xckpt.engine.threads.sync_pool` (a file system commits concurrent fsyncs together;
    on a disk, 4,000 directories took 0.23 s one after another); every descriptor is closed, then the first
    failure raises a :class:`SaveError` naming its file."""
    def run(group: list[tuple[int | None, str]]) -> int:
        first: BaseException | None = None
        for fd, path in group:
            try:
                if first is None:
                    if fd is None:
                        sync_dir(path)
                    else:
                        os.fsync(fd)
            except OSError as exc:
                first = SaveError(f"cannot sync: {exc.strerror or exc}", code="io.write", file=path)
            finally:
                if fd is not None:
                    os.close(fd)
        if first is not None:
            raise first
        return 0

    if len(files) <= 2:
        run(files)
        return
    n = min(threads.SYNC_THREADS, len(files))
    pool = threads.sync_pool()
    threads.gather([pool.submit(run, files[i::n]) for i in range(n)])


#: How the hub cache names a repository's folder: ``models--<org>--<name>`` and the like.
HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def hub_blobs(root: str) -> str | None:
    """The ``blobs`` folder of the Hugging Face hub cache repository whose snapshot ``root`` is
    (``<repo>/snapshots/<revision>``, the repository's folder named as the cache names it), else None."""
    snapshots = os.path.dirname(os.path.abspath(root))
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or not os.path.basename(repo).startswith(HUB_REPO_PREFIXES):
        return None
    blobs = os.path.join(repo, "blobs")
    return blobs if os.path.isdir(blobs) and not os.path.islink(blobs) else None


class LocalStore:
    """A local checkpoint directory; no path component below the root is followed if it is a link
    (but for a hub cache snapshot's links to its own blobs, :func:`hub_blobs`).

    The root directory is opened once, when the store is made, and every read goes through
    that descriptor: a reader keeps reading the directory it opened even if another save
    replaces the checkpoint at the same path meanwhile (:meth:`replaced` tells).
    """

    remote = False  # (Store.remote)

    def __init__(self, root: str, *, create: bool = False) -> None:
        self.location = Location(root)
        self.root = root
        if create:
            os.makedirs(root, exist_ok=True)
        self._dirs: OrderedDict[tuple[str, ...], int] = OrderedDict()
        self._lock = threading.Lock()
        self._prefix = os.path.join(root, "")  # the root with one trailing separator: a file's path is this + its name
        self._made: set[str] = set()  # directories this store wrote into (made, or found)
        self.created: dict[str, bytes] = {}  # (Store.created): never filled, a save's directory is its own
        self._unsynced: list[tuple[int, str]] = []  # files written, open, not yet fsynced (:meth:`sync`)
        with self._lock:
            self._dir(())
        blobs = None if create else hub_blobs(root)
        self._blobs: tuple[str, int] | None = None
        if blobs is not None:
            try:
                self._blobs = (blobs, os.open(blobs, _DIR_FLAGS))
            except OSError:
                pass

    def _blob(self, d: int, parts: tuple[str, ...]) -> int | None:
        """Open what the link ``parts`` (in the directory ``d``) names if it is a hub cache snapshot's link to
        a regular file directly in its repository's blobs folder (``../../blobs/<name>``, one more ``../``
        per subfolder, or that folder's absolute path); None for any other link."""
        if self._blobs is None:
            return None
        folder, fd = self._blobs
        try:
            target = os.readlink(parts[-1], dir_fd=d)
        except OSError:
            return None
        for prefix in ("../" * (len(parts) + 1) + "blobs/", folder.rstrip("/") + "/"):
            name = target[len(prefix):] if target.startswith(prefix) else ""
            if name and "/" not in name and name not in (".", ".."):
                try:
                    return os.open(name, _READ_FLAGS, dir_fd=fd)
                except OSError:
                    return None
        return None

    def replaced(self) -> bool:
        """Whether the directory this store reads is no longer at its path (replaced or removed)."""
        fd = self._dirs.get(())
        if fd is None:
            return False
        mine = os.fstat(fd)
        try:
            now = os.stat(self.root)
        except OSError:
            return True
        return mine.st_nlink == 0 or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino)

    def pinned_path(self) -> str:
        """A path naming the directory this store reads, for libraries that open files by path
        (Linux: through ``/proc/self/fd``; elsewhere the root path itself)."""
        fd = self._dirs.get(())
        if fd is not None and os.path.isdir(f"/proc/self/fd/{fd}"):
            return f"/proc/self/fd/{fd}"
        return self.root

    def kvstore(self, sub: str = "") -> dict[str, Any]:
        """The ``file`` kvstore spec of the directory ``sub``, through the directory this store opened
        (:meth:`pinned_path`), so that a checkpoint put at the same path meanwhile is never mixed in."""
        tail = sub.strip("/") + "/" if sub.strip("/") else ""
        return {"driver": "file", "path": self.pinned_path().rstrip("/") + "/" + tail}

    # -- directories -----------------------------------------------------------------------------

    def _refuse(self, exc: OSError, parts: Iterable[str]) -> XckptError:
        path = _file(self.root, "/".join(parts))
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) or os.path.islink(path):
            return UnsafePathError(f"{path} is a symbolic link or not a directory; a checkpoint holds plain "
                                   "files only", code="path.link", file=path)
        return XckptError(f"cannot open {path}: {exc.strerror}", code="io.read", file=path)

    def _dir(self, parts: tuple[str, ...]) -> int | None:
        """A descriptor of the directory ``parts`` below the root (None when missing).

        Called with the lock held; the descriptor stays valid until the lock is released.
        """
        fd = self._dirs.get(parts)
        if fd is not None:
            self._dirs.move_to_end(parts)
            return fd
        if not parts:
            try:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise XckptError(f"cannot open {self.root}: {exc.strerror}", code="io.read", file=self.root)
        else:
            parent = self._dir(parts[:-1])
            if parent is None:
                return None
            try:
                fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self._refuse(exc, parts) from None
        self._dirs[parts] = fd
        while len(self._dirs) > _DIR_CACHE:
            old_parts = next(p for p in self._dirs if p and p != parts and p != parts[:len(p)])
            os.close(self._dirs.pop(old_parts))
        return fd

    # -- objects ---------------------------------------------------------------------------------

    def open(self, name: str) -> LocalBlob | None:
        """Open a regular file without following links or blocking; None when missing."""
        parts = tuple(name.split("/"))
        try:
            with self._lock:
                d = self._dir(parts[:-1])
                if d is None:
                    return None
                try:
                    fd = os.open(parts[-1], _READ_FLAGS, dir_fd=d)
                except OSError as exc:
                    blob = self._blob(d, parts) if exc.errno == errno.ELOOP else None
                    if blob is None:
                        raise
                    fd = blob
        except FileNotFoundError:
            return None
        except OSError as exc:
            path = _file(self.root, name)
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"{path} is a symbolic link; a checkpoint holds plain files only (a hub "
                                      "cache snapshot's links to its own blobs excepted)", code="path.link",
                                      file=path) from None
            raise XckptError(f"cannot open {path}: {exc.strerror}", code="io.read", file=path) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            path = _file(self.root, name)
            raise UnsafePathError(f"{path} is not a regular file", code="path.special", file=path)
        return LocalBlob(name, self.root, fd, st.st_size)

    def read(self, name: str, limit: int = MAX_READ_BYTES) -> bytes | None:
        """A whole file, None when missing; one above ``limit`` bytes is refused before it is read."""
        blob = self.open(name)
        if blob is None:
            return None
        try:
            _check_size(blob.size or 0, limit, blob.path)
            out = np.empty(blob.size or 0, dtype=np.uint8)
            blob.read_into(0, out)
            return out.tobytes()
        finally:
            blob.close()

    def prefetch(self, names: Sequence[str], limit: int) -> dict[str, bytes]:
        """None: a local file is read as fast one at a time (:meth:`Store.prefetch`)."""
        return {}

    def write(self, name: str, data: Any, *, atomic: bool = False) -> None:
        """Write a file (parents created) from one or several parts. Writing is into a directory the save
        made itself, so paths are used directly.

        The file is durable once :meth:`sync` returns, which fsyncs it with every other file written
        since (together: a file system commits concurrent fsyncs at once) and then their directories;
        meanwhile its writeback has started (:func:`start_writeback`, small files too: on a disk,
        3,000 vectors' files took 0.9 s to fsync without it against 0.54 s with it) and it stays open
        (at most :data:`MAX_UNSYNCED` files: past that, all held are fsynced here). ``atomic`` writes
        a temporary file, fsyncs it and renames it over the name."""
        path = self._prefix + name  # _file(root, name) for the plain relative names a save writes, built cheaper
        parent = path[:path.rindex("/")]
        if parent not in self._made:
            make_dirs(parent)
            with self._lock:
                self._made.add(parent)
        if atomic:
            target = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
            _write_synced(os.open(target, _WRITE_FLAGS, 0o644), data)
            os.rename(target, path)
            return
        fd = os.open(path, _WRITE_FLAGS, 0o644)
        try:
            _write_all(fd, data)
            start_writeback(fd)
        except BaseException:
            os.close(fd)
            raise
        due: list[tuple[int, str]] = []
        with self._lock:
            self._unsynced.append((fd, path))
            if len(self._unsynced) > MAX_UNSYNCED:
                due, self._unsynced = self._unsynced, []
        if due:
            fsync_all(due)

    def create(self, name: str, data: bytes) -> bool:
        """Write a file only if nothing is at its name (``O_EXCL``), fsynced; False when something is."""
        path = _file(self.root, name)
        make_dirs(os.path.dirname(path))
        try:
            fd = os.open(path, _WRITE_FLAGS | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        _write_synced(fd, data)
        with self._lock:
            self._made.add(os.path.dirname(path))
        return True

    def delete(self, name: str) -> None:
        """Unlink a file (a link is removed, never followed); nothing happens when it is missing."""
        try:
            os.unlink(_file(self.root, name))
        except FileNotFoundError:
            pass

    def delete_created(self, created: Mapping[str, bytes]) -> None:
        """Unlink each file of ``created`` (which a local store never fills: see :attr:`Store.created`)."""
        for name in created:
            try:
                self.delete(name)
            except OSError:
                pass

    def exists(self, name: str) -> bool:
        """Whether a regular file is there, in the directory this store opened (links are not followed, but
        for a hub cache snapshot's links to its blobs)."""
        parts = tuple(name.split("/"))
        try:
            with self._lock:
                d = self._dir(parts[:-1])
                if d is None:
                    return False
                st = os.stat(parts[-1], dir_fd=d, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    blob = self._blob(d, parts)
                    if blob is None:
                        return False
                    try:
                        st = os.fstat(blob)
                    finally:
                        os.close(blob)
        except (OSError, XckptError):
            return False
        return stat.S_ISREG(st.st_mode)

    def list(self, prefix: str = "") -> list[str]:
        """Every non-directory entry below ``prefix`` (a directory name ending in '/', or ''), not following
        links; nothing when ``prefix`` is missing or is not a directory."""
        try:
            return sorted(name for name, kind in self.walk(prefix) if kind != "dir")
        except XckptError:
            return []

    def walk(self, prefix: str = "") -> Iterator[tuple[str, str]]:
        """Every entry below the directory ``prefix`` ('' for the root), depth first, sorted by name, as
        ``(name, kind)``: kind ``file``, ``dir``, ``link``, ``fifo``, ``socket``, ``device`` or ``other``.

        Directories are opened relative to their parent without following links (nothing is ever read
        through a link, and a link swapped in during the walk is not entered); the kinds come from the
        directory listing or ``lstat``. A directory that cannot be read is an ``io.read`` error (a
        missing or linked ``prefix``: ``path.link`` or ``io.read``).
        """
        parts = tuple(p for p in prefix.strip("/").split("/") if p)
        with self._lock:
            start = self._dir(parts)
            fd = None if start is None else os.dup(start)
        if fd is None:
            raise XckptError(f"{_file(self.root, '/'.join(parts))} is missing", code="io.read",
                             file=_file(self.root, "/".join(parts)))
        stack: list[tuple[int, str, Iterator[os.DirEntry[str]]]] = []
        try:
            stack.append((fd, "/".join(parts), self._entries(fd, "/".join(parts))))
            while stack:
                fd, rel, it = stack[-1]
                entry = next(it, None)
                if entry is None:
                    os.close(stack.pop()[0])
                    continue
                name = f"{rel}/{entry.name}" if rel else entry.name
                kind = entry_kind(entry)
                yield name, kind
                if kind == "dir":
                    try:
                        sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                    except OSError as exc:  # replaced since it was listed
                        raise self._refuse(exc, tuple(name.split("/"))) from None
                    try:
                        stack.append((sub, name, self._entries(sub, name)))
                    except BaseException:
                        os.close(sub)
                        raise
        finally:
            for d, _, _ in stack:
                os.close(d)

    def prune(self, owns: Callable[[str, str], bool]) -> bool:
        """Delete what below the root ``owns(name, kind)`` says is its own (kinds as :meth:`walk` gives them): its
        files, then its directories once emptied, deepest first, then the root once empty. Each unlink and rmdir
        is relative to a descriptor of its directory, opened without following links (a link swapped in meanwhile
        leads nowhere); anything else stays, as does what cannot be deleted. Whether the root is gone."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        self._prune_in(fd, "", owns)
        try:
            os.rmdir(self.root)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True

    def _prune_in(self, fd: int, rel: str, owns: Callable[[str, str], bool]) -> None:
        """:meth:`prune` below the directory ``rel``, open as ``fd`` (closed here)."""
        try:
            try:
                entries = [(e.name, entry_kind(e)) for e in os.scandir(fd)]
            except OSError:
                return
            for base, kind in entries:
                name = f"{rel}/{base}" if rel else base
                if not owns(name, kind):
                    continue
                try:
                    if kind == "dir":
                        self._prune_in(os.open(base, _DIR_FLAGS, dir_fd=fd), name, owns)
                        os.rmdir(base, dir_fd=fd)
                    else:
                        os.unlink(base, dir_fd=fd)
                except OSError:  # gone, swapped for a link, not empty: it stays
                    continue
        finally:
            os.close(fd)

    def _entries(self, fd: int, rel: str) -> Iterator[os.DirEntry[str]]:
        try:
            with os.scandir(fd) as it:
                listed = list(it)
        except OSError as exc:
            path = _file(self.root, rel) if rel else self.root
            raise XckptError(f"cannot list {path}: {exc.strerror}", code="io.read", file=path) from None
        return iter(sorted(listed, key=lambda e: e.name))

    def sync(self) -> None:
        """fsync every file written since the last sync (:meth:`write`), and every directory this store
        wrote into and their parents up to the root, all together (:func:`fsync_all`)."""
        with self._lock:
            files: list[tuple[int | None, str]] = list(self._unsynced)
            self._unsynced = []
            dirs = set()
            for d in self._made:
                while d.startswith(self.root) and d not in dirs:
                    dirs.add(d)
                    d = d.rpartition("/")[0]
        fsync_all(files + [(None, d) for d in sorted(dirs, reverse=True)])

    def close(self) -> None:
        """Close the cached directory descriptors, and the files written but not synced (not fsyncing them:
        a store closed before :meth:`sync` is a save that failed)."""
        with self._lock:
            for fd, _ in self._unsynced:
                os.close(fd)
            self._unsynced.clear()
            for fd in self._dirs.values():
                os.close(fd)
            self._dirs.clear()
            if self._blobs is not None:
                os.close(self._blobs[1])
                self._blobs = None


class KvBlob:
    """An object of a TensorStore key-value store, read by byte ranges."""

    def __init__(self, kv: ts.KvStore, name: str, file: str) -> None:
        self.name = name
        self.path = file
        self.size: int | None = None
        self._kv = kv

    def _range(self, byte_range: slice) -> bytes:
        try:
            res = self._kv.read(self.name, byte_range=byte_range).result()
        except ValueError as exc:
            code = "chunk.truncated" if "OUT_OF_RANGE" in str(exc) else "io.read"
            raise DataError(f"cannot read bytes {byte_range.start}..{byte_range.stop}: {exc}", code=code,
                            file=self.path) from None
        if res.state != "value":
            raise DataError("object disappeared while being read", code="chunk.missing", file=self.path)
        return bytes(res.value)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` with the bytes at ``offset`` (one ranged read)."""
        data = self._range(slice(offset, offset + out.nbytes))
        if len(data) != out.nbytes:
            raise DataError("object is shorter than its index says", code="chunk.truncated", file=self.path)
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)

    def read_tail(self, n: int) -> np.ndarray:
        """The last ``n`` bytes."""
        data = self._range(slice(-n, None))
        if len(data) != n:
            raise DataError(f"object has fewer than {n} bytes", code="chunk.truncated", file=self.path)
        return np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        """Nothing to release."""


def kv_failed(exc: BaseException, file: str, *, write: bool = False) -> XckptError:
    """The error of a key-value store request that failed (TensorStore raises a ``ValueError`` holding the
    store's answer): ``io.write`` (a :class:`SaveError`) or ``io.read`` naming ``file``, saying first in words
    what is known to be wrong (a missing bucket, a refused access, an unreachable store)."""
    text = str(exc)
    why = ("the bucket does not exist; " if "NoSuchBucket" in text
           else "access denied (check the credentials and the bucket's policy); "
           if "PERMISSION_DENIED" in text or "AccessDenied" in text or "UNAUTHENTICATED" in text
           else "the store cannot be reached; " if "CURL error" in text or "UNAVAILABLE" in text else "")
    if write:
        return SaveError(f"cannot write: {why}{text}", code="io.write", file=file)
    return XckptError(f"cannot read: {why}{text}", code="io.read", file=file)


def kv_result(future: Any, file: str, *, write: bool = False) -> Any:
    """The result of a TensorStore key-value store request; a failure is :func:`kv_failed`."""
    try:
        return future.result()
    except (ValueError, RuntimeError) as exc:
        raise kv_failed(exc, file, write=write) from exc


def landed(error: XckptError, check: Callable[[], Any]) -> Any:
    """After a conditional write that failed with ``error`` (its answer lost, say, with no retry left): what
    ``check`` finds if the write took effect all the same (a truthy value); ``error`` is raised when ``check``
    finds nothing or cannot look."""
    try:
        found = check()
    except XckptError:
        found = None
    if not found:
        raise error
    return found


_kv_cache: dict[str, ts.KvStore] = {}
_kv_lock = threading.Lock()


def open_kvstore(spec: dict[str, Any], file: str = "") -> ts.KvStore:
    """A TensorStore key-value store of ``spec``, opened once per process (``file``: the location it serves,
    named by the error of a spec the store refuses)."""
    key = json.dumps(spec, sort_keys=True)
    with _kv_lock:
        kv = _kv_cache.get(key)
    if kv is None:
        kv = kv_result(ts.KvStore.open(spec), file)
        with _kv_lock:
            if len(_kv_cache) > 64:
                _kv_cache.clear()
            _kv_cache[key] = kv
    return kv


#: Small object writes (:data:`PIPELINED_BYTES` at most each) a :class:`KvStore` keeps in flight at once.
PIPELINED_WRITES = 64
#: Largest object a :class:`KvStore` writes without waiting for the answer (a ``zarr.json``, a small leaf's chunk).
PIPELINED_BYTES = 1 << 20


class KvStore:
    """A checkpoint root in a TensorStore key-value store (object stores).

    A small object's write is sent and not waited for: up to :data:`PIPELINED_WRITES` are in flight at
    once, so a save of thousands of small leaves costs their requests' round trips together, not one
    after another (each waited for would cost a whole round trip: 20 ms to a store a region away). Every
    other request this store makes, and :meth:`sync`, first waits for the writes in flight; the first of
    them that failed is raised there, naming its object (``io.write``). So nothing reads, lists, creates
    (the commit's manifest) or deletes before every earlier write has landed.

    Every write only creates (``If-None-Match: *``): a save writes into its prefix in place, so a save that
    was stopped (a paused machine) for longer than its lease, judged dead and its prefix taken over by
    another save, must not write over that save's objects when it wakes. An object found there already is
    ``save.conflict`` naming it, unless it holds exactly what this write sent (the store created it on an
    attempt whose answer was lost, and the driver's retry found it).
    """

    remote = True  # (Store.remote)

    def __init__(self, location: Location) -> None:
        self.location = location
        self._kv = open_kvstore(location.kvstore(), str(location))
        self._in_flight: deque[tuple[str, Any, int]] = deque()  # (name, its write, the crc32c of what it sent)
        self.created: dict[str, bytes] = {}  # (Store.created)
        self._flight_lock = threading.Lock()

    def _file(self, name: str) -> str:
        return str(self.location.child(name))

    def _land(self, upto: int = 0) -> None:
        """Wait for the writes in flight until at most ``upto`` remain; raise the first that failed (once the
        others waited for are done too)."""
        first: XckptError | None = None
        while True:
            with self._flight_lock:
                if len(self._in_flight) <= upto:
                    break
                name, future, crc = self._in_flight.popleft()
            try:
                self._created(name, kv_result(future, self._file(name), write=True).generation, crc)
            except XckptError as exc:
                first = first or exc
        if first is not None:
            raise first

    def open(self, name: str) -> KvBlob | None:
        """An object read by ranges; None when it does not exist."""
        return KvBlob(self._kv, name, self._file(name)) if self.exists(name) else None

    def read(self, name: str, limit: int = MAX_READ_BYTES) -> bytes | None:
        """A whole object, None when missing; one above ``limit`` bytes is refused (once fetched: a store's
        read does not say the size first)."""
        self._land()
        res = kv_result(self._kv.read(name), self._file(name))
        if res.state != "value":
            return None
        _check_size(len(res.value), limit, self._file(name))
        return bytes(res.value)

    def prefetch(self, names: Sequence[str], limit: int) -> dict[str, bytes]:
        """Of ``names``, the objects of at most ``limit`` bytes, every read sent before the first answer is
        awaited (the driver runs them concurrently: one round trip for many small objects, where
        :meth:`open` costs a request for the size and one per range); failures are left to the caller
        (:meth:`Store.prefetch`)."""
        self._land()
        pending = [(name, self._kv.read(name)) for name in names]
        out: dict[str, bytes] = {}
        for name, future in pending:
            try:
                res = future.result()
            except (ValueError, RuntimeError):  # the caller's own read says what went wrong
                continue
            if res.state == "value" and len(res.value) <= limit:
                out[name] = bytes(res.value)
        return out

    def write(self, name: str, data: Any, *, atomic: bool = False) -> None:
        """Write an object from one or several parts (every object write is atomic on object stores); a small one
        is sent and left in flight (see the class), landed by :meth:`sync` or the store's next request, unless
        ``atomic`` (a status record, a manager's file: one that others look for once this returns)."""
        blob = b"".join(bytes(memoryview(p).cast("B")) for p in _parts(data))
        if atomic or len(blob) > PIPELINED_BYTES:
            self._created(name, self._put(name, blob, if_equal=ABSENT), crc32c.crc32c(blob))
            return
        future = self._kv.write(name, blob, if_equal=ABSENT)
        with self._flight_lock:
            self._in_flight.append((name, future, crc32c.crc32c(blob)))
            full = len(self._in_flight) > PIPELINED_WRITES
        if full:
            self._land(PIPELINED_WRITES)

    def _put(self, name: str, blob: bytes | None, **conditions: Any) -> bytes:
        """One write (None: a delete) through the driver, its retries included, after the writes in flight; the
        new storage generation (empty when a condition failed). A store that stays unreachable is ``io.write``."""
        self._land()
        return kv_result(self._kv.write(name, blob, **conditions), self._file(name), write=True).generation

    def _created(self, name: str, generation: bytes, crc: int) -> None:
        """After a write of ``name`` conditioned on its absence (:meth:`write`), which sent bytes of crc32c
        ``crc``: noted in :attr:`created` when it created the object (``generation``), or when the object found
        holds those bytes (this write's own, its first answer lost); else ``save.conflict`` naming it."""
        if generation:
            self.created[name] = generation
            return
        if self._holds(name, lambda found: crc32c.crc32c(found) == crc):
            return
        raise SaveError(f"{self._file(name)} was written by another save while this one wrote it (this save was "
                        "stopped past its lease, judged dead and its prefix taken over, or another writer put an "
                        "object there); it was not replaced", code="save.conflict", file=self._file(name))

    def create(self, name: str, data: bytes) -> bool:
        """Write an object only if it is absent: a conditional write, atomic where the store honours
        ``If-None-Match`` (S3 since 2024, and most S3-compatible stores); False when it exists.

        An object already holding exactly ``data`` is this write's own: the store created it on an
        attempt whose answer was lost, and the driver's retry found it (a manifest names its save's
        generation, so no other save writes the same bytes). So is one found after the write failed: the store
        created it, and the answer was lost with no retry left (:func:`landed`)."""
        blob = bytes(data)
        try:
            generation = self._put(name, blob, if_equal=ABSENT)
        except XckptError as exc:
            return bool(landed(exc, lambda: self._holds(name, blob.__eq__)))
        if generation:
            self.created[name] = generation
            return True
        return self._holds(name, blob.__eq__)

    def _holds(self, name: str, same: Callable[[bytes], bool]) -> bool:
        """Whether ``name`` holds what this store's own write of it sent (``same`` of its bytes): the store created
        it on an attempt whose answer was lost. Noted in :attr:`created` at the version read."""
        res = kv_result(self._kv.read(name), self._file(name))
        if res.state != "value" or not same(bytes(res.value)):
            return False
        self.created[name] = res.stamp.generation
        return True

    def delete(self, name: str) -> None:
        """Delete an object (nothing happens when it is missing)."""
        self._put(name, None)

    def delete_created(self, created: Mapping[str, bytes]) -> None:
        """Delete each object of ``created`` only while it is the version created (a conditional delete: the
        driver compares the object's ETag first)."""
        for name, version in created.items():
            try:
                self._put(name, None, if_equal=version)
            except XckptError:
                pass

    def exists(self, name: str) -> bool:
        """Whether an object exists (a store that cannot answer: ``io.read`` naming the object)."""
        self._land()
        return kv_result(self._kv.read(name, byte_range=slice(0, 0)), self._file(name)).state == "value"

    def list(self, prefix: str = "") -> list[str]:
        """Every object name under ``prefix``, sorted (a store that cannot list: ``io.read`` naming the prefix)."""
        file = str(self.location.child(prefix.rstrip("/"))) if prefix.strip("/") else str(self.location)
        self._land()
        if prefix:
            rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
            keys = kv_result(self._kv.list(rng), file)
        else:
            keys = kv_result(self._kv.list(), file)
        return sorted(k.decode() for k in keys)

    def sync(self) -> None:
        """Wait for the writes in flight (an object write is durable once the store answered it); the first that
        failed is raised, naming its object."""
        self._land()

    def replaced(self) -> bool:
        """Never: a committed prefix is not replaced in place."""
        return False

    def kvstore(self, sub: str = "") -> dict[str, Any]:
        """The kvstore spec of the prefix ``sub`` under this root (for reads handed to TensorStore: the writes in
        flight land first)."""
        self._land()
        return self.location.kvstore(sub)

    def close(self) -> None:
        """Wait for the writes in flight, their failures aside (a save that goes on has met them at its sync or
        its commit; one that failed is removing what it wrote)."""
        try:
            self._land()
        except XckptError:
            pass
