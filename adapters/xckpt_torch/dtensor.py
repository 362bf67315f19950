"""Plain tensors and DTensors as xckpt sources (what to save) and targets (what to load into).

A DTensor's local tensor is described as one or more boxes of the global tensor:
each ``Shard``-like placement narrows the list of global indices a rank holds
along one tensor dimension (``torch.chunk`` splits, several mesh dimensions on one
tensor dimension, ``_StridedShard`` of FSDP2 + TP); every maximal run of
consecutive indices becomes a box. The usual placements give one box, the local
tensor itself, fetched zero-copy. Replicas are listed by every rank that holds
them; the core planner keeps one writer per distinct box. Nothing is gathered.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard as TShard
from torch.distributed.tensor.placement_types import _StridedShard

from xckpt.errors import UnsupportedError, XckptError
from xckpt.engine.regions import Region
from xckpt.registry import ArraySource, ArrayTarget, Shard

from .tensors import copy_into, from_numpy, logical_dtype, to_host, torch_dtype


@dataclass(frozen=True)
class Piece:
    """One box of the global tensor held locally: where it is globally and locally."""

    region: Region
    local: tuple[slice, ...]


def _runs(indices: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive indices: ``(global_start, local_start, length)``."""
    if indices.size == 0:
        return []
    breaks = np.nonzero(np.diff(indices) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [indices.size]])
    return [(int(indices[s]), int(s), int(e - s)) for s, e in zip(starts, ends)]


def local_indices(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                  placements: Sequence[Any]) -> list[np.ndarray | None]:
    """Per tensor dimension, the global indices this mesh coordinate holds (None: all of them)."""
    idx: list[np.ndarray | None] = [None] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, _StridedShard):
            d = p.dim
            current = idx[d] if idx[d] is not None else np.arange(shape[d])
            from torch.distributed.tensor.placement_types import _StridedShardOffsetMode
            size, offs = p.local_shard_size_and_offset(len(current), mesh_shape[mesh_dim], coord[mesh_dim],
                                                        _StridedShardOffsetMode.ALL)
            local = np.asarray(offs if size else [], dtype=np.int64)
        elif isinstance(p, TShard):
            d = p.dim
            current = idx[d] if idx[d] is not None else np.arange(shape[d])
            size, off = TShard.local_shard_size_and_offset(len(current), mesh_shape[mesh_dim], coord[mesh_dim])
            local = np.arange(int(off), int(off) + int(size), dtype=np.int64) if size else np.zeros(0, np.int64)
        else:
            raise UnsupportedError(f"cannot save a DTensor with placement {p} (reduce Partial placements "
                                   "first, e.g. redistribute to Replicate or Shard)", code="dtensor.placement")
        idx[d] = current[local]
    return idx


def local_pieces(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int] | None,
                 placements: Sequence[Any]) -> list[Piece]:
    """The boxes of the global tensor held at ``coord`` (none when this rank is outside the mesh)."""
    shape = tuple(int(s) for s in shape)
    if coord is None:
        return []
    per_dim: list[list[tuple[int, int, int]]] = []
    for d, ind in enumerate(local_indices(shape, mesh_shape, coord, placements)):
        runs = [(0, 0, shape[d])] if ind is None else _runs(ind)
        if not runs or runs == [(0, 0, 0)]:
            runs = [(0, 0, 0)]
        per_dim.append(runs)
    pieces = []
    for combo in itertools.product(*per_dim):
        region = Region(tuple(g for g, _, _ in combo), tuple(n for _, _, n in combo))
        pieces.append(Piece(region, tuple(slice(lo, lo + n) for _, lo, n in combo)))
    return pieces


def _mesh_info(d: DTensor) -> dict[str, Any]:
    mesh = d.device_mesh
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"dim{i}" for i in range(mesh.ndim)]
    dim_axes: list[list[str]] = [[] for _ in range(d.ndim)]
    for mesh_dim, p in enumerate(d.placements):
        if isinstance(p, (TShard, _StridedShard)):
            dim_axes[p.dim].append(names[mesh_dim])
    return {"framework": "torch", "framework_version": torch.__version__, "mesh_shape": list(mesh.shape), "axis_names": names,
            "dim_axes": dim_axes, "placements": [repr(p) for p in d.placements],
            "device_type": mesh.device_type}


def dtensor_pieces(d: DTensor) -> tuple[list[Piece], torch.Tensor]:
    """The local boxes of a DTensor and its local tensor (detached), checked against each other."""
    mesh = d.device_mesh
    local = d.to_local().detach()
    pieces = local_pieces(tuple(d.shape), tuple(mesh.shape), mesh.get_coordinate(), d.placements)
    if pieces:
        expect = tuple(max(s.stop for s in col) if col else 0 for col in zip(*[p.local for p in pieces]))
        if expect != tuple(local.shape):
            raise UnsupportedError(f"DTensor local tensor has shape {tuple(local.shape)} but placements "
                                   f"{list(d.placements)} give {expect} (padded local tensors are not supported)",
                                   code="dtensor.local_shape")
    return pieces, local


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "meta":
        raise UnsupportedError("a tensor on the meta device has no data to save", code="tensor.meta")


def _xckpt_errors(fn: Any) -> Any:
    """Turn torch errors into XckptErrors, which the core reports on every rank (no rank is left waiting)."""
    @functools.wraps(fn)
    def wrapped(obj: Any) -> Any:
        try:
            return fn(obj)
        except XckptError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised as a specific xckpt error
            raise UnsupportedError(f"cannot describe this {type(obj).__name__}: {type(exc).__name__}: {exc}",
                                   code="torch.tensor") from exc
    return wrapped


@_xckpt_errors
def dtensor_source(d: DTensor) -> ArraySource:
    """Save a DTensor: this rank's boxes of it, replicas included (the planner picks one writer)."""
    _check_device(d)
    pieces, local = dtensor_pieces(d)
    shards = [Shard(p.region, lambda sl=p.local: to_host(local[sl])) for p in pieces]
    return ArraySource(tuple(int(s) for s in d.shape), logical_dtype(d.dtype), shards, _mesh_info(d))


@_xckpt_errors
def tensor_source(t: torch.Tensor) -> ArraySource:
    """Save a plain tensor: held whole by every rank; one rank writes it."""
    _check_device(t)
    t = t.detach()
    shape = tuple(int(s) for s in t.shape)
    return ArraySource(shape, logical_dtype(t.dtype), [Shard(Region.full(shape), lambda: to_host(t))],
                       {"framework": "torch", "framework_version": torch.__version__})


def dtensor_target(like: DTensor, entry: Any) -> ArrayTarget:
    """Load into a DTensor in place: read exactly this rank's boxes, copy them into its local tensor."""
    pieces, local = dtensor_pieces(like)

    def build(parts: list[np.ndarray]) -> DTensor:
        for p, arr in zip(pieces, parts):
            copy_into(local[p.local], arr)
        return like

    return ArrayTarget(tuple(int(s) for s in like.shape), logical_dtype(like.dtype),
                       [p.region for p in pieces], build)


def tensor_target(like: torch.Tensor, entry: Any) -> ArrayTarget:
    """Load a whole array into a plain tensor in place (a new CPU tensor for a ``meta`` target)."""
    shape = tuple(int(s) for s in like.shape)
    name = logical_dtype(like.dtype)

    def build(parts: list[np.ndarray]) -> torch.Tensor:
        if like.device.type == "meta":
            return from_numpy(parts[0], name).clone().requires_grad_(like.requires_grad)
        copy_into(like, parts[0])
        return like

    return ArrayTarget(shape, name, [Region.full(shape)], build)


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a DTensor."""
    return isinstance(x, DTensor)


def is_plain_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor that is not a DTensor."""
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


__all__ = ["Piece", "local_indices", "local_pieces", "dtensor_source", "tensor_source", "dtensor_target",
           "tensor_target", "is_dtensor", "is_plain_tensor", "torch_dtype"]
