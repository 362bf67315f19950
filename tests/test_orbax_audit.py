"""Audit of the Orbax reader: names Orbax nests into directories, hostile ``_METADATA`` / ``zarr.json`` /
``manifest.ocdbt`` contents.

Real Orbax writes every checkpoint (jax on CPU with 8 host devices); what xckpt reads is compared element by
element with what Orbax itself restores, and every hostile input must be a specific
:class:`~xckpt.errors.XckptError` naming the file and the leaf.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # must be set before jax is imported (tests/conftest.py may already have done it)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import json
import logging
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xckpt
from xckpt.errors import XckptError
from xckpt.format.tree import key_str

from test_orbax_read import assert_same

logging.getLogger("absl").setLevel(logging.ERROR)


def _plain(tree: Any) -> Any:
    """What a load with no target gives: plain dicts and lists, numpy arrays, Python scalars."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    if isinstance(tree, (jax.Array, np.ndarray)):
        return np.asarray(tree)
    return tree


def _save(path: Path, tree: dict[str, Any], ocdbt: bool, zarr3: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)).save(
            path, args=ocp.args.PyTreeSave(tree))


def _orbax_restore(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ocp.PyTreeCheckpointer().restore(path)


def _refused(fn: Callable[[], Any], code: str, file: str, leaf: str | None) -> XckptError:
    with pytest.raises(XckptError) as info:
        fn()
    exc = info.value
    assert (exc.code, exc.file, exc.leaf) == (code, file, leaf), str(exc)
    return exc


# -- keys holding '/': Orbax stores such arrays in nested directories (Haiku's module names) ------------------


def _slash_tree() -> dict[str, Any]:
    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(4, 2) if devs.size == 8 else devs.reshape(-1, 1), ("x", "y"))
    rng = np.random.default_rng(3)
    return {
        "mlp/~/linear_0": {"w": jax.device_put(rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
                                               NamedSharding(mesh, P("x", "y"))),
                           "b": rng.standard_normal(4).astype(np.float32)},
        "mlp/~/linear_1": {"w": jnp.asarray(rng.integers(-9, 9, (3, 2)).astype(np.int8))},
        "d/x": rng.integers(0, 2**32 - 1, 5, dtype=np.uint32),
        "opt/count": 3,
        "run/name": "exp-1",
        "plain": {"s": "y", "c": (rng.standard_normal(2) + 1j).astype(np.complex64)},
    }


@pytest.mark.parametrize("ocdbt,zarr3", [(False, False), (True, True)])
def test_keys_holding_a_slash_load_as_orbax_restores_them(tmp_path: Path, ocdbt: bool, zarr3: bool) -> None:
    """Before the fix: ``path.unsafe`` ("array name 'mlp/~/linear_0.w' must be one plain name") for arrays, and
    ``orbax.strings_missing`` for a string under such a key (Orbax writes it at the JSON pointer ``/run/name``)."""
    tree = _slash_tree()
    path = tmp_path / "ckpt"
    _save(path, tree, ocdbt, zarr3)
    want = _plain(_orbax_restore(path))
    assert_same(want, _plain(tree))  # Orbax itself restores them exactly
    got = xckpt.load(path)
    assert_same(got, want)
    part = xckpt.load(path, like={"mlp/~/linear_0": {"w": xckpt.ReadSpec(region=(slice(2, 6), slice(1, 3)))}},
                      partial=True)
    assert_same(part["mlp/~/linear_0"]["w"], want["mlp/~/linear_0"]["w"][2:6, 1:3])


@pytest.mark.parametrize("ocdbt", [False, True])
def test_a_slash_name_and_a_name_spelling_its_escape_stay_apart(tmp_path: Path, ocdbt: bool) -> None:
    """``a/b`` (stored in nested directories) and ``a%2Fb`` (one directory of that name) are two arrays; the
    entry path of the first must not be the second's name, or one leaf would be read from the other's data."""
    tree = {"a/b": np.arange(6, dtype=np.int32), "a%2Fb": np.arange(6, 12, dtype=np.int32),
            "a%b": np.full(3, 7, dtype=np.int8)}
    path = tmp_path / "ckpt"
    _save(path, tree, ocdbt, False)
    want = _plain(_orbax_restore(path))
    assert_same(want, _plain(tree))
    assert_same(xckpt.load(path), want)


def test_a_string_under_a_key_holding_a_slash_is_found_where_orbax_put_it(tmp_path: Path) -> None:
    """Orbax writes a string at the JSON pointer ``/<name>`` of ``_strings.json``, so ``run/name`` nests:
    ``{"run": {"name": ...}}``. Before the fix: ``orbax.strings_missing`` ("string 'run/name' is missing")."""
    tree = {"run/name": "exp-1", "run/a~1b": "tilde-one", "flat": {"s": "y"}, "w": np.arange(3, dtype=np.int16)}
    path = tmp_path / "ckpt"
    _save(path, tree, True, False)
    strings = json.loads((path / "_strings.json").read_text())
    assert strings["run"] == {"name": "exp-1", "a/b": "tilde-one"} and strings["flat.s"] == "y"  # as Orbax wrote
    want = _plain(_orbax_restore(path))
    assert_same(want, _plain(tree))
    assert_same(xckpt.load(path), want)
    (path / "_strings.json").write_text(json.dumps(dict(strings, run={"name": ["not a string"], "a/b": "x"})))
    _refused(lambda: xckpt.load(path), "orbax.strings_invalid", str(path / "_strings.json"), key_str(("run/name",)))
    (path / "_strings.json").write_text(json.dumps(dict(strings, run={"name": "exp-1"})))
    _refused(lambda: xckpt.load(path), "orbax.strings_missing", str(path / "_strings.json"),
             key_str(("run/a~1b",)))


def test_a_slash_name_below_a_reserved_name_or_leaving_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, {"w": np.arange(4, dtype=np.int32)}, False, False)
    meta = json.loads((path / "_METADATA").read_text())
    rec = meta["tree_metadata"].pop("('w',)")
    for parts in (["array_metadatas/w"], ["a/../../w"], ["_METADATA/x"], ["outer", "manifest.ocdbt/x"]):
        rec["key_metadata"] = [{"key": p, "key_type": 2} for p in parts]
        (path / "_METADATA").write_text(json.dumps(dict(meta, tree_metadata={"k": rec})))
        code = "array.metadata_missing" if parts[0] == "outer" else "path.unsafe"  # outer.manifest.ocdbt/x: allowed
        file = str(path / "outer.manifest.ocdbt/x/.zarray") if parts[0] == "outer" else str(path / "_METADATA")
        _refused(lambda: xckpt.load(path), code, file, key_str(tuple(parts)))


# -- hostile _METADATA and zarr.json ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("orbax_audit")
    tree = {"w": np.arange(32, dtype=np.float32).reshape(8, 4), "step": 7}
    out = {}
    for name, (ocdbt, zarr3) in {"zarr2": (False, False), "zarr3": (False, True), "ocdbt": (True, False)}.items():
        _save(root / name, tree, ocdbt, zarr3)
        out[name] = root / name
    return out


def _copy(plain_ckpts: dict[str, Path], name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(plain_ckpts[name], dst)
    return dst


def test_a_sequence_index_of_thousands_of_digits_is_invalid(plain_ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Before the fix: a raw ``ValueError`` (Python's 4300-digit limit of ``int``)."""
    path = _copy(plain_ckpts, "zarr2", tmp_path)
    meta = json.loads((path / "_METADATA").read_text())
    meta["tree_metadata"]["('l', '0')"] = {
        "key_metadata": [{"key": "l", "key_type": 2}, {"key": "9" * 5000, "key_type": 1}],
        "value_metadata": {"value_type": "None", "skip_deserialize": True}}
    (path / "_METADATA").write_text(json.dumps(meta))
    for fn in (lambda: xckpt.load(path), lambda: xckpt.inspect(path)):
        exc = _refused(fn, "orbax.invalid", str(path / "_METADATA"), "('l', '0')")
        assert len(str(exc)) < 1000


@pytest.mark.parametrize("edit", ["grid_configuration", "sharding_configuration"])
def test_a_zarr3_configuration_that_is_not_an_object_is_array_metadata(plain_ckpts: dict[str, Path],
                                                                       tmp_path: Path, edit: str) -> None:
    """Before the fix: a raw ``AttributeError: 'list' object has no attribute 'get'``."""
    path = _copy(plain_ckpts, "zarr3", tmp_path)
    meta = json.loads((path / "w" / "zarr.json").read_text())
    if edit == "grid_configuration":
        meta["chunk_grid"]["configuration"] = [8, 4]
    else:
        codec = next(c for c in meta["codecs"] if c["name"] == "sharding_indexed")
        codec["configuration"] = [8, 4]
    (path / "w" / "zarr.json").write_text(json.dumps(meta))
    for fn in (lambda: xckpt.load(path), lambda: xckpt.inspect(path)):
        _refused(fn, "array.metadata", str(path / "w" / "zarr.json"), "w")


# -- hostile OCDBT manifests (rewritten with a valid crc32c, so TensorStore decodes them) -----------------------


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _rewrite_manifest(file: Path, edit: Callable[[bytes], bytes]) -> None:
    """Decode ``manifest.ocdbt`` (magic, length, version, zstd body, crc32c), edit its body, encode it again."""
    import crc32c
    import zstandard

    raw = file.read_bytes()
    assert raw[12:14] == b"\x00\x01", "version 0, zstd"
    body = edit(zstandard.ZstdDecompressor().decompress(raw[14:-4], max_output_size=1 << 20))
    packed = zstandard.ZstdCompressor().compress(body)
    out = raw[:4] + struct.pack("<Q", 14 + len(packed) + 4) + b"\x00\x01" + packed
    file.write_bytes(out + struct.pack("<I", crc32c.crc32c(out)))


def _root_version(body: bytes) -> tuple[int, int]:
    """Where the one inline version's root node reference starts in the manifest body, and its node length."""
    data_files = body.index(b"d/")
    at = body.index(b"\x01\x01\x00\x00\x00", data_files)  # 1 version, generation 1, height 0, file 0, offset 0
    length, shift, i = 0, 0, at + 5
    while True:
        length |= (body[i] & 0x7F) << shift
        shift += 7
        i += 1
        if body[i - 1] < 0x80:
            return at, length


def _outside_name(name: str) -> str:
    """A data file path of the same length as ``d/<name>`` that leaves the checkpoint: ``../outside/<...>``."""
    return ("../outside/" + name)[:len(name) + 2]


@pytest.mark.parametrize("case", ["offset_past_file", "length_huge", "versions_huge", "height_wrong",
                                  "data_file_outside"])
def test_a_hostile_ocdbt_manifest_is_a_specific_error(plain_ckpts: dict[str, Path], tmp_path: Path,
                                                      case: str) -> None:
    path = _copy(plain_ckpts, "ocdbt", tmp_path)
    outside = tmp_path / "outside"
    name = next(p.name for p in (path / "d").iterdir())  # the root database's one data file

    def edit(body: bytes) -> bytes:
        at, length = _root_version(body)
        old = b"\x01\x01\x00\x00\x00" + _varint(length)
        new = {"offset_past_file": b"\x01\x01\x00\x00" + _varint(10 * length) + _varint(length),
               "length_huge": b"\x01\x01\x00\x00\x00" + _varint(2**60),
               "versions_huge": _varint(2**40) + b"\x01\x00\x00\x00" + _varint(length),
               "height_wrong": b"\x01\x01\x07\x00\x00" + _varint(length)}.get(case)
        if new is not None:
            return body[:at] + new + body[at + len(old):]
        return body.replace(f"d/{name}".encode(), _outside_name(name).encode(), 1)

    if case == "data_file_outside":  # the data file renamed ../outside/<...>, which is there: never read
        outside.mkdir()
        shutil.copy(path / "d" / name, tmp_path / _outside_name(name)[len("../"):])
        shutil.rmtree(path / "d")
    _rewrite_manifest(path / "manifest.ocdbt", edit)
    for fn in (lambda: xckpt.load(path), lambda: xckpt.inspect(path)):
        with pytest.raises(XckptError) as info:
            fn()
        exc = info.value
        assert exc.code == "array.metadata" and exc.leaf in ("w", "step"), str(exc)
        # the file TensorStore could not read: the data file the manifest points past, or the manifest itself;
        # where it names no file inside the checkpoint, the array being read
        named = {"offset_past_file": str(path / "d" / name), "length_huge": str(path / "d" / name),
                 "versions_huge": str(path / "manifest.ocdbt")}.get(case)
        if named is not None:
            assert exc.file == named, str(exc)
        else:
            assert exc.file is not None and exc.file.startswith(str(path / exc.leaf)), str(exc)


@pytest.mark.parametrize("edit", ["skip_deserialize", "use_ocdbt", "fill_value", "key_type_true", "key_type_float"])
def test_a_flag_or_key_type_of_another_json_type_is_invalid(plain_ckpts: dict[str, Path], tmp_path: Path,
                                                          edit: str) -> None:
    """``"false"`` (a string) was taken for true by ``bool()``: skip_deserialize "false" skipped the leaf; a
    key_type of ``true`` or ``2.0`` passed as 1 or 2. Each is now ``orbax.invalid`` naming ``_METADATA``."""
    path = _copy(plain_ckpts, "zarr2", tmp_path)
    meta = json.loads((path / "_METADATA").read_text())
    rec = meta["tree_metadata"]["('w',)"]
    leaf: str | None = None
    if edit == "skip_deserialize":
        rec["value_metadata"]["skip_deserialize"] = "false"
        leaf = "w"
    elif edit == "use_ocdbt":
        meta["use_ocdbt"] = "false"
    elif edit == "fill_value":
        meta["store_array_data_equal_to_fill_value"] = 0
    else:
        rec["key_metadata"][0]["key_type"] = True if edit == "key_type_true" else 2.0
        leaf = "('w',)"
    (path / "_METADATA").write_text(json.dumps(meta))
    for fn in (lambda: xckpt.load(path), lambda: xckpt.inspect(path)):
        _refused(fn, "orbax.invalid", str(path / "_METADATA"), leaf)
    rec["value_metadata"]["skip_deserialize"] = False
    rec["key_metadata"][0]["key_type"] = 2
    meta.update(use_ocdbt=False, store_array_data_equal_to_fill_value=False)
    (path / "_METADATA").write_text(json.dumps(meta))
    np.testing.assert_array_equal(xckpt.load(path)["w"], np.arange(32, dtype=np.float32).reshape(8, 4))
