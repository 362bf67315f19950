"""Safetensors headers of very many tensors: every value read back exactly (files written by the real
``safetensors`` library), and every lying entry among many honest ones still refused with the code, file and
tensor it always had (the facts of a shape seen before are reused only for a list of the same integers, and
are checked again against each tensor's dtype)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file as np_save_file

import xckpt
from xckpt.engine.read import ReadRequest
from xckpt.errors import ManifestError, ShapeError, UnsupportedError, XckptError
from xckpt.format import manifest as manifest_mod
from xckpt.format.regions import Region
from xckpt.format.safetensors import INDEX_FILE, MAX_ELEMENTS, SINGLE_FILE, parse_header
from xckpt.interop.safetensors.checkpoint import open_safetensors

#: Tiny tensors of the big file: 200,000 as in the report of the slow open.
TINY = 200_000
#: Each tiny tensor's dtype, by its number modulo 5 (the library lays the data out by dtype, then name: the
#: header's order is not the data's).
_TINY_DTYPES = (np.float32, np.int64, np.uint8, np.bool_, np.float16)


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal dtype, shape and bytes (element by element)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _tiny(i: int) -> np.ndarray:
    """Tiny tensor number ``i``: shape (1,), a value of its own where its dtype allows."""
    dtype = _TINY_DTYPES[i % 5]
    value = {np.float32: i * 0.5, np.int64: i - 10**12, np.uint8: i % 256, np.bool_: i % 3 == 0,
             np.float16: (i % 2048) - 1024}[dtype]
    return np.array([value], dtype=dtype)


def _normal() -> dict[str, np.ndarray]:
    """A few ordinary tensors beside the tiny ones."""
    rng = np.random.default_rng(3)
    return {"embed.weight": rng.standard_normal((300, 64)).astype(np.float32),
            "lm_head.bias": rng.standard_normal(300),
            "mask": rng.random((7, 5)) > 0.5,
            "step": np.array(12345, dtype=np.int64),
            "empty": np.zeros((0, 4), np.float32)}


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """``model.safetensors`` of :data:`TINY` tiny tensors and a few normal ones, written by the library."""
    d = tmp_path_factory.mktemp("many")
    want = {f"model.layers.{i}.tiny": _tiny(i) for i in range(TINY)}
    want.update(_normal())
    np_save_file(want, str(d / SINGLE_FILE), metadata={"format": "np"})
    return d, want


def test_a_header_of_very_many_tiny_tensors_loads_every_value(big_file: tuple[Path, dict[str, np.ndarray]]) -> None:
    d, want = big_file
    got = xckpt.load(str(d))
    assert set(got) == set(want)
    for k, v in want.items():
        _same(got[k], v)
    # all at once too: the tiny values side by side, element by element
    names = [f"model.layers.{i}.tiny" for i in range(TINY)]
    for r in range(5):
        picked = names[r::5]
        np.testing.assert_array_equal(np.concatenate([got[k] for k in picked]),
                                      np.concatenate([want[k] for k in picked]), strict=True)


def test_the_opened_manifest_matches_the_header(big_file: tuple[Path, dict[str, np.ndarray]]) -> None:
    """Every leaf as before: its key, shape, dtype, one chunk the size of the tensor; its bytes where the header
    puts them; reads of regions (a job of the I/O pool holds many small reads) return the right values."""
    d, want = big_file
    ck = open_safetensors(d)
    try:
        assert ck.manifest.producer == {"library": "safetensors", "framework": "numpy"}
        assert [e.key for e in ck.manifest.leaves] == [(k,) for k in ck.files[0].header.tensors]
        assert len(ck.manifest.leaves) == len(want)
        for e in ck.manifest.leaves:
            w = want[e.key[0]]
            assert e.shape == w.shape and e.chunk_shape == e.inner_chunk_shape == tuple(max(1, s) for s in w.shape)
            assert e.dtype == np.dtype(w.dtype).name and e.path == e.key[0]
        leaves = ck.manifest.leaves
        for e in leaves[:50] + leaves[-50:]:  # check_shape passes (its checks are covered by the parser's)
            manifest_mod.check_shape(e, str(d / SINGLE_FILE))
        # partial regions of the big ones, whole tiny ones, in one read
        by = ck.manifest.by_key()
        reqs = [ReadRequest(by[("embed.weight",)], Region((10, 3), (100, 20)), np.empty((100, 20), np.float32)),
                ReadRequest(by[("mask",)], Region((1, 0), (3, 5)), np.empty((3, 5), np.bool_))]
        tiny = [f"model.layers.{i}.tiny" for i in range(0, TINY, 97)]
        reqs += [ReadRequest(by[(k,)], Region((0,), (1,)), np.empty(1, want[k].dtype)) for k in tiny]
        strided = np.empty((300, 128), np.float32)[:, ::2]  # a strided output is read through a buffer
        reqs.append(ReadRequest(by[("embed.weight",)], Region((0, 0), (300, 64)), strided))
        assert ck.read(reqs) == sum(r.out.nbytes for r in reqs)
        _same(reqs[0].out, want["embed.weight"][10:110, 3:23])
        _same(reqs[1].out, want["mask"][1:4])
        for k, r in zip(tiny, reqs[2:]):
            _same(r.out, want[k])
        _same(np.ascontiguousarray(strided), want["embed.weight"])
    finally:
        ck.close()


def test_a_sharded_index_of_many_tensors(tmp_path: Path) -> None:
    want = {f"h.{i}.w": _tiny(i) for i in range(30_000)}
    want.update(_normal())
    names = list(want)
    weight_map = {}
    for s in range(3):
        file = f"model-{s + 1:05d}-of-00003.safetensors"
        np_save_file({k: want[k] for k in names[s::3]}, str(tmp_path / file))
        weight_map.update({k: file for k in names[s::3]})
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    got = xckpt.load(str(tmp_path))
    assert set(got) == set(want)
    for k, v in want.items():
        _same(got[k], v)


def test_a_file_cut_short_names_the_first_tensor_it_lost(tmp_path: Path) -> None:
    """Many small reads run in a few jobs; the error is still that of the first read (in request order)
    that fails, naming its tensor."""
    want = {f"t{i:05d}": np.full(3, i, np.int32) for i in range(5000)}
    np_save_file(want, str(tmp_path / SINGLE_FILE))
    ck = open_safetensors(tmp_path)
    try:
        header = ck.files[0].header
        ordered = sorted(header.tensors.values(), key=lambda t: t.begin)
        cut = ordered[3000]
        os.truncate(tmp_path / SINGLE_FILE, header.data_start + cut.begin + 5)
        reqs = [ReadRequest(e, Region((0,), (3,)), np.empty(3, np.int32)) for e in ck.manifest.leaves]
        with pytest.raises(XckptError) as info:
            ck.read(reqs)
        assert info.value.code == "safetensors.truncated" and info.value.leaf == cut.name, info.value
    finally:
        ck.close()


# -- lying entries among many honest ones ---------------------------------------------------------------


def _entry(dtype: str, shape: Any, begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


#: Honest F32 (1,) tensors before and after the lying one.
_BEFORE, _AFTER = 2000, 2000

_BAD = [
    # (id, entry at offset 4 * _BEFORE, code, error class, the entry's bytes in the buffer, tensor named)
    ("negative dimension", _entry("F32", [-1], 8000, 8000), "safetensors.shape", ShapeError, 0, "bad"),
    ("bool dimension", _entry("F32", [True], 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("float dimension", _entry("F32", [1.0], 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("string dimension", _entry("F32", ["1"], 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("null dimension", _entry("F32", [None], 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("shape not a list", _entry("F32", 1, 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("too many elements", _entry("F32", [2**40, 2**40], 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("one byte too many", _entry("F32", [2**51 + 1], 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("a huge dimension", _entry("U8", [10**400], 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("too many elements with an empty dimension", _entry("U8", [0, 2**54], 8000, 8000), "safetensors.shape",
     ShapeError, 0, "bad"),
    ("more than 64 dimensions", _entry("F32", [1] * 65, 8000, 8004), "safetensors.shape", ShapeError, 4, "bad"),
    ("unknown dtype", _entry("F31", [1], 8000, 8004), "safetensors.dtype", UnsupportedError, 4, "bad"),
    ("dtype not a string", _entry(["F32"], [1], 8000, 8004), "safetensors.dtype", UnsupportedError, 4,  # type: ignore
     "bad"),
    ("negative offset", _entry("F32", [1], -4, 0), "safetensors.offsets", ManifestError, 4, "bad"),
    ("float offsets", _entry("F32", [1], 8000.0, 8004.0), "safetensors.offsets", ManifestError, 4, "bad"),
    ("bool offset", _entry("U8", [1], False, True), "safetensors.offsets", ManifestError, 1, "bad"),
    ("offsets reversed", _entry("F32", [0], 8004, 8000), "safetensors.offsets", ManifestError, 4, "bad"),
    ("three offsets", {"dtype": "F32", "shape": [1], "data_offsets": [8000, 8004, 8008]}, "safetensors.offsets",
     ManifestError, 4, "bad"),
    ("wrong byte count", _entry("F32", [2], 8000, 8004), "safetensors.offsets", ManifestError, 4, "bad"),
    ("beyond the buffer", _entry("F32", [1], 10**9, 10**9 + 4), "safetensors.offsets", ManifestError, 4, "bad"),
    ("overlapping the one before", _entry("F32", [2], 7996, 8004), "safetensors.offsets", ManifestError, 4, "bad"),
    ("a hole before it", _entry("F32", [1], 8004, 8008), "safetensors.offsets", ManifestError, 8, "bad"),
    ("missing member", {"dtype": "F32", "shape": [1]}, "safetensors.header", ManifestError, 4, "bad"),
    ("unknown member", dict(_entry("F32", [1], 8000, 8004), extra=1), "safetensors.header", ManifestError, 4,
     "bad"),
    ("entry not an object", [1], "safetensors.header", ManifestError, 4, "bad"),
]


def _with_many(path: Path, bad: Any, bad_bytes: int, *, name: str = "bad") -> Path:
    """A header of honest tiny tensors with the entry ``bad`` among them (as the data's next bytes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i in range(_BEFORE):
        header[f"model.layers.{i}.tiny"] = _entry("F32", [1], 4 * i, 4 * i + 4)
    header[name] = bad
    base = 4 * _BEFORE + bad_bytes
    for i in range(_AFTER):
        header[f"model.layers.{_BEFORE + i}.tiny"] = _entry("F32", [1], base + 4 * i, base + 4 * i + 4)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(base + 4 * _AFTER))
    return path


@pytest.mark.parametrize("case", _BAD, ids=[c[0] for c in _BAD])
def test_a_lying_entry_among_many_is_refused(tmp_path: Path, case: tuple) -> None:
    _, bad, code, cls, nbytes, tensor = case
    path = _with_many(tmp_path / SINGLE_FILE, bad, nbytes)
    with pytest.raises(cls) as info:
        xckpt.load(str(tmp_path))
    assert info.value.code == code, info.value
    assert info.value.file == str(path) and info.value.leaf == tensor, info.value


def test_the_first_lying_entry_in_the_header_is_the_one_named(tmp_path: Path) -> None:
    header = {f"t{i}": _entry("U8", [1], i, i + 1) for i in range(1000)}
    header["t10"] = _entry("U8", [True], 10, 11)
    header["t500"] = _entry("X9", [1], 500, 501)
    raw = json.dumps(header).encode()
    with pytest.raises(ShapeError) as info:
        parse_header(raw, 8 + len(raw) + 1000, file="f")
    assert info.value.code == "safetensors.shape" and info.value.leaf == "t10"


def test_a_duplicate_among_many_names_its_tensor(tmp_path: Path) -> None:
    """A repeated name (or member) among thousands: ``safetensors.duplicate`` naming the tensor, as before."""
    many = ",".join(f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(3000))
    for raw, tensor in ((f'{{{many},"t7":{{"dtype":"U8","shape":[1],"data_offsets":[3000,3001]}}}}', "t7"),
                        (f'{{{many},"x":{{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[3000,3001]}}}}', "x")):
        with pytest.raises(ManifestError) as info:
            parse_header(raw.encode(), 8 + len(raw) + 3001, file="f")
        assert info.value.code == "safetensors.duplicate" and info.value.leaf == tensor, info.value


def test_a_lone_surrogate_name_among_many(tmp_path: Path) -> None:
    many = ",".join(f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(1000))
    ok = f'{{{many},"\\ud83d\\ude00":{{"dtype":"U8","shape":[1],"data_offsets":[1000,1001]}}}}'.encode()
    h = parse_header(ok, 8 + len(ok) + 1001, file="f")  # a surrogate pair is one valid character
    assert "\U0001F600" in h.tensors
    bad = ok.replace(b"\\ude00", b"\\u0041")
    with pytest.raises(ManifestError) as info:
        parse_header(bad, 8 + len(bad) + 1001, file="f")
    assert info.value.code == "safetensors.header" and info.value.leaf is None


def test_a_shape_seen_before_is_checked_again_for_each_dtype() -> None:
    """The facts of a shape already checked are reused, but its bytes are the tensor's own: 2**51 elements are
    within the limit as U8 and beyond it as F64; the same integers as floats are refused, not taken as seen."""
    n = MAX_ELEMENTS // 4
    ok = {"a": _entry("U8", [n], 0, n), "b": _entry("U8", [n], n, 2 * n)}
    raw = json.dumps(ok).encode()
    h = parse_header(raw, 8 + len(raw) + 2 * n, file="f")
    assert h.tensors["a"].shape == h.tensors["b"].shape == (n,) and h.tensors["b"].begin == n
    for bad, code in (({"a": _entry("U8", [n], 0, n), "b": _entry("F64", [n], n, 9 * n)}, "safetensors.shape"),
                      ({"a": _entry("U8", [n], 0, n), "b": _entry("U8", [float(n)], n, 2 * n)}, "safetensors.shape"),
                      ({"a": _entry("U8", [1], 0, 1), "b": _entry("U8", [True], 1, 2)}, "safetensors.shape")):
        raw = json.dumps(bad).encode()
        with pytest.raises(ShapeError) as info:
            parse_header(raw, 8 + len(raw) + 9 * n, file="f")
        assert info.value.code == code and info.value.leaf == "b", info.value
