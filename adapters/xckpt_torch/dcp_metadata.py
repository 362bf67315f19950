"""Reading a stock DCP checkpoint (``FileSystemWriter`` output) without trusting it.

DCP's ``.metadata`` is a pickle. Converting a DCP checkpoint is the only place xckpt
parses a pickle, and it does so with :class:`MetadataUnpickler`, which builds nothing
but the plain data DCP metadata is made of:

* ``torch.distributed.checkpoint.metadata``: ``Metadata``, ``TensorStorageMetadata``,
  ``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``,
  ``MetadataIndex``, ``StorageMeta``; ``_MEM_FORMAT_ENCODING`` (reconstructed: a member
  looked up by its integer value only);
* ``torch.distributed.checkpoint.filesystem._StorageInfo``;
* ``torch.Size``; the ``torch.dtype`` objects (pickled as ``torch.<name>``: admitted only
  when ``torch.<name>`` is a ``torch.dtype`` object, looked up without importing anything);
* ``torch.serialization._get_layout`` (reconstructed: a ``torch.layout`` by its name only);
* ``pathlib.PosixPath``, ``pathlib.WindowsPath``, ``pathlib.PurePosixPath``,
  ``pathlib.PureWindowsPath`` (also under ``pathlib._local``; ``StorageMeta.checkpoint_id``),
  reconstructed as pure paths from strings only;
* ``collections.OrderedDict``.

Every other global is refused before it is looked up (``convert.dcp_pickle``, naming the
file and the ``module.name``), and so are the opcodes that reach outside the pickle
(persistent ids, the copyreg extension registry, protocol 0/1 instance creation,
out-of-band buffers, ``BYTEARRAY8``). ``REDUCE`` and ``NEWOBJ`` may call admitted objects only,
the items ``REDUCE`` passes counting against the pickle's size (one shared list passed to many calls
would be copied by each), and ``BUILD`` may only set, once, the fields of a freshly created instance
of one of the admitted dataclasses (never the attributes of a class, of a shared object such as a
dtype or an enum member, nor names that are not fields). Dict keys and a ``MetadataIndex``'s fields
must be cheap to hash and print (a pickle can nest one shared tuple 40 levels deep in a kilobyte).
The result must be a ``Metadata`` (``convert.dcp_metadata``) whose parts have the types and bounds conversion relies on
(:func:`check_metadata`).

The pickle is read with the pure-Python unpickler of the standard library (the same
machine as ``pickle.Unpickler``) because only it lets ``BUILD``, ``REDUCE`` and ``NEWOBJ``
be checked; DCP metadata is small, so its speed does not matter.

:class:`DcpDirectory` opens ``.metadata`` and the data files relative to a descriptor of
the checkpoint directory, never following a link (``path.link``) and never opening
anything but a regular file (``path.special``) or blocking on one; each stored range is
checked against the file's size before it is read (``chunk.truncated``). The directory
itself may be reached through links.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import io
import os
import pathlib
import pickle
import re
import stat
from typing import Any, Callable, Iterable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from xckpt.errors import DataError, ResourceError, ShapeError, UnsafePathError, UnsupportedError, XckptError
from xckpt.format import names
from xckpt.format.manifest import MAX_ELEMENTS, MAX_RANK
from xckpt.format.tree import MAX_DEPTH

__all__ = ["ADMITTED", "MAX_METADATA_BYTES", "METADATA_NAME", "REFUSED_OPCODES", "DcpDirectory", "MetadataUnpickler",
           "check_metadata", "check_storage_name", "load_metadata", "merge_rank_metadata", "rank_metadata_name"]

#: The largest ``.metadata`` file read (bytes).
MAX_METADATA_BYTES = 1 << 30
#: DCP's metadata file name.
METADATA_NAME = names.DCP_METADATA

_RANK_METADATA = re.compile(r"__(0|[1-9][0-9]{0,8})\.metadata")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_MD = "torch.distributed.checkpoint.metadata"
#: The dataclasses a DCP metadata pickle creates and fills (``NEWOBJ`` + ``BUILD``).
_DATACLASSES: tuple[type, ...] = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                                  TensorProperties, MetadataIndex, StorageMeta, _StorageInfo)
_FIELDS: dict[type, frozenset[str]] = {c: frozenset(f.name for f in dataclasses.fields(c)) for c in _DATACLASSES}


def _describe(obj: Any) -> str:
    """What ``obj`` is, for messages, without calling anything of it (no ``repr``)."""
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} object"


def _pickle_error(message: str) -> UnsupportedError:
    return UnsupportedError(message, code="convert.dcp_pickle")


def _layout(name: Any) -> torch.layout:
    """``torch.serialization._get_layout``, reconstructed: a ``torch.layout`` by its name, nothing else."""
    layout = _LAYOUTS.get(name) if type(name) is str else None
    if layout is None:
        raise _pickle_error(f"the layout {name[:80]!r} is not a torch layout" if type(name) is str
                            else f"a layout named by {_describe(name)}")
    return layout


def _mem_format(value: Any) -> _MEM_FORMAT_ENCODING:
    """``_MEM_FORMAT_ENCODING(value)``, reconstructed: a member looked up by its integer value only."""
    if type(value) is not int:
        raise _pickle_error(f"_MEM_FORMAT_ENCODING of {_describe(value)}, not an integer")
    return _MEM_FORMAT_ENCODING(value)


def _path_maker(cls: type) -> Callable[..., Any]:
    def make(*parts: Any) -> Any:
        if not all(type(p) is str for p in parts):
            raise _pickle_error("a pickled path made of something other than strings: "
                                f"{[_describe(p) for p in parts][:5]}")
        return cls(*parts)
    make.__name__ = f"pure_{cls.__name__}"
    return make


def _size(*args: Any) -> torch.Size:
    """``torch.Size(dims)`` of a list or tuple of integers (what it copies is counted by the unpickler: a pickle can
    pass one shared list of millions of items to many calls)."""
    dims = args[0] if len(args) == 1 else None
    if type(dims) not in (list, tuple) or not all(type(d) is int for d in dims):
        raise _pickle_error(f"a torch.Size of {_describe(dims)}, not of integers")
    return torch.Size(dims)


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    """``collections.OrderedDict()``: empty (its items come after it, as pickle writes them, where each key is
    checked before it is hashed; items passed to the call would be hashed unchecked)."""
    if args:
        raise _pickle_error(f"an OrderedDict made from {_describe(args[0])} (a pickled one is made empty)")
    return collections.OrderedDict()


_LAYOUTS: dict[str, torch.layout] = {
    str(v): v for v in (getattr(torch, n, None) for n in ("strided", "sparse_coo", "sparse_csr", "sparse_csc",
                                                          "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"))
    if isinstance(v, torch.layout)}
_POSIX_PATH = _path_maker(pathlib.PurePosixPath)
_WINDOWS_PATH = _path_maker(pathlib.PureWindowsPath)

#: (module, name) -> the object the unpickler gets for it. dtypes are admitted separately (``torch.<dtype>``).
ADMITTED: dict[tuple[str, str], Any] = {
    (_MD, "Metadata"): Metadata,
    (_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    (_MD, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_MD, "TensorProperties"): TensorProperties,
    (_MD, "MetadataIndex"): MetadataIndex,
    (_MD, "StorageMeta"): StorageMeta,
    (_MD, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): _ordered_dict,
    **{(m, n): maker for m in ("pathlib", "pathlib._local")
       for n, maker in (("PosixPath", _POSIX_PATH), ("PurePosixPath", _POSIX_PATH),
                        ("WindowsPath", _WINDOWS_PATH), ("PureWindowsPath", _WINDOWS_PATH))},
}
#: What ``NEWOBJ`` may create: the admitted dataclasses (``torch.Size`` and ``OrderedDict`` are made by their
#: reconstructions, :func:`_size` and :func:`_ordered_dict`, which check what they copy).
_NEW_OK: tuple[type, ...] = _DATACLASSES
#: What ``REDUCE`` may call: the admitted classes and reconstructions.
_CALL_OK: frozenset[int] = frozenset(id(v) for v in ADMITTED.values())
#: Opcodes refused outright (by their name in :mod:`pickle`).
REFUSED_OPCODES = ("PERSID", "BINPERSID", "INST", "OBJ", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER",
                   "BYTEARRAY8")


def _dtype(name: str) -> torch.dtype | None:
    value = vars(torch).get(name)  # no import: torch's lazy attributes are not resolved
    return value if isinstance(value, torch.dtype) else None


#: What a dict key or set member of DCP metadata may be made of (besides a ``MetadataIndex``): objects whose
#: hash costs little and is computed once (an int is bounded to 64 bits: a huge int's hash is not cached).
_KEY_ATOMS = (str, bytes, bool, float, type(None))


def _cheap_key(k: Any) -> bool:
    """Whether hashing ``k`` costs little: an atom, a bounded int, or a tuple (``torch.Size``) of at most
    :data:`~xckpt.format.manifest.MAX_RANK` of them; a ``MetadataIndex`` of such fields. A pickle can share one
    object many times (its memo), so a key built of shared tuples (a tuple of two references to a tuple of two
    ...) would take 2**depth steps to hash, and a huge one would be hashed again at every use."""
    if type(k) is MetadataIndex:
        return _cheap_key(getattr(k, "fqn", None)) and _cheap_key(getattr(k, "offset", None))
    if type(k) in (tuple, torch.Size):
        return len(k) <= MAX_RANK and all(_cheap_atom(x) for x in k)
    return _cheap_atom(k)


def _cheap_atom(x: Any) -> bool:
    return type(x) in _KEY_ATOMS or (type(x) is int and -(1 << 63) <= x < 1 << 63)


class MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """An unpickler that builds DCP metadata and nothing else (see the module docstring).

    ``file`` names the pickle in errors.
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, stream: io.BufferedIOBase | io.BytesIO, *, file: str, copies: int = 1 << 20) -> None:
        super().__init__(stream)
        self.file = file
        self._unfilled: set[int] = set()  # ids of the instances created and not yet filled (BUILD)
        #: items the admitted calls may still copy from their arguments: the pickle's size (each item of a pickle
        #: takes a byte of it at least, unless it is one shared object passed to many calls, each copying it)
        self._copies = copies

    def find_class(self, module: str, name: str) -> Any:
        """The admitted object for ``module.name``; anything else is refused (``convert.dcp_pickle``)."""
        found = ADMITTED.get((module, name))
        if found is None and module == "torch":
            found = _dtype(name)
        if found is None:
            raise UnsupportedError(f"the DCP metadata pickle refers to {f'{module}.{name}'[:200]}, which is not one of the "
                                   "classes DCP metadata is made of; refused without importing it",
                                   code="convert.dcp_pickle", file=self.file)
        return found

    def persistent_load(self, pid: Any) -> Any:
        """Refused: DCP metadata has no persistent ids."""
        raise UnsupportedError("the DCP metadata pickle uses a persistent id", code="convert.dcp_pickle",
                               file=self.file)

    def _refuse_opcode(self) -> None:
        raise UnsupportedError("the DCP metadata pickle uses an opcode DCP metadata never needs (persistent id, "
                               "extension registry, protocol 0/1 instance, out-of-band buffer, or bytearray: "
                               "its stated length would be allocated before it is read)",
                               code="convert.dcp_pickle", file=self.file)

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if id(func) not in _CALL_OK or type(args) is not tuple:
            raise UnsupportedError(f"the DCP metadata pickle calls {_describe(func)} (with {_describe(args)}), "
                                   "which is not an admitted class", code="convert.dcp_pickle", file=self.file)
        self._copies -= len(args) + sum(len(a) for a in args if type(a) in (list, tuple, str))
        if self._copies < 0:
            raise UnsupportedError("the DCP metadata pickle passes more items to the classes it calls than it holds "
                                   "(one object shared by many calls, each copying it)", code="convert.dcp_pickle",
                                   file=self.file)
        self.stack[-1] = func(*args)

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        if not (isinstance(cls, type) and cls in _NEW_OK) or type(args) is not tuple or type(kwargs) is not dict:
            raise UnsupportedError(f"the DCP metadata pickle creates an instance of {_describe(cls)}, which is not "
                                   "an admitted class", code="convert.dcp_pickle", file=self.file)
        inst = cls.__new__(cls, *args, **kwargs)
        self._unfilled.add(id(inst))  # (kept alive by the stack or the memo while the pickle is read)
        self.append(inst)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls, args, {})

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._new(cls, args, kwargs)

    def _check_keys(self, keys: list[Any]) -> None:
        """Refuse, before anything hashes them, dict keys or set members that are costly to hash
        (:func:`_cheap_key`): DCP metadata's keys are names and ``MetadataIndex`` objects."""
        for k in keys:
            if not _cheap_key(k):
                fqn = getattr(k, "fqn", None) if type(k) is MetadataIndex else None
                raise XckptError(f"the DCP metadata pickle uses {_describe(k)} as a dict key or set member that is "
                                 "not a name, a bounded integer, a short tuple of them or a MetadataIndex of them",
                                 code="convert.dcp_metadata", file=self.file,
                                 leaf=fqn if type(fqn) is str else None)

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in _FIELDS or id(inst) not in self._unfilled:
            raise UnsupportedError(f"the DCP metadata pickle sets the state of {_describe(inst)} (only new "
                                   "instances of the admitted dataclasses may be filled, once)",
                                   code="convert.dcp_pickle", file=self.file)
        self._unfilled.discard(id(inst))
        if cls is TensorProperties:
            if type(state) is not tuple or len(state) != 5:
                raise XckptError(f"TensorProperties state is {_describe(state)}, not a 5-tuple",
                                 code="convert.dcp_metadata", file=self.file)
            TensorProperties.__setstate__(inst, state)
            return
        if state is None:
            return
        if type(state) is not dict or not all(type(k) is str and k in _FIELDS[cls] for k in state):
            names = [k[:40] if type(k) is str else _describe(k) for k in state] if type(state) is dict else []
            extra = [k for k in names if k not in _FIELDS[cls]][:5]
            raise UnsupportedError(f"the DCP metadata pickle sets the state of a {cls.__name__} from "
                                   f"{_describe(state)}" + (f" with names that are not its fields: {extra}" if extra
                                                            else ""), code="convert.dcp_pickle", file=self.file)
        if cls is MetadataIndex and not all(_cheap_key(state.get(f)) for f in ("fqn", "offset", "index")):
            fqn = state.get("fqn")
            raise XckptError("the DCP metadata pickle fills a MetadataIndex (a dict key) with fields that are not a "
                             "name, a bounded integer or a short tuple of them", code="convert.dcp_metadata",
                             file=self.file, leaf=fqn if type(fqn) is str else None)
        inst.__dict__.update(state)


MetadataUnpickler.dispatch[pickle.REDUCE[0]] = MetadataUnpickler._load_reduce
MetadataUnpickler.dispatch[pickle.NEWOBJ[0]] = MetadataUnpickler._load_newobj
MetadataUnpickler.dispatch[pickle.NEWOBJ_EX[0]] = MetadataUnpickler._load_newobj_ex
MetadataUnpickler.dispatch[pickle.BUILD[0]] = MetadataUnpickler._load_build
for _op in REFUSED_OPCODES:
    MetadataUnpickler.dispatch[getattr(pickle, _op)[0]] = MetadataUnpickler._refuse_opcode


def _hashing(base: Callable[[Any], None], keys: Callable[[list[Any]], list[Any]]) -> Callable[[Any], None]:
    """An opcode that hashes ``keys(stack)`` (dict keys, set members), checked first (``_check_keys``)."""
    def load(self: MetadataUnpickler) -> None:
        self._check_keys(keys(self.stack))
        base(self)
    return load


for _op, _keys in (("SETITEM", lambda st: st[-2:-1]), ("SETITEMS", lambda st: st[0::2]), ("DICT", lambda st: st[0::2]),
                   ("ADDITEMS", lambda st: st), ("FROZENSET", lambda st: st)):
    _code = getattr(pickle, _op)[0]
    MetadataUnpickler.dispatch[_code] = _hashing(pickle._Unpickler.dispatch[_code], _keys)  # type: ignore[attr-defined]


def load_metadata(data: bytes, *, file: str) -> Metadata:
    """Unpickle DCP metadata with :class:`MetadataUnpickler` and check it (:func:`check_metadata`).

    Raises ``convert.dcp_pickle`` for anything outside the admitted classes and opcodes,
    ``convert.dcp_metadata`` for a pickle that cannot be read or is not valid DCP metadata.
    """
    try:
        md = MetadataUnpickler(io.BytesIO(data), file=file, copies=len(data) + 4096).load()
    except XckptError as exc:
        raise exc.at(file=file) from None
    except Exception as exc:  # noqa: BLE001 - whatever a malformed pickle raises
        raise XckptError(f"the DCP metadata cannot be unpickled: {type(exc).__name__}: {exc}",
                         code="convert.dcp_metadata", file=file) from None
    if type(md) is not Metadata:
        raise XckptError(f"the DCP metadata pickle holds a {type(md).__name__}, not a "
                         "torch.distributed.checkpoint.metadata.Metadata", code="convert.dcp_metadata", file=file)
    check_metadata(md, file=file)
    return md


def check_storage_name(name: Any, *, file: str, leaf: str | None = None) -> str:
    """``name`` if it is a plain file name in the checkpoint directory (a ``_StorageInfo.relative_path``, of the
    item ``leaf`` where given).

    Refuses (``path.unsafe``) an empty name, ``.``, ``..``, and names holding ``/``, ``\\`` or NUL.
    """
    if type(name) is not str:
        raise XckptError(f"a DCP storage path is a {type(name).__name__}, not a string",
                         code="convert.dcp_metadata", file=file, leaf=leaf)
    if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise UnsafePathError(f"the DCP storage path {name[:200]!r} is not a plain file name in the checkpoint",
                              code="path.unsafe", file=file, leaf=leaf)
    return name


def _int(v: Any) -> bool:
    """A non-negative integer below 2**128 (an offset, a length, a dimension; one of thousands of digits could not
    even be printed in a message)."""
    return type(v) is int and 0 <= v < 1 << 128


def _dims(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and all(_int(x) for x in v)


#: The one DCP extension whose data xckpt reads: ``ZStandard`` (a zstd stream of the torch.save data).
ZSTD_TRANSFORM = "stream.zstd/1"


def zstd_compressed(info: _StorageInfo) -> bool:
    """Whether a stored item was written through DCP's ``ZStandard`` extension (checked by :func:`check_metadata`)."""
    return list(getattr(info, "transform_descriptors", None) or []) == [ZSTD_TRANSFORM]


def _transforms(transforms: Any) -> str:
    """DCP extension descriptors, for messages, without ``repr`` of anything but a few short strings."""
    if isinstance(transforms, (list, tuple)) and all(type(t) is str for t in transforms[:5]):
        return repr([t[:40] for t in transforms[:5]]) + (f" and {len(transforms) - 5} more" if len(transforms) > 5
                                                          else "")
    return _describe(transforms)


def check_metadata(md: Metadata, *, file: str) -> None:
    """Check the parts of DCP metadata conversion uses (``convert.dcp_metadata``; ``path.unsafe`` for
    storage paths; ``convert.dcp_transform`` for stored data written through a DCP extension).

    Each entry of ``state_dict_metadata`` is a tensor (dtype, non-negative size, chunks of its rank
    within it) or a value; each chunk and value has a storage entry; storage entries name plain
    files with non-negative integer offset and length; flattening paths are tuples of str/int.
    """
    try:
        _check_metadata(md, file)
    except XckptError:
        raise
    except Exception as exc:  # noqa: BLE001 - a part missing, or of a type without the expected behaviour
        raise XckptError(f"invalid DCP metadata: {type(exc).__name__}: {exc}", code="convert.dcp_metadata",
                         file=file) from None


def _check_metadata(md: Metadata, file: str) -> None:
    def bad(what: str, leaf: str | None = None) -> XckptError:
        return XckptError(f"invalid DCP metadata: {what}", code="convert.dcp_metadata", file=file, leaf=leaf)

    sdm, storage, planner = md.state_dict_metadata, md.storage_data, md.planner_data
    if not isinstance(sdm, dict) or not all(type(k) is str for k in sdm):
        raise bad("state_dict_metadata is not a dict of names")
    if not isinstance(storage, dict):
        raise bad("storage_data is not a dict")
    if planner is not None and not isinstance(planner, dict):
        raise bad("planner_data is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str or not (
                index.offset is None or _dims(index.offset)):
            raise bad(f"storage key {_describe(index)} is not a MetadataIndex of a name and an offset")
        if type(info) is not _StorageInfo or not (_int(info.offset) and _int(info.length)):
            raise bad(f"storage entry of {index.fqn!r} is not a _StorageInfo with integer offset and length",
                      index.fqn)
        check_storage_name(info.relative_path, file=file, leaf=index.fqn)
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and (not isinstance(transforms, (list, tuple))
                                       or len(transforms) and list(transforms) != [ZSTD_TRANSFORM]):
            raise UnsupportedError(f"the data of {index.fqn!r} was written through DCP extensions "
                                   f"{_transforms(transforms)}; xckpt reads plain torch.save data, and that data "
                                   f"compressed by DCP's ZStandard extension ({ZSTD_TRANSFORM!r}) only",
                                   code="convert.dcp_transform", file=file, leaf=index.fqn)
    for fqn, smd in sdm.items():
        path = planner.get(fqn) if planner else None
        if path is not None and not (isinstance(path, (tuple, list)) and all(
                type(p) is str or (type(p) is int and 0 <= p < 1 << 63) for p in path)):
            raise bad(f"the flattening path of {fqn!r} is not a tuple of names and indices", fqn)
        if path is not None and len(path) > MAX_DEPTH:
            raise bad(f"the flattening path of {fqn!r} has {len(path)} parts, more than {MAX_DEPTH}", fqn)
        if type(smd) is BytesStorageMetadata:
            if MetadataIndex(fqn) not in storage:
                raise bad(f"value {fqn!r} has no storage entry", fqn)
            continue
        if type(smd) is not TensorStorageMetadata:
            raise bad(f"{fqn!r} has storage metadata of type {type(smd).__name__}", fqn)
        props = smd.properties
        if type(props) is not TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
            raise bad(f"tensor {fqn!r} has no dtype", fqn)
        if not (type(getattr(props, "layout", None)) is torch.layout
                and type(getattr(props, "memory_format", None)) is torch.memory_format
                and type(getattr(props, "requires_grad", None)) is bool
                and type(getattr(props, "pin_memory", None)) is bool):  # (ranks' files compare them)
            raise bad(f"tensor {fqn!r} has properties that are not a layout, a memory format and two flags", fqn)
        if not _dims(smd.size) or not isinstance(smd.chunks, list):
            raise bad(f"tensor {fqn!r} has an invalid size or chunk list", fqn)
        _check_shape(tuple(smd.size), props.dtype, fqn, file)
        seen: set[tuple[int, ...]] = set()
        for c in smd.chunks:
            if type(c) is not ChunkStorageMetadata or not (_dims(c.offsets) and _dims(c.sizes)) \
                    or not len(c.offsets) == len(c.sizes) == len(smd.size) \
                    or any(o + s > d for o, s, d in zip(c.offsets, c.sizes, smd.size)):
                raise bad(f"a chunk of tensor {fqn!r} does not lie within its shape {tuple(smd.size)}", fqn)
            at = tuple(c.offsets)
            if at in seen:  # DCP records each chunk once; a repeat would be converted again and again
                raise bad(f"tensor {fqn!r} lists its chunk at {at} more than once", fqn)
            seen.add(at)
            if MetadataIndex(fqn, c.offsets) not in storage:
                raise bad(f"chunk at {at} of tensor {fqn!r} has no storage entry", fqn)


def _check_shape(shape: tuple[int, ...], dtype: torch.dtype, fqn: str, file: str) -> None:
    """Refuse a tensor shape no array can have before anything counts its elements: more than
    :data:`~xckpt.format.manifest.MAX_RANK` dimensions (``convert.dcp_metadata``), a dimension, element
    or byte count of 2**53 or more (``shape.too_large``, as the xckpt format bounds them)."""
    if len(shape) > MAX_RANK:
        raise XckptError(f"invalid DCP metadata: tensor {fqn!r} has {len(shape)} dimensions, more than "
                         f"{MAX_RANK}", code="convert.dcp_metadata", file=file, leaf=fqn)
    numel = 1
    for n in shape:
        numel = min(numel * n, MAX_ELEMENTS + 1)  # capped: a huge product is never built
    if any(n >= MAX_ELEMENTS for n in shape) or numel * dtype.itemsize > MAX_ELEMENTS:
        said = (f"of shape {list(shape)}" if all(n < MAX_ELEMENTS for n in shape)
                else "with a dimension of 2**53 or more")
        raise ShapeError(f"tensor {fqn!r} {said} is larger than the xckpt format allows "
                         "(dimensions below 2**53, at most 2**53 elements and bytes)", code="shape.too_large",
                         file=file, leaf=fqn)


def rank_metadata_name(rank: int) -> str:
    """The metadata file one rank writes when DCP saves without collectives (``use_collectives=False``)."""
    return f"__{rank}{METADATA_NAME}"


def merge_rank_metadata(parts: list[tuple[str, Metadata]]) -> Metadata:
    """One checkpoint's metadata from the per-rank files ``(path, metadata)`` of a save without collectives,
    in rank order. Each rank describes what it wrote: a tensor's chunks are the union of every rank's (a
    chunk at the same offsets written by several ranks, a replica, is kept once: the lowest rank's), a value
    is the lowest rank's. Ranks must agree on each tensor's shape and properties and on each name's kind
    (``convert.dcp_metadata``, naming the later rank's file); the result is checked again as a whole.
    """
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    planner: dict[str, Any] = {}
    first: dict[str, str] = {}
    for path, md in parts:
        for fqn, item in md.state_dict_metadata.items():
            have = sdm.get(fqn)
            if have is None:
                sdm[fqn] = (dataclasses.replace(item, chunks=list(item.chunks))
                            if type(item) is TensorStorageMetadata else item)
                first[fqn] = path
                continue
            if type(have) is not type(item) or (type(item) is TensorStorageMetadata and (
                    tuple(have.size) != tuple(item.size) or have.properties != item.properties)):
                raise XckptError(f"the ranks' DCP metadata disagree about {fqn!r} (as in {first[fqn]})",
                                 code="convert.dcp_metadata", file=path)
            if type(item) is TensorStorageMetadata:
                known = {tuple(c.offsets): tuple(c.sizes) for c in have.chunks}
                for c in item.chunks:
                    at = tuple(c.offsets)
                    if at not in known:
                        known[at] = tuple(c.sizes)
                        have.chunks.append(c)
                    elif known[at] != tuple(c.sizes):
                        raise XckptError(f"the ranks' DCP metadata disagree about the chunk of {fqn!r} at {at} "
                                         f"(as in {first[fqn]})", code="convert.dcp_metadata", file=path)
        for index, info in md.storage_data.items():
            storage.setdefault(index, info)
        for fqn, where in (md.planner_data or {}).items():
            planner.setdefault(fqn, where)
    merged = Metadata(state_dict_metadata=sdm, planner_data=planner or None, storage_data=storage)
    check_metadata(merged, file=parts[0][0])
    return merged


class DcpDirectory:
    """A DCP checkpoint directory, read without following links, blocking, or reading out of bounds.

    The directory is opened once (its own path may go through links); ``.metadata`` and the data
    files are opened relative to that descriptor with ``O_NOFOLLOW | O_NONBLOCK`` and must be
    regular files. Usable as a context manager; safe to read from several threads.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        #: The metadata file :meth:`read_metadata` read (rank 0's of per-rank ones), for messages.
        self.metadata_file: str | None = None
        try:
            self._fd: int | None = os.open(self.root, _DIR_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise XckptError(f"{self.root} is not a DCP checkpoint (not a directory)", code="convert.not_dcp",
                             file=self.root) from None
        except OSError as exc:
            raise XckptError(f"cannot open {self.root}: {exc.strerror}", code="io.read", file=self.root) from None

    def __enter__(self) -> "DcpDirectory":
        """This directory (closed on exit)."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the directory descriptor."""
        self.close()

    def close(self) -> None:
        """Close the directory descriptor."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def path(self, name: str) -> str:
        """The path of ``name`` in the checkpoint, for messages."""
        return os.path.join(self.root, name)

    def _open(self, name: str) -> tuple[int, int]:
        """An open regular file ``name`` and its size; ``FileNotFoundError`` when it is missing."""
        assert self._fd is not None, "DcpDirectory is closed"
        path = self.path(name)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self._fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            try:
                st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
            except OSError:
                st = None
            if exc.errno == errno.ELOOP or (st is not None and stat.S_ISLNK(st.st_mode)):
                raise UnsafePathError(f"{path} is a symbolic link; a DCP checkpoint is read from plain files only",
                                      code="path.link", file=path) from None
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(f"{path} is not a regular file", code="path.special", file=path) from None
            raise XckptError(f"cannot open {path}: {exc.strerror}", code="io.read", file=path) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafePathError(f"{path} is not a regular file", code="path.special", file=path)
        return fd, st.st_size

    def read_metadata(self) -> Metadata:
        """``.metadata``, or the per-rank ``__<rank>.metadata`` of a save without collectives (ranks 0 to
        N-1, none missing) merged (:func:`merge_rank_metadata`); size-capped, all files together
        (``resource.too_large``), unpickled and checked (:func:`load_metadata`)."""
        budget = [MAX_METADATA_BYTES]
        try:
            md = self._read_one(METADATA_NAME, budget)
            self.metadata_file = self.path(METADATA_NAME)
            return md
        except FileNotFoundError:
            pass
        assert self._fd is not None, "DcpDirectory is closed"
        ranks = sorted(int(m.group(1)) for m in map(_RANK_METADATA.fullmatch, os.listdir(self._fd)) if m)
        if not ranks:
            raise XckptError(f"{self.root} is not a DCP checkpoint (no .metadata, nor {rank_metadata_name(0)})",
                             code="convert.not_dcp", file=self.root)
        if ranks != list(range(len(ranks))):
            missing = _missing(ranks, 8)
            raise DataError(f"the DCP checkpoint has per-rank metadata up to rank {ranks[-1]} but none of ranks "
                            f"{missing[:8]}", code="convert.dcp_metadata",
                            file=self.path(rank_metadata_name(missing[0])))
        parts = []
        for r in ranks:
            try:
                parts.append((self.path(rank_metadata_name(r)), self._read_one(rank_metadata_name(r), budget)))
            except FileNotFoundError:  # removed since it was listed
                raise DataError("a per-rank DCP metadata file is gone", code="convert.dcp_metadata",
                                file=self.path(rank_metadata_name(r))) from None
        md = merge_rank_metadata(parts)
        self.metadata_file = parts[0][0]
        return md

    def _read_one(self, name: str, budget: list[int]) -> Metadata:
        """One metadata file, counted against ``budget[0]`` bytes; ``FileNotFoundError`` when missing."""
        path = self.path(name)
        fd, size = self._open(name)
        try:
            if size > budget[0]:
                raise ResourceError(f"the DCP metadata is more than the {MAX_METADATA_BYTES} bytes read",
                                    code="resource.too_large", file=path)
            budget[0] -= size
            data = _pread(fd, 0, size, path)
        finally:
            os.close(fd)
        return load_metadata(data, file=path)

    def size_of(self, name: str) -> int:
        """The size of the data file ``name`` (a plain file name), checked to be a regular file."""
        check_storage_name(name, file=self.path(name))
        try:
            fd, size = self._open(name)
        except FileNotFoundError:
            raise DataError("a DCP data file is missing", code="chunk.missing", file=self.path(name)) from None
        os.close(fd)
        return size

    def check_ranges(self, infos: Iterable[tuple[str, _StorageInfo]]) -> None:
        """Check that every stored range ``(fqn, info)`` lies within its file (``chunk.truncated``), opening
        each file once; an error names the file and the fqn of the item that found it."""
        sizes: dict[str, int] = {}
        for fqn, info in infos:
            name = info.relative_path
            try:
                if name not in sizes:
                    sizes[name] = self.size_of(name)
                _check_range(info, sizes[name], self.path(name))
            except XckptError as exc:
                raise exc.at(leaf=fqn) from None

    def item(self, info: _StorageInfo) -> "DcpItem":
        """One stored item as a read-only file of exactly its bytes (read on demand, never held whole),
        after checking its range against the file's size; close it (or use it as a context manager)."""
        name = check_storage_name(info.relative_path, file=self.path(str(info.relative_path)))
        path = self.path(name)
        try:
            fd, size = self._open(name)
        except FileNotFoundError:
            raise DataError("a DCP data file is missing", code="chunk.missing", file=path) from None
        try:
            _check_range(info, size, path)
        except BaseException:
            os.close(fd)
            raise
        return DcpItem(fd, info.offset, info.length, path)


class DcpItem(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file as a seekable read-only file of its own.

    ``torch.load`` reads a ``torch.save`` archive through it record by record, each straight into its
    tensor's memory: converting an item holds it once, not also as bytes. A file that became shorter
    than the item since its range was checked raises ``chunk.truncated`` (see :attr:`truncated`)."""

    def __init__(self, fd: int, offset: int, length: int, path: str) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self.path = fd, offset, length, path
        self._pos = 0
        self.truncated: DataError | None = None  # set when a read found the file short (torch may wrap the error)

    def readable(self) -> bool:
        """True."""
        return True

    def seekable(self) -> bool:
        """True."""
        return True

    def tell(self) -> int:
        """The position within the item."""
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        """Move within the item (clamped at 0; reads past its end return nothing)."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        """Read up to ``len(buf)`` bytes of the item at the current position into ``buf``."""
        view = memoryview(buf).cast("B")
        want = max(0, min(len(view), self._length - self._pos))
        done = 0
        while done < want:
            got = os.preadv(self._fd, [view[done:want]], self._offset + self._pos + done)
            if got == 0:
                self.truncated = DataError(f"the file ends {want - done} bytes short of a stored DCP item",
                                           code="chunk.truncated", file=self.path)
                raise self.truncated
            done += got
        self._pos += done
        return done

    def close(self) -> None:
        """Close the file."""
        if not self.closed:
            os.close(self._fd)
        super().close()


def _missing(ranks: list[int], n: int) -> list[int]:
    """The first ``n`` numbers below ``ranks[-1]`` missing from the sorted ``ranks`` (found without listing them all:
    a directory may hold ``__0.metadata`` and ``__999999999.metadata``)."""
    out: list[int] = []
    expect = 0
    for r in ranks:
        while expect < r and len(out) < n:
            out.append(expect)
            expect += 1
        if len(out) >= n:
            break
        expect = r + 1
    return out


def _check_range(info: _StorageInfo, size: int, path: str) -> None:
    if info.offset + info.length > size:
        raise DataError(f"a stored DCP item at bytes {info.offset}..{info.offset + info.length} lies beyond the "
                        f"end of its {size}-byte file", code="chunk.truncated", file=path)


def _pread(fd: int, offset: int, length: int, path: str) -> bytes:
    parts: list[bytes] = []
    done = 0
    while done < length:
        part = os.pread(fd, length - done, offset + done)
        if not part:
            raise DataError(f"the file ends {length - done} bytes short of a stored DCP item",
                            code="chunk.truncated", file=path)
        parts.append(part)
        done += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)
