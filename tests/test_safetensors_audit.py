"""Audit of the safetensors reader and exporter: hostile files refused with the right code, file and tensor;
memory near the tensors' sizes; exports and HF-written files compared element by element with the real
``safetensors`` and ``transformers`` libraries."""

from __future__ import annotations

import json
import os
import random
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load as np_load, save as np_save, save_file as np_save_file
from safetensors.torch import load_file as torch_load_file, save_file as torch_save_file

import xckpt
import xckpt.convert
from xckpt.engine import storage
from xckpt.engine.read import ReadRequest
from xckpt.errors import XckptError
from xckpt.format.regions import Region
from xckpt.format.safetensors import INDEX_FILE, SINGLE_FILE
from xckpt.interop.safetensors.checkpoint import open_safetensors


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal dtype, shape and bytes, element by element."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _torch_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# -- a name given twice: the error names the tensor it belongs to, and only a tensor ----------------------

_ENTRY = '{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}'
_HEADER_DUPLICATES = [
    # (id, header, tensor the error must name)
    ("a tensor named twice", '{"a":%s,"a":%s}' % (_ENTRY % (0, 1), _ENTRY % (1, 2)), "a"),
    ("a tensor named like an entry member, twice", '{"shape":%s,"shape":%s}' % (_ENTRY % (0, 1), _ENTRY % (1, 2)),
     "shape"),
    ("a member repeated in an entry", '{"a":%s,"b":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
     % (_ENTRY % (0, 1)), "b"),
    ("a key repeated in __metadata__", '{"__metadata__":{"format":"pt","format":"np"},"a":%s,"b":%s}'
     % (_ENTRY % (0, 1), _ENTRY % (1, 2)), None),
    ("__metadata__ twice", '{"__metadata__":{},"__metadata__":{},"a":%s,"b":%s}' % (_ENTRY % (0, 1), _ENTRY % (1, 2)),
     None),
]


@pytest.mark.parametrize("case", _HEADER_DUPLICATES, ids=[c[0] for c in _HEADER_DUPLICATES])
def test_a_duplicate_in_a_header_names_its_tensor(tmp_path: Path, case: tuple) -> None:
    _, header, tensor = case
    raw = header.encode()
    path = tmp_path / SINGLE_FILE
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0")
    with pytest.raises(XckptError) as info:
        xckpt.load(str(tmp_path))
    assert info.value.code == "safetensors.duplicate", info.value
    assert info.value.file == str(path) and info.value.leaf == tensor, info.value


_INDEX_DUPLICATES = [
    ("a tensor listed twice", '{"weight_map":{"a":"s.safetensors","a":"s.safetensors"}}', "a"),
    ("total_size twice", '{"metadata":{"total_size":1,"total_size":1},"weight_map":{"a":"s.safetensors"}}', None),
    ("weight_map twice", '{"weight_map":{"a":"s.safetensors"},"weight_map":{"a":"s.safetensors"}}', None),
]


@pytest.mark.parametrize("case", _INDEX_DUPLICATES, ids=[c[0] for c in _INDEX_DUPLICATES])
def test_a_duplicate_in_an_index_names_only_a_tensor(tmp_path: Path, case: tuple) -> None:
    _, index, tensor = case
    np_save_file({"a": np.arange(3, dtype=np.uint8)}, str(tmp_path / "s.safetensors"))
    (tmp_path / INDEX_FILE).write_text(index)
    with pytest.raises(XckptError) as info:
        xckpt.load(str(tmp_path))
    assert info.value.code == "safetensors.duplicate", info.value
    assert info.value.file == str(tmp_path / INDEX_FILE) and info.value.leaf == tensor, info.value


# -- files changing while read; memory -----------------------------------------------------------------


def test_an_index_cut_short_while_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index shrinks between its open (size taken) and its read: ``safetensors.truncated``, naming it."""
    np_save_file({"a": np.arange(3, dtype=np.uint8)}, str(tmp_path / "s.safetensors"))
    index = tmp_path / INDEX_FILE
    index.write_text(json.dumps({"metadata": {"total_size": 3}, "weight_map": {"a": "s.safetensors"}}))
    real = storage.LocalBlob.read_into

    def shrinking(self: storage.LocalBlob, offset: int, out: np.ndarray) -> None:
        if self.name == INDEX_FILE:
            os.truncate(index, 10)
        real(self, offset, out)

    monkeypatch.setattr(storage.LocalBlob, "read_into", shrinking)
    with pytest.raises(XckptError) as info:
        xckpt.load(str(tmp_path))
    assert info.value.code == "safetensors.truncated" and info.value.file == str(index), info.value


def test_checking_a_bool_tensor_allocates_no_copy_of_it(tmp_path: Path) -> None:
    """The 0-or-1 check of a BOOL tensor needs no temporary of its size: a load peaks at about the output."""
    n = 16 << 20
    want = np.zeros(n, bool)
    want[::3] = True
    np_save_file({"m": want}, str(tmp_path / SINGLE_FILE))
    tracemalloc.start()
    try:
        got = xckpt.load(str(tmp_path))["m"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _same(got, want)
    assert peak < n * 1.5, peak
    # a strided output is checked too
    raw = bytearray((tmp_path / SINGLE_FILE).read_bytes())
    raw[-1] = 2
    (tmp_path / SINGLE_FILE).write_bytes(bytes(raw))
    ck = open_safetensors(tmp_path)
    try:
        out = np.zeros(2 * 1000, bool)[::2]
        with pytest.raises(XckptError) as info:
            ck.read([ReadRequest(ck.manifest.leaves[0], Region((n - 1000,), (1000,)), out)])
        assert info.value.code == "safetensors.data" and info.value.leaf == "m"
    finally:
        ck.close()


def test_a_narrow_region_of_a_tall_tensor_stays_small(tmp_path: Path) -> None:
    """One column of a 256Ki-row tensor is 256Ki one-byte runs: their offsets are not all Python ints at once."""
    rows = 1 << 18
    a = (np.arange(rows * 2) % 251).astype(np.uint8).reshape(rows, 2)
    np_save_file({"m": a}, str(tmp_path / SINGLE_FILE))
    tracemalloc.start()
    try:
        got = xckpt.load(str(tmp_path), like={"m": xckpt.ReadSpec(region=(slice(None), slice(1, 2)))})["m"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _same(got, a[:, 1:2])
    assert peak < 8 << 20, peak


# -- the real libraries, element by element ---------------------------------------------------------------


def test_every_torch_dtype_written_by_safetensors_reads_exactly(tmp_path: Path) -> None:
    """Files of the real library, fp8 variants, complex, 0-d and empty tensors included, over two shards."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, generator=g).to(torch.float16),
        "e4m3": (torch.randn(9, generator=g) * 3).to(torch.float8_e4m3fn),
        "e5m2": (torch.randn(2, 3, generator=g) * 3).to(torch.float8_e5m2),
        "e4m3fnuz": (torch.randn(6, generator=g) * 3).to(torch.float8_e4m3fnuz),
        "e5m2fnuz": (torch.randn(6, generator=g) * 3).to(torch.float8_e5m2fnuz),
        "e8m0": torch.tensor([0.5, 1.0, 4.0, 1024.0]).to(torch.float8_e8m0fnu),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "flag": torch.tensor([[True, False], [False, True]]),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
    }
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for fname, keys in shards.items():
        torch_save_file({k: tensors[k] for k in keys}, str(tmp_path / fname), metadata={"format": "pt"})
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0},
                                                   "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    got = xckpt.load(str(tmp_path))
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].shape == tuple(t.shape) and got[k].dtype.itemsize == t.element_size(), k
        assert got[k].tobytes() == _torch_bytes(t), k
    assert got["e4m3fnuz"].dtype == ml_dtypes.float8_e4m3fnuz and got["e8m0"].dtype == ml_dtypes.float8_e8m0fnu


def test_export_read_back_by_safetensors_element_by_element(tmp_path: Path) -> None:
    """An export over several shards, one tensor above the shard size: every tensor as ``safetensors`` reads it,
    the index as ``transformers`` writes it (``total_size``, ``weight_map`` naming each tensor's file)."""
    rng = np.random.default_rng(5)
    model = {
        "embed": rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16),  # 2048 bytes: above the limit
        "layers": [{"w": rng.standard_normal((8, 8)).astype(np.float16),
                    "q": rng.integers(-128, 128, (4, 4), dtype=np.int8),
                    "s": rng.standard_normal(4).astype(ml_dtypes.float8_e4m3fn)} for _ in range(3)],
        "mask": rng.random((3, 5)) > 0.5,
        "ids": np.arange(7, dtype=np.uint8),
        "scale": np.array(0.25, np.float32),
        "none": np.zeros((2, 0), np.float32),
        "e5m2": rng.standard_normal(5).astype(ml_dtypes.float8_e5m2),
    }
    xckpt.save({"model": model, "step": 3}, str(tmp_path / "ck"))
    xckpt.convert.convert(str(tmp_path / "ck"), str(tmp_path / "hf"), target="safetensors", select="model",
                          max_shard_size=300)
    flat: dict[str, np.ndarray] = {f"layers.{i}.{k}": v for i, layer in enumerate(model["layers"])
                                   for k, v in layer.items()}
    flat.update({k: np.asarray(v) for k, v in model.items() if k != "layers"})
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(files + [INDEX_FILE]) and len(files) >= 3
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in flat.values())
    assert set(index["weight_map"]) == set(flat)
    seen = {}
    for fname in files:
        with safe_open(str(tmp_path / "hf" / fname), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == fname and name not in seen
                seen[name] = f.get_tensor(name)
        held = torch_load_file(str(tmp_path / "hf" / fname))
        assert sum(t.nbytes for t in held.values()) <= 300 or len(held) == 1, fname  # a big tensor: its own file
    assert set(seen) == set(flat)
    for name, want in flat.items():
        t = seen[name]
        assert tuple(t.shape) == want.shape and t.element_size() == want.itemsize, name
        assert _torch_bytes(t) == np.ascontiguousarray(want).tobytes(), name
    assert seen["mask"].dtype == torch.bool and seen["embed"].dtype == torch.bfloat16
    assert seen["layers.0.s"].dtype == torch.float8_e4m3fn and seen["e5m2"].dtype == torch.float8_e5m2
    back = xckpt.load(str(tmp_path / "hf"))  # and xckpt reads its own export exactly
    for name, want in flat.items():
        _same(back[name], want)


def test_a_tied_bf16_model_saved_by_transformers_then_exported_round_trips(tmp_path: Path) -> None:
    """``save_pretrained`` (sharded, bf16, tied embeddings stored once) -> xckpt -> export -> ``from_pretrained``:
    every parameter equal, the tie kept."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="8KB", safe_serialization=True)
    stored = {}
    for fname in sorted(set(json.loads((tmp_path / "hf" / INDEX_FILE).read_text())["weight_map"].values())):
        stored.update(torch_load_file(str(tmp_path / "hf" / fname)))
    got = xckpt.load(str(tmp_path / "hf"))
    assert set(got) == set(stored) and "lm_head.weight" not in got
    for k, t in stored.items():
        assert got[k].dtype == ml_dtypes.bfloat16 and got[k].tobytes() == _torch_bytes(t), k
    xckpt.convert.convert(str(tmp_path / "hf"), str(tmp_path / "ck"), source="safetensors")
    xckpt.convert.convert(str(tmp_path / "ck"), str(tmp_path / "out"), target="safetensors", max_shard_size="6KB")
    cfg.save_pretrained(str(tmp_path / "out"))
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), torch_dtype=torch.bfloat16)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# -- differential fuzzing against the safetensors library --------------------------------------------------


def test_mutated_files_agree_with_the_safetensors_library(tmp_path: Path) -> None:
    """Random byte mutations of a real file: xckpt raises only XckptError naming the file, accepts nothing the
    library refuses, and where both read it, reads the same values."""
    rng = np.random.default_rng(0)
    base = np_save({"a": rng.standard_normal((3, 4)).astype(np.float32), "b": np.arange(5, dtype=np.int16),
                    "c": np.zeros((0, 2), np.uint8), "d": np.array(True)}, metadata={"format": "pt"})
    n = struct.unpack("<Q", base[:8])[0]
    rand = random.Random(11)
    path = tmp_path / SINGLE_FILE
    accepted = 0
    for _ in range(400):
        buf = bytearray(base)
        kind = rand.randrange(5)
        if kind == 0:
            buf[rand.randrange(8, 8 + n)] = rand.choice(b'{}[]":,0123456789-. eE\\\x00\xff')
        elif kind == 1:
            digits = [i for i in range(8, 8 + n) if chr(buf[i]).isdigit()]
            buf[rand.choice(digits)] = ord(str(rand.randrange(10)))
        elif kind == 2:
            del buf[rand.randrange(len(buf)):]
        elif kind == 3:
            buf += bytes(rand.randrange(1, 9))
        else:
            buf[:8] = struct.pack("<Q", max(0, n + rand.randint(-10, 10)))
        data = bytes(buf)
        path.write_bytes(data)
        try:
            want: dict[str, np.ndarray] | None = np_load(data)
        except Exception:  # noqa: BLE001 - the library refuses it
            want = None
        try:
            got = xckpt.load(str(tmp_path))
        except XckptError as exc:
            assert exc.file == str(path), exc
            assert exc.code.startswith("safetensors."), exc
            continue
        assert want is not None, data[:8 + n]
        accepted += 1
        assert set(got) == set(want)
        for k, v in want.items():
            _same(got[k], v)
    assert accepted > 5
