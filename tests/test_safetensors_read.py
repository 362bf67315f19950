"""Reading Hugging Face safetensors: files written by the ``safetensors`` library and by ``transformers``,
loaded into numpy, torch and JAX targets, converted; and every lying header refused with its code."""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as np_load_file, save_file as np_save_file
from safetensors.torch import save_file as torch_save_file

import xckpt
import xckpt.cli
from xckpt.engine import storage
from xckpt.engine.read import ReadRequest
from xckpt.errors import KeyMismatchError, ManifestError, ShapeError, UnsafePathError, UnsupportedError, XckptError
from xckpt.format.regions import Region
from xckpt.interop.safetensors import checkpoint as st_checkpoint
from xckpt.interop.safetensors.checkpoint import open_safetensors
from xckpt.format.safetensors import MAX_HEADER_BYTES, parse_header

pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")


def _numpy_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "model.embed.weight": rng.standard_normal((7, 5)).astype(np.float32),
        "f64": rng.standard_normal((3, 2, 2)),
        "f16": rng.standard_normal(9).astype(np.float16),
        "i64": rng.integers(-2**62, 2**62, (4,), dtype=np.int64),
        "i32": rng.integers(-2**31, 2**31 - 1, (2, 3), dtype=np.int32),
        "i16": rng.integers(-2**15, 2**15 - 1, (5,), dtype=np.int16),
        "i8": rng.integers(-128, 127, (6,), dtype=np.int8),
        "u8": rng.integers(0, 255, (2, 2), dtype=np.uint8),
        "u16": rng.integers(0, 2**16 - 1, (3,), dtype=np.uint16),
        "u32": rng.integers(0, 2**32 - 1, (3,), dtype=np.uint32),
        "u64": rng.integers(0, 2**63, (3,), dtype=np.uint64),
        "mask": rng.random((3, 4)) > 0.5,
        "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def _torch_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"bf16": torch.randn(6, 4, generator=g).to(torch.bfloat16),
            "e4m3": (torch.randn(10, generator=g) * 4).to(torch.float8_e4m3fn),
            "e5m2": (torch.randn(3, 3, generator=g) * 4).to(torch.float8_e5m2),
            "flag": torch.tensor([True, False, True])}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's bytes as the numpy dtype xckpt gives (bf16 and float8 through ml_dtypes)."""
    np_dtype = {torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
                torch.float8_e5m2: ml_dtypes.float8_e5m2, torch.bool: np.bool_}[t.dtype]
    return t.contiguous().view(torch.uint8).numpy().view(np_dtype).reshape(tuple(t.shape))


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal dtype, shape and bytes (element by element, NaNs and signed zeros included)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


class _Counter:
    """Counts the bytes read through every local file the stores open."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        original = storage.LocalBlob.read_into

        def read_into(blob: Any, offset: int, out: np.ndarray) -> None:
            self.bytes += out.nbytes
            original(blob, offset, out)

        monkeypatch.setattr(storage.LocalBlob, "read_into", read_into)


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


# -- reading what the library writes ----------------------------------------------------------------


def test_every_dtype_reads_exactly(tmp_path: Path) -> None:
    """numpy load of every tensor, several dtypes (bf16, float8, bool, complex, 0-d, empty), byte for byte."""
    d = tmp_path / "np"
    d.mkdir()
    arrays = _numpy_tensors()
    np_save_file(arrays, str(d / "model.safetensors"), metadata={"format": "np"})
    got = xckpt.load(str(d))
    assert set(got) == set(arrays)
    for k, v in arrays.items():
        _same(got[k], v)
    reference = np_load_file(str(d / "model.safetensors"))  # the library's own reader agrees
    for k in arrays:
        _same(got[k], reference[k])
    info = xckpt.inspect(str(d))
    assert info["format"] == "safetensors" and info["producer"] == {"library": "safetensors", "framework": "numpy"}
    assert {leaf["key"] for leaf in info["leaves"]} == set(arrays)

    tensors = _torch_tensors()
    torch_save_file(tensors, str(tmp_path / "t.safetensors"))
    got = xckpt.load(str(tmp_path / "t.safetensors"))  # a path to a single file
    for k, t in tensors.items():
        _same(got[k], _as_numpy(t))


def test_regions_read_only_their_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A region load reads about the region's bytes: row blocks as one run, column slices run by run."""
    rng = np.random.default_rng(2)
    big = rng.standard_normal((256, 128)).astype(np.float32)
    other = rng.standard_normal((64, 64)).astype(np.float32)
    np_save_file({"big": big, "other": other}, str(tmp_path / "model.safetensors"))
    header = _header_bytes(tmp_path / "model.safetensors")
    for region in [(slice(10, 74), slice(None)), (slice(100, 200), slice(64, 96)), (slice(5, 6), slice(3, 4))]:
        counter = _Counter(monkeypatch)
        got = xckpt.load(str(tmp_path), like={"big": xckpt.ReadSpec(region)})["big"]
        _same(got, big[region])
        needed = big[region].nbytes
        assert needed <= counter.bytes - header <= 1.1 * needed, (region, counter.bytes, needed)
        monkeypatch.undo()
    ck = open_safetensors(tmp_path)
    try:
        e = ck.manifest.by_key()[("big",)]
        out = np.empty((100, 32), np.float32)
        assert ck.read([ReadRequest(e, Region((100, 64), (100, 32)), out)]) == out.nbytes
        _same(out, big[100:200, 64:96])
    finally:
        ck.close()


@pytest.mark.parametrize("piece", [24, 4096])
def test_any_region_into_any_output_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    """Random regions of a 3-d tensor into contiguous, strided and transposed outputs, with pieces small
    enough to split runs, rows and staging blocks: exact, and exactly the region's bytes read."""
    monkeypatch.setattr(st_checkpoint, "PIECE_BYTES", piece)
    rng = np.random.default_rng(3)
    a = rng.integers(-2**31, 2**31 - 1, (9, 7, 11), dtype=np.int32)
    np_save_file({"a": a}, str(tmp_path / "x.safetensors"))
    ck = open_safetensors(tmp_path / "x.safetensors")
    try:
        e = ck.manifest.by_key()[("a",)]
        for _ in range(40):
            lo = [int(rng.integers(0, n)) for n in a.shape]
            hi = [int(rng.integers(s + 1, n + 1)) for s, n in zip(lo, a.shape)]
            sizes = tuple(h - s for s, h in zip(lo, hi))
            want = a[tuple(slice(s, h) for s, h in zip(lo, hi))]
            layouts = [np.empty(sizes, np.int32),
                       np.empty((sizes[0] * 2,) + sizes[1:], np.int32)[::2],
                       np.empty(sizes[::-1], np.int32).T,
                       np.empty((sizes[0], sizes[1], sizes[2] + 3), np.int32)[:, :, 1:-2]]
            for out in layouts:
                n = ck.read([ReadRequest(e, Region(tuple(lo), sizes), out)])
                assert n == want.nbytes
                np.testing.assert_array_equal(out, want)
    finally:
        ck.close()


def _llama(tie: bool, dtype: torch.dtype = torch.float32) -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype), cfg


@pytest.fixture(scope="module")
def hf_sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], Any]:
    """A tiny bf16 Llama saved by ``transformers`` in several shards with its index."""
    model, cfg = _llama(tie=False, dtype=torch.bfloat16)
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(str(path), max_shard_size="10KB", safe_serialization=True)
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (path / "model.safetensors.index.json").exists()
    return path, {k: v.clone() for k, v in model.state_dict().items()}, cfg


def test_torch_model_from_a_sharded_transformers_checkpoint(hf_sharded: tuple[Path, dict, Any]) -> None:
    """``like=model`` and ``like=model.state_dict()`` match the stored names; values exact, loaded in place."""
    import transformers

    path, saved, cfg = hf_sharded
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    assert not all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert xckpt.load(str(path), like=model) is model
    for k, v in model.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, saved[k]), k
    fresh = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    state = fresh.state_dict()
    xckpt.load(str(path), like=state)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    index = json.loads((path / "model.safetensors.index.json").read_text())
    ck = open_safetensors(path)
    try:
        assert ck.format == "safetensors" and sorted(ck.manifest.metadata["safetensors"]["files"]) == \
            sorted(set(index["weight_map"].values()))
        assert {e.key for e in ck.manifest.leaves} == {(k,) for k in index["weight_map"]}
    finally:
        ck.close()


def test_tied_weights_stored_once(tmp_path: Path) -> None:
    """``transformers`` stores a tied ``lm_head.weight`` once: a strict load names it missing;
    ``strict=False`` loads the rest (the tied parameter with it)."""
    model, cfg = _llama(tie=True)
    model.save_pretrained(str(tmp_path / "tied"), safe_serialization=True)
    import transformers

    other = transformers.LlamaForCausalLM(cfg)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert not all(torch.equal(v, saved[k]) for k, v in other.state_dict().items())
    with pytest.raises(KeyMismatchError) as info:
        xckpt.load(str(tmp_path / "tied"), like=other)
    assert info.value.missing == ["lm_head.weight"] and not info.value.unexpected
    with pytest.warns(xckpt.XckptWarning, match="lm_head.weight"):
        xckpt.load(str(tmp_path / "tied"), like=other, strict=False)
    assert torch.equal(other.lm_head.weight, model.model.embed_tokens.weight)
    got = other.state_dict()
    assert set(got) == set(saved)
    for k, v in got.items():
        assert v.dtype == saved[k].dtype and torch.equal(v, saved[k]), k


def test_jax_arrays_on_a_mesh(tmp_path: Path) -> None:
    """Load into JAX arrays sharded over a 4x2 mesh of host devices: every shard exact."""
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = np.array(jax.devices())
    if devices.size != 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    mesh = Mesh(devices.reshape(4, 2), ("x", "y"))
    tensors = {"w": torch.randn(16, 8).to(torch.bfloat16), "b": torch.randn(8), "e": torch.randn(12, 6)}
    torch_save_file(tensors, str(tmp_path / "model.safetensors"))
    specs = {"w": P("x", "y"), "b": P("y"), "e": P(None, "y")}
    like = {k: jax.ShapeDtypeStruct(tuple(t.shape), jax.numpy.bfloat16 if t.dtype == torch.bfloat16 else np.float32,
                                    sharding=NamedSharding(mesh, specs[k])) for k, t in tensors.items()}
    got = xckpt.load(str(tmp_path), like=like)
    for k, t in tensors.items():
        want = _as_numpy(t) if t.dtype == torch.bfloat16 else t.numpy()
        assert got[k].sharding == like[k].sharding
        for shard in got[k].addressable_shards:
            _same(np.asarray(shard.data), want[shard.index])


def test_mapping_views_read_through_the_source(tmp_path: Path) -> None:
    """A mapping (rename + transpose) over a safetensors checkpoint: TensorStore views of its tensors."""
    from xckpt import mapping as M

    w = np.random.default_rng(4).standard_normal((6, 4)).astype(np.float32)
    np_save_file({"layers.0.fc.weight": w, "layers.1.fc.weight": w * 2}, str(tmp_path / "model.safetensors"))
    m = M.Mapping(M.rename("layers.{i}.fc.weight", "params/layers_{i}/kernel", M.transpose(1, 0)))
    got = xckpt.load(str(tmp_path), like={"params": {"layers_0": {"kernel": np.empty((4, 6), np.float32)},
                                                     "layers_1": {"kernel": np.empty((4, 6), np.float32)}}},
                     mapping=m)
    _same(got["params"]["layers_0"]["kernel"], w.T.copy())
    _same(got["params"]["layers_1"]["kernel"], (w * 2).T.copy())


def test_convert_then_load(tmp_path: Path, hf_sharded: tuple[Path, dict, Any]) -> None:
    """``xckpt convert --from safetensors`` writes an xckpt checkpoint that loads exactly (and validates)."""
    path, saved, _ = hf_sharded
    dst = tmp_path / "converted"
    assert xckpt.cli.main(["convert", "--from", "safetensors", str(path), str(dst)]) == 0
    got = xckpt.load(str(dst))
    assert set(got) == set(saved)
    for k, t in saved.items():
        _same(got[k], _as_numpy(t))
    info = xckpt.inspect(str(dst))
    assert info["format"] == "xckpt"
    assert xckpt.validate(str(dst), deep=True).ok


def test_detection_keeps_other_formats(tmp_path: Path) -> None:
    """An xckpt checkpoint with a stray model.safetensors is still xckpt; an empty directory is still
    ``manifest.missing``; a directory is read as safetensors only by its well-known file names."""
    ck = tmp_path / "ck"
    xckpt.save({"a": np.arange(3)}, str(ck))
    np_save_file({"b": np.arange(2)}, str(ck / "model.safetensors"))
    assert xckpt.inspect(str(ck))["format"] == "xckpt"
    os.unlink(ck / "model.safetensors")
    (tmp_path / "empty").mkdir()
    np_save_file({"b": np.arange(2)}, str(tmp_path / "empty" / "weights.safetensors"))
    with pytest.raises(XckptError) as info:
        xckpt.load(str(tmp_path / "empty"))
    assert info.value.code == "manifest.missing"
    _same(xckpt.load(str(tmp_path / "empty" / "weights.safetensors"))["b"], np.arange(2))


# -- lying headers ---------------------------------------------------------------------------------


def _write(path: Path, header: Any, data: bytes = b"", *, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _f32(n: int, begin: int = 0) -> dict[str, Any]:
    return {"dtype": "F32", "shape": [n], "data_offsets": [begin, begin + 4 * n]}


_LIES = [
    # (name, header, data, code, error class, tensor named)
    ("not utf-8", b'{"a\xff": 1}', b"", "safetensors.header", ManifestError, None),
    ("not json", b"{not json}", b"", "safetensors.header", ManifestError, None),
    ("not an object", b"[1, 2]", b"", "safetensors.header", ManifestError, None),
    ("entry not an object", {"a": [1]}, b"", "safetensors.header", ManifestError, "a"),
    ("unknown member", {"a": dict(_f32(1), extra=1)}, b"\0" * 4, "safetensors.header", ManifestError, "a"),
    ("missing member", {"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "safetensors.header", ManifestError, "a"),
    ("metadata not strings", {"__metadata__": {"k": 1}}, b"", "safetensors.header", ManifestError, None),
    ("name given twice", (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                          b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'), b"\0\0",
     "safetensors.duplicate", ManifestError, "a"),
    ("unknown dtype", {"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "safetensors.dtype",
     UnsupportedError, "a"),
    ("sub-byte dtype", {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", "safetensors.dtype",
     UnsupportedError, "a"),
    ("negative shape", {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "safetensors.shape",
     ShapeError, "a"),
    ("float shape", {"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, b"\0" * 4,
     "safetensors.shape", ShapeError, "a"),
    ("string shape", {"a": {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}}, b"\0" * 4,
     "safetensors.shape", ShapeError, "a"),
    ("bool shape", {"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4,
     "safetensors.shape", ShapeError, "a"),
    ("huge shape", {"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}, b"\0" * 4,
     "safetensors.shape", ShapeError, "a"),
    ("float offsets", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}}, b"\0" * 4,
     "safetensors.offsets", ManifestError, "a"),
    ("offsets reversed", {"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4,
     "safetensors.offsets", ManifestError, "a"),
    ("wrong byte count", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4,
     "safetensors.offsets", ManifestError, "a"),
    ("beyond the buffer", {"a": _f32(2)}, b"\0" * 4, "safetensors.offsets", ManifestError, "a"),
    ("overlapping", {"a": _f32(2), "b": _f32(2, 4)}, b"\0" * 12, "safetensors.offsets", ManifestError, "b"),
    ("hole", {"a": _f32(1), "b": _f32(1, 8)}, b"\0" * 12, "safetensors.offsets", ManifestError, "b"),
    ("trailing bytes", {"a": _f32(1)}, b"\0" * 8, "safetensors.offsets", ManifestError, None),
    ("lone surrogate", b'{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\0",
     "safetensors.header", ManifestError, None),
]


@pytest.mark.parametrize("case", _LIES, ids=[c[0] for c in _LIES])
def test_lying_headers_are_refused(tmp_path: Path, case: tuple) -> None:
    _, header, data, code, cls, tensor = case
    path = _write(tmp_path / "model.safetensors", header, data)
    with pytest.raises(cls) as info:
        xckpt.load(str(tmp_path))
    assert info.value.code == code, info.value
    assert info.value.file == str(path)
    assert info.value.leaf == tensor


def test_an_honest_header_parses(tmp_path: Path) -> None:
    """The same checks accept what the library writes, zero-sized tensors anywhere included."""
    tensors = {"a": np.zeros((0, 2), np.float32), "b": np.arange(3, dtype=np.int16), "c": np.zeros(0, np.uint8)}
    np_save_file(tensors, str(tmp_path / "ok.safetensors"))
    raw = (tmp_path / "ok.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    h = parse_header(raw[8:8 + n], len(raw), file="ok")
    assert set(h.tensors) == set(tensors) and h.buffer_size == 6 and h.data_start == 8 + n
    assert h.tensors["b"].dtype == "int16" and h.tensors["b"].shape == (3,)


@pytest.mark.parametrize("length", [2**40, 2**64 - 1, MAX_HEADER_BYTES + 1, MAX_HEADER_BYTES - 100, 93])
def test_a_header_length_beyond_the_file_allocates_nothing(tmp_path: Path, length: int) -> None:
    """A 100-byte file declaring a huge (or merely too long) header fails at once, before allocating it."""
    path = _write(tmp_path / "model.safetensors", b"{}" + b" " * 90, length=length)
    assert path.stat().st_size == 100
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ManifestError) as info:
            open_safetensors(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 1.0
    assert peak < 1 << 20, peak
    assert info.value.code == "safetensors.header" and info.value.file == str(path)


def test_a_file_shorter_than_its_length_prefix(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x02\0\0")
    with pytest.raises(ManifestError) as info:
        xckpt.load(str(tmp_path))
    assert info.value.code == "safetensors.header"


# -- lying indexes and files that are not files -------------------------------------------------------


def _sharded(path: Path) -> dict[str, np.ndarray]:
    """Two shards and an index, as transformers writes them."""
    path.mkdir()
    a, b, c = np.arange(6, dtype=np.float32), np.ones((2, 2), np.int64), np.arange(3, dtype=np.uint8)
    np_save_file({"a": a, "b": b}, str(path / "model-00001-of-00002.safetensors"))
    np_save_file({"c": c}, str(path / "model-00002-of-00002.safetensors"))
    _index(path, {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"})
    return {"a": a, "b": b, "c": c}


def _index(path: Path, weight_map: dict[str, str]) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1},
                                                                   "weight_map": weight_map}))


def test_a_sharded_directory_reads_exactly(tmp_path: Path) -> None:
    want = _sharded(tmp_path / "s")
    got = xckpt.load(str(tmp_path / "s"))
    for k, v in want.items():
        _same(got[k], v)
    got = xckpt.load(str(tmp_path / "s" / "model.safetensors.index.json"))  # the index named directly
    assert set(got) == set(want)
    for k, v in want.items():
        _same(got[k], v)


@pytest.mark.parametrize("case", ["outside", "absolute", "subdirectory", "not safetensors", "missing file",
                                  "not in its file", "not in the index", "in two files", "not json",
                                  "no weight_map"])
def test_lying_indexes_are_refused(tmp_path: Path, case: str) -> None:
    d = tmp_path / "s"
    _sharded(d)
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index = d / "model.safetensors.index.json"
    code, cls, leaf, file = "safetensors.index", ManifestError, "c", index
    if case == "outside":
        np_save_file({"c": np.arange(3, dtype=np.uint8)}, str(tmp_path / "x.safetensors"))
        _index(d, {"a": s1, "b": s1, "c": "../x.safetensors"})
        cls = UnsafePathError
    elif case == "absolute":
        _index(d, {"a": s1, "b": s1, "c": str(tmp_path / "x.safetensors")})
        cls = UnsafePathError
    elif case == "subdirectory":
        _index(d, {"a": s1, "b": s1, "c": "sub/" + s2})
        cls = UnsafePathError
    elif case == "not safetensors":
        _index(d, {"a": s1, "b": s1, "c": "config.json"})
    elif case == "missing file":
        _index(d, {"a": s1, "b": s1, "c": "model-00003-of-00002.safetensors"})
        code, cls, leaf, file = "safetensors.missing", XckptError, None, d / "model-00003-of-00002.safetensors"
    elif case == "not in its file":
        _index(d, {"a": s1, "b": s1, "c": s2, "zz": s2})
        leaf = "zz"
    elif case == "not in the index":
        _index(d, {"a": s1, "c": s2})
        leaf = "b"
    elif case == "in two files":
        np_save_file({"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 2), np.int64),
                      "c": np.arange(3, dtype=np.uint8)}, str(d / s1))
        code, leaf, file = "safetensors.duplicate", "c", d / s1
    elif case == "not json":
        index.write_text("{weight_map")
        leaf = None
    else:
        index.write_text(json.dumps({"metadata": {}}))
        leaf = None
    with pytest.raises(cls) as info:
        xckpt.load(str(d))
    assert info.value.code == code, info.value
    assert info.value.leaf == leaf and info.value.file == str(file), info.value


def test_links_and_special_files_are_refused(tmp_path: Path) -> None:
    """A link in place of a shard (``path.link``) or of ``model.safetensors``, or a FIFO (``path.special``,
    without blocking) is refused: never read through."""
    d = tmp_path / "s"
    _sharded(d)
    shard = d / "model-00002-of-00002.safetensors"
    os.rename(shard, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", shard)
    with pytest.raises(UnsafePathError) as info:
        xckpt.load(str(d))
    assert info.value.code == "path.link" and info.value.file == str(shard)
    os.unlink(shard)
    os.mkfifo(shard)
    start = time.monotonic()
    with pytest.raises(UnsafePathError) as info:
        xckpt.load(str(d))
    assert info.value.code == "path.special" and time.monotonic() - start < 5
    single = tmp_path / "one"
    single.mkdir()
    os.symlink(tmp_path / "elsewhere.safetensors", single / "model.safetensors")
    for path in (single, single / "model.safetensors"):
        with pytest.raises(UnsafePathError) as info:
            xckpt.load(str(path))
        assert info.value.code == "path.link"


def test_a_hub_cache_snapshot_reads_through_its_own_blob_links(tmp_path: Path,
                                                               hf_sharded: tuple[Path, dict, Any]) -> None:
    """A model in the Hugging Face hub cache, its snapshot's files linked to ``<repo>/blobs/<hash>`` by
    huggingface_hub's own code, loads from the snapshot (or one file of it); any other link in it is
    still refused: one that leaves the blobs folder, climbs out of it, or a blob that is a link."""
    import hashlib
    import shutil

    import transformers
    from huggingface_hub import file_download, try_to_load_from_cache

    src, saved, cfg = hf_sharded
    cache, rev = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--xckpt--tiny-llama"
    snap = repo / "snapshots" / rev
    for d in (repo / "refs", repo / "blobs", snap):
        d.mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    names = sorted(f.name for f in src.iterdir() if f.is_file())
    for name in names:
        blob = repo / "blobs" / hashlib.sha256((src / name).read_bytes()).hexdigest()
        shutil.copyfile(src / name, blob)
        file_download._create_symlink(str(blob), str(snap / name))
    index = snap / "model.safetensors.index.json"
    assert os.path.islink(index) and try_to_load_from_cache("xckpt/tiny-llama", index.name, cache_dir=cache) == \
        str(index)
    for path in (snap, index):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        xckpt.load(str(path), like=model)
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), k
    shard = snap / next(n for n in names if n.startswith("model-"))
    blob_name = os.readlink(shard).rsplit("/", 1)[1]
    climbs = "../../blobs/" + os.path.relpath(src / shard.name, repo / "blobs")  # names a real file
    for hostile in (str(src / shard.name), climbs, "../../refs/main"):
        os.unlink(shard)
        os.symlink(hostile, shard)
        with pytest.raises(UnsafePathError) as info:
            xckpt.load(str(snap))
        assert info.value.code == "path.link" and info.value.file == str(shard), hostile
    os.unlink(shard)
    os.symlink(f"../../blobs/{blob_name}", shard)
    xckpt.load(str(snap), like=transformers.LlamaForCausalLM(cfg).to(torch.bfloat16))  # the hub's own form again
    os.rename(repo / "blobs" / blob_name, tmp_path / "moved")
    os.symlink(tmp_path / "moved", repo / "blobs" / blob_name)  # the blob itself a link
    with pytest.raises(UnsafePathError) as info:
        xckpt.load(str(snap))
    assert info.value.code == "path.link"


def test_a_file_truncated_after_opening(tmp_path: Path) -> None:
    """The files are checked when opened; one cut short afterwards fails its read with ``safetensors.truncated``."""
    np_save_file({"a": np.arange(1000, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    ck = open_safetensors(tmp_path)
    try:
        e = ck.manifest.leaves[0]
        os.truncate(tmp_path / "model.safetensors", 200)
        with pytest.raises(XckptError) as info:
            ck.read([ReadRequest(e, Region((0,), (1000,)), np.empty(1000, np.float32))])
        assert info.value.code == "safetensors.truncated" and info.value.leaf == "a"
    finally:
        ck.close()


def test_bool_bytes_other_than_0_and_1(tmp_path: Path) -> None:
    _write(tmp_path / "model.safetensors", {"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}},
           b"\x00\x01\x07")
    with pytest.raises(XckptError) as info:
        xckpt.load(str(tmp_path))
    assert info.value.code == "safetensors.data" and info.value.leaf == "m"


def test_an_object_store(tmp_path: Path) -> None:
    """Through a TensorStore key-value store (object stores; ``memory://`` here), whose objects have no
    size up front: regions read exactly; a file that ends before its last tensor is refused when opened."""
    from safetensors.numpy import save as np_save

    a = np.arange(60, dtype=np.float32).reshape(6, 10)
    kv = storage.open_kvstore(storage.Location.of("memory://st-test/ck").kvstore())
    kv.write("model.safetensors", np_save({"a": a, "b": np.ones(3, np.int8)})).result()
    _same(xckpt.load("memory://st-test/ck")["a"], a)
    got = xckpt.load("memory://st-test/ck/model.safetensors", like={"a": xckpt.ReadSpec((slice(2, 5), slice(3, 7)))})
    _same(got["a"], a[2:5, 3:7])
    kv.write("model.safetensors", np_save({"a": a})[:-8]).result()
    with pytest.raises(ManifestError) as info:
        xckpt.load("memory://st-test/ck")
    assert info.value.code == "safetensors.offsets" and info.value.file == "memory://st-test/ck/model.safetensors"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_directory_into_a_flax_model_with_the_preset(tmp_path: Path, family: str) -> None:
    """A model directory written by ``save_pretrained`` (sharded) loads into the flax model of the same family,
    on a mesh, through ``M.torch_to_flax()`` with no arguments: every parameter equals what transformers' own
    converter makes of the torch weights, and the flax logits equal the torch ones."""
    jax = pytest.importorskip("jax")
    import transformers
    from flax.traverse_util import flatten_dict
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    from xckpt import mapping as M

    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        torch_cls, flax_cls = transformers.GPT2LMHeadModel, transformers.FlaxGPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
        torch_cls, flax_cls = transformers.LlamaForCausalLM, transformers.FlaxLlamaForCausalLM
    torch.manual_seed(11)
    model = torch_cls(cfg).eval()
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    flax_model = flax_cls(cfg, seed=1)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, P("x") if a.shape[0] % 2 == 0 else P())), flax_model.params)
    got = xckpt.load(str(tmp_path / "hf"), like={"params": like}, mapping=M.torch_to_flax())["params"]
    want = flatten_dict(convert_pytorch_state_dict_to_flax({k: v.detach() for k, v in model.state_dict().items()},
                                                           flax_model))
    flat = flatten_dict(got)
    assert set(flat) == set(flatten_dict(flax_model.params))
    for k, v in flat.items():
        assert v.sharding == flatten_dict(like)[k].sharding
        _same(np.asarray(v), np.asarray(want[k]))
    ids = np.array([[1, 5, 9, 2, 33, 31, 4, 0]])
    with torch.no_grad():
        torch_logits = model(torch.from_numpy(ids)).logits.numpy()
    flax_logits = np.asarray(flax_model(ids, params=got).logits)
    np.testing.assert_allclose(flax_logits, torch_logits, rtol=1e-5, atol=1e-5)


def test_every_stored_tensor_is_accounted_for_going_into_flax(tmp_path: Path) -> None:
    """Each tensor of a Hugging Face directory is a top-level key of its own, yet one that no flax leaf takes is
    reported by a strict load (a 2-layer checkpoint into a 1-layer model; ``strict=False`` warns and loads the
    rest), while the buffers flax computes are left out: an older GPT-2 directory's causal masks
    (``h.N.attn.bias``, rank 4) and ``masked_bias``, stored without the ``transformer.`` prefix as the hub's."""
    jax = pytest.importorskip("jax")
    import transformers
    from flax.traverse_util import flatten_dict
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    from xckpt import mapping as M

    def config(layers: int) -> Any:
        return transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=16)

    torch.manual_seed(3)
    model = transformers.GPT2Model(config(2)).eval()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "hf").mkdir()
    torch_save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))

    flax_model = transformers.FlaxGPT2LMHeadModel(config(2), seed=1)
    got = xckpt.load(str(tmp_path / "hf"), like={"params": flax_model.params}, mapping=M.torch_to_flax())["params"]
    want = flatten_dict(convert_pytorch_state_dict_to_flax({k: v.numpy() for k, v in model.state_dict().items()},
                                                           flax_model))
    flat = flatten_dict(got)
    assert set(flat) == set(flatten_dict(flax_model.params))
    for k, v in flat.items():
        _same(np.asarray(v), np.asarray(want[k]))

    one = transformers.FlaxGPT2LMHeadModel(config(1), seed=1)
    with pytest.raises(KeyMismatchError) as info:
        xckpt.load(str(tmp_path / "hf"), like={"params": one.params}, mapping=M.torch_to_flax())
    layer1 = sorted(k for k in model.state_dict() if k.startswith("h.1."))
    assert info.value.code == "tree.key_mismatch" and info.value.file == str(tmp_path / "hf")
    assert sorted(u.split(" ")[0] for u in info.value.unexpected) == layer1, info.value.unexpected
    assert not info.value.missing and not info.value.mismatched
    with pytest.warns(xckpt.XckptWarning, match="h.1.mlp.c_fc.weight"):
        part = xckpt.load(str(tmp_path / "hf"), like={"params": one.params}, mapping=M.torch_to_flax(), strict=False)
    _same(np.asarray(part["params"]["transformer"]["h"]["0"]["mlp"]["c_fc"]["kernel"]),
          np.asarray(want[("transformer", "h", "0", "mlp", "c_fc", "kernel")]))
