"""jax.Array leaves: what each process saves of them, and how load targets are built.

Saving: every process lists the distinct regions its addressable devices hold
(one shard per region, the lowest ``replica_id`` among its own devices); the engine
starts the device-to-host copy (``prefetch``) of every shard this process is
assigned to write before it waits for any, and copies no replica another process
writes. The core planner keeps one writer per region across
processes, balanced by bytes. A shard in an accelerator's memory is copied into page-locked
host memory of the save's own (:class:`PinnedCopy`), which an asynchronous save keeps as it is.

Loading: a target leaf (``jax.ShapeDtypeStruct`` with a sharding, a real
``jax.Array``, or a bare ``jax.sharding.Sharding``) asks for the regions its
addressable devices need, identical regions once, and the result is assembled
with ``jax.make_array_from_single_device_arrays``: no process ever holds the
whole array on the host unless its devices need all of it.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

from xckpt.engine import env
from xckpt.engine.layout import Mesh, MeshLayout, mesh, mesh_layout
from xckpt.format import dtypes
from xckpt.errors import KeyMismatchError, SaveError, ShapeError, UnsupportedError
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, ArrayTarget, Shard


def region_of(index: Sequence[slice], shape: Sequence[int]) -> Region:
    """The region a jax shard index (a tuple of unit-step slices) selects in an array of ``shape``."""
    offsets, sizes = [], []
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    for s, n in zip(index, shape):
        start, stop, step = s.indices(int(n))
        if step != 1:
            raise ShapeError(f"shard index {index} has a strided slice; only unit steps are supported")
        offsets.append(start)
        sizes.append(max(0, stop - start))
    return Region(tuple(offsets), tuple(sizes))


def logical_dtype(dtype: Any) -> str:
    """The xckpt logical dtype name of a jax dtype (bfloat16 and float8 included)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        raise UnsupportedError(f"arrays of the extended dtype {dtype} have no xckpt dtype (typed PRNG keys are "
                               "stored as their key data)", code="dtype.unsupported")
    return dtypes.logical_name(np.dtype(dtype))


def is_prng_key(dtype: Any) -> bool:
    """Whether ``dtype`` is the dtype of typed PRNG keys (``jax.random.key``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _prng_impl(dtype: Any) -> Any:
    """The PRNG implementation of a typed key dtype (its name, key shape and key data dtype)."""
    impl = getattr(dtype, "_impl", None)
    if impl is None or not hasattr(impl, "key_shape"):
        raise UnsupportedError(f"cannot tell the PRNG implementation of the key dtype {dtype}",
                               code="dtype.unsupported")
    return impl


def sharding_info(sharding: Sharding, ndim: int) -> dict[str, Any]:
    """What the manifest records about a jax sharding (free-form, for people and tools)."""
    info: dict[str, Any] = {"framework": "jax", "framework_version": jax.__version__,
                            "sharding_type": type(sharding).__name__,
                            "num_devices": len(sharding.device_set),
                            "replicated": bool(sharding.is_fully_replicated)}
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        info["mesh_shape"] = [int(n) for n in mesh.axis_sizes]
        info["axis_names"] = [str(a) for a in mesh.axis_names]
        spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
        info["dim_axes"] = [[] if p is None else [str(p)] if isinstance(p, str) else [str(a) for a in p]
                            for p in spec]
    return info


def _fetch(data: jax.Array) -> np.ndarray:
    return np.asarray(data)


#: The memory kind an accelerator shard is copied into before it is saved: page-locked host memory
#: (the device copies into it at the bus's speed; JAX's own device-to-host path goes through pageable
#: memory, several times slower)
PINNED = "pinned_host"
_pinned: dict[Any, bool] = {}


def copies_to_pinned_host(data: jax.Array) -> bool:
    """Whether a shard's data (a single-device array) is saved through a copy in page-locked host
    memory: it lies in an accelerator's own memory, the device offers that memory kind, and
    ``XCKPT_JAX_PINNED_HOST`` is not ``0`` (JAX's allocator keeps that memory for later copies)."""
    if not env.number("XCKPT_JAX_PINNED_HOST", 1, integer=True):
        return False
    device = next(iter(data.devices()))
    known = _pinned.get(device)
    if known is None:
        try:
            kinds = {m.kind for m in device.addressable_memories()}
        except Exception:  # noqa: BLE001 - a backend that does not list its memories: JAX's own path
            kinds = set()
        known = _pinned[device] = device.platform != "cpu" and PINNED in kinds
    kind = getattr(data.sharding, "memory_kind", None)
    return known and kind in (None, "device")


class PinnedCopy:
    """A shard's copy in page-locked host memory of its own, made once for a save: :meth:`start` queues
    the device-to-host copy (``jax.device_put`` to the ``pinned_host`` memory kind) and returns at
    once, :meth:`fetch` waits for it and gives it as numpy (a view of that memory, not another copy).
    Where the device cannot give that memory (none left), the shard takes JAX's own path instead:
    ``copy_to_host_async``, then ``np.asarray``, a host copy of its own as well. Either way the copy is
    the save's alone: the caller may change, donate or delete its array once :meth:`fetch` returned."""

    def __init__(self, data: jax.Array) -> None:
        self._data: jax.Array | None = data
        self._host: jax.Array | None = None
        self._out: np.ndarray | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Queue the copy (once; later calls do nothing)."""
        with self._lock:
            if self._host is not None or self._data is None:  # queued already, or fetched
                return
            try:
                self._host = jax.device_put(self._data, self._data.sharding.with_memory_kind(PINNED))
            except Exception:  # noqa: BLE001 - no page-locked memory to be had: JAX's own path
                self._data.copy_to_host_async()

    def fetch(self) -> np.ndarray:
        """The copy as host numpy, once it is made."""
        self.start()
        with self._lock:
            if self._out is None:
                assert self._data is not None
                out = None
                if self._host is not None:
                    try:
                        out = np.asarray(self._host)
                    except Exception:  # noqa: BLE001 - the copy failed on the device: JAX's own path
                        pass
                self._out = np.asarray(self._data) if out is None else out
                self._host = self._data = None
            return self._out


def _mesh(m: Any) -> Mesh:
    key = id(m)
    hit = _meshes.get(key)
    if hit is None or hit[0] is not m:
        devices = np.asarray(m.devices)
        hit = _meshes[key] = (m, mesh(tuple(int(n) for n in devices.shape),
                                      tuple(int(d.process_index) for d in devices.flat)))
    return hit[1]


_meshes: dict[int, tuple[Any, Mesh]] = {}


def layout_of(sharding: Sharding, shape: tuple[int, ...]) -> MeshLayout | None:
    """The layout of a ``NamedSharding`` over the processes (None for other shardings).

    Mesh axes that split one dimension together split it in mesh-axis order, as
    nested ``torch.chunk`` splits do; the caller checks the result against the array's shards.
    """
    if not isinstance(sharding, NamedSharding):
        return None
    names = list(sharding.mesh.axis_names)
    placements: list[tuple[Any, ...]] = [("R",)] * len(names)
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for d, p in enumerate(spec):
        axes = [] if p is None else [p] if isinstance(p, str) else list(p)
        if [names.index(a) for a in axes] != sorted(names.index(a) for a in axes):
            return None
        for a in axes:
            placements[names.index(a)] = ("S", d)
    return mesh_layout(shape, _mesh(sharding.mesh), tuple(placements))


def array_source(arr: jax.Array) -> ArraySource:
    """This process's part of a ``jax.Array``: one shard per distinct region its devices hold.

    Each shard's ``prefetch`` starts its device-to-host copy asynchronously: on an accelerator, into
    page-locked host memory of the save's own (:class:`PinnedCopy`). A
    ``NamedSharding`` also gives the array's layout over the processes, once checked
    against the shards this process holds.
    """
    if arr.is_deleted():
        raise SaveError("cannot save a deleted (donated) jax.Array")
    if is_prng_key(arr.dtype):  # typed PRNG keys: their key data (uint32, the key shape last), as Orbax stores them
        src = array_source(jax.random.key_data(arr))
        src.sharding = dict(src.sharding or {}, prng_impl=str(jax.random.key_impl(arr)))
        return src
    shape = tuple(int(n) for n in arr.shape)
    dtype = logical_dtype(arr.dtype)
    chosen: dict[Region, Any] = {}
    for shard in arr.addressable_shards:
        region = region_of(shard.index, shape)
        held = chosen.get(region)
        if held is None or shard.replica_id < held.replica_id:
            chosen[region] = shard
    shards = []
    for region, shard in chosen.items():
        data = shard.data
        if copies_to_pinned_host(data):
            copy = PinnedCopy(data)
            shards.append(Shard(region, copy.fetch, copy.start, fetch_copies=True))
        else:
            shards.append(Shard(region, functools.partial(_fetch, data), data.copy_to_host_async))
    layout = layout_of(arr.sharding, shape)
    if layout is not None and {r for r, _ in layout.pieces_of(jax.process_index())} != \
            {r for r in chosen if not r.is_empty()}:
        layout = None  # the mesh does not say what this process holds: describe its regions instead
    return ArraySource(shape, dtype, shards, sharding_info(arr.sharding, len(shape)), layout)


def sharded_target(shape: Sequence[int], dtype: Any, sharding: Sharding) -> ArrayTarget:
    """Read what ``sharding``'s addressable devices need of an array of ``shape``, as ``dtype``.

    A typed PRNG key ``dtype`` reads the stored key data (``shape`` plus the key shape, uint32)
    and wraps it into keys of that implementation.
    """
    shape = tuple(int(n) for n in shape)
    sharding = _concrete(sharding)
    impl = _prng_impl(dtype) if is_prng_key(dtype) else None
    tail = tuple(int(n) for n in impl.key_shape) if impl is not None else ()
    canonical = np.dtype(np.uint32) if impl is not None else np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    regions: list[Region] = []
    position: dict[Region, int] = {}
    placement: list[tuple[Any, int]] = []
    try:
        indices = sharding.addressable_devices_indices_map(shape)
    except (IndexError, ValueError, TypeError) as exc:  # a spec of another rank than the shape, say
        raise ShapeError(f"the target's sharding {sharding} does not fit the shape {list(shape)}: {exc}",
                         code="shape.mismatch") from None
    memory_kind = getattr(sharding, "memory_kind", None)
    for device, index in indices.items():
        index = tuple(index)  # (the key data's last dimensions whole)
        region = region_of(index + (slice(None),) * (len(shape) + len(tail) - len(index)), shape + tail)
        if region not in position:
            position[region] = len(regions)
            regions.append(region)
        placement.append((device, position[region]))

    def build(parts: list[np.ndarray]) -> jax.Array:
        host = [np.asarray(parts[i]).reshape(regions[i].sizes) for _, i in placement]
        # each piece on its device, in the sharding's memory (pinned host memory for offloaded state, say)
        on_devices = jax.device_put(host, [SingleDeviceSharding(d, memory_kind=memory_kind) for d, _ in placement])
        if impl is not None:
            on_devices = [jax.random.wrap_key_data(piece, impl=impl) for piece in on_devices]
        # a process holding none of the sharding's devices builds its (empty) part from the dtype alone
        return jax.make_array_from_single_device_arrays(shape, sharding, on_devices,
                                                        dtype=dtype if impl is not None else canonical)

    return ArrayTarget(shape + tail, logical_dtype(canonical), regions, build)


def _concrete(sharding: Sharding) -> Sharding:
    """``sharding`` on real devices: a ``NamedSharding`` over an abstract mesh (what ``jax.eval_shape`` gives
    under ``jax.set_mesh``) takes the concrete mesh set now, which must match it."""
    abstract = getattr(jax.sharding, "AbstractMesh", None)
    if abstract is None or not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, abstract):
        return sharding
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    current = get_mesh() if get_mesh is not None else None
    if current is None or current.empty or current.abstract_mesh != sharding.mesh:
        now = "none" if current is None or current.empty else current
        raise UnsupportedError(f"the target's sharding {sharding} is on an abstract mesh, and the mesh set now "
                               f"({now}) is not one like it; load under jax.set_mesh(mesh), or give targets on a "
                               "concrete mesh", code="unsupported")
    return NamedSharding(current, sharding.spec, memory_kind=sharding.memory_kind)


def _check_key_impl(dtype: Any, entry: Any) -> None:
    """Refuse to load keys saved with one PRNG implementation into keys of another."""
    if not is_prng_key(dtype):
        return
    stored = (getattr(entry, "sharding", None) or {}).get("prng_impl")
    wanted = _prng_impl(dtype).name
    if stored is not None and stored != wanted:
        raise KeyMismatchError(f"the stored PRNG keys are {stored} keys, the target's are {wanted} keys")


def _default_sharding() -> Sharding:
    return SingleDeviceSharding(jax.local_devices()[0])


def struct_target(like: jax.ShapeDtypeStruct, entry: Any) -> ArrayTarget:
    """A ``jax.ShapeDtypeStruct`` target: its shape, dtype and sharding (None: this process's first device)."""
    sharding = like.sharding if isinstance(like.sharding, Sharding) else _default_sharding()
    _check_key_impl(like.dtype, entry)
    return sharded_target(like.shape, like.dtype, sharding)


def array_target(like: jax.Array, entry: Any) -> ArrayTarget:
    """A real ``jax.Array`` target: a new array with its shape, dtype and sharding."""
    _check_key_impl(like.dtype, entry)
    return sharded_target(like.shape, like.dtype, like.sharding)


def sharding_target(like: Sharding, entry: Any) -> ArrayTarget:
    """A bare ``Sharding`` target: the stored shape and dtype, placed on that sharding."""
    return sharded_target(entry.shape, dtypes.numpy_dtype(entry.dtype), like)


def is_jax_array(obj: Any) -> bool:
    """Whether ``obj`` is a concrete ``jax.Array`` (not a tracer)."""
    return isinstance(obj, jax.Array) and not isinstance(obj, jax.core.Tracer)
