"""Reading checkpoints that real Orbax wrote (zarr v2 / v3, with and without OCDBT), and converting them.

Orbax writes every checkpoint here (jax on CPU with 8 host devices); xckpt reads them with
TensorStore alone and every value is compared element by element.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # must be set before jax is imported (tests/conftest.py may already have done it)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import collections
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xckpt
import xckpt.cli
from xckpt.errors import DataError, ManifestError, UnsafePathError
from xckpt.interop.orbax.checkpoint import open_orbax

pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")

logging.getLogger("absl").setLevel(logging.ERROR)


def _mesh() -> Mesh:
    devs = np.array(jax.devices())
    return Mesh(devs.reshape(4, 2) if devs.size == 8 else devs.reshape(-1, 1), ("x", "y"))


def _trees() -> tuple[dict[str, Any], dict[str, Any]]:
    """(tree for StandardCheckpointer, tree for PyTreeCheckpointer): jax and numpy arrays, scalars, nesting."""
    rng = np.random.default_rng(0)
    mesh = _mesh()
    w = rng.standard_normal((8, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(ml_dtypes.bfloat16)
    i = rng.integers(-1000, 1000, (3, 4)).astype(np.int32)
    std = {
        "params": {"w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),
                   "b": jax.device_put(b, NamedSharding(mesh, P("x"))),
                   "i": jnp.asarray(i)},
        "step": 7,
        "layers": [{"k": rng.standard_normal((2, 3)).astype(np.float32)},
                   {"k": rng.standard_normal((2, 3)).astype(np.float32)}],
        "nested": {"lst": [rng.integers(0, 9, 5).astype(np.int32), {"deep": rng.standard_normal(4)}]},
    }
    pytree = dict(std)
    pytree.update({
        "name": "run-1", "lr": 0.25, "flag": True, "none": None, "empty_d": {}, "empty_l": [],
        "f8": jnp.asarray(rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn)),
    })
    return std, pytree


def _expected(tree: Any) -> Any:
    """What a load with no target gives: plain containers, numpy arrays, Python scalars."""
    if isinstance(tree, dict):
        return {k: _expected(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_expected(v) for v in tree]
    if isinstance(tree, jax.Array):
        return np.asarray(tree)
    return tree


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal element by element, with the same container types, dtypes and shapes."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for n, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}/{n}")
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


WRITERS = ("std_ocdbt", "std_zarr2", "pytree_zarr3", "pytree_ocdbt_zarr3")


def _save(name: str, path: Path, std: dict[str, Any], pytree: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "std_ocdbt":
            c = ocp.StandardCheckpointer()
            c.save(path, std)
            c.wait_until_finished()
        elif name == "std_zarr2":
            c = ocp.StandardCheckpointer(use_ocdbt=False)
            c.save(path, std)
            c.wait_until_finished()
        else:
            handler = ocp.PyTreeCheckpointHandler(use_ocdbt=name == "pytree_ocdbt_zarr3", use_zarr3=True)
            ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(pytree))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Every writer's checkpoint, written once: name -> (path, expected load result)."""
    root = tmp_path_factory.mktemp("orbax")
    std, pytree = _trees()
    out = {}
    for name in WRITERS:
        path = root / name
        _save(name, path, std, pytree)
        out[name] = (path, _expected(std if name.startswith("std") else pytree))
    return out


def _copy(ckpts: dict[str, tuple[Path, Any]], name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(ckpts[name][0], dst)
    return dst


@pytest.mark.parametrize("name", WRITERS)
def test_load_whole_tree(ckpts: dict[str, tuple[Path, Any]], name: str) -> None:
    path, want = ckpts[name]
    # the writers really produced the four layouts
    assert (path / "manifest.ocdbt").exists() == ("ocdbt" in name)
    if "ocdbt" not in name:
        meta = "zarr.json" if "zarr3" in name else ".zarray"
        assert (path / "params.w" / meta).exists()
    assert json.loads((path / "_METADATA").read_text())["use_zarr3"] == ("zarr3" in name)
    got = xckpt.load(path)
    assert_same(got, want)
    assert type(got["step"]) is int and got["step"] == 7
    if name.startswith("pytree"):
        assert got["name"] == "run-1" and got["lr"] == 0.25 and got["flag"] is True and got["none"] is None
        assert got["f8"].dtype == ml_dtypes.float8_e4m3fn
    info = xckpt.inspect(path)
    assert info["format"] == "orbax"
    w = next(leaf for leaf in info["leaves"] if leaf["key"] == "params/w")
    assert w["shape"] == [8, 8] and w["dtype"] == "float32"
    if len(jax.devices()) == 8:
        assert w["sharding"]["mesh_shape"] == [4, 2] and w["sharding"]["dim_axes"] == [["x"], ["y"]]


@pytest.mark.parametrize("name", WRITERS)
def test_partial_read_and_scalar_targets(ckpts: dict[str, tuple[Path, Any]], name: str) -> None:
    path, want = ckpts[name]
    with pytest.warns(xckpt.XckptWarning):  # params/b and params/i are not in the target
        got = xckpt.load(path, like={"params": {"w": xckpt.ReadSpec(region=(slice(2, 6), slice(0, 8)))}},
                         strict=False)
    assert list(got) == ["params"] and list(got["params"]) == ["w"]
    np.testing.assert_array_equal(got["params"]["w"], want["params"]["w"][2:6, 0:8])
    assert got["params"]["w"].shape == (4, 8)
    got = xckpt.load(path, like={"params": {"w": xckpt.ReadSpec(region=(slice(1, 3), slice(5, 7)), dtype=np.float64),
                                            "b": np.zeros(8, ml_dtypes.bfloat16), "i": None},
                                 "step": 0, "layers": [{"k": None}, {"k": np.zeros((2, 3), np.float32)}]})
    np.testing.assert_array_equal(got["params"]["w"], want["params"]["w"][1:3, 5:7].astype(np.float64))
    assert got["params"]["w"].dtype == np.float64
    assert_same(got["params"]["b"], want["params"]["b"])
    assert got["params"]["i"] is None and got["layers"][0]["k"] is None
    assert_same(got["layers"][1]["k"], want["layers"][1]["k"])
    assert type(got["step"]) is int and got["step"] == 7
    got = xckpt.load(path, like={"step": np.zeros((), np.int64)})
    assert isinstance(got["step"], np.ndarray) and got["step"].shape == () and got["step"] == 7


def test_rich_types_give_tuples_and_namedtuples(tmp_path: Path) -> None:
    from orbax.checkpoint._src.metadata.pytree_metadata_options import PyTreeMetadataOptions
    NT = collections.namedtuple("NT", ["mu", "nu"])
    tree = {"tup": (np.arange(3, dtype=np.float32), 2), "nt": NT(mu=np.ones(2, np.int32), nu=None)}
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True,
                                          pytree_metadata_options=PyTreeMetadataOptions(support_rich_types=True))
    ocp.Checkpointer(handler).save(tmp_path / "rich", args=ocp.args.PyTreeSave(tree))
    got = xckpt.load(tmp_path / "rich")
    assert isinstance(got["tup"], tuple) and got["tup"][1] == 2
    np.testing.assert_array_equal(got["tup"][0], np.arange(3, dtype=np.float32))
    assert type(got["nt"]).__name__ == "NT" and got["nt"]._fields == ("mu", "nu") and got["nt"].nu is None
    np.testing.assert_array_equal(got["nt"].mu, np.ones(2, np.int32))


@pytest.mark.parametrize("name", ["std_ocdbt", "pytree_zarr3"])
def test_convert_from_orbax_cli(ckpts: dict[str, tuple[Path, Any]], name: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    src, want = ckpts[name]
    dst = tmp_path / "converted"
    assert xckpt.cli.main(["convert", "--from", "orbax", str(src), str(dst)]) == 0
    report = xckpt.validate(dst, deep=True)
    assert report.ok, [str(f) for f in report.findings]
    assert report.bytes_checked > 0
    assert xckpt.inspect(dst)["format"] == "xckpt"
    got = xckpt.load(dst)
    assert_same(got, want)
    m = json.loads((dst / "xckpt.json").read_text())
    assert m["metadata"]["converted_from"]["format"] == "orbax"
    if name == "pytree_zarr3":  # float8 is stored raw in xckpt and must come back as the same float8 values
        f8 = next(e for e in m["leaves"] if e["key"] == ["f8"])
        assert f8["dtype"] == "float8_e4m3fn" and f8["storage_dtype"] == "uint8"
    # a second, xckpt -> xckpt copy is also a valid checkpoint holding the same tree
    again = tmp_path / "again"
    assert xckpt.cli.main(["convert", "--from", "xckpt", str(dst), str(again)]) == 0
    assert xckpt.validate(again, deep=True).ok
    assert_same(xckpt.load(again), want)
    # converting onto an existing path needs --overwrite
    assert xckpt.cli.main(["convert", "--from", "orbax", str(src), str(dst)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert xckpt.cli.main(["convert", "--from", "orbax", "--overwrite", str(src), str(dst)]) == 0
    assert_same(xckpt.load(dst), want)


def test_corrupt_metadata_is_a_manifest_error(ckpts: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path = _copy(ckpts, "std_zarr2", tmp_path)
    (path / "_METADATA").write_text('{"tree_metadata": {"(\'step\',)": ')
    with pytest.raises(ManifestError) as err:
        xckpt.load(path)
    assert err.value.code == "orbax.invalid" and err.value.file == str(path / "_METADATA")
    (path / "_METADATA").write_text('{"tree_metadata": {"(\'a\',)": {"key_metadata": [{"key": "a", '
                                    '"key_type": 7}], "value_metadata": {"value_type": "scalar"}}}}')
    with pytest.raises(ManifestError) as err:
        xckpt.load(path)
    assert err.value.file == str(path / "_METADATA") and "key_type" in str(err.value)


def test_deleted_array_dir_names_file_and_leaf(ckpts: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path = _copy(ckpts, "std_zarr2", tmp_path)
    shutil.rmtree(path / "params.w")
    with pytest.raises(DataError) as err:
        xckpt.load(path)
    assert err.value.code == "array.metadata_missing" and err.value.leaf == "params/w"
    assert err.value.file.startswith(str(path / "params.w" / ".zarray"))


def test_deleted_chunk_is_an_error_only_where_read(ckpts: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path = _copy(ckpts, "pytree_zarr3", tmp_path)
    meta = json.loads((path / "params.w" / "zarr.json").read_text())
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    assert chunk[0] < 8, "w was written in several shards"
    last = sorted((path / "params.w" / "c").rglob("*"))[-1]
    assert last.is_file()
    last.unlink()
    with pytest.raises(DataError) as err:
        xckpt.load(path)
    assert err.value.code == "chunk.missing" and err.value.leaf == "params/w"
    assert err.value.file == str(path / "params.w")
    want = ckpts["pytree_zarr3"][1]["params"]["w"]
    got = xckpt.load(path, like={"params": {"w": xckpt.ReadSpec(region=(slice(0, chunk[0]), slice(0, 8))),
                                            "b": None, "i": None}})
    np.testing.assert_array_equal(got["params"]["w"], want[:chunk[0]])


def test_deleted_ocdbt_data_is_a_data_error(ckpts: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path = _copy(ckpts, "std_ocdbt", tmp_path)
    for f in (path / "d").iterdir():
        f.unlink()
    with pytest.raises(DataError) as err:
        xckpt.load(path)
    assert err.value.leaf is not None and str(path) in err.value.file
    path2 = _copy(ckpts, "pytree_ocdbt_zarr3", tmp_path)
    (path2 / "manifest.ocdbt").unlink()
    with pytest.raises(DataError) as err:
        xckpt.load(path2)
    assert err.value.code == "orbax.ocdbt_missing" and err.value.file == str(path2 / "manifest.ocdbt")


def test_strings_missing_and_commit_missing(ckpts: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path = _copy(ckpts, "pytree_zarr3", tmp_path)
    (path / "commit_success.txt").unlink()
    with pytest.warns(xckpt.XckptWarning, match="commit_success.txt"):
        got = xckpt.load(path, like={"name": ""})
    assert got["name"] == "run-1"
    strings = json.loads((path / "_strings.json").read_text())
    del strings["name"]
    (path / "_strings.json").write_text(json.dumps(strings))
    with pytest.raises(DataError) as err, pytest.warns(xckpt.XckptWarning):
        xckpt.load(path)
    assert err.value.leaf == "name" and err.value.file == str(path / "_strings.json")


def test_colliding_and_unsafe_names_are_refused(ckpts: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    path = _copy(ckpts, "std_zarr2", tmp_path)
    meta = json.loads((path / "_METADATA").read_text())
    original = json.dumps(meta)
    record = {"key_metadata": [{"key": "params.w", "key_type": 2}],
              "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
    meta["tree_metadata"]["('params.w',)"] = record  # stored under the same name as params/w
    (path / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(ManifestError) as err:
        open_orbax(path)
    assert err.value.code == "manifest.path_collision" and err.value.file == str(path / "_METADATA")
    meta = json.loads(original)
    meta["tree_metadata"]["('..',)"] = {"key_metadata": [{"key": "..", "key_type": 2}],
                                        "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
    (path / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(UnsafePathError) as err2:
        open_orbax(path)
    assert err2.value.leaf == ".." and err2.value.file == str(path / "_METADATA")
