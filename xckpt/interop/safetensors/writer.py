"""Writing Hugging Face safetensors from any checkpoint xckpt reads (``xckpt convert --to safetensors``).

The export is planned from the manifest alone (names, dtypes, shapes: which tensor goes into
which file, every file's header), then streamed: each tensor is read from the source in
pieces of at most :data:`PIECE_BYTES` (:func:`xckpt.engine.copy.read_region`) and appended to
its file, so host memory stays near one piece whatever the size of the model.

Output, as ``transformers`` writes it: one ``model.safetensors`` when every tensor fits in one
file of ``max_shard_size`` bytes, else ``model-00001-of-0000N.safetensors`` ... and
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).
A tensor larger than ``max_shard_size`` gets a file of its own.

Names are the leaf keys joined with ``.`` (the torch adapter keys a module's state by its FQN,
so ``{"model": model}`` gives ``model.transformer.h.0.attn.c_attn.weight``); ``select`` keeps the
leaves under a key prefix and strips it (``select="model"`` gives ``model.state_dict()`` names).
Non-array leaves are skipped, with an :class:`~xckpt.errors.XckptWarning` naming them.

The files are written into a temporary directory beside ``dst`` and moved into place when all
are written and synced (:mod:`xckpt.engine.commit`): a failed export leaves nothing, an existing
``dst`` is refused unless ``overwrite``, which replaces only a safetensors export.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from xckpt.engine import atomic, claims
from xckpt.engine.commit import Hold, SaveOptions, check_target, publish
from xckpt.engine.copy import piece_bytes_for, read_region
from xckpt.engine.storage import Location
from xckpt.errors import SaveError, UnsupportedError, XckptError, XckptWarning
from xckpt.format import dtypes
from xckpt.format.manifest import ArrayEntry, Manifest
from xckpt.format.safetensors import DTYPES as SAFETENSORS_DTYPES, INDEX_FILE, MAX_HEADER_BYTES, SINGLE_FILE
from xckpt.format.regions import Region
from xckpt.format.tree import Key, key_str
from xckpt.sources.base import Source

#: Most bytes of one tensor read from the source at a time.
PIECE_BYTES = 16 << 20
#: ``max_shard_size`` when none is given (as ``transformers``' ``save_pretrained``).
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: The ``__metadata__`` every file carries (what ``transformers`` checks before loading it).
FILE_METADATA = {"format": "pt"}

#: xckpt logical dtype -> safetensors dtype string (every dtype both know).
DTYPES: dict[str, str] = {name: st for st, name in SAFETENSORS_DTYPES.items()}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def safetensors_dtype(dtype: str) -> str:
    """The safetensors dtype string of an xckpt logical dtype; ``convert.safetensors_dtype`` if it has none."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise UnsupportedError(f"dtype {dtype} has no safetensors equivalent; exportable: {', '.join(DTYPES)}",
                               code="convert.safetensors_dtype") from None


def parse_size(size: int | str | None) -> int:
    """Bytes from a shard size: an int, ``"123"``, or a number with a unit, decimal as ``transformers``
    (``"5GB"`` = 5 * 10**9, ``"200MB"``, ``"500KB"``) or binary (``"2GiB"``); None: :data:`DEFAULT_MAX_SHARD_SIZE`."""
    if size is None:
        size = DEFAULT_MAX_SHARD_SIZE
    if isinstance(size, bool):
        raise UnsupportedError(f"max_shard_size {size!r} is not a size", code="convert.safetensors_size")
    if isinstance(size, int):
        n = size
    else:
        text = str(size).strip().replace(" ", "").lower()
        number = text.rstrip("kmgtib")
        unit = text[len(number):]
        try:
            value = float(number) if unit in _UNITS and number else None
        except ValueError:
            value = None
        if value is None or not math.isfinite(value):
            raise UnsupportedError(f"max_shard_size {size!r} is not a size: a byte count or a number with a unit "
                                   "(KB, MB, GB, TB, decimal as in transformers; KiB, MiB, GiB, TiB)",
                                   code="convert.safetensors_size")
        n = int(value * _UNITS[unit])
    if n < 1:
        raise UnsupportedError(f"max_shard_size {size!r} must be at least one byte", code="convert.safetensors_size")
    return n


@dataclass(frozen=True)
class Tensor:
    """One tensor of the export: its safetensors name, the array leaf it comes from, its bytes."""

    name: str
    entry: ArrayEntry
    dtype: str  # the safetensors dtype string

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return self.entry.nbytes


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: each file's name and tensors (in file order), and what it leaves out."""

    files: tuple[tuple[str, tuple[Tensor, ...]], ...]
    skipped: tuple[str, ...]  # the keys of the non-array leaves selected, which safetensors cannot hold

    @property
    def total_size(self) -> int:
        """Bytes of tensor data in all files (the index's ``total_size``)."""
        return sum(t.nbytes for _, ts in self.files for t in ts)

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> its file, sorted by name (the index's ``weight_map``)."""
        return dict(sorted((t.name, f) for f, ts in self.files for t in ts))


def _prefix(select: str | None) -> str:
    """A subtree path (``model``, ``model/encoder``, ``model.encoder``) as a dotted name prefix ('' for all)."""
    if select is None:
        return ""
    return ".".join(part for part in select.replace("/", ".").split(".") if part)


def export_name(key: Key, prefix: str = "") -> str | None:
    """The safetensors name of the leaf at ``key``: its key components joined with ``.``, less ``prefix``
    (a dotted name, see ``select``); None when the leaf is not under ``prefix``."""
    name = ".".join(str(k) for k in key)
    if not prefix:
        return name
    if name == prefix:
        return ""
    return name[len(prefix) + 1:] if name.startswith(prefix + ".") else None


def plan_export(manifest: Manifest, *, select: str | None = None,
                max_shard_size: int | str | None = None) -> ExportPlan:
    """Which tensors an export writes into which file, from the manifest alone (nothing is read).

    Tensors go into files in tree order, a new file starting when the next tensor would take the
    current one past ``max_shard_size`` (as ``transformers``); inside a file they are ordered by
    element size, largest first, so that every tensor starts at a multiple of its element size.
    Raises ``convert.safetensors_select`` (nothing selected, or ``select`` names a leaf),
    ``convert.safetensors_name`` (two leaves would share a name), ``convert.safetensors_dtype``
    and ``convert.safetensors_size``.
    """
    limit = parse_size(max_shard_size)
    prefix = _prefix(select)
    tensors: list[Tensor] = []
    skipped: list[str] = []
    seen: dict[str, Key] = {}
    for e in manifest.leaves:
        name = export_name(e.key, prefix)
        if name is None:
            continue
        if name == "":
            raise UnsupportedError(f"--select {select!r} names a leaf, not a subtree; select the subtree holding it",
                                   code="convert.safetensors_select", leaf=key_str(e.key))
        if not isinstance(e, ArrayEntry):
            skipped.append(key_str(e.key))
            continue
        if name in seen or name == "__metadata__":
            other = f"leaf {key_str(seen[name])!r} has it too" if name in seen else "safetensors reserves it"
            raise UnsupportedError(f"the tensor name {name!r} cannot be written: {other}",
                                   code="convert.safetensors_name", leaf=key_str(e.key))
        seen[name] = e.key
        try:
            tensors.append(Tensor(name, e, safetensors_dtype(e.dtype)))
        except XckptError as exc:
            raise exc.at(leaf=key_str(e.key)) from None
    if not tensors:
        tops = sorted({key_str(e.key[:1]) for e in manifest.leaves})
        where = f"under {select!r}" if prefix else "in the checkpoint"
        raise UnsupportedError(f"no array leaf {where} to export; top-level keys: {', '.join(tops) or 'none'}",
                               code="convert.safetensors_select")
    groups: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        if not groups or (groups[-1] and size + t.nbytes > limit):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    files = []
    for i, group in enumerate(groups):
        name = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        files.append((name, tuple(sorted(group, key=lambda t: -dtypes.itemsize(t.entry.dtype)))))
    return ExportPlan(tuple(files), tuple(skipped))


def header_bytes(tensors: Sequence[Tensor]) -> bytes:
    """A file's header: the 8-byte little-endian length, then the JSON (space-padded to a multiple of 8)."""
    head: dict[str, Any] = {"__metadata__": FILE_METADATA}
    offset = 0
    for t in tensors:
        head[t.name] = {"dtype": t.dtype, "shape": list(t.entry.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise UnsupportedError(f"a safetensors header of {len(text)} bytes is above the {MAX_HEADER_BYTES} bytes "
                               "readers accept; lower max_shard_size", code="convert.safetensors_header")
    return struct.pack("<Q", len(text)) + text


def pieces(shape: tuple[int, ...], itemsize: int, piece_bytes: int = PIECE_BYTES) -> Iterator[Region]:
    """Regions covering an array of ``shape`` in C order, each contiguous in it and of at most
    ``piece_bytes`` (or one element): written one after the other they give the array's C-order bytes."""
    if math.prod(shape) == 0:
        return
    if not shape:
        yield Region((), ())
        return
    k = next((d for d in range(len(shape)) if math.prod(shape[d + 1:]) * itemsize <= piece_bytes), len(shape) - 1)
    step = max(1, piece_bytes // (math.prod(shape[k + 1:]) * itemsize))
    rest = shape[k + 1:]
    for lead in itertools.product(*(range(n) for n in shape[:k])):
        for start in range(0, shape[k], step):
            yield Region(lead + (start,) + (0,) * len(rest), (1,) * k + (min(step, shape[k] - start),) + rest)


def _write_file(ckpt: Source, path: str, tensors: Sequence[Tensor], piece_bytes: int) -> None:
    """Write one safetensors file, tensor by tensor, piece by piece; synced when it returns."""
    with open(path, "xb") as f:
        f.write(header_bytes(tensors))
        for t in tensors:
            size = dtypes.itemsize(t.entry.dtype)
            written = 0
            for region in pieces(t.entry.shape, size, piece_bytes_for(t.entry, size, piece_bytes)):
                piece = np.ascontiguousarray(read_region(ckpt, t.entry, region))
                if sys.byteorder != "little" and size > 1:
                    piece = piece.byteswap()
                f.write(piece.reshape(-1).view(np.uint8).data)
                written += piece.nbytes
                del piece
            if written != t.nbytes:  # the regions tile the array: never expected
                raise XckptError(f"wrote {written} bytes of {t.nbytes} for {t.name!r}", leaf=key_str(t.entry.key))
        f.flush()
        os.fsync(f.fileno())


def _write_index(path: str, plan: ExportPlan) -> None:
    _write_new(path, json.dumps({"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map},
                                indent=2, ensure_ascii=False).encode("utf-8") + b"\n")


def _write_new(path: str, data: bytes) -> None:
    """A new file holding ``data``, synced."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_export(ckpt: Source, dst: str, plan: ExportPlan, *, overwrite: bool = False,
                 piece_bytes: int = PIECE_BYTES, extra_files: dict[str, str] | None = None) -> None:
    """Write ``plan`` (:func:`plan_export` of ``ckpt``'s manifest) as a safetensors directory at ``dst``:
    into a temporary sibling, moved into place once every file is synced; on failure nothing is left.
    ``extra_files`` (name in the export -> a file to copy there: its ``config.json``) go in with the weights."""
    final = Location.of(dst)
    if not final.is_local:
        raise UnsupportedError("safetensors exports are written to local directories only",
                               code="convert.safetensors_remote", file=str(final))
    extra = dict(extra_files or {})
    for name in extra:
        if os.path.basename(name) != name or name in (SINGLE_FILE, INDEX_FILE) or name.startswith("."):
            raise UnsupportedError(f"an extra file of a safetensors export is a plain name of its own, not {name!r}",
                                   code="convert.option")
    target = check_target(final, SaveOptions(overwrite=overwrite), kind="safetensors", writes=extra)
    hold = Hold(target, claims.new_generation(), SaveOptions().stale_after())
    try:
        try:
            tmp = hold.tmp.local_path
            for name, tensors in plan.files:
                _write_file(ckpt, os.path.join(tmp, name), tensors, piece_bytes)
            if len(plan.files) > 1:
                _write_index(os.path.join(tmp, INDEX_FILE), plan)
            for name, source in extra.items():
                with open(source, "rb") as f:
                    _write_new(os.path.join(tmp, name), f.read())
            atomic.sync_dir(tmp)
            publish(hold.tmp, target, hold.generation, hold=hold)
        except OSError as exc:
            raise SaveError(f"cannot write the safetensors export: {exc.strerror or exc}; nothing was written",
                            code="io.write", file=getattr(exc, "filename", None) or str(final)) from exc
    except BaseException:
        if not hold.committed:  # (after the move into place, the directory there is the replaced export)
            shutil.rmtree(hold.tmp.local_path, ignore_errors=True)
        raise
    finally:
        hold.end()


def xckpt_to_safetensors(src: str, dst: str, *, overwrite: bool = False, select: str | None = None,
                         max_shard_size: int | str | None = None, mapping: Any = None, like: Any = None,
                         extra_files: dict[str, str] | None = None) -> None:
    """Export the checkpoint at ``src`` (xckpt or Orbax) as Hugging Face safetensors in the directory ``dst``.

    ``select``: keep only the leaves under this key prefix (``"model"``, ``"model/encoder"``) and strip
    it from their names. ``max_shard_size``: bytes per file (``"5GB"``, ``"200MB"``, an int; default 5GB).
    ``mapping`` (and the ``like`` it resolves against) renames and lays out the arrays first: a flax
    checkpoint exported with Hugging Face torch names is ``mapping=M.flax_to_torch(), like={"model":
    model}, select="model"``, where ``model`` may live on the meta device (nothing of it is read).
    ``extra_files`` (name -> a file to copy: ``{"config.json": ...}``) are written with the weights.
    Everything is checked (names, dtypes) before ``dst`` is touched; non-array leaves are skipped with an
    :class:`~xckpt.errors.XckptWarning`.
    """
    from xckpt.load import describe_target
    from xckpt.sources.detect import open_checkpoint  # here: detect imports this package's reader

    ckpt = open_checkpoint(src)
    try:
        if mapping is not None:
            ckpt = mapping.apply(ckpt, None if like is None else describe_target(like))
        plan = plan_export(ckpt.manifest, select=select, max_shard_size=max_shard_size)
        if plan.skipped:
            shown = ", ".join(plan.skipped[:8]) + (f" and {len(plan.skipped) - 8} more" if len(plan.skipped) > 8 else "")
            warnings.warn(f"safetensors holds only arrays: skipped {len(plan.skipped)} non-array leaves ({shown})",
                          XckptWarning, stacklevel=2)
        write_export(ckpt, dst, plan, overwrite=overwrite, extra_files=extra_files)
    finally:
        ckpt.close()
