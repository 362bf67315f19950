"""Orbax checkpoints that try to make the reader leave them: links and FIFOs in place of their files.

Real Orbax writes each checkpoint once per module (zarr v2 and v3, with and without OCDBT);
each test copies one, puts a symbolic link (to an outside copy) or a FIFO where one of its
files or directories was, and checks that xckpt refuses it with ``path.link`` or
``path.special`` before anything is read: the outside copy's access time stays where the test
set it (``/tmp`` honours relatime: a read would move it). A checkpoint reached through a
linked root or a linked parent directory still loads exactly. A hostile ``_METADATA`` (JSON nested
too deeply to parse, a key longer than a tree may be deep) is refused with ``orbax.invalid`` or
``orbax.tree``, never a ``RecursionError``.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # must be set before jax is imported (tests/conftest.py may already have done it)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import base64
import json
import logging
import shutil
import threading
import warnings
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xckpt
from xckpt.engine.read import ReadRequest
from xckpt.engine.storage import LocalStore
from xckpt.errors import UnsafePathError, XckptError
from xckpt.format.regions import Region
from xckpt.interop.orbax.checkpoint import open_orbax
from xckpt.interop.orbax.files import check_tree

from opened import Opened, probe
from test_orbax_read import assert_same

logging.getLogger("absl").setLevel(logging.ERROR)

#: name -> (use_ocdbt, use_zarr3)
WRITERS = {"zarr2": (False, False), "zarr3": (False, True), "ocdbt_zarr3": (True, True), "ocdbt_zarr2": (True, False)}


def _tree(scale: float = 1.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tree Orbax saves, what xckpt.load gives back for it)."""
    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(4, 2) if devs.size == 8 else devs.reshape(-1, 1), ("x", "y"))
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, 8)) * scale).astype(np.float32)
    b = rng.integers(-50, 50, 6).astype(np.int32)
    deep = rng.standard_normal(5)
    tree = {"w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))), "b": b, "step": 7, "name": "run-1",
            "nested": {"deep": deep}}
    return tree, {"w": w, "b": b, "step": 7, "name": "run-1", "nested": {"deep": deep}}


def _save(path: Path, tree: dict[str, Any], ocdbt: bool, zarr3: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
        ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(tree))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every layout's checkpoint, written once by Orbax: name -> path (read-only for the tests)."""
    root = tmp_path_factory.mktemp("orbax_hostile")
    tree, _ = _tree()
    out = {}
    for name, (ocdbt, zarr3) in WRITERS.items():
        _save(root / name, tree, ocdbt, zarr3)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def want() -> dict[str, Any]:
    return _tree()[1]


@pytest.fixture(scope="module")
def watch_works(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The inotify watch of :mod:`opened` sees a read here."""
    probe(tmp_path_factory.mktemp("probe"))


def _copy(ckpts: dict[str, Path], name: str, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpts[name], dst)
    return dst


def _pick(path: Path, what: str) -> str:
    """The relative path of the file or directory ``what`` names in the checkpoint at ``path``."""
    if what == "chunk":  # a data file of the array w (zarr v2: w/0.0, zarr v3: w/c/0/0)
        files = sorted(p for p in (path / "w").rglob("*") if p.is_file() and not p.name.startswith((".z", "zarr")))
        return str(files[0].relative_to(path))
    if what.endswith("/*"):  # the first file of a directory
        return str(min((path / what[:-2]).iterdir()).relative_to(path))
    if what == "ocdbt.process_*":
        return next(p.name for p in sorted(path.iterdir()) if p.name.startswith("ocdbt.process_"))
    assert (path / what).exists() or (path / what).is_symlink(), what
    return what


def _raises(fn: Callable[[], Any], timeout: float = 60.0) -> BaseException | None:
    """Run ``fn`` in a thread; the exception it raised (None when it returned). Fails if it hangs."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back
            box[0] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"blocked for {timeout}s (on a FIFO?)"
    return box[0]


LINKED = [
    ("zarr2", "chunk"), ("zarr2", "w"), ("zarr2", "w/.zarray"), ("zarr2", "_METADATA"), ("zarr2", "_strings.json"),
    ("zarr2", "step/0"),
    ("zarr3", "chunk"), ("zarr3", "w"), ("zarr3", "w/c"), ("zarr3", "w/zarr.json"), ("zarr3", "step/c"),
    ("zarr3", "_strings.json"), ("zarr3", "_CHECKPOINT_METADATA"), ("zarr3", "commit_success.txt"),
    ("ocdbt_zarr3", "manifest.ocdbt"), ("ocdbt_zarr3", "d/*"), ("ocdbt_zarr3", "d"),
    ("ocdbt_zarr3", "ocdbt.process_*"), ("ocdbt_zarr3", "ocdbt.process_0/d/*"),
    ("ocdbt_zarr3", "ocdbt.process_0/manifest.ocdbt"), ("ocdbt_zarr3", "_METADATA"),
    ("ocdbt_zarr3", "_strings.json"),
    ("ocdbt_zarr2", "manifest.ocdbt"), ("ocdbt_zarr2", "ocdbt.process_0/d/*"),
]


@pytest.mark.parametrize("name,what", LINKED)
def test_link_to_an_outside_copy_is_refused_unread(ckpts: dict[str, Path], name: str, what: str, tmp_path: Path,
                                                   watch_works: None) -> None:
    path = _copy(ckpts, name, tmp_path)
    rel = _pick(path, what)
    outside = tmp_path / "outside" / Path(rel).name
    outside.parent.mkdir()
    shutil.move(str(path / rel), outside)
    os.symlink(outside, path / rel)
    with Opened(outside) as seen:
        for fn in (lambda: xckpt.load(path), lambda: xckpt.inspect(path), lambda: open_orbax(path)):
            with pytest.raises(XckptError) as err:
                fn()
            assert err.value.code == "path.link", str(err.value)
            assert err.value.file == str(path / rel), str(err.value)
            if name.startswith("zarr") and rel.split("/")[0] in ("w", "step"):
                assert err.value.leaf == rel.split("/")[0]
        assert seen.paths() == [], "read through a link"
        report = xckpt.validate(path, deep=True)  # the validator reads xckpt checkpoints; it refuses this one
        assert not report.ok
        assert seen.paths() == [], "the validator read through a link"


@pytest.mark.parametrize("name,what", [("zarr3", "chunk"), ("zarr2", "w")])
def test_dangling_and_inside_links_are_refused(ckpts: dict[str, Path], name: str, what: str, tmp_path: Path) -> None:
    path = _copy(ckpts, name, tmp_path)
    rel = _pick(path, what)
    kept = tmp_path / "kept"
    shutil.move(str(path / rel), kept)
    os.symlink(tmp_path / "nowhere", path / rel)  # dangling
    with pytest.raises(UnsafePathError) as err:
        xckpt.load(path)
    assert err.value.code == "path.link" and err.value.file == str(path / rel)
    os.unlink(path / rel)
    # a link to the same content inside the checkpoint is refused as well: a checkpoint holds no links
    shutil.move(str(kept), path / "elsewhere")
    os.symlink("../" * rel.count("/") + "elsewhere", path / rel)
    with pytest.raises(UnsafePathError) as err:
        xckpt.load(path)
    assert err.value.code == "path.link"


FIFOS = [("zarr2", "chunk"), ("zarr3", "chunk"), ("zarr3", "step/c"), ("zarr3", "_strings.json"),
         ("zarr2", "w/.zarray"), ("ocdbt_zarr3", "d/*"), ("ocdbt_zarr3", "ocdbt.process_0/d/*"),
         ("ocdbt_zarr3", "manifest.ocdbt"), ("ocdbt_zarr2", "ocdbt.process_0/d/*")]


@pytest.mark.parametrize("name,what", FIFOS)
def test_fifo_is_refused_without_blocking(ckpts: dict[str, Path], name: str, what: str, tmp_path: Path) -> None:
    path = _copy(ckpts, name, tmp_path)
    rel = _pick(path, what)
    os.unlink(path / rel)
    os.mkfifo(path / rel)
    try:
        for fn in (lambda: xckpt.load(path), lambda: xckpt.inspect(path)):
            exc = _raises(fn)
            assert isinstance(exc, XckptError), repr(exc)
            assert exc.code == "path.special" and exc.file == str(path / rel), str(exc)
    finally:  # should a reader be blocked in open(), a writer that comes and goes lets it go
        try:
            os.close(os.open(path / rel, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_socket_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    import socket

    path = _copy(ckpts, "ocdbt_zarr3", tmp_path)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path / "d" / "sock"))
        exc = _raises(lambda: xckpt.load(path))
    assert isinstance(exc, UnsafePathError) and exc.code == "path.special" and exc.file == str(path / "d" / "sock")


@pytest.mark.parametrize("name", list(WRITERS))
def test_linked_root_and_linked_parent_still_load(ckpts: dict[str, Path], name: str, want: dict[str, Any],
                                                   tmp_path: Path) -> None:
    root = tmp_path / "root"
    os.symlink(ckpts[name], root)
    assert_same(xckpt.load(root), want)
    assert xckpt.inspect(root)["format"] == "orbax"
    parent = tmp_path / "parent"
    os.symlink(ckpts[name].parent, parent)
    assert_same(xckpt.load(parent / name), want)
    assert_same(xckpt.load(ckpts[name]), want)


@pytest.mark.parametrize("name", ["zarr3", "ocdbt_zarr3"])
def test_a_checkpoint_replaced_after_opening_is_not_mixed_in(ckpts: dict[str, Path], name: str,
                                                             want: dict[str, Any], tmp_path: Path) -> None:
    path = _copy(ckpts, name, tmp_path)
    other_tree, other = _tree(scale=-3.0)
    _save(tmp_path / "other", other_tree, *WRITERS[name])
    ckpt = open_orbax(path)
    try:
        os.rename(path, tmp_path / "old")
        os.rename(tmp_path / "other", path)
        w = next(e for e in ckpt.manifest.arrays() if e.key == ("w",))
        out = np.empty((8, 8), np.float32)
        ckpt.read([ReadRequest(w, Region.full((8, 8)), out)])
        np.testing.assert_array_equal(out, want["w"])
        assert ckpt.values()[next(i for i, e in enumerate(ckpt.manifest.leaves) if e.key == ("step",))] == 7
    finally:
        ckpt.close()
    np.testing.assert_array_equal(xckpt.load(path)["w"], other["w"])


def test_check_tree_counts_files_and_names_the_leaf(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(ckpts, "zarr2", tmp_path)
    n = sum(1 for p in path.rglob("*") if p.is_file())
    store = LocalStore(str(path))
    try:
        assert check_tree(store) == n
        os.symlink("0.0", path / "w" / "9.9")
        with pytest.raises(UnsafePathError) as err:
            check_tree(store, {"w": "params/w"})
    finally:
        store.close()
    assert err.value.code == "path.link" and err.value.file == f"{path}/w/9.9" and err.value.leaf == "params/w"


# -- a hostile _METADATA ----------------------------------------------------------------------------


def _edit_metadata(ckpts: dict[str, Path], tmp_path: Path, edit: Callable[[dict[str, Any]], str]) -> Path:
    """A copy of the zarr3 checkpoint whose ``_METADATA`` is ``edit(the parsed document)``."""
    path = _copy(ckpts, "zarr3", tmp_path)
    meta = json.loads((path / "_METADATA").read_text())
    (path / "_METADATA").write_text(edit(meta))
    return path


def _long_key(n: int, value_type: str = "scalar") -> Callable[[dict[str, Any]], str]:
    """An edit adding a record whose key_metadata has ``n`` parts (``k/k/.../k``)."""
    def edit(meta: dict[str, Any]) -> str:
        meta["tree_metadata"]["('deep',)"] = {"key_metadata": [{"key": "k", "key_type": 2}] * n,
                                              "value_metadata": {"value_type": value_type, "skip_deserialize": True}}
        return json.dumps(meta)
    return edit


def _refused(path: Path, code: str) -> list[XckptError]:
    """load and inspect both refuse ``path`` with ``code``, naming its _METADATA; validate reports, never raises."""
    errors = []
    for fn in (lambda: xckpt.load(path), lambda: xckpt.inspect(path)):
        exc = _raises(fn)
        assert isinstance(exc, XckptError), repr(exc)
        assert exc.code == code and exc.file == str(path / "_METADATA"), str(exc)
        errors.append(exc)
    assert not xckpt.validate(path).ok
    return errors


@pytest.mark.parametrize("where", ["top", "record"])
def test_metadata_nested_too_deeply_to_parse_is_invalid(ckpts: dict[str, Path], tmp_path: Path, where: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000

    def edit(meta: dict[str, Any]) -> str:
        text = json.dumps(meta)
        if where == "top":
            return text[:-1] + f', "x": {deep}}}'
        return text.replace('"value_metadata": {', f'"value_metadata": {{"x": {deep}, ', 1)

    for exc in _refused(_edit_metadata(ckpts, tmp_path, edit), "orbax.invalid"):
        assert "too deeply" in str(exc)


def test_metadata_with_a_huge_number_or_a_deep_tuple_key_is_invalid(ckpts: dict[str, Path], tmp_path: Path) -> None:
    _refused(_edit_metadata(ckpts, tmp_path, lambda meta: json.dumps(meta)[:-1] + ', "x": ' + "1" * 5000 + "}"),
             "orbax.invalid")
    shutil.rmtree(tmp_path / "ckpt")

    def old_key(meta: dict[str, Any]) -> str:  # no key_metadata: the record key is parsed as a Python tuple
        meta["tree_metadata"]["-" * 100_000 + "1"] = {"value_metadata": {"value_type": "None"}}
        return json.dumps(meta)

    _refused(_edit_metadata(ckpts, tmp_path, old_key), "orbax.invalid")


@pytest.mark.parametrize("parts", [65, 1000, 100_000])
def test_key_deeper_than_a_tree_may_be_is_refused(ckpts: dict[str, Path], tmp_path: Path, parts: int) -> None:
    for exc in _refused(_edit_metadata(ckpts, tmp_path, _long_key(parts)), "orbax.tree"):
        assert exc.leaf == "/".join(["k"] * 64) + "/..."
        assert f"key of {parts} parts" in str(exc)


def test_key_as_deep_as_a_tree_may_be_loads(ckpts: dict[str, Path], want: dict[str, Any], tmp_path: Path) -> None:
    path = _edit_metadata(ckpts, tmp_path, _long_key(64, "None"))
    got = xckpt.load(path)
    node = got.pop("k")
    for _ in range(63):  # k/k/.../k: 64 parts
        node = node["k"]
    assert node is None
    assert_same(got, want)
    assert xckpt.inspect(path)["format"] == "orbax"


# -- every other JSON file of an Orbax checkpoint, and what its array metadata declares -------------------------

#: Documents Python's ``json`` cannot parse, or parses into a string nothing can print or store.
BAD_JSON = {"deep": "[" * 100_000 + "]" * 100_000, "huge_number": '{"shape": [' + "1" * 5000 + "]}",
            "lone_surrogate": '{"\\ud800": 1}'}


def _array_meta_file(name: str) -> str:
    return "w/.zarray" if name == "zarr2" else "w/zarr.json"


def _leaf(report: dict[str, Any], key: str) -> dict[str, Any]:
    """The leaf ``key`` of an :func:`xckpt.inspect` report."""
    return next(leaf for leaf in report["leaves"] if leaf["key"] == key)


@pytest.mark.parametrize("bad", list(BAD_JSON))
@pytest.mark.parametrize("name,rel,code", [("zarr2", "w/.zarray", "array.metadata_json"),
                                           ("zarr3", "w/zarr.json", "array.metadata_json"),
                                           ("zarr3", "_strings.json", "orbax.strings_invalid")])
def test_a_json_file_that_cannot_be_read_is_a_specific_error(ckpts: dict[str, Path], tmp_path: Path, name: str,
                                                             rel: str, code: str, bad: str) -> None:
    path = _copy(ckpts, name, tmp_path)
    (path / rel).write_text(BAD_JSON[bad])
    readers = [lambda: xckpt.load(path)] + ([lambda: xckpt.inspect(path)] if rel.startswith("w/") else [])
    for fn in readers:  # inspect reads no value, so no _strings.json
        exc = _raises(fn)
        assert isinstance(exc, XckptError), repr(exc)
        assert exc.code == code and exc.file == str(path / rel), str(exc)
        assert exc.leaf == ("w" if rel.startswith("w/") else None), str(exc)
    str(exc)  # printable: no lone surrogate in the message


@pytest.mark.parametrize("bad", list(BAD_JSON))
def test_a_sharding_file_that_cannot_be_read_is_left_out(ckpts: dict[str, Path], want: dict[str, Any],
                                                         tmp_path: Path, bad: str) -> None:
    path = _copy(ckpts, "zarr2", tmp_path)
    record = json.dumps({"sharding_type": "NamedSharding", "shape": BAD_JSON[bad]})
    for text in (BAD_JSON[bad], json.dumps({base64.urlsafe_b64encode(b"w").decode(): record}),
                 json.dumps({base64.urlsafe_b64encode(b"w").decode(): BAD_JSON[bad]})):
        (path / "_sharding").write_text(text)
        assert_same(xckpt.load(path), want)
        assert "mesh_shape" not in (_leaf(xckpt.inspect(path), "w")["sharding"] or {})


def test_a_malformed_sharding_record_records_no_mesh(ckpts: dict[str, Path], want: dict[str, Any],
                                                     tmp_path: Path) -> None:
    path = _copy(ckpts, "zarr2", tmp_path)
    saved = json.loads((path / "_sharding").read_text())
    key = base64.urlsafe_b64encode(b"w").decode()
    good = json.loads(saved[key])
    for edit in ({"shape": "abcd"}, {"shape": [4, True]}, {"axis_names": ["x"]}, {"axis_names": {"x": 1}},
                 {"partition_spec": [[1, 2]]}, {"partition_spec": ["z"]}, {"partition_spec": "x"}):
        (path / "_sharding").write_text(json.dumps(dict(saved, **{key: json.dumps(dict(good, **edit))})))
        assert_same(xckpt.load(path), want)
        src = open_orbax(path)
        try:
            w = next(e for e in src.manifest.arrays() if e.key == ("w",))
            assert "mesh_shape" not in (w.sharding or {}), (edit, w.sharding)
        finally:
            src.close()
    (path / "_sharding").write_text(json.dumps(saved))  # the record as Orbax wrote it is read
    src = open_orbax(path)
    try:
        w = next(e for e in src.manifest.arrays() if e.key == ("w",))
        assert w.sharding is not None and w.sharding["mesh_shape"] == [4, 2] and w.sharding["axis_names"] == ["x", "y"]
        assert w.sharding["dim_axes"] == [["x"], ["y"]]
    finally:
        src.close()


def test_a_record_key_with_a_lone_surrogate_is_invalid(ckpts: dict[str, Path], tmp_path: Path) -> None:
    def surrogate_key(meta: dict[str, Any]) -> str:
        rec = meta["tree_metadata"].pop("('b',)")
        rec["key_metadata"] = [{"key": "\ud800", "key_type": 2}]
        meta["tree_metadata"]["('\\ud800',)"] = rec
        return json.dumps(meta)

    for exc in _refused(_edit_metadata(ckpts, tmp_path, surrogate_key), "orbax.invalid"):
        assert "surrogate" in str(exc)
    shutil.rmtree(tmp_path / "ckpt")

    def old_key(meta: dict[str, Any]) -> str:  # no key_metadata: the record key is parsed as a Python tuple
        meta["tree_metadata"]["('\\ud800',)"] = {"value_metadata": {"value_type": "None"}}
        return json.dumps(meta)

    for exc in _refused(_edit_metadata(ckpts, tmp_path, old_key), "orbax.invalid"):
        assert "surrogate" in str(exc)


@pytest.mark.parametrize("name", ["zarr2", "ocdbt_zarr2", "ocdbt_zarr3"])
def test_array_metadata_above_its_bound_is_refused_unread(ckpts: dict[str, Path], tmp_path: Path, name: str) -> None:
    """A zarr metadata file larger than the 1 MiB a reader takes whole (as xckpt's own zarr.json) is
    ``resource.too_large``, in a plain directory and inside OCDBT alike; one just under the bound still loads."""
    import tensorstore as ts

    from xckpt.format.zarr import MAX_METADATA_BYTES

    path = _copy(ckpts, name, tmp_path)
    rel = ".zarray" if name.endswith("zarr2") else "zarr.json"
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"} if name.startswith("ocdbt")
                         else f"file://{path}/").result()
    text = kv.read(f"w/{rel}").result().value.decode()
    for size, code in ((MAX_METADATA_BYTES, None), (MAX_METADATA_BYTES + 1, "resource.too_large"),
                       (8 * MAX_METADATA_BYTES, "resource.too_large")):
        kv.write(f"w/{rel}", (text[:-1] + " " * (size - len(text)) + "}").encode()).result()
        exc = _raises(lambda: xckpt.load(path))
        if code is None:
            assert exc is None, repr(exc)
            continue
        assert isinstance(exc, XckptError) and exc.code == code, repr(exc)
        assert exc.leaf == "w" and exc.file.startswith(str(path / "w" / rel)), str(exc)


@pytest.mark.parametrize("name", ["zarr2", "zarr3"])
def test_a_chunk_larger_than_memory_is_refused_not_decoded(ckpts: dict[str, Path], tmp_path: Path,
                                                           name: str) -> None:
    """TensorStore decodes a whole chunk to read any part of it and aborts the process when it cannot allocate
    one: a chunk declared larger than the machine's memory is ``resource.too_large`` (the load runs in a child
    process, which such an abort would kill)."""
    import subprocess
    import sys

    path = _copy(ckpts, name, tmp_path)
    rel = _array_meta_file(name)
    meta = json.loads((path / rel).read_text())
    huge = [2**40, 8]
    meta["shape"] = huge
    if name == "zarr2":
        meta["chunks"] = huge
    else:
        meta["chunk_grid"]["configuration"]["chunk_shape"] = huge
        for codec in meta["codecs"]:
            if codec["name"] == "sharding_indexed":
                codec["configuration"]["chunk_shape"] = huge
    (path / rel).write_text(json.dumps(meta))
    code = ("import xckpt\n"
            "from xckpt.errors import XckptError\n"
            "try:\n"
            f"    xckpt.load({str(path)!r}, like={{'w': xckpt.ReadSpec(region=(slice(0, 2), slice(0, 2)))}},"
            " partial=True)\n"
            "except XckptError as exc:\n"
            "    print(exc.code, exc.leaf, exc.file)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["resource.too_large", "w", str(path / rel)], out.stdout
    assert _leaf(xckpt.inspect(path), "w")["shape"] == huge  # its metadata is still described


@pytest.mark.parametrize("name, code", [("zarr2", "chunk.truncated"), ("zarr3", "chunk.crc32c")])
def test_a_truncated_chunk_is_a_data_error_naming_the_leaf(ckpts: dict[str, Path], tmp_path: Path, name: str,
                                                           code: str) -> None:
    """A data file cut short is ``chunk.truncated`` naming the array's leaf (TensorStore says FAILED_PRECONDITION,
    which read as a metadata mismatch before); a zarr v3 shard cut short
    has its index read from the wrong bytes, whose crc32c then fails."""
    path = _copy(ckpts, name, tmp_path)
    chunk = path / _pick(path, "chunk")
    data = chunk.read_bytes()
    chunk.write_bytes(data[:len(data) // 2])
    exc = _raises(lambda: xckpt.load(path))
    assert isinstance(exc, XckptError) and (exc.code, exc.leaf) == (code, "w"), repr(exc)
