"""A damaged OCDBT database is named by the error, not the array being read.

Real Orbax writes each checkpoint (``StandardCheckpointer``, OCDBT with zarr v2, Orbax's default; and
``PyTreeCheckpointHandler`` with OCDBT and zarr v3); each test copies one and damages a file of its OCDBT
database: the root ``manifest.ocdbt`` (cut short, emptied, garbled, one byte flipped), the B-tree node the
merged database reads first (at the end of a data file under ``d/``: cut short, emptied, garbled, flipped,
deleted), the
same after the checkpoint was opened, the databases of a save whose per-process databases were never
merged, and the same checkpoint on an S3 store (a moto server). The error keeps its code; its ``file`` is
the damaged file (as the reader displays it, never TensorStore's ``/proc/self/fd`` path) and its ``leaf`` the
array being read, or None when the database fails before any array is read. Undamaged copies load exactly.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # must be set before jax is imported (tests/conftest.py may already have done it)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import logging
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xckpt
from xckpt.engine.read import ReadRequest
from xckpt.errors import XckptError
from xckpt.format.regions import Region
from xckpt.interop.orbax.checkpoint import open_orbax

logging.getLogger("absl").setLevel(logging.ERROR)

WRITERS = ("std_ocdbt", "pytree_ocdbt_zarr3")
#: The leaves of the tree stored as arrays (a scalar is a 0-d array): those an error may be reading.
ARRAY_LEAVES = {"w", "b", "nested/deep", "step"}


def _tree() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tree Orbax saves, what xckpt.load gives back for it)."""
    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(4, 2) if devs.size == 8 else devs.reshape(-1, 1), ("x", "y"))
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 32)).astype(np.float32)  # 8 KiB: stored in a data file, not inline in a node
    b = rng.integers(-50, 50, 10).astype(np.int32)
    deep = rng.standard_normal(5)
    tree = {"w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))), "b": b, "step": 7, "nested": {"deep": deep}}
    return tree, {"w": w, "b": b, "step": 7, "nested": {"deep": deep}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each writer's checkpoint, written once by Orbax: name -> path (read-only for the tests)."""
    root = tmp_path_factory.mktemp("ocdbt_errors")
    tree, _ = _tree()
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in WRITERS:
            path = root / name
            if name == "std_ocdbt":
                c = ocp.StandardCheckpointer()
                c.save(path, tree)
                c.wait_until_finished()
            else:
                handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
                ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(tree))
            assert (path / "manifest.ocdbt").is_file() and len(list((path / "d").iterdir())) == 1
            out[name] = path
    return out


@pytest.fixture(scope="module")
def want() -> dict[str, Any]:
    """What xckpt.load gives back for the saved tree."""
    return _tree()[1]


def _copy(ckpts: dict[str, Path], name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(ckpts[name], dst)
    return dst


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Element by element."""
    assert sorted(got) == sorted(want)
    np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(got["b"], want["b"])
    np.testing.assert_array_equal(got["nested"]["deep"], want["nested"]["deep"])
    assert got["step"] == want["step"]


def _node(path: Path) -> Path:
    """The root database's one data file, ending with the merged database's B-tree node (the node read first)."""
    [node] = list((path / "d").iterdir())
    return node


def _cut(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])


def _empty(file: Path) -> None:
    file.write_bytes(b"")


def _garble(file: Path) -> None:
    file.write_bytes(b"\x5a" * file.stat().st_size)


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) - 6] ^= 0xFF  # in the body (zstd-compressed, then a crc32c): never a valid encoding
    file.write_bytes(bytes(data))


DAMAGES: dict[str, Callable[[Path], None]] = {"cut": _cut, "empty": _empty, "garbled": _garble, "flipped": _flip}


def _refused(path: Path, fns: tuple[str, ...] = ("load", "inspect")) -> list[XckptError]:
    out = []
    for fn in fns:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(XckptError) as err:
                getattr(xckpt, fn)(path)
        out.append(err.value)
    return out


def _names_the_file(exc: XckptError, file: Path | str) -> None:
    """The error's file is ``file``; its message shows that path, never the one TensorStore was given."""
    assert exc.file == str(file), str(exc)
    assert str(file) in exc.message and "/proc/self/fd" not in exc.message, exc.message


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("name", WRITERS)
def test_a_damaged_root_manifest_is_named(ckpts: dict[str, Path], want: dict[str, Any], tmp_path: Path,
                                          name: str, damage: str) -> None:
    """``manifest.ocdbt`` damaged: ``array.metadata`` naming it, the leaf the first array read."""
    _same(xckpt.load(_copy(ckpts, name, tmp_path / "whole")), want)
    path = _copy(ckpts, name, tmp_path)
    DAMAGES[damage](path / "manifest.ocdbt")
    for exc in _refused(path):
        assert exc.code == "array.metadata", str(exc)
        _names_the_file(exc, path / "manifest.ocdbt")
        assert exc.leaf in ARRAY_LEAVES, str(exc)


@pytest.mark.parametrize("damage", [*DAMAGES, "deleted"])
@pytest.mark.parametrize("name", WRITERS)
def test_a_damaged_btree_node_is_named(ckpts: dict[str, Path], tmp_path: Path, name: str, damage: str) -> None:
    """The merged database's B-tree node (``d/<file>``) damaged or deleted: ``array.metadata`` naming that file."""
    path = _copy(ckpts, name, tmp_path)
    node = _node(path)
    if damage == "deleted":
        node.unlink()
    else:
        DAMAGES[damage](node)
    for exc in _refused(path):
        assert exc.code == "array.metadata", str(exc)
        _names_the_file(exc, node)
        assert exc.leaf in ARRAY_LEAVES, str(exc)


@pytest.mark.parametrize("damage,code", [("manifest", "array.metadata_mismatch"), ("node", "array.metadata_mismatch"),
                                         ("node deleted", "array.metadata_missing")])
def test_damage_after_opening_is_named_by_the_read(ckpts: dict[str, Path], tmp_path: Path, damage: str,
                                                   code: str) -> None:
    """A database damaged after the checkpoint was opened (TensorStore reads the manifest again to open each
    array): the read of ``w`` and of the scalar ``step`` fail naming the damaged file, each its own leaf."""
    path = _copy(ckpts, "std_ocdbt", tmp_path)
    ckpt = open_orbax(path)
    try:
        node = _node(path)
        damaged = path / "manifest.ocdbt" if damage == "manifest" else node
        if damage == "node deleted":
            node.unlink()
        else:
            _garble(damaged)
        w = next(e for e in ckpt.manifest.arrays() if e.key == ("w",))
        with pytest.raises(XckptError) as err:
            ckpt.read([ReadRequest(w, Region.full(w.shape), np.empty(w.shape, np.float32))])
        assert err.value.code == code and err.value.leaf == "w", str(err.value)
        _names_the_file(err.value, damaged)
        with pytest.raises(XckptError) as err:
            ckpt.values()
        assert err.value.code == code and err.value.leaf == "step", str(err.value)
        _names_the_file(err.value, damaged)
    finally:
        ckpt.close()


def _unmerged(ckpts: dict[str, Path], tmp_path: Path) -> Path:
    """A copy whose root database is removed: its per-process database (``ocdbt.process_0/``), as a save
    whose merge never ran leaves it."""
    path = _copy(ckpts, "std_ocdbt", tmp_path)
    (path / "manifest.ocdbt").unlink()
    shutil.rmtree(path / "d")
    return path


def test_a_damaged_per_process_database_is_named_before_any_leaf(ckpts: dict[str, Path], want: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    """An unmerged database: its manifest, or a data file whose B-tree node is read to list its keys, damaged:
    ``orbax.ocdbt`` naming that file, no leaf (nothing was read for an array yet)."""
    whole = _unmerged(ckpts, tmp_path / "whole")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same(xckpt.load(whole), want)
        ckpt = open_orbax(whole)
    try:
        assert ckpt.manifest.metadata["orbax"]["unmerged_ocdbt"] == ["ocdbt.process_0"]
    finally:
        ckpt.close()

    path = _unmerged(ckpts, tmp_path / "manifest")
    for damage in DAMAGES.values():
        shutil.copy(whole / "ocdbt.process_0" / "manifest.ocdbt", path / "ocdbt.process_0" / "manifest.ocdbt")
        damage(path / "ocdbt.process_0" / "manifest.ocdbt")
        for exc in _refused(path):
            assert exc.code == "orbax.ocdbt" and exc.leaf is None, str(exc)
            _names_the_file(exc, path / "ocdbt.process_0" / "manifest.ocdbt")

    named = []
    for i, data in enumerate(sorted((whole / "ocdbt.process_0" / "d").iterdir())):
        path = _unmerged(ckpts, tmp_path / f"data{i}")
        damaged = path / "ocdbt.process_0" / "d" / data.name
        _garble(damaged)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                xckpt.inspect(path)
            except XckptError as exc:
                assert exc.code == "orbax.ocdbt" and exc.leaf is None, str(exc)
                _names_the_file(exc, damaged)
                named.append(data.name)
    assert named, "no data file holds a B-tree node the listing reads"


@pytest.mark.parametrize("damage", ["manifest", "node"])
def test_on_an_object_store_the_damaged_object_is_named(ckpts: dict[str, Path], moto: Any, damage: str) -> None:
    """The same checkpoint uploaded to S3: the error names the damaged object by its URL."""
    bucket = f"ocdbt-errors-{os.getpid()}-{damage}"
    moto.client.create_bucket(Bucket=bucket)
    local = ckpts["std_ocdbt"]
    rel = "manifest.ocdbt" if damage == "manifest" else f"d/{_node(local).name}"
    for f in local.rglob("*"):
        if f.is_file():
            key = str(f.relative_to(local))
            body = f.read_bytes()
            moto.client.put_object(Bucket=bucket, Key=f"ck/{key}", Body=body[:len(body) // 2] if key == rel else body)
    url = f"s3://{bucket}/ck"
    for exc in _refused(url):  # type: ignore[arg-type]
        assert exc.code == "array.metadata" and exc.leaf in ARRAY_LEAVES, str(exc)
        _names_the_file(exc, f"{url}/{rel}")
