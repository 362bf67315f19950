"""DCP planners that keep non-tensor values neutral: msgpack, never ``torch.save``/``torch.load``.

Stock DCP turns each non-tensor value into ``torch.save`` bytes on save and runs
``torch.load(weights_only=False)`` on load. The xckpt storage layer takes the
object itself from the save planner and hands the decoded value straight to the
load planner, so no pickle is produced or read.

DCP also only reads a stored tensor into a tensor. :class:`XckptLoadPlanner` reads one into a
numpy array or scalar of the state dict as well (an array that ``xckpt.save`` stored from numpy
or JAX, say): it asks for it whole, as for a value, and puts the stored array in its place.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem, SavePlanner, WriteItem, WriteItemType

from xckpt.errors import ShapeError, UnsupportedError, XckptError
from xckpt.format import values

from .dcp_numpy import PickledArray
from .tensors import cpu_to_numpy


def plain_value(value: Any, limit: int | None = None) -> Any:
    """``value`` with each ``io.BytesIO`` (a value DCP stores as such) replaced by its bytes, and each numpy
    array a DCP pickle held (:class:`.dcp_numpy.PickledArray`) by that array as a leaf, in dicts, lists and tuples
    too: what xckpt stores for it (msgpack has no file objects). Containers nested deeper than values may
    be are left as they are, for the encoder to refuse by name. ``limit``: the most items (containers and what they
    hold, each time it is met) copied, beyond which it is ``convert.dcp_value``: for a value read from a checkpoint,
    about its stored bytes (each item of a pickle takes a byte at least, unless it is shared: a list of two
    references to a list of two references ..., 40 levels deep in a kilobyte, would be 2**40 items copied)."""
    left = [limit if limit is not None else -1]
    return _plain(value, 0, left)


def _plain(value: Any, depth: int, left: list[int]) -> Any:
    if left[0] >= 0:
        if left[0] == 0:
            raise XckptError("a value of more items than its stored bytes (containers shared many times)",
                             code="convert.dcp_value")
        left[0] -= 1
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, PickledArray):
        return value.leaf()
    if depth > values.MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {k: _plain(v, depth + 1, left) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, depth + 1, left) for v in value]
    if type(value) is tuple:  # a namedtuple is left to the encoder
        return tuple(_plain(v, depth + 1, left) for v in value)
    return value


class XckptSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose non-tensor items resolve to msgpack bytes, not ``torch.save``."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        """Tensors unchanged; values msgpack-encoded (an ``io.BytesIO`` as its bytes)."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(values.encode(plain_value(object)))
        return object


class XckptLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that takes decoded values (and msgpack bytes), never ``torch.load``, and reads
    stored tensors into numpy arrays and scalars of the state dict too (replacing them, as DCP replaces a
    value: the stored dtype, the target's shape)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``DefaultLoadPlanner``'s arguments."""
        super().__init__(*args, **kwargs)
        self._numpy: dict[str, bool] = {}  # keys of numpy targets read whole -> whether the target is a scalar

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False,
                       ) -> None:
        """DCP's set-up, then each numpy target of a stored tensor asked for whole (:func:`numpy_targets`; found
        first: DCP's set-up puts None in place of every value that is not a tensor or a Python scalar)."""
        flat = flatten_state_dict(state_dict)[0] if self.flatten_state_dict else state_dict
        targets = {fqn: obj for fqn, obj in flat.items() if isinstance(obj, (np.ndarray, np.generic))}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._numpy = {}
        if self.metadata is not None:
            self.metadata, self._numpy = numpy_targets(targets, self.metadata)

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Put an already decoded value into the state dict being loaded (a tensor read for a numpy target as
        numpy: a 0-d one for a numpy scalar as that scalar)."""
        scalar = self._numpy.get(read_item.dest_index.fqn)
        if scalar is not None and isinstance(value, torch.Tensor):
            value = cpu_to_numpy(value)
            if scalar:
                value = value[()]
        set_value(self, read_item, value)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode msgpack bytes (the only encoding xckpt uses) and store the value."""
        set_value(self, read_item, values.decode(value.read()))


def numpy_targets(targets: dict[str, np.ndarray | np.generic], metadata: Metadata) -> tuple[Metadata, dict[str, bool]]:
    """``metadata`` with each stored tensor whose target (``targets``: the numpy arrays and scalars of the
    flattened state dict, by key) is numpy described as a value, so that DCP asks the storage reader for it
    whole (DCP only reads a tensor into a tensor), and those keys, each with whether its target is a scalar;
    ``ShapeError`` naming the key where the target's shape is not the stored one, and the checkpoint where the
    storage reader gave its id (``storage_meta.checkpoint_id``, as :class:`XckptStorageReader` does)."""
    stored = metadata.state_dict_metadata
    where = getattr(metadata.storage_meta, "checkpoint_id", None)
    retyped: dict[str, Any] = {}
    scalar: dict[str, bool] = {}
    for fqn, obj in targets.items():
        md = stored.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            continue
        if tuple(obj.shape) != tuple(md.size):
            raise ShapeError(f"the state dict holds a numpy array of shape {list(obj.shape)} where the checkpoint "
                             f"has shape {list(md.size)}", leaf=fqn, file=str(where) if where else None)
        retyped[fqn] = BytesStorageMetadata()
        scalar[fqn] = isinstance(obj, np.generic)
    if not retyped:
        return metadata, scalar
    return dataclasses.replace(metadata, state_dict_metadata={**stored, **retyped}), scalar


def set_value(planner: DefaultLoadPlanner, item: ReadItem, value: Any) -> None:
    """Put a decoded value where ``DefaultLoadPlanner.load_bytes`` would have put an unpickled one (bytes
    where the state dict holds an ``io.BytesIO`` as a new ``io.BytesIO``, as DCP itself gives one back)."""
    if isinstance(value, bytes) and isinstance(planner.state_dict.get(item.dest_index.fqn), io.BytesIO):
        value = io.BytesIO(value)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[item.dest_index.fqn], value)
    else:
        planner.state_dict[item.dest_index.fqn] = value


def deliver_value(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Hand a decoded value to a load planner without any bytes to unpickle."""
    if hasattr(planner, "load_value"):
        planner.load_value(item, value)
    elif isinstance(planner, DefaultLoadPlanner):
        set_value(planner, item, value)
    else:
        raise UnsupportedError(f"cannot hand the value {item.dest_index.fqn!r} to a {type(planner).__name__}: "
                               "xckpt never unpickles, so use DefaultLoadPlanner or XckptLoadPlanner",
                               code="dcp.planner")


def raw_object(planner: SavePlanner, item: WriteItem) -> Any:
    """The object behind a BYTE_IO item, before the planner would ``torch.save`` it."""
    if hasattr(planner, "lookup_object"):
        return planner.lookup_object(item.index)
    raise UnsupportedError(f"cannot get the value {item.index.fqn!r} from a {type(planner).__name__} without "
                           "torch.save; use DefaultSavePlanner or XckptSavePlanner", code="dcp.planner")
