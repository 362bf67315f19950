"""Keys holding ``/`` (Haiku's module names, ``mlp/~/linear_0``): stored in nested directories as Orbax
stores them (format 1.3), read back by xckpt, plain Orbax, zarr-python and the validator; every way two
names could share a place, or a name could leave its directory, is refused.

Real Orbax restores what xckpt writes and writes what xckpt converts; values are compared element by element.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xckpt
from xckpt.errors import TreeError, XckptError
from xckpt.format import names
from xckpt.format.tree import key_str

from test_orbax_read import assert_same


def _haiku_tree() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "mlp/~/linear_0": {"w": rng.standard_normal((6, 4)).astype(np.float32), "b": np.arange(4, dtype=np.float32)},
        "mlp/~/linear_1": {"w": rng.integers(-9, 9, (4, 2)).astype(np.int8), "b": np.zeros(2, np.float32)},
        "opt/count": 3,
        "opt/lr": 0.25,
        "run/name": "exp-1",
        "plain": {"s": "y", "v": np.arange(3, dtype=np.int64)},
    }


def _orbax_restore(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ocp.PyTreeCheckpointer().restore(path)


def _plain(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (jax.Array, np.ndarray)):
        return np.asarray(tree)
    return tree


def test_a_haiku_tree_saves_nested_and_every_reader_gets_it_back(tmp_path: Path) -> None:
    tree = _haiku_tree()
    path = tmp_path / "ckpt"
    xckpt.save(tree, path)
    manifest = json.loads((path / "xckpt.json").read_text())
    assert manifest["version"] == "1.3"
    assert [e["path"] for e in manifest["leaves"] if e.get("kind", "array") == "array" and "path" in e][:2] == \
        ["mlp/~/linear_0.w", "mlp/~/linear_0.b"]
    assert (path / "mlp" / "~" / "linear_0.w" / "zarr.json").is_file()
    assert json.loads((path / "_strings.json").read_text()) == {"run": {"name": "exp-1"}, "plain.s": "y"}
    assert_same(xckpt.load(path), tree)
    # plain Orbax restores it without conversion, as it restores its own Haiku checkpoints, through v0 and v1
    assert_same(_plain(_orbax_restore(path)), _plain(tree))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same(_plain(ocp.v1.load(path)), _plain(tree))
    # zarr-python opens the nested array where the manifest says
    zarr = pytest.importorskip("zarr")
    np.testing.assert_array_equal(zarr.open_array(str(path / "mlp" / "~" / "linear_1.w"), mode="r")[...],
                                  tree["mlp/~/linear_1"]["w"])
    report = xckpt.validate(path, deep=True)
    assert report.findings == [], report.findings
    part = xckpt.load(path, like={"mlp/~/linear_0": {"w": xckpt.ReadSpec(region=(slice(1, 5), slice(2, 4)))}},
                      partial=True)
    np.testing.assert_array_equal(part["mlp/~/linear_0"]["w"], tree["mlp/~/linear_0"]["w"][1:5, 2:4])


def test_a_tree_without_a_slash_still_says_1_2(tmp_path: Path) -> None:
    """A 1.2 reader reads every checkpoint it can: only a nested path makes the version 1.3."""
    xckpt.save({"a": {"b": np.arange(3)}, "s": "x"}, tmp_path / "c")
    assert json.loads((tmp_path / "c" / "xckpt.json").read_text())["version"] == "1.2"


def test_sharded_jax_haiku_params_round_trip_and_orbax_restores_them_sharded(tmp_path: Path) -> None:
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    sharding = NamedSharding(mesh, P("x", None))
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    tree = {"encoder/~/mlp": {"w": jax.device_put(jnp.asarray(w), sharding), "b": jnp.ones(8, jnp.bfloat16)}}
    path = tmp_path / "ckpt"
    xckpt.save(tree, path)
    target = {"encoder/~/mlp": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                                          sharding=NamedSharding(mesh, P(None, "x"))),
                                "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16,
                                                          sharding=NamedSharding(mesh, P()))}}
    got = xckpt.load(path, like=target)
    assert got["encoder/~/mlp"]["w"].sharding == target["encoder/~/mlp"]["w"].sharding
    np.testing.assert_array_equal(np.asarray(got["encoder/~/mlp"]["w"]), w)
    np.testing.assert_array_equal(np.asarray(got["encoder/~/mlp"]["b"]), np.ones(8, jnp.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restored = ocp.StandardCheckpointer().restore(path, target)
    assert restored["encoder/~/mlp"]["w"].sharding == target["encoder/~/mlp"]["w"].sharding
    np.testing.assert_array_equal(np.asarray(restored["encoder/~/mlp"]["w"]), w)


@pytest.mark.parametrize("ocdbt", [False, True])
def test_an_orbax_haiku_checkpoint_converts_to_xckpt(tmp_path: Path, ocdbt: bool) -> None:
    """Before: ``tree.invalid`` ("key component 'mlp/~/linear_0' contains a path separator")."""
    tree = {"mlp/~/linear_0": {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones(4)},
            "step": 5}
    src = tmp_path / "orbax"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)).save(src, args=ocp.args.PyTreeSave(tree))
    want = _plain(_orbax_restore(src))
    xckpt.convert.convert(str(src), str(tmp_path / "x"), source="orbax")
    assert_same(xckpt.load(tmp_path / "x"), want)
    assert xckpt.validate(tmp_path / "x", deep=True).findings == []


@pytest.mark.parametrize("tree,words", [
    ({"a": np.ones(1), "a/b": np.ones(1)}, "one inside the other's directory, at 'a/b'"),
    ({"a/c/0": np.ones(1), "a": np.ones(1)}, "one inside the other's directory, at 'a'"),
    ({"a/b": np.ones(1), "a": {"b/c": np.ones(1)}}, None),  # a/b and a.b/c: apart
    ({"a/b": np.ones(1), "a/b.x": "s", "a": {"b": 1}}, None),  # a/b, a/b.x, a.b: apart
    ({"run": "s", "run/name": "t"}, "one inside the other's directory, at 'run/name'"),
    ({"a/b": {"c": np.ones(1)}, "a/b.c": np.ones(1)}, "would both be stored as 'a/b.c'"),
])
def test_names_sharing_a_place_are_refused_before_anything_is_written(tmp_path: Path, tree: Any,
                                                                      words: str | None) -> None:
    if words is None:
        xckpt.save(tree, tmp_path / "c")
        assert_same(xckpt.load(tmp_path / "c"), _plain(tree))
        return
    with pytest.raises(TreeError, match=words) as info:
        xckpt.save(tree, tmp_path / "c")
    assert info.value.code == "tree.name_collision"
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("key", ["/a", "a/", "a//b", "a/./b", "a/../b", "..", "a/.hidden", "_METADATA/x",
                                 "xckpt.json/w", ".orbax_marker/x", "a\\b", "a:b/c", "x" * 256 + "/y",
                                 "/".join(["p" * 200] * 6)])
def test_a_key_whose_name_cannot_nest_safely_is_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(TreeError) as info:
        xckpt.save({key: np.ones(2)}, tmp_path / "c")
    assert info.value.code == "tree.invalid" and info.value.leaf == key_str((key,))
    assert not os.path.exists(tmp_path / "c")


def test_nesting_finds_every_clash_and_only_clashes() -> None:
    pairs = [("a/b", ("k1",)), ("a.b", ("k2",)), ("c/d/e", ("k3",)), ("c/d2", ("k4",))]
    assert names.nesting(pairs) is None
    assert names.nesting(pairs + [("c/d", ("k5",))]) == (("k3",), ("k5",), "c/d")
    assert names.nesting(pairs + [("c/d/e/f", ("k5",))]) == (("k3",), ("k5",), "c/d/e/f")
    assert names.nesting(pairs + [("a.b", ("k5",))]) == (("k2",), ("k5",), "a.b")
    assert list(names.parents("a/b/c")) == ["a", "a/b"] and list(names.parents("abc")) == []


def _edit(path: Path, fn: Any) -> None:
    m = json.loads((path / "xckpt.json").read_text())
    fn(m)
    (path / "xckpt.json").write_text(json.dumps(m))


def _refused(path: Path, code: str, leaf: str | None) -> None:
    with pytest.raises(XckptError) as info:
        xckpt.load(path)
    assert (info.value.code, info.value.leaf) == (code, leaf), str(info.value)
    assert info.value.file == str(path / "xckpt.json")


def test_a_reader_refuses_nested_paths_it_must_not_trust(tmp_path: Path) -> None:
    src = tmp_path / "src"
    xckpt.save({"m/~/l": {"w": np.arange(4, dtype=np.int32)}, "v": np.arange(3, dtype=np.int32)}, src)

    def case(name: str, fn: Any, code: str, leaf: str | None) -> None:
        p = tmp_path / name
        shutil.copytree(src, p)
        _edit(p, fn)
        _refused(p, code, leaf)
        assert any(f.code == code for f in xckpt.validate(p).findings)

    def leaf(m: dict[str, Any], i: int) -> dict[str, Any]:
        return m["leaves"][i]

    # a nested path in a manifest of a version before 1.3
    case("v12", lambda m: m.update(version="1.2"), "path.unsafe", key_str(("m/~/l", "w")))
    # a path that leaves the checkpoint, or lies in a reserved name
    case("dotdot", lambda m: leaf(m, 0).update(path="m/../../w"), "path.unsafe", key_str(("m/~/l", "w")))
    case("reserved", lambda m: leaf(m, 0).update(path="_METADATA/w"), "path.unsafe", key_str(("m/~/l", "w")))
    # one leaf's path inside the other's directory: its chunks would be the other's files
    case("inside", lambda m: leaf(m, 1).update(path="m/~/l.w/c"), "manifest.path_collision", key_str(("v",)))


def test_a_linked_directory_on_a_nested_path_is_never_read_through(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    tree = {"mlp/~/linear_0": {"w": np.arange(6, dtype=np.float32)}}
    xckpt.save(tree, path)
    shutil.copytree(path / "mlp", tmp_path / "elsewhere")
    shutil.rmtree(path / "mlp")
    os.symlink(tmp_path / "elsewhere", path / "mlp")
    with pytest.raises(XckptError) as info:
        xckpt.load(path)
    assert info.value.code == "path.link" and info.value.leaf == key_str(("mlp/~/linear_0", "w")), str(info.value)
    assert [f.code for f in xckpt.validate(path).findings if f.severity == "error"] == ["path.link"]


def test_validator_names_the_leaf_of_a_nested_file_and_warns_about_strays(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    xckpt.save(_haiku_tree(), path)
    (path / "mlp" / "stray").mkdir()
    (path / "mlp" / "~" / "notes.txt").write_text("x")
    os.symlink("/etc/hostname", path / "mlp" / "~" / "linear_0.w" / "c" / "link")
    findings = xckpt.validate(path).findings
    got = sorted((f.code, f.file, f.leaf) for f in findings)
    assert ("path.link", str(path / "mlp/~/linear_0.w/c/link"), key_str(("mlp/~/linear_0", "w"))) in got
    assert ("path.unexpected", str(path / "mlp/stray"), None) in got
    assert ("path.unexpected", str(path / "mlp/~/notes.txt"), None) in got
    assert all(f.leaf == key_str(("mlp/~/linear_0", "w")) for f in findings if f.severity == "error"), findings


def test_a_manager_keeps_steps_of_a_haiku_tree(tmp_path: Path) -> None:
    tree = _haiku_tree()
    with xckpt.CheckpointManager(tmp_path / "run", max_to_keep=1, save_interval_steps=1) as mgr:
        mgr.save(1, tree)
        mgr.save(2, dict(tree, **{"opt/count": 4}))
        mgr.wait()
        assert [s.step for s in mgr.all_steps()] == [2]
        got = mgr.restore()
    assert_same(got, _plain(dict(tree, **{"opt/count": 4})))


def test_nested_names_on_an_object_store(moto: Any) -> None:
    """On S3 the nested name is the object's key: ``<prefix>/mlp/~/linear_0.w/zarr.json``."""
    pytest.importorskip("boto3")
    bucket = "nested-names"
    moto.client.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/run/step_1"
    tree = _haiku_tree()
    xckpt.save(tree, url)
    keys = {o["Key"] for o in moto.client.list_objects_v2(Bucket=bucket, Prefix="run/step_1/")["Contents"]}
    assert "run/step_1/mlp/~/linear_0.w/zarr.json" in keys
    assert_same(xckpt.load(url), tree)
    report = xckpt.validate(url, deep=True)
    assert report.ok, [str(f) for f in report.findings]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["a", "b", "a.b", "c"]), min_size=1, max_size=3).map("/".join),
                max_size=8))
def test_nesting_agrees_with_the_pairwise_rule(stored: list[str]) -> None:
    """``nesting`` finds a clash exactly when two names are equal or one is a directory above the other."""
    def clash(x: str, y: str) -> bool:
        return x == y or y.startswith(x + "/") or x.startswith(y + "/")

    pairs = [(name, (i,)) for i, name in enumerate(stored)]
    found = names.nesting(pairs)
    want = next(((i, j) for j in range(len(stored)) for i in range(j) if clash(stored[i], stored[j])), None)
    if want is None:
        assert found is None
    else:
        assert found is not None
        (i,), (j,), name = found
        assert j == want[1] and clash(stored[i], stored[j]) and i < j and name == stored[j]


def test_a_dead_object_store_saves_nested_objects_are_its_own() -> None:
    """What the cleanup of a dead save's claimed prefix deletes: the objects a save writes, nested names' too;
    never a checkpoint committed inside the prefix, nor objects others put there."""
    from xckpt.engine import claims

    keys = ["mlp/~/linear_0.w/zarr.json", "mlp/~/linear_0.w/c/0", "mlp/~/linear_0.w/c/0/1", "opt/count/c",
            "w/zarr.json", "w/0/c/0", "_METADATA", ".orbax_marker/.zarray", claims.CLAIM,
            "notes/readme.txt", "mlp/.hidden/zarr.json", "mlp/~/x.w/data.bin",
            "inner/xckpt.json", "inner/w/zarr.json", "inner/w/c/0"]
    assert claims._own_objects(keys) == ["mlp/~/linear_0.w/zarr.json", "mlp/~/linear_0.w/c/0",
                                         "mlp/~/linear_0.w/c/0/1", "opt/count/c", "w/zarr.json", "w/0/c/0",
                                         "_METADATA", ".orbax_marker/.zarray"]


def test_a_safetensors_file_with_slash_names_converts_and_exports_back(tmp_path: Path) -> None:
    """Tensor names holding '/' (as TensorFlow-style exporters write them) convert to xckpt (before:
    ``tree.invalid``) and export back to a file the real ``safetensors`` library reads with the same names."""
    from safetensors.numpy import load_file, save_file

    tensors = {"encoder/layer_0/kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
               "encoder/layer_0/bias": np.ones(3, np.float16), "encoder.scale": np.array([0.5], np.float32)}
    (tmp_path / "in").mkdir()
    save_file(tensors, str(tmp_path / "in" / "model.safetensors"))
    xckpt.convert.convert(str(tmp_path / "in"), str(tmp_path / "x"), source="safetensors")
    assert (tmp_path / "x" / "encoder" / "layer_0" / "kernel" / "zarr.json").is_file()
    assert_same(xckpt.load(tmp_path / "x"), tensors)
    assert xckpt.validate(tmp_path / "x", deep=True).findings == []
    xckpt.convert.convert(str(tmp_path / "x"), str(tmp_path / "out"), target="safetensors")
    assert_same(load_file(str(tmp_path / "out" / "model.safetensors")), tensors)
