"""Plain tensors and DTensors as xckpt sources (what to save) and targets (what to load into).

A DTensor is described by its :class:`~xckpt.engine.layout.MeshLayout`: the device
mesh's ranks and one placement per mesh dimension (``torch.chunk`` splits, several mesh
dimensions on one tensor dimension, ``_StridedShard`` of FSDP2 + TP). From it every
rank knows what every rank holds, so planning a save sends no per-shard messages; its
local tensor is one or more boxes of the global tensor (the usual placements give one
box, the local tensor itself, fetched zero-copy). Of each box's holders one writes it.
Loads read each box straight into the local tensor. Nothing is gathered.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard as TShard
from torch.distributed.tensor.placement_types import _StridedShard

from xckpt.engine.layout import Mesh, MeshLayout, mesh, mesh_layout
from xckpt.errors import UnsupportedError, XckptError
from xckpt.format.regions import Region, refuse_overlap
from xckpt.registry import ArraySource, ArrayTarget

from .staging import tensor_shard
from .tensors import copy_into, cpu_view, from_numpy, logical_dtype, torch_dtype


_meshes: dict[int, tuple[Any, Mesh]] = {}


def _mesh(device_mesh: Any) -> Mesh:
    """The engine's mesh of a DeviceMesh (global ranks), built once per DeviceMesh."""
    hit = _meshes.get(id(device_mesh))
    if hit is None or hit[0] is not device_mesh:
        ranks = device_mesh.mesh
        hit = _meshes[id(device_mesh)] = (device_mesh, mesh(tuple(int(n) for n in ranks.shape),
                                                            tuple(int(r) for r in ranks.reshape(-1).tolist())))
    return hit[1]


def placement(p: Any) -> tuple[Any, ...]:
    """The engine's form of a DTensor placement."""
    if isinstance(p, Replicate):
        return ("R",)
    if isinstance(p, _StridedShard):
        return ("SS", int(p.dim), int(p.split_factor))
    if isinstance(p, TShard):
        return ("S", int(p.dim))
    raise UnsupportedError(f"cannot save a DTensor with placement {p} (reduce Partial placements "
                           "first, e.g. redistribute to Replicate or Shard)", code="dtensor.placement")


def layout_of(d: DTensor) -> tuple[MeshLayout, tuple[int, ...] | None]:
    """How a DTensor lies over the ranks, and this rank's position in its mesh (None: outside it)."""
    coord = d.device_mesh.get_coordinate()
    lay = mesh_layout(tuple(int(n) for n in d.shape), _mesh(d.device_mesh),
                      tuple(placement(p) for p in d.placements))
    return lay, None if coord is None else tuple(int(c) for c in coord)


def dtensor_pieces(d: DTensor) -> tuple[MeshLayout, Sequence[tuple[Region, tuple[slice, ...]]], torch.Tensor]:
    """A DTensor's layout, its local boxes and its local tensor (detached), checked against each other."""
    _, lay, pieces, expect, _ = _laid_out(d)
    return lay, pieces, _local(d, pieces, expect)


#: Most (mesh, placements, shape) combinations :func:`_laid_out` keeps; past it, it starts over.
_LAID_MAX = 4096
_laid: dict[tuple[int, tuple[Any, ...], tuple[int, ...]], tuple[Any, ...]] = {}


def _laid_out(d: DTensor) -> tuple[Any, MeshLayout, Sequence[tuple[Region, tuple[slice, ...]]],
                                   tuple[int, ...] | None, dict[str, Any]]:
    """``(device mesh, layout, this rank's boxes, the local shape they expect (None: outside the mesh),
    the manifest's sharding description)`` of a DTensor, worked out once per device mesh, placements
    and shape: the leaves of a model are laid out alike, and each save describes every one of them."""
    device_mesh = d.device_mesh
    key = (id(device_mesh), tuple(d.placements), tuple(d.shape))
    hit = _laid.get(key)
    if hit is None or hit[0] is not device_mesh:
        lay, coord = layout_of(d)
        if len(_laid) >= _LAID_MAX:
            _laid.clear()
        hit = _laid[key] = (device_mesh, lay, () if coord is None else lay.pieces(coord),
                            None if coord is None else lay.local_shape(coord), _mesh_info(d))
    return hit  # type: ignore[return-value]


def _local(d: DTensor, pieces: Sequence[tuple[Region, tuple[slice, ...]]], expect: tuple[int, ...] | None
           ) -> torch.Tensor:
    """A DTensor's local tensor, detached, checked against the shape its layout gives (``expect``).

    It is read from the DTensor's ``_local_tensor`` where it has one: ``to_local()`` builds an
    autograd node unless grad mode is off (ten times the cost, for every DTensor of every save),
    and turning grad mode off and on costs as much again."""
    local = getattr(d, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        local = local.detach()
    else:
        with torch.no_grad():
            local = d.to_local().detach()
    if expect is not None and expect != tuple(local.shape) and pieces:
        raise UnsupportedError(f"DTensor local tensor has shape {tuple(local.shape)} but placements "
                               f"{list(d.placements)} give {expect}: padded local tensors are not supported, nor an "
                               "uneven _StridedShard whose split torch made in another order than its placements "
                               "read (FSDP2 over tensor parallel with a dimension the meshes do not divide)",
                               code="dtensor.local_shape")
    return local


_infos: dict[tuple[int, tuple[Any, ...], int], tuple[Any, dict[str, Any]]] = {}


def _mesh_info(d: DTensor) -> dict[str, Any]:
    """What the manifest records of a DTensor's sharding (one shared dict per mesh and placements)."""
    key = (id(d.device_mesh), tuple(d.placements), d.ndim)
    hit = _infos.get(key)
    if hit is None or hit[0] is not d.device_mesh:
        hit = _infos[key] = (d.device_mesh, _describe(d))
    return hit[1]


def _describe(d: DTensor) -> dict[str, Any]:
    mesh = d.device_mesh
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"dim{i}" for i in range(mesh.ndim)]
    dim_axes: list[list[str]] = [[] for _ in range(d.ndim)]
    for mesh_dim, p in enumerate(d.placements):
        if isinstance(p, (TShard, _StridedShard)):
            dim_axes[p.dim].append(names[mesh_dim])
    return {"framework": "torch", "framework_version": torch.__version__, "mesh_shape": list(mesh.shape), "axis_names": names,
            "dim_axes": dim_axes, "placements": [repr(p) for p in d.placements],
            "device_type": mesh.device_type}


def _check_device(t: torch.Tensor) -> None:
    """Refuse a tensor whose data cannot be saved as it lies: on the meta device (``tensor.meta``), or sparse or
    otherwise not strided (``tensor.layout``: densify it first)."""
    if t.is_meta:
        raise UnsupportedError("a tensor on the meta device has no data to save", code="tensor.meta")
    if t.layout != torch.strided:
        raise UnsupportedError(f"a tensor of layout {t.layout} is not saved (only strided, dense tensors are): "
                               "densify it first (to_dense())", code="tensor.layout")


def _xckpt_errors(fn: Any) -> Any:
    """Turn torch errors into XckptErrors, which the core reports on every rank (no rank is left waiting)."""
    @functools.wraps(fn)
    def wrapped(obj: Any, *rest: Any) -> Any:
        try:
            return fn(obj, *rest)
        except XckptError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised as a specific xckpt error
            doing = "load into" if rest else "describe"  # a target gets the stored entry too
            raise UnsupportedError(f"cannot {doing} this {type(obj).__name__}: {type(exc).__name__}: {exc}",
                                   code="torch.tensor") from exc
    return wrapped


def _host_view(t: torch.Tensor) -> bool:
    """Whether a load can read straight into ``t``'s memory: a CPU tensor with no lazy conjugate or
    negative bit (those are filled by torch's ``copy_``, which applies the bits)."""
    return t.device.type == "cpu" and not t.is_conj() and not t.is_neg()


def _refuse_overlap(t: torch.Tensor) -> None:
    """Refuse a target tensor whose elements share memory (an expanded one), before anything is written."""
    refuse_overlap(tuple(t.shape), [st * t.element_size() for st in t.stride()], t.element_size(), None)


@_xckpt_errors
def dtensor_source(d: DTensor) -> ArraySource:
    """Save a DTensor: this rank's boxes of it and its layout (each box is written by one of its holders)."""
    _, lay, pieces, expect, sharding = _laid_out(d)
    local = _local(d, pieces, expect)
    _check_device(local)
    shards = [tensor_shard(region, local[sl]) for region, sl in pieces]
    return ArraySource(lay.shape, logical_dtype(d.dtype), shards, sharding, lay)


@_xckpt_errors
def tensor_source(t: torch.Tensor) -> ArraySource:
    """Save a plain tensor: held whole by every rank; one rank writes it."""
    _check_device(t)
    t = t.detach()
    shape = tuple(int(s) for s in t.shape)
    return ArraySource(shape, logical_dtype(t.dtype), [tensor_shard(Region.full(shape), t)],
                       {"framework": "torch", "framework_version": torch.__version__})


@_xckpt_errors
def dtensor_target(like: DTensor, entry: Any) -> ArrayTarget:
    """Load into a DTensor in place: read exactly this rank's boxes, straight into its local tensor
    (on the CPU; other devices get a copy from the host)."""
    _, pieces, local = dtensor_pieces(like)
    on_host = _host_view(local)
    if not on_host:  # filled by copy_ (the core checks the memory it reads into itself)
        for _, sl in pieces:
            _refuse_overlap(local[sl])

    def build(parts: list[np.ndarray]) -> DTensor:
        if not on_host:
            for (_, sl), arr in zip(pieces, parts):
                copy_into(local[sl], arr)
        return like

    return ArrayTarget(tuple(int(s) for s in like.shape), logical_dtype(like.dtype),
                       [region for region, _ in pieces], build,
                       (lambda k: cpu_view(local[pieces[k][1]])) if on_host else None)


@_xckpt_errors
def tensor_target(like: torch.Tensor, entry: Any) -> ArrayTarget:
    """Load a whole array into a plain tensor in place (straight into it on the CPU; a new CPU
    tensor for a ``meta`` target)."""
    shape = tuple(int(s) for s in like.shape)
    name = logical_dtype(like.dtype)
    on_host = _host_view(like)
    if not on_host and like.device.type != "meta":  # filled by copy_ (the core checks the memory it reads into itself)
        _refuse_overlap(like)

    def build(parts: list[np.ndarray]) -> torch.Tensor:
        if like.device.type == "meta":
            return from_numpy(parts[0], name).clone().requires_grad_(like.requires_grad)
        if not on_host:
            copy_into(like, parts[0])
        return like

    return ArrayTarget(shape, name, [Region.full(shape)], build,
                       (lambda k: cpu_view(like.detach())) if on_host else None)


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a DTensor."""
    return isinstance(x, DTensor)


def is_plain_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor that is not a DTensor."""
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


__all__ = ["layout_of", "placement", "dtensor_pieces", "dtensor_source", "tensor_source", "dtensor_target",
           "tensor_target", "is_dtensor", "is_plain_tensor", "torch_dtype"]
