"""Random number generator states, saved per rank and restored in place.

``rng_state()`` is a live handle: saving it records this process's torch CPU RNG,
the current CUDA device's RNG (when CUDA is available), Python's ``random`` and
numpy's global RNG; loading into it sets them back. Each state is one array of
shape ``(world_size, nbytes)`` whose row ``r`` is written by rank ``r``, so ranks
keep their own streams. A job with another world size restores row
``rank % saved_world_size``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from xckpt.engine.layout import mesh, mesh_layout
from xckpt.errors import ShapeError
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, ArrayTarget, Shard


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class RankRow:
    """One rank's row of a per-rank array (save), or the request for it (load, ``data`` None)."""

    data: np.ndarray | None
    rank: int
    world: int


def rank_row_source(row: RankRow) -> ArraySource:
    """A ``(world, n)`` uint8 array of which this rank holds and writes row ``rank``: one row per rank
    of a 1-d mesh of every rank, so every rank describes it alike."""
    assert row.data is not None
    data = np.ascontiguousarray(row.data, dtype=np.uint8).reshape(1, -1)
    n = data.shape[1]
    layout = mesh_layout((row.world, n), mesh((row.world,), tuple(range(row.world))), (("S", 0),))
    return ArraySource((row.world, n), "uint8", [Shard(Region((row.rank, 0), (1, n)), lambda: data)],
                       {"framework": "torch", "per_rank": True}, layout)


def rank_row_target(row: RankRow, entry: Any) -> ArrayTarget:
    """Read row ``rank % rows`` of a stored per-rank array."""
    shape = tuple(entry.shape)
    if len(shape) != 2 or shape[0] < 1:
        raise ShapeError(f"a per-rank RNG state must be a (world, nbytes) array, not {list(shape)}")
    r = row.rank % shape[0]
    return ArrayTarget(shape, "uint8", [Region((r, 0), (1, shape[1]))], lambda parts: parts[0][0])


def _python_state() -> np.ndarray:
    version, internal, gauss = random.getstate()
    assert version == 3 and len(internal) == 625
    return np.frombuffer(np.asarray(internal, dtype=np.uint32).tobytes()
                         + np.float64(0.0 if gauss is None else gauss).tobytes()
                         + bytes([gauss is not None]), dtype=np.uint8)


def _set_python_state(b: np.ndarray) -> None:
    raw = np.asarray(b, dtype=np.uint8).tobytes()
    internal = tuple(int(x) for x in np.frombuffer(raw[:2500], dtype=np.uint32))
    gauss = float(np.frombuffer(raw[2500:2508], dtype=np.float64)[0]) if raw[2508] else None
    random.setstate((3, internal, gauss))


def _numpy_state() -> np.ndarray:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert name == "MT19937"
    return np.frombuffer(np.asarray(keys, dtype=np.uint32).tobytes()
                         + np.asarray([pos, has_gauss], dtype=np.int64).tobytes()
                         + np.float64(cached).tobytes(), dtype=np.uint8)


def _set_numpy_state(b: np.ndarray) -> None:
    raw = np.asarray(b, dtype=np.uint8).tobytes()
    keys = np.frombuffer(raw[:2496], dtype=np.uint32).copy()
    pos, has_gauss = (int(x) for x in np.frombuffer(raw[2496:2512], dtype=np.int64))
    cached = float(np.frombuffer(raw[2512:2520], dtype=np.float64)[0])
    np.random.set_state(("MT19937", keys, pos, has_gauss, cached))


def _set_torch_cpu(b: np.ndarray) -> None:
    torch.set_rng_state(torch.from_numpy(np.array(b, dtype=np.uint8)))


def _set_torch_cuda(b: np.ndarray) -> None:
    torch.cuda.set_rng_state(torch.from_numpy(np.array(b, dtype=np.uint8)))


class RNGState:
    """A live handle on this process's RNG states (see :func:`rng_state`)."""

    def __init__(self, *, python: bool = True, numpy: bool = True) -> None:
        self.python = python
        self.numpy = numpy

    def _getters(self) -> dict[str, tuple[Callable[[], np.ndarray], Callable[[np.ndarray], None]] | None]:
        cuda = torch.cuda.is_available()
        out: dict[str, Any] = {
            "torch_cpu": (lambda: torch.get_rng_state().numpy(), _set_torch_cpu),
            "torch_cuda": (lambda: torch.cuda.get_rng_state().numpy(), _set_torch_cuda) if cuda else None,
        }
        if self.python:
            out["python"] = (_python_state, _set_python_state)
        if self.numpy:
            out["numpy"] = (_numpy_state, _set_numpy_state)
        return out

    def save_view(self) -> dict[str, Any]:
        """This rank's current states, one per-rank row each."""
        rank, world = _rank_world()
        return {k: RankRow(g[0](), rank, world) for k, g in self._getters().items() if g is not None}

    def load_view(self) -> tuple[dict[str, Any], Callable[[dict[str, Any]], "RNGState"]]:
        """Requests for this rank's rows; the rebuild sets the generators."""
        rank, world = _rank_world()
        getters = self._getters()
        like = {k: (RankRow(None, rank, world) if g is not None else None) for k, g in getters.items()}

        def rebuild(loaded: dict[str, Any]) -> "RNGState":
            for k, g in getters.items():
                value = loaded.get(k)
                if g is not None and isinstance(value, np.ndarray):
                    g[1](value)
            return self

        return like, rebuild


def rng_state(*, python: bool = True, numpy: bool = True) -> RNGState:
    """A live handle on the RNG states of this process, to put in a saved or loaded tree.

    Saving records torch's CPU RNG, the current CUDA device's RNG when CUDA is
    available, and (by default) Python's ``random`` and numpy's global RNG; loading
    into it restores them.
    """
    return RNGState(python=python, numpy=numpy)
