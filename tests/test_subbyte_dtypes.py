"""Format 1.4's sub-byte dtypes (int4, uint4, int2, uint2, float4_e2m1fn): numpy, JAX on a mesh, Orbax both ways.

Stored as raw uint8, one element per byte in its low bits (spec 3.4); a checkpoint holding one says 1.4, an
older manifest naming one is refused (the conformance vector ``invalid/dtype_subbyte_before_1_4``).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import xckpt
from xckpt.convert import convert
from xckpt.errors import KeyMismatchError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
ocp = pytest.importorskip("orbax.checkpoint")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")

SUBBYTE = ("int4", "uint4", "int2", "uint2", "float4_e2m1fn")


def _every_value(name: str, shape: tuple[int, ...] = (4, 8)) -> np.ndarray:
    """Every bit pattern of ``name``, repeated to ``shape`` (float4: every value, -0.0 included)."""
    dt = np.dtype(getattr(ml_dtypes, name))
    bits = 2 if name.endswith("int2") else 4
    patterns = np.arange(2 ** bits, dtype=np.uint8)
    return np.resize(patterns, shape).view(dt)


@pytest.mark.parametrize("name", SUBBYTE)
def test_numpy_round_trip_raw_low_bits_and_version(tmp_path, name):
    """Every value round-trips bit for bit; stored as uint8 holding the element in its low bits (what zarr-python
    reads); the manifest says 1.4. High bits set in memory are cleared as stored, each element keeping its value:
    ml_dtypes ignores them for the integer types, and reads a float4_e2m1fn byte with any of them set as negative
    (stored with the sign bit, bit 3)."""
    arr = _every_value(name)
    junk = (arr.view(np.uint8) | np.uint8(0xFC if name.endswith("int2") else 0xF0)).view(arr.dtype)
    xckpt.save({"x": arr, "junk": junk, "w": np.arange(3, dtype=np.float32)}, tmp_path / "c")
    m = json.loads((tmp_path / "c" / "xckpt.json").read_text())
    assert m["version"] == "1.4"
    entry = next(e for e in m["leaves"] if e["key"] == ["x"])
    assert (entry["dtype"], entry["storage_dtype"]) == (name, "uint8")
    got = xckpt.load(tmp_path / "c")
    assert got["x"].dtype == arr.dtype and got["junk"].dtype == arr.dtype
    np.testing.assert_array_equal(got["x"].view(np.uint8), arr.view(np.uint8))
    stored = arr.view(np.uint8) | np.uint8(0x08) if name == "float4_e2m1fn" else arr.view(np.uint8)
    np.testing.assert_array_equal(got["junk"].view(np.uint8), stored)
    np.testing.assert_array_equal(got["junk"].astype(np.float32).view(np.uint32),
                                  junk.astype(np.float32).view(np.uint32))  # the values it held, -0.0 included
    assert (junk.view(np.uint8) >= 0xF0).all()  # the caller's array is left as it was
    import zarr
    for name_, want in (("x", arr.view(np.uint8)), ("junk", stored)):
        raw = zarr.open_array(str(tmp_path / "c" / name_), mode="r")[...]
        assert raw.dtype == np.uint8
        np.testing.assert_array_equal(raw, want)


def test_casts_into_and_out_of_subbyte_targets(tmp_path):
    """A load into a sub-byte target refuses stored values it cannot hold (an int8 of -100 would wrap to -4 in
    int4) and loads those it can; sub-byte values widen into int8 and float32 targets."""
    xckpt.save({"wide": np.array([-100, 3, 7], np.int8), "fits": np.array([-8, 0, 7], np.int8),
                "q": np.array([-8, -1, 0, 7], ml_dtypes.int4), "f4": np.array([-6, 0.5, 1.5, 6], ml_dtypes.float4_e2m1fn)},
               tmp_path / "c")
    with pytest.raises(KeyMismatchError) as err:
        xckpt.load(tmp_path / "c", like={"wide": np.zeros(3, ml_dtypes.int4)}, partial=True)
    assert err.value.leaf == "wide" and "int4" in err.value.message
    got = xckpt.load(tmp_path / "c", like={"fits": np.zeros(3, ml_dtypes.int4), "q": np.zeros(4, np.int8),
                                           "f4": np.zeros(4, np.float32)}, partial=True)
    assert got["fits"].dtype == ml_dtypes.int4 and got["fits"].astype(int).tolist() == [-8, 0, 7]
    assert got["q"].dtype == np.int8 and got["q"].tolist() == [-8, -1, 0, 7]
    assert got["f4"].dtype == np.float32 and got["f4"].tolist() == [-6.0, 0.5, 1.5, 6.0]


def test_jax_sharded_round_trip_onto_another_mesh(tmp_path):
    """JAX arrays of every sub-byte dtype, sharded on a (4, 2) mesh, load onto a (2, 4) mesh split the other way,
    each device's shard compared element by element."""
    devices = np.array(jax.devices())
    m42, m24 = Mesh(devices.reshape(4, 2), ("x", "y")), Mesh(devices.reshape(2, 4), ("x", "y"))
    want = {name: _every_value(name, (8, 8)) for name in SUBBYTE}
    saved = {name: jax.device_put(a, NamedSharding(m42, P("x", "y"))) for name, a in want.items()}
    xckpt.save(saved, tmp_path / "c")
    like = {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m24, P("y", "x")))
            for name, a in want.items()}
    out = xckpt.load(tmp_path / "c", like=like)
    for name, a in want.items():
        got = out[name]
        assert isinstance(got, jax.Array) and got.dtype == a.dtype and got.sharding == like[name].sharding, name
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8), a[shard.index].view(np.uint8))


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
@pytest.mark.parametrize("ocdbt", [False, True], ids=["files", "ocdbt"])
def test_orbax_written_subbyte_arrays_read_and_convert(tmp_path, zarr3, ocdbt):
    """Real Orbax writes int4, int2 and float4_e2m1fn (TensorStore's dtypes; it refuses uint4 and uint2): xckpt reads
    them exactly, and converts them into a 1.4 checkpoint."""
    want = {"q": _every_value("int4", (4, 4)), "i2": _every_value("int2", (8,)),
            "f4": _every_value("float4_e2m1fn", (2, 8)), "w": np.linspace(-1, 1, 6, dtype=np.float32)}
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3))
    ckptr.save(tmp_path / "orbax", args=ocp.args.PyTreeSave({k: jnp.asarray(v) for k, v in want.items()}))
    for got in (xckpt.load(tmp_path / "orbax"), None):
        if got is None:
            convert(str(tmp_path / "orbax"), str(tmp_path / "x"), source="orbax")
            assert json.loads((tmp_path / "x" / "xckpt.json").read_text())["version"] == "1.4"
            got = xckpt.load(tmp_path / "x")
        for k, v in want.items():
            assert got[k].dtype == v.dtype, k
            np.testing.assert_array_equal(np.asarray(got[k]).astype(np.float32), v.astype(np.float32))


def test_plain_orbax_restores_the_rest_of_a_checkpoint_holding_subbyte_arrays(tmp_path):
    """Orbax would read the raw bytes as uint8, so sub-byte arrays stay out of its view (as float8 do); it restores
    every other leaf."""
    xckpt.save({"q": _every_value("int4", (4, 4)), "w": np.arange(6, dtype=np.float32), "step": 3}, tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "_METADATA").read_text())
    assert sorted(meta["tree_metadata"]) == ["('step',)", "('w',)"]
    out = ocp.PyTreeCheckpointer().restore(tmp_path / "c")
    assert set(out) == {"w", "step"} and out["step"] == 3
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(6, dtype=np.float32))


def test_high_bits_another_writer_left_set_are_ignored(tmp_path, monkeypatch):
    """A writer that stores sub-byte elements with their high bits set (spec 3.4: it should not) still loads as the
    values its low bits say: float4_e2m1fn too, whose value ml_dtypes would read from the high bits."""
    from xckpt.format import dtypes
    arr = _every_value("float4_e2m1fn")
    junk = (arr.view(np.uint8) | np.uint8(0xF0)).view(arr.dtype)
    monkeypatch.setattr(dtypes, "canonical", lambda raw, name: raw)  # that other writer
    xckpt.save({"f4": junk}, tmp_path / "c")
    import zarr
    assert (zarr.open_array(str(tmp_path / "c" / "f4"), mode="r")[...] >= 0xF0).all()  # stored as it was given
    got = xckpt.load(tmp_path / "c")["f4"]
    np.testing.assert_array_equal(got.view(np.uint8), arr.view(np.uint8))
    np.testing.assert_array_equal(got.astype(np.float32), arr.astype(np.float32))
