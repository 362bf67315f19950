#!/usr/bin/env python3
"""Generate the xckpt conformance vectors, deterministically.

    python spec/conformance/generate.py            # rewrite valid/ and invalid/ next to this file
    python spec/conformance/generate.py --out DIR  # write them under DIR instead
    python spec/conformance/generate.py --check    # regenerate in a temporary directory and compare
                                                   # (bytes, or parsed content for JSON files)

Every vector is a directory holding ``expected.json`` and ``checkpoint/``:

* ``valid/<name>/``: ``checkpoint/`` is written by xckpt itself; ``expected.json`` holds
  ``{"description", "tree"}``, the tree that loading it must give (see :func:`tagged`).
* ``invalid/<name>/``: ``checkpoint/`` is a valid checkpoint with one targeted defect
  (a byte-level corruption, a file removed, a manifest field changed); ``expected.json``
  holds ``{"code", "deep", "load", "description"}``: the finding code a validator must
  report, whether only a deep validation (every crc32c recomputed) finds it, and the
  code xckpt's loader fails with when loading the whole checkpoint (null: the defect
  does not stop a load, e.g. it concerns only the Orbax files).

Determinism: the producer recorded in the manifest is fixed, and the two things xckpt
writes that are not a function of its input are set to fixed values after each save: the
manifest's ``generation`` (random) and the Orbax timestamps in ``_CHECKPOINT_METADATA``.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import shutil
import sys
import tempfile
import threading
from collections import namedtuple
from typing import Any, Callable, Iterator

import crc32c
import msgpack
import ml_dtypes
import numpy as np

from xckpt.engine.collective import LocalCoordinator, ThreadGroup
from xckpt.engine.commit import SaveOptions
from xckpt.engine import protocol
from xckpt.engine.storage import Location
from xckpt.engine.write import ChunkWriter
from xckpt.format import names as naming, shard, values as xvalues, zarr as arrays
from xckpt.format.dtypes import logical_name
from xckpt.format.regions import Region
from xckpt.format.tree import Value
from xckpt.registry import ArraySource, Shard, register_source

HERE = os.path.dirname(os.path.abspath(__file__))
PRODUCER = {"library": "xckpt", "library_version": "conformance", "framework": "numpy",
            "framework_version": "conformance", "generator": "spec/conformance/generate.py"}
FIXED_NS = 1_700_000_000_000_000_000
FIXED_GENERATION = "0123456789abcdef0123456789abcdef"
#: The generation of another save of the same tree (for chunk objects transplanted between checkpoints).
OTHER_GENERATION = "fedcba9876543210fedcba9876543210"
_MISSING = 2**64 - 1

#: The logical dtypes of format 1.0 (a fixed list: the vectors must not depend on ml_dtypes' version).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
          "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
          "float8_e4m3", "float8_e3m4", "float8_e8m0fnu")
#: The sub-byte dtypes format 1.4 adds (their own vector: a checkpoint holding one says 1.4).
SUBBYTE_DTYPES = ("int4", "uint4", "int2", "uint2", "float4_e2m1fn")

Pair = namedtuple("Pair", ["first", "second"])


# --------------------------------------------------------------------------- sources and saving

class HostShards:
    """An array of which this (simulated) process holds only ``regions``."""

    def __init__(self, full: np.ndarray, regions: list[Region], sharding: dict[str, Any] | None = None):
        self.full, self.regions, self.sharding = full, regions, sharding


def _host_shards_source(x: HostShards) -> ArraySource:
    shards = [Shard(r, lambda r=r: np.ascontiguousarray(x.full[r.slices()])) for r in x.regions]
    return ArraySource(tuple(x.full.shape), logical_name(x.full.dtype), shards, x.sharding)


register_source(lambda x: isinstance(x, HostShards), _host_shards_source)


@contextlib.contextmanager
def _generation(generation: str) -> Iterator[None]:
    """Saves in this block get ``generation`` (the vectors must not change from one run to the next; the
    generation is in every chunk object's place tag, so it is chosen before the save, not edited after)."""
    random = protocol.new_generation
    protocol.new_generation = lambda: generation
    try:
        yield
    finally:
        protocol.new_generation = random


def _save_one(tree: Any, path: str, coord: Any, **options: Any) -> None:
    protocol.save(tree, path, coordinator=coord, options=SaveOptions(producer=dict(PRODUCER), **options))


def _normalise(path: str) -> None:
    name = os.path.join(path, naming.ORBAX_CHECKPOINT_METADATA)
    with open(name) as f:
        meta = json.load(f)
    meta["init_timestamp_nsecs"] = meta["commit_timestamp_nsecs"] = FIXED_NS
    with open(name, "w") as f:
        f.write(json.dumps(meta))


def save(tree: Any, path: str, generation: str = FIXED_GENERATION, **options: Any) -> None:
    """Save as one process with a fixed generation, then fix the timestamps."""
    with _generation(generation):
        _save_one(tree, path, LocalCoordinator(), **options)
    _normalise(path)


def save_ranks(trees: list[Any], path: str, **options: Any) -> None:
    """Save as ``len(trees)`` processes (threads), rank ``r`` holding ``trees[r]``."""
    group = ThreadGroup(len(trees))
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            _save_one(trees[rank], path, group.coordinator(rank), **options)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(trees))]
    with _generation(FIXED_GENERATION):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    _normalise(path)


# --------------------------------------------------------------------------- expected trees

def tagged(obj: Any) -> Any:
    """A JSON form of a tree that keeps every type and every bit (the ``tree`` of expected.json).

    Arrays: ``{"t": "array", "dtype", "shape", "hex"}`` (little-endian bytes in C order);
    floats as ``float.hex()``; ints as decimal strings; bytes as hex; containers keep their kind.
    """
    if isinstance(obj, np.ndarray):
        data = obj.astype(obj.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
        return {"t": "array", "dtype": logical_name(obj.dtype), "shape": list(obj.shape), "hex": data.hex()}
    if obj is None:
        return {"t": "none"}
    if isinstance(obj, bool):
        return {"t": "bool", "v": obj}
    if isinstance(obj, int):
        return {"t": "int", "v": str(obj)}
    if isinstance(obj, float):
        return {"t": "float", "v": obj.hex()}
    if isinstance(obj, complex):
        return {"t": "complex", "v": [obj.real.hex(), obj.imag.hex()]}
    if isinstance(obj, str):
        return {"t": "str", "v": obj}
    if isinstance(obj, bytes):
        return {"t": "bytes", "v": obj.hex()}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return {"t": "namedtuple", "name": type(obj).__name__, "fields": list(type(obj)._fields),
                "v": [tagged(v) for v in obj]}
    if isinstance(obj, (list, tuple)):
        return {"t": type(obj).__name__, "v": [tagged(v) for v in obj]}
    if isinstance(obj, dict):
        return {"t": "dict", "v": [[tagged(k), tagged(v)] for k, v in obj.items()]}
    raise TypeError(f"cannot tag {type(obj)}")


def untagged(obj: Any) -> Any:
    """Inverse of :func:`tagged` (namedtuples come back as generated namedtuple classes)."""
    t = obj["t"]
    if t == "array":
        from xckpt.format.dtypes import numpy_dtype
        dt = numpy_dtype(obj["dtype"]).newbyteorder("<")
        return np.frombuffer(bytes.fromhex(obj["hex"]), dtype=dt).reshape(obj["shape"]).astype(dt.newbyteorder("="))
    simple: dict[str, Callable[[Any], Any]] = {
        "none": lambda v: None, "bool": bool, "int": int, "float": float.fromhex, "str": str,
        "complex": lambda v: complex(float.fromhex(v[0]), float.fromhex(v[1])), "bytes": bytes.fromhex}
    if t in simple:
        return simple[t](obj.get("v"))
    if t == "namedtuple":
        return namedtuple(obj["name"], obj["fields"])(*[untagged(v) for v in obj["v"]])  # type: ignore[misc]
    if t == "list":
        return [untagged(v) for v in obj["v"]]
    if t == "tuple":
        return tuple(untagged(v) for v in obj["v"])
    if t == "dict":
        return {_hashable(untagged(k)): untagged(v) for k, v in obj["v"]}
    raise ValueError(f"unknown tag {t!r}")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, (list, tuple)) else k


def _plain(tree: Any) -> Any:
    """What loading ``tree`` with no target gives: HostShards become their full array, numpy scalars 0-d arrays."""
    if isinstance(tree, HostShards):
        return tree.full
    if isinstance(tree, np.generic):
        return np.asarray(tree)
    if isinstance(tree, Value):
        return tree.value
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        return type(tree)(*[_plain(v) for v in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    return tree


# --------------------------------------------------------------------------- valid vectors

def _dtype_samples(name: str) -> np.ndarray:
    from xckpt.format.dtypes import numpy_dtype
    dt = numpy_dtype(name)
    if name == "bool":
        return np.array([True, False, True])
    if name in SUBBYTE_DTYPES and name != "float4_e2m1fn":  # every value
        info = ml_dtypes.iinfo(dt)
        return np.arange(int(info.min), int(info.max) + 1).astype(dt)
    if name == "float4_e2m1fn":  # every value but -0.0's twin (0b1000 is -0.0)
        return np.arange(16, dtype=np.uint8).view(dt)
    if name.startswith(("int", "uint")):
        info = np.iinfo(dt)
        return np.array([info.min, 0, 1, info.max], dtype=dt)
    if name.startswith("complex"):
        return np.array([0, 1.5 - 2j, complex(np.inf, -0.0), complex(np.nan, 1)], dtype=dt)
    if name == "float8_e8m0fnu":  # exponent only: powers of two and NaN
        return np.array([0.5, 1, 2, 1024, np.nan], dtype=np.float32).astype(dt)
    info = ml_dtypes.finfo(dt)
    vals = [0.0, -0.0, 1.0, -1.5, float(info.max), float(info.smallest_subnormal), np.nan]
    if not name.endswith(("fn", "fnuz")):
        vals.append(np.inf)
    return np.array(vals, dtype=np.float64).astype(dt)


def valid_dtypes(path: str) -> tuple[Any, str]:
    """Every logical dtype, with extreme and special values."""
    tree = {name: _dtype_samples(name) for name in DTYPES}
    save(tree, path)
    return tree, ("one 1-d array of every logical dtype of format 1.0 (float8 stored as raw uint8), "
                  "holding extreme and special values (min/max, -0.0, subnormal, inf, NaN)")


def valid_nested_values(path: str) -> tuple[Any, str]:
    """A nested tree with every container kind and every value type."""
    tree = {
        "model": {"layers": [{"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
                             {"w": np.arange(6, 12, dtype=np.float32).reshape(2, 3)}]},
        "pair": Pair(np.array([1, 2], dtype=np.int16), (np.array([True, False]), "inner")),
        "values": {"none": None, "t": True, "f": False, "int": -7, "u64": 2**64 - 1, "big": -(2**70),
                   "float": 0.1, "nan": float("nan"), "inf": float("-inf"), "complex": 1 - 2.5j,
                   "str": "héllo ✓", "bytes": b"\x00\x01\xff"},
        "whole": Value({"lr": 1e-3, 3: (1, "a"), (1, 2): [None, b"x"]}),
        7: {"int_key": np.array([5], dtype=np.uint8)},
        "empty_dict": {}, "empty_list": [], "empty_tuple": (),
    }
    save(tree, path)
    return tree, ("dict, list, tuple, namedtuple and empty containers; int dict keys; a Value-wrapped dict with "
                  "non-str keys; every value type (None, bool, int incl. 64-bit and beyond, float incl. NaN/-inf, "
                  "complex, str, bytes)")


def valid_empty_and_scalar(path: str) -> tuple[Any, str]:
    """Arrays with zero elements and 0-d arrays."""
    tree = {"empty": np.zeros((0,), np.float32), "empty2d": np.zeros((3, 0), np.int64),
            "scalar_f": np.array(2.5, np.float64), "scalar_i": np.array(-3, np.int32),
            "scalar_bf16": np.array(1.5, ml_dtypes.bfloat16), "scalar_f8": np.array(0.5, ml_dtypes.float8_e5m2)}
    save(tree, path)
    return tree, "empty arrays (no chunk object at all) and 0-d arrays (one chunk object named 'c')"


def valid_sharded(path: str) -> tuple[Any, str]:
    """Written by 4 ranks: a 2x2-mesh-sharded matrix, an uneven 1-d split, a replicated vector."""
    w = np.arange(48, dtype=np.float32).reshape(8, 6)
    v = np.arange(10, dtype=np.int64) * 3 - 7
    bias = np.linspace(-1, 1, 6).astype(np.float16)
    mesh = {"mesh_shape": [2, 2], "axis_names": ["x", "y"], "framework": "conformance"}
    trees = []
    for rank in range(4):
        i, j = divmod(rank, 2)
        w_region = Region((4 * i, 3 * j), (4, 3))
        v_regions = [Region((0,), (4,)), Region((4,), (4,)), Region((8,), (2,))]  # torch.chunk(10, 3)
        trees.append({
            "w": HostShards(w, [w_region], dict(mesh, dim_axes=[["x"], ["y"]])),
            "v": HostShards(v, [v_regions[rank % 3]] + ([v_regions[2]] if rank == 3 else []),
                            {"framework": "conformance", "placements": ["Shard(0)"]}),
            "bias": HostShards(bias, [Region.full(bias.shape)], dict(mesh, dim_axes=[[]])),
            "step": 100,
        })
    save_ranks(trees, path, inner_chunk_bytes=24)
    return _plain(trees[0]), ("saved by 4 ranks (threads with a real coordinator): 'w' 8x6 split on a 2x2 mesh "
                              "into 4 shard objects, each of 2 inner chunks; 'v' split unevenly 4/4/2 "
                              "(last chunk partial), held by several ranks; 'bias' replicated on every rank "
                              "and written once")


def valid_zstd(path: str) -> tuple[Any, str]:
    """zstd-compressed inner chunks."""
    tree = {"z": HostShards(np.tile(np.arange(16, dtype=np.int32), 4).reshape(8, 8),
                            [Region((0, 0), (4, 8)), Region((4, 0), (4, 8))]),
            "small": np.arange(3, dtype=np.float64)}
    save(tree, path, compression="zstd", inner_chunk_bytes=64)
    return _plain(tree), "compression 'zstd': inner codecs bytes, zstd, crc32c; 2 shards of 2 inner chunks each"


def valid_segmented(path: str) -> tuple[Any, str]:
    """Format 1.1: a leaf split unevenly twice over (a (2, 2) mesh on one dimension) stored as segments."""
    e = (np.arange(26 * 3, dtype=np.float32) - 10).reshape(26, 3)
    rows = [(0, 7), (7, 6), (13, 7), (20, 6)]  # torch.chunk(26, 2), then each half torch.chunk(13, 2)
    trees = [{"emb": HostShards(e, [Region((o, 0), (n, 3))], {"framework": "conformance",
                                                             "placements": ["Shard(0)", "Shard(0)"]})}
             for o, n in rows]
    save_ranks(trees, path)
    return _plain(trees[0]), ("saved by 4 ranks holding 7, 6, 7 and 6 rows of 'emb' (26 x 3): the common grid "
                              "would be 26 one-row objects, so the leaf is a Zarr group of two segment arrays "
                              "(rows 0-12 and 13-25, chunks of 7 rows), one object per shard")


def valid_nested_names(path: str) -> tuple[Any, str]:
    """Format 1.3: keys holding '/' (Haiku's module names) stored in nested directories."""
    tree = {"mlp/~/linear_0": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([0.5, -1.0])},
            "mlp/~/linear_1": {"w": np.arange(4, dtype=np.int16).reshape(4, 1)},
            "opt/count": 7, "run/name": "exp", "mlp": {"scale": np.array([2.0], dtype=np.float32)}}
    save(tree, path)
    return tree, ("format 1.3: keys holding '/' nest their storage names in directories as Orbax stores them "
                  "('mlp/~/linear_0.w' is the array in mlp/~/linear_0.w/, beside mlp.scale/; the int 'opt/count' "
                  "mirrored at opt/count; the string 'run/name' at the JSON pointer /run/name of _strings.json)")


def valid_subbyte_dtypes(path: str) -> tuple[Any, str]:
    """Format 1.4: the sub-byte dtypes, every value of each, stored as raw bytes."""
    tree = {name: _dtype_samples(name) for name in SUBBYTE_DTYPES}
    tree["int4_2d"] = np.arange(-8, 8).astype(ml_dtypes.int4).reshape(4, 4)
    save(tree, path)
    return tree, ("format 1.4: one array of every sub-byte dtype (int4, uint4, int2, uint2, float4_e2m1fn) holding "
                  "each value it has, stored as raw uint8, one element per byte in its low bits; and a 4x4 int4")


VALID: dict[str, Callable[[str], tuple[Any, str]]] = {
    "dtypes": valid_dtypes, "nested_values": valid_nested_values, "empty_and_scalar": valid_empty_and_scalar,
    "sharded": valid_sharded, "zstd": valid_zstd, "segmented": valid_segmented, "nested_names": valid_nested_names,
    "subbyte_dtypes": valid_subbyte_dtypes,
}


# --------------------------------------------------------------------------- invalid vectors

def base(path: str, generation: str = FIXED_GENERATION, scale: int = 1) -> None:
    """The checkpoint each invalid vector corrupts: 'w' in 2 shards of 2 inner chunks, 'b', values."""
    tree = {"w": HostShards(np.arange(16, dtype=np.float32).reshape(4, 4) * scale,
                            [Region((0, 0), (2, 4)), Region((2, 0), (2, 4))]),
            "b": np.arange(4, dtype=np.int32), "step": 3, "name": "run-1", "opt": [None, 0.5]}
    save(tree, path, generation, inner_chunk_bytes=16)


def read(path: str, name: str) -> bytes:
    """The bytes of ``name`` under the checkpoint ``path``."""
    with open(os.path.join(path, name), "rb") as f:
        return f.read()


def write(path: str, name: str, data: bytes) -> None:
    """Write ``name`` under the checkpoint ``path`` (creating directories)."""
    os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)


def edit_manifest(path: str, fn: Callable[[dict[str, Any]], None]) -> None:
    """Change the manifest as a JSON object, keeping its layout."""
    m = json.loads(read(path, naming.MANIFEST))
    fn(m)
    write(path, naming.MANIFEST, (json.dumps(m, indent=1) + "\n").encode())


def leaf(m: dict[str, Any], key: list[Any]) -> dict[str, Any]:
    """The manifest entry of ``key``."""
    return next(e for e in m["leaves"] if e["key"] == key)


def edit_index(path: str, name: str, n_inner: int, fn: Callable[[list[list[int]]], None],
               fix_crc: bool = True, shift: int = 0) -> None:
    """Change the (offset, nbytes) pairs of a shard index; recompute its crc32c and the place tag unless told
    not to (so that only the defect under test remains). ``shift`` inserts that many zero bytes at the start."""
    data = bytearray(read(path, name))
    start = len(data) - (16 * n_inner + 4)
    pairs = np.frombuffer(bytes(data[start:-4]), dtype="<u8").reshape(-1, 2).tolist()
    fn(pairs)
    body = np.array(pairs, dtype="<u8").tobytes()
    crc = crc32c.crc32c(body) if fix_crc else int.from_bytes(data[-4:], "little")
    data[start:] = body + crc.to_bytes(4, "little")
    if fix_crc:
        index = np.frombuffer(bytes(data[start:]), dtype=np.uint8)
        data[start - shard.TAG_NBYTES:start] = shard.place_tag(shard.place_of(FIXED_GENERATION, name), index)
    write(path, name, bytes(b"\0" * shift + data))


def rewrite_values(path: str, fn: Callable[[dict[int, Any]], None]) -> None:
    """Change the decoded values, re-encode them, and update size and crc32c in the manifest."""
    vals = xvalues.decode(read(path, naming.VALUES))
    fn(vals)
    blob = xvalues.encode(vals)
    write(path, naming.VALUES, blob)
    edit_manifest(path, lambda m: m["values"].update(size=len(blob), crc32c=crc32c.crc32c(blob)))


def flip(path: str, name: str, offset: int) -> None:
    """Change one bit of one byte of a file."""
    data = bytearray(read(path, name))
    data[offset] ^= 0x40
    write(path, name, bytes(data))


def _remove_commit_files(p: str) -> None:
    for name in (naming.MANIFEST, naming.ORBAX_METADATA, naming.ORBAX_CHECKPOINT_METADATA, "_strings.json",
                 naming.COMMIT):
        os.remove(os.path.join(p, name))


def _orbax_meta(p: str, fn: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads(read(p, naming.ORBAX_METADATA))
    fn(meta)
    write(p, naming.ORBAX_METADATA, json.dumps(meta, indent=1).encode())


def _zarr_json(p: str, array: str, fn: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads(read(p, array + "/zarr.json"))
    fn(meta)
    write(p, array + "/zarr.json", json.dumps(meta).encode())


def _swap_keys(m: dict[str, Any]) -> None:
    m["leaves"][0]["key"], m["leaves"][1]["key"] = m["leaves"][1]["key"], m["leaves"][0]["key"]


def _half_segment(m: dict[str, Any]) -> None:
    w = leaf(m, ["w"])
    w["segments"] = [{"path": "0", "offset": [0, 0], "shape": [2, 4], "chunk_shape": w.pop("chunk_shape"),
                      "inner_chunk_shape": w.pop("inner_chunk_shape")}]


def _second_leaf_shares_path(m: dict[str, Any]) -> None:
    leaf(m, ["b"])["path"] = "w"


def _data_offset(p: str) -> int:
    """Offset of the first data byte of inner chunk 0 of shard w/c/0/0."""
    data = read(p, "w/c/0/0")
    pairs = np.frombuffer(data[-(16 * 2 + 4):-4], dtype="<u8").reshape(-1, 2)
    return int(pairs[0][0])


def _remove_inner(pairs: list[list[int]]) -> None:
    pairs[1] = [_MISSING, _MISSING]


def _index_past_end(pairs: list[list[int]]) -> None:
    pairs[1][0] = 10_000


def _index_overlap(pairs: list[list[int]]) -> None:
    pairs[1] = list(pairs[0])


def _index_short(pairs: list[list[int]]) -> None:
    pairs[0][1] -= 4


def _index_long(pairs: list[list[int]]) -> None:
    pairs[0][1] += 4


def _index_gap(pairs: list[list[int]]) -> None:
    for pair in pairs:  # the object gets 8 bytes in front that no entry covers
        pair[0] += 8


def _swap_chunks(p: str) -> None:
    """Swap two chunk objects of 'w' of the same size (rows 0-1 and rows 2-3)."""
    a, b = read(p, "w/c/0/0"), read(p, "w/c/1/0")
    write(p, "w/c/0/0", b)
    write(p, "w/c/1/0", a)


def _transplant_chunk(p: str) -> None:
    """Replace w/c/1/0 by the same object of another save of the same tree shapes (other data and generation)."""
    with tempfile.TemporaryDirectory() as tmp:
        other = os.path.join(tmp, "other")
        base(other, OTHER_GENERATION, scale=2)
        write(p, "w/c/1/0", read(other, "w/c/1/0"))


def _without_tag(p: str) -> None:
    """A chunk object as a 1.1 writer wrote it (no place tag) in a 1.2 checkpoint."""
    data = read(p, "w/c/0/0")
    end = len(data) - (16 * 2 + 4)
    write(p, "w/c/0/0", data[:end - shard.TAG_NBYTES] + data[end:])


def _noncanonical_values(p: str) -> None:
    """values.msgpack whose 'step' is a big-int extension holding '0003' (not the canonical form of an int
    outside the msgpack range, which is all that extension may hold); size and crc32c updated."""
    payload = msgpack.packb([[2, msgpack.ExtType(xvalues.EXT_BIGINT, msgpack.packb("0003"))], [3, "run-1"],
                             [4, None], [5, 0.5]], use_bin_type=True)
    blob = msgpack.packb(msgpack.ExtType(xvalues.EXT_DICT, payload))
    write(p, naming.VALUES, blob)
    edit_manifest(p, lambda m: m["values"].update(size=len(blob), crc32c=crc32c.crc32c(blob)))


def _link_manifest(p: str) -> None:
    """xckpt.json replaced by a link to a copy of itself (inside the checkpoint, under a name no reader opens)."""
    os.rename(os.path.join(p, naming.MANIFEST), os.path.join(p, "manifest-copy.json"))
    os.symlink("manifest-copy.json", os.path.join(p, naming.MANIFEST))


def _surrogate_key(p: str) -> None:
    """The key of 'step' spelled with a lone UTF-16 surrogate escape (valid JSON, not valid Unicode)."""
    raw = read(p, naming.MANIFEST)
    write(p, naming.MANIFEST, raw.replace(b'"step"', b'"\\ud800"'))


def _key_twice(m: dict[str, Any]) -> None:
    """'b' renamed 'w', in the tree and in its leaf entry (its array keeps its own path)."""
    next(item for item in m["tree"]["items"] if item[0] == "b")[0] = "w"
    leaf(m, ["b"])["key"] = ["w"]


def _values_too_deep(p: str) -> None:
    """values.msgpack whose 'name' is 64 nested arrays inside the file's top-level dict (65 levels); size and
    crc32c updated."""
    deep: Any = "run-1"
    for _ in range(64):
        deep = [deep]
    payload = msgpack.packb([[2, 3], [3, deep], [4, None], [5, 0.5]], use_bin_type=True)
    blob = msgpack.packb(msgpack.ExtType(xvalues.EXT_DICT, payload))
    write(p, naming.VALUES, blob)
    edit_manifest(p, lambda m: m["values"].update(size=len(blob), crc32c=crc32c.crc32c(blob)))


def _write_values(p: str, pairs: bytes) -> None:
    """values.msgpack made of the msgpack array of [index, value] pairs ``pairs`` (the payload of the file's
    top-level extension type 2), written byte for byte; size and crc32c updated."""
    blob = msgpack.packb(msgpack.ExtType(xvalues.EXT_DICT, pairs))
    write(p, naming.VALUES, blob)
    edit_manifest(p, lambda m: m["values"].update(size=len(blob), crc32c=crc32c.crc32c(blob)))


def _values_float32(p: str) -> None:
    """values.msgpack whose 'opt/1' (0.5) is a msgpack float 32 (0xca), where the rules write float 64."""
    _write_values(p, msgpack.packb([[2, 3], [3, "run-1"], [4, None], [5, 0.5]], use_single_float=True))


def _values_array_leaf(p: str) -> None:
    """values.msgpack with an extra entry for index 0, the array leaf 'w' (only value leaves have entries)."""
    _write_values(p, msgpack.packb([[0, "not an array"], [2, 3], [3, "run-1"], [4, None], [5, 0.5]]))


def _segment_not_ascii(m: dict[str, Any]) -> None:
    """'w' recorded as one segment (the whole leaf) whose path is ARABIC-INDIC DIGIT ZERO, a digit to
    str.isdigit but not one of the ASCII digits the format's segment paths are."""
    w = leaf(m, ["w"])
    w["segments"] = [{"path": "\u0660", "offset": [0, 0], "shape": [4, 4], "chunk_shape": w.pop("chunk_shape"),
                      "inner_chunk_shape": w.pop("inner_chunk_shape")}]


# name -> (code, deep, load, description, corruption applied to a copy of the base checkpoint);
# load: True when loading the whole checkpoint fails with the same code, a code when it fails with
# another one, False when the defect does not stop a load (it concerns Orbax, or bytes no read touches).
Invalid = tuple[str, bool, "bool | str", str, Callable[[str], None]]
INVALID: dict[str, Invalid] = {
    "missing_manifest": ("manifest.missing", False, True,
                         "arrays and values written, but no xckpt.json (a save interrupted before its commit)",
                         _remove_commit_files),
    "manifest_truncated": ("manifest.json", False, True, "xckpt.json cut in the middle",
                           lambda p: write(p, naming.MANIFEST, read(p, naming.MANIFEST)[:200])),
    "manifest_not_utf8": ("manifest.json", False, True, "xckpt.json holds a byte that is not UTF-8",
                          lambda p: write(p, naming.MANIFEST, read(p, naming.MANIFEST).replace(b'"w"', b'"\xff"', 1))),
    "manifest_not_object": ("manifest.schema", False, True, "xckpt.json is a JSON array",
                            lambda p: write(p, naming.MANIFEST, b"[]\n")),
    "wrong_format": ("manifest.format", False, True, "format is 'zarr', not 'xckpt'",
                     lambda p: edit_manifest(p, lambda m: m.update(format="zarr"))),
    "unknown_version": ("manifest.version", False, True, "version '2.0', which a 1.0/1.1/1.2 reader must refuse",
                        lambda p: edit_manifest(p, lambda m: m.update(version="2.0"))),
    "schema_unknown_field": ("manifest.schema", False, True, "a leaf entry has a field the schema does not allow",
                             lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(order="F"))),
    "schema_compression": ("manifest.schema", False, True, "compression 'lz4', not one of none/zstd",
                           lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(compression="lz4"))),
    "schema_missing_leaves": ("manifest.schema", False, True, "the required 'leaves' field is missing",
                              lambda p: edit_manifest(p, lambda m: m.pop("leaves"))),
    "schema_float_integer": ("manifest.schema", False, True, "a shape of [4.0, 4]: 4.0 is a JSON number, not an "
                             "integer", lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(shape=[4.0, 4]))),
    "segments_gap": ("shape.segments", False, True, "format 1.1 segments that cover only half of the leaf",
                     lambda p: edit_manifest(p, _half_segment)),
    "shape_2e60_elements": ("shape.too_large", False, True,
                            "shape [2**30, 2**30]: 2**60 elements, beyond the 2**53 limit; a reader must refuse "
                            "it before allocating anything",
                            lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(
                                shape=[2**30, 2**30], chunk_shape=[2**30, 2**30], inner_chunk_shape=[2**30, 2**30]))),
    "shape_dim_2e60": ("shape.too_large", False, True, "one dimension of 2**60, beyond the JSON-safe 2**53 - 1",
                       lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(shape=[2**60, 4]))),
    "shape_bytes_2e53": ("shape.too_large", False, True,
                         "2**52 float32 elements: fewer than 2**53 elements but more than 2**53 bytes",
                         lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(
                             shape=[2**52], chunk_shape=[2**52], inner_chunk_shape=[2**52]))),
    "too_many_chunks": ("shape.too_many_chunks", False, True, "chunk_shape [1] splits 2**25 elements into "
                        "2**25 objects, more than the 2**24 allowed",
                        lambda p: edit_manifest(p, lambda m: leaf(m, ["b"]).update(
                            shape=[2**25], chunk_shape=[1], inner_chunk_shape=[1]))),
    "shape_rank": ("shape.rank", False, True, "chunk_shape has a different rank than shape",
                   lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(chunk_shape=[2]))),
    "inner_not_dividing": ("shape.chunking", False, True, "inner_chunk_shape [1, 3] does not divide chunk_shape [2, 4]",
                           lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(inner_chunk_shape=[1, 3]))),
    "dtype_unknown": ("dtype.unsupported", False, True, "dtype 'float128' is not a format 1.0 dtype",
                      lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(dtype="float128",
                                                                                 storage_dtype="float128"))),
    "dtype_subbyte_before_1_4": ("dtype.unsupported", False, True,
                                 "dtype 'int4' (stored as uint8) in a format 1.2 manifest (sub-byte dtypes are 1.4's)",
                                 lambda p: edit_manifest(p, lambda m: leaf(m, ["b"]).update(dtype="int4",
                                                                                            storage_dtype="uint8"))),
    "dtype_storage_mismatch": ("dtype.mismatch", False, True, "storage_dtype 'int32' for dtype 'float32'",
                               lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(storage_dtype="int32"))),
    "path_dotdot": ("path.unsafe", False, True, "an array path '../w' that escapes the checkpoint",
                    lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(path="../w"))),
    "path_absolute": ("path.unsafe", False, True, "an absolute array path '/tmp/w'",
                      lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(path="/tmp/w"))),
    "path_nested": ("path.unsafe", False, True, "an array path 'sub/w' with a separator in a format 1.2 manifest "
                    "(paths nest from 1.3)",
                    lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(path="sub/w"))),
    "path_inside_another": ("manifest.path_collision", False, True,
                            "format 1.3: array 'b' stored at 'w/c/b', inside array 'w''s directory",
                            lambda p: (os.rename(os.path.join(p, "b"), os.path.join(p, "w", "c", "b")),
                                       edit_manifest(p, lambda m: (m.update(version="1.3"),
                                                                   leaf(m, ["b"]).update(path="w/c/b"))))),
    "path_reserved": ("path.unsafe", False, True, "an array path that is a reserved name ('_METADATA')",
                      lambda p: edit_manifest(p, lambda m: leaf(m, ["w"]).update(path="_METADATA"))),
    "path_name": ("manifest.path_name", False, "chunk.place",
                  "array 'b' stored under 'bias' rather than its key joined with '.' (Orbax would not find it); "
                  "its chunk objects' place tags still name 'b/...', so a load refuses them",
                  lambda p: (os.rename(os.path.join(p, "b"), os.path.join(p, "bias")),
                             edit_manifest(p, lambda m: leaf(m, ["b"]).update(path="bias")))),
    "symlink": ("path.link", False, True, "a chunk object that is a symbolic link (to another chunk)",
                lambda p: (os.remove(os.path.join(p, "w/c/1/0")), os.symlink("../0/0", os.path.join(p, "w/c/1/0")))),
    "path_collision": ("manifest.path_collision", False, True, "two array leaves with the same path",
                       lambda p: edit_manifest(p, _second_leaf_shares_path)),
    "tree_leaves_disagree": ("manifest.tree", False, True, "leaf 0 and leaf 1 have swapped keys",
                             lambda p: edit_manifest(p, _swap_keys)),
    "tree_index_range": ("manifest.tree", False, True, "a tree leaf index beyond the leaves list",
                         lambda p: edit_manifest(p, lambda m: m["tree"]["items"][0][1].update(index=99))),
    "values_entry_missing": ("manifest.values", False, True, "value leaves listed but no 'values' entry",
                             lambda p: edit_manifest(p, lambda m: m.pop("values"))),
    "values_file_missing": ("values.missing", False, True, "values.msgpack removed",
                            lambda p: os.remove(os.path.join(p, naming.VALUES))),
    "values_size": ("values.size", False, True, "values.msgpack one byte longer than the manifest says",
                    lambda p: write(p, naming.VALUES, read(p, naming.VALUES) + b"\x00")),
    "values_crc32c": ("values.crc32c", False, True, "one byte of values.msgpack changed",
                      lambda p: flip(p, naming.VALUES, 5)),
    "values_type": ("values.type", False, True, "the manifest says 'step' is an int, values.msgpack holds a str",
                    lambda p: rewrite_values(p, lambda v: v.update({2: "three"}))),
    "values_undecodable": ("values.invalid", False, True, "values.msgpack is not msgpack (size and crc updated)",
                           lambda p: (write(p, naming.VALUES, b"\xc1"),
                                      edit_manifest(p, lambda m: m["values"].update(
                                          size=1, crc32c=crc32c.crc32c(b"\xc1"))))),
    "values_leaf_missing": ("values.missing", False, True, "values.msgpack lacks the value of one leaf",
                            lambda p: rewrite_values(p, lambda v: v.pop(2))),
    "chunk_missing": ("chunk.missing", False, True, "shard object w/c/1/0 removed",
                      lambda p: os.remove(os.path.join(p, "w/c/1/0"))),
    "inner_chunk_missing": ("chunk.missing", False, True,
                            "the shard index of w/c/0/0 marks an inner chunk inside the array as absent",
                            lambda p: edit_index(p, "w/c/0/0", 2, _remove_inner)),
    "chunk_truncated": ("chunk.truncated", False, True, "shard object w/c/1/0 cut to 10 bytes",
                        lambda p: write(p, "w/c/1/0", read(p, "w/c/1/0")[:10])),
    "index_out_of_bounds": ("chunk.truncated", False, True,
                            "the shard index (crc32c valid) points past the end of the object",
                            lambda p: edit_index(p, "w/c/0/0", 2, _index_past_end)),
    "index_overlap": ("chunk.overlap", False, True, "two entries of a shard index point at the same bytes",
                      lambda p: edit_index(p, "w/c/0/0", 2, _index_overlap)),
    "inner_chunk_short": ("chunk.truncated", False, True,
                          "an uncompressed inner chunk 4 bytes shorter than its element count times itemsize + 4",
                          lambda p: edit_index(p, "w/c/0/0", 2, _index_short)),
    "inner_chunk_long": ("chunk.size", False, True,
                         "an uncompressed inner chunk 4 bytes longer than its element count times itemsize + 4 "
                         "(TensorStore decodes its first bytes and ignores the rest)",
                         lambda p: edit_index(p, "w/c/1/0", 2, _index_long)),
    "data_crc32c": ("chunk.crc32c", True, True, "one data byte of an inner chunk changed (found only by deep "
                    "validation, which recomputes every inner chunk's crc32c)",
                    lambda p: flip(p, "w/c/0/0", _data_offset(p) + 1)),
    "index_crc32c": ("chunk.crc32c", False, True, "one byte of a shard index changed, its crc32c kept",
                     lambda p: edit_index(p, "w/c/1/0", 2, lambda pairs: pairs[0].__setitem__(0, pairs[0][0] + 1),
                                          fix_crc=False)),
    "zarr_json_missing": ("array.metadata_missing", False, True, "w/zarr.json removed",
                          lambda p: os.remove(os.path.join(p, "w/zarr.json"))),
    "zarr_json_invalid": ("array.metadata_json", False, True, "w/zarr.json is not JSON",
                          lambda p: write(p, "w/zarr.json", b"{not json")),
    "zarr_json_shape": ("array.metadata_mismatch", False, True, "w/zarr.json says shape [4, 8], the manifest [4, 4]",
                        lambda p: _zarr_json(p, "w", lambda z: z.update(shape=[4, 8]))),
    "zarr_json_dtype": ("array.metadata_mismatch", False, True, "b/zarr.json says uint32, the manifest int32",
                        lambda p: _zarr_json(p, "b", lambda z: z.update(data_type="uint32"))),
    "zarr_json_codecs": ("array.metadata_mismatch", False, True,
                         "w/zarr.json lacks the inner crc32c codec the format requires",
                         lambda p: _zarr_json(p, "w", lambda z: z["codecs"][0]["configuration"]["codecs"].pop())),
    "chunk_unexpected": ("chunk.unexpected", False, False, "an extra object w/c/2/0 outside the chunk grid",
                         lambda p: write(p, "w/c/2/0", read(p, "w/c/1/0"))),
    "chunk_swapped": ("chunk.place", False, True, "two chunk objects of one array (same size, valid indexes and "
                      "checksums) swapped: each one's place tag names the other place", _swap_chunks),
    "chunk_transplanted": ("chunk.place", False, True, "w/c/1/0 copied from another save of the same shapes: its "
                           "place tag names the other save's generation", _transplant_chunk),
    "chunk_no_tag": ("chunk.place", False, True, "a chunk object without its place tag (as format 1.1 wrote it) "
                     "in a format 1.2 checkpoint", _without_tag),
    "index_gap": ("chunk.gap", False, True, "the inner chunks (index and tag rewritten) leave 8 bytes at the start "
                  "of the object that no entry covers", lambda p: edit_index(p, "w/c/0/0", 2, _index_gap, shift=8)),
    "manifest_surrogate": ("manifest.unicode", False, True, "a key holding a lone UTF-16 surrogate ('\\ud800'), "
                           "valid JSON but not valid UTF-8", _surrogate_key),
    "manifest_symlink": ("path.link", False, True, "xckpt.json is a symbolic link (to a copy of itself inside the "
                         "checkpoint): refused, not read through, and not taken for an absent manifest",
                         _link_manifest),
    "manifest_huge_number": ("manifest.json", False, True, "a JSON number of 5000 digits (beyond what a reader "
                             "converts), where an integer is expected",
                             lambda p: write(p, naming.MANIFEST, read(p, naming.MANIFEST).replace(
                                 b'"index":0', b'"index":' + b"1" * 5000, 1))),
    "too_many_inner_chunks": ("shape.too_many_chunks", False, True, "'b' declares 2**21 inner chunks in one chunk "
                              "object, more than the 2**20 allowed",
                              lambda p: edit_manifest(p, lambda m: leaf(m, ["b"]).update(
                                  shape=[2**21], chunk_shape=[2**21], inner_chunk_shape=[1]))),
    "values_noncanonical": ("values.invalid", False, True, "a big-int extension holding '0003': decodable, but not "
                            "what the encoding rules write (size and crc32c updated)", _noncanonical_values),
    "zarr_json_member_twice": ("array.metadata_json", False, True, "w/zarr.json gives 'shape' twice (JSON readers "
                               "disagree on which one counts)",
                               lambda p: write(p, "w/zarr.json", read(p, "w/zarr.json").replace(
                                   b'"shape":', b'"shape":[4,4],"shape":', 1))),
    "manifest_member_twice": ("manifest.json", False, True, "xckpt.json gives 'leaves' twice, first empty (JSON "
                              "readers disagree on which one counts)",
                              lambda p: write(p, naming.MANIFEST, read(p, naming.MANIFEST).replace(
                                  b'{"format":"xckpt"', b'{"format":"xckpt","leaves":[]', 1))),
    "tree_key_twice": ("manifest.tree", False, True, "two leaves under the key 'w' of one dict ('b' renamed): a "
                       "reader would keep one and drop the other", lambda p: edit_manifest(p, _key_twice)),
    "namedtuple_field_keyword": ("manifest.tree", False, True, "a namedtuple node whose field is the keyword "
                                 "'class' (no namedtuple can have it)",
                                 lambda p: edit_manifest(p, lambda m: m["tree"]["items"].append(
                                     ["nt", {"kind": "namedtuple", "name": "Pair", "fields": ["class"],
                                             "items": [{"kind": "list", "items": []}]}]))),
    "values_too_deep": ("values.invalid", False, True, "a value of 64 nested arrays in the values file's top-level "
                        "dict: 65 levels, more than the 64 allowed (size and crc32c updated)", _values_too_deep),
    "generation_missing": ("manifest.schema", False, True, "a format 1.2 manifest without its generation",
                           lambda p: edit_manifest(p, lambda m: m.pop("generation"))),
    "generation_null": ("manifest.schema", False, True, "a format 1.2 manifest whose generation is null (not a "
                        "string of 32 hex digits; null is not 'absent', and a reader taking it so would check no "
                        "place tag)", lambda p: edit_manifest(p, lambda m: m.update(generation=None))),
    "orbax_path_null": ("manifest.schema", False, True, "value leaf 'step' with orbax_path null (the schema says a "
                        "non-empty string when present)",
                        lambda p: edit_manifest(p, lambda m: leaf(m, ["step"]).update(orbax_path=None))),
    "values_null": ("manifest.schema", False, True, "the values member is null (the schema says an object)",
                    lambda p: edit_manifest(p, lambda m: m.update(values=None))),
    "tree_index_2e53": ("manifest.schema", False, True, "a tree leaf index of 2**53, above the schema's maximum "
                        "(an index, not a shape: not shape.too_large)",
                        lambda p: edit_manifest(p, lambda m: m["tree"]["items"][0][1].update(index=2**53))),
    "manifest_nan": ("manifest.json", False, True, "xckpt.json holds NaN and -Infinity in producer (Python's json "
                     "reads them; they are not JSON)",
                     lambda p: write(p, naming.MANIFEST, read(p, naming.MANIFEST).replace(
                         b'"producer":{', b'"producer":{"x":NaN,"y":-Infinity,', 1))),
    "zarr_json_nan": ("array.metadata_json", False, True, "w/zarr.json holds NaN in its attributes (not JSON)",
                      lambda p: write(p, "w/zarr.json", read(p, "w/zarr.json").replace(
                          b'"attributes":{}', b'"attributes":{"a":NaN}', 1))),
    "zarr_json_fill_float": ("array.metadata_mismatch", False, True, "b/zarr.json (int32) says fill_value 0.0; an "
                             "integer type's fill value is the integer literal 0",
                             lambda p: _zarr_json(p, "b", lambda z: z.update(fill_value=0.0))),
    "zarr_json_dtype_word": ("array.metadata_mismatch", False, True, "w/zarr.json says data_type 'JSON' (valid "
                             "JSON that differs from the manifest; the word in it does not make it invalid JSON)",
                             lambda p: _zarr_json(p, "w", lambda z: z.update(data_type="JSON"))),
    "segment_path_not_ascii": ("path.unsafe", False, True, "a segment path U+0660 (ARABIC-INDIC DIGIT ZERO): "
                               "segment paths are ASCII decimal numbers", lambda p: edit_manifest(p, _segment_not_ascii)),
    "values_float32": ("values.invalid", False, True, "values.msgpack stores the float 0.5 as msgpack float 32; "
                       "the encoding rules write float 64 (size and crc32c updated)", _values_float32),
    "values_array_leaf": ("values.invalid", False, True, "values.msgpack holds an entry for index 0, the array "
                          "leaf 'w' (size and crc32c updated)", _values_array_leaf),
    "orbax_checkpoint_metadata_missing": ("orbax.checkpoint_metadata", False, False,
                                          "_CHECKPOINT_METADATA removed (Orbax's CheckpointManager lists steps by it)",
                                          lambda p: os.remove(os.path.join(p, naming.ORBAX_CHECKPOINT_METADATA))),
    "orbax_checkpoint_metadata_invalid": ("orbax.checkpoint_metadata", False, False,
                                          "_CHECKPOINT_METADATA is not a JSON object",
                                          lambda p: write(p, naming.ORBAX_CHECKPOINT_METADATA, b"garbage")),
    "orbax_metadata_missing": ("orbax.missing", False, False, "_METADATA removed: Orbax could not restore it",
                               lambda p: os.remove(os.path.join(p, naming.ORBAX_METADATA))),
    "orbax_metadata_invalid": ("orbax.invalid", False, False, "_METADATA is not JSON",
                               lambda p: write(p, naming.ORBAX_METADATA, b"{")),
    "orbax_metadata_mismatch": ("orbax.mismatch", False, False,
                                "_METADATA records 'w' with a write_shape that disagrees with the manifest",
                                lambda p: _orbax_meta(p, lambda m: m["tree_metadata"]["('w',)"]["value_metadata"]
                                                      .update(write_shape=[4, 4]))),
    "orbax_metadata_extra": ("orbax.mismatch", False, False, "_METADATA records a leaf the manifest does not have",
                             lambda p: _orbax_meta(p, lambda m: m["tree_metadata"].update({"('ghost',)": {
                                 "key_metadata": [{"key": "ghost", "key_type": 2}],
                                 "value_metadata": {"value_type": "scalar", "skip_deserialize": False}}}))),
    "orbax_scalar_mirror": ("orbax.mismatch", False, False,
                            "the 0-d mirror array of value 'step' holds a different number than values.msgpack",
                            lambda p: _rewrite_mirror(p, "step", np.int64(4))),
    "orbax_strings": ("orbax.mismatch", False, False, "_strings.json disagrees with the string value 'name'",
                      lambda p: write(p, "_strings.json", json.dumps({"name": "run-2"}).encode())),
}


def _rewrite_mirror(p: str, name: str, value: np.generic) -> None:
    meta = arrays.zarr_metadata([], str(value.dtype), [], [])
    with ChunkWriter(Location.of(p).store(), FIXED_GENERATION) as w:
        w.file(f"{name}/zarr.json", arrays.encode_metadata(meta))
        w.chunk(f"{name}/c", arrays.geometry(str(value.dtype), (), (), "none"), np.asarray(value), name)


# --------------------------------------------------------------------------- driver

def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def generate(out: str) -> None:
    """Write every vector under ``out`` (its valid/ and invalid/ are replaced)."""
    for sub in ("valid", "invalid"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    for name, make in VALID.items():
        d = os.path.join(out, "valid", name)
        os.makedirs(d)
        tree, description = make(os.path.join(d, "checkpoint"))
        _write_json(os.path.join(d, "expected.json"), {"description": description, "tree": tagged(_plain(tree))})
    with tempfile.TemporaryDirectory() as tmp:
        pristine = os.path.join(tmp, "base")
        base(pristine)
        for name, (code, deep, load, description, corrupt) in INVALID.items():
            d = os.path.join(out, "invalid", name)
            os.makedirs(d)
            ckpt = os.path.join(d, "checkpoint")
            shutil.copytree(pristine, ckpt, symlinks=True)
            corrupt(ckpt)
            _write_json(os.path.join(d, "expected.json"),
                        {"code": code, "deep": deep, "load": code if load is True else (load or None),
                         "description": description})


def _same(a: str, b: str) -> list[str]:
    """Paths that differ between two trees (content, kind or link target)."""
    diffs = []
    names = sorted(set(_walk(a)) | set(_walk(b)))
    for rel in names:
        pa, pb = os.path.join(a, rel), os.path.join(b, rel)
        if os.path.islink(pa) or os.path.islink(pb):
            if not (os.path.islink(pa) and os.path.islink(pb) and os.readlink(pa) == os.readlink(pb)):
                diffs.append(rel)
        elif not (os.path.isfile(pa) and os.path.isfile(pb) and (filecmp.cmp(pa, pb, shallow=False)
                                                                 or _same_json(pa, pb))):
            diffs.append(rel)
    return diffs


def _same_json(a: str, b: str) -> bool:
    """Whether two files hold the same JSON (TensorStore may serialise zarr.json differently)."""
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return json.loads(fa.read()) == json.loads(fb.read())
    except ValueError:
        return False


def _walk(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.append(os.path.relpath(os.path.join(dirpath, n), root))
    return out


def check(out: str = HERE) -> list[str]:
    """Regenerate in a temporary directory; return the paths that differ from ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        return [p for sub in ("valid", "invalid")
                for p in (os.path.join(sub, x) for x in _same(os.path.join(out, sub), os.path.join(tmp, sub)))]


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=HERE, help="directory to write valid/ and invalid/ into")
    ap.add_argument("--check", action="store_true", help="compare a fresh generation with --out")
    args = ap.parse_args(argv)
    if args.check:
        diffs = check(args.out)
        for d in diffs:
            print("differs:", d)
        return 1 if diffs else 0
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
