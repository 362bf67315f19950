"""Orbax v1 and CheckpointManager layouts, unmerged multi-process OCDBT, and Orbax v1 reading xckpt.

Real Orbax writes every Orbax checkpoint here (jax on CPU, 8 host devices; one spawned group of
two ``jax.distributed`` processes for the unmerged OCDBT case) and every value is compared
element by element. The other way, ``orbax.checkpoint.v1`` loads what xckpt wrote.

Loads of a whole Orbax v1 checkpoint or step directory go through ``xckpt.sources.detect``'s
table (its ``orbax-layout`` kind, :mod:`xckpt.interop.orbax.layouts`).

Run as ``python tests/test_orbax_v1.py worker RANK PORT OUT``, this file is one of the two
spawned processes.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # must be set before jax is imported (tests/conftest.py may already have done it)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import json
import logging
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xckpt
from xckpt.engine.storage import Location
from xckpt.errors import ManifestError, NotACheckpointError, UnsafePathError, XckptError
from xckpt.format import orbax_view
from xckpt.interop.orbax import layouts
from xckpt.interop.orbax.checkpoint import open_orbax
from xckpt.interop.orbax.layouts import orbax_to_xckpt

from spawn import free_port, run_processes

ocpv1 = ocp.v1


# -- what is saved -----------------------------------------------------------------------------------


def _mesh() -> Mesh:
    devs = np.array(jax.devices())
    return Mesh(devs.reshape(4, 2) if devs.size == 8 else devs.reshape(-1, 1), ("x", "y"))


def _numpy_tree() -> dict[str, Any]:
    """The values every Orbax save here holds (strings and scalars beside arrays of several dtypes)."""
    rng = np.random.default_rng(7)
    return {
        "params": {"w": rng.standard_normal((8, 8)).astype(np.float32),
                   "emb": rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16),
                   "ids": rng.integers(-500, 500, (6,)).astype(np.int32)},
        "layers": [{"k": rng.standard_normal((2, 3)).astype(np.float32)}, {"k": np.arange(6.0).reshape(2, 3)}],
        "step": 11, "lr": 0.125,
    }


def _jax_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with its params as sharded jax.Arrays (the other arrays stay numpy)."""
    mesh = _mesh()
    out = dict(tree)
    out["params"] = {"w": jax.device_put(tree["params"]["w"], NamedSharding(mesh, P("x", "y"))),
                     "emb": jax.device_put(tree["params"]["emb"], NamedSharding(mesh, P(None, "x"))),
                     "ids": jax.device_put(tree["params"]["ids"], NamedSharding(mesh, P()))}
    return out


def _check_equal(got: Any, want: Any, where: str = "") -> None:
    """Same structure; arrays equal element by element with the same dtype; values equal with the same type."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (where, sorted(got))  # Orbax sorts keys
        for k in want:
            _check_equal(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (where, got)
        for i, (g, w) in enumerate(zip(got, want)):
            _check_equal(g, w, f"{where}/{i}")
    elif isinstance(want, (np.ndarray, jax.Array)):
        want = np.asarray(want)
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


# -- one spawned group: two processes save an OCDBT checkpoint and never merge it -------------------


def _unmerged_values() -> dict[str, np.ndarray]:
    """The global arrays of the multi-process save (the same on every process)."""
    return {"w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 3,
            "e": (np.arange(8 * 16, dtype=np.float32).reshape(8, 16) - 50).astype(ml_dtypes.bfloat16),
            "r": np.linspace(-1, 1, 10, dtype=np.float32)}


def _worker(rank: int, port: int, out: str) -> None:
    """One of two processes: save with Orbax's handlers directly, whose ``finalize`` (the merge) is never run."""
    from etils import epath
    from jax.experimental import multihost_utils

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    vals = _unmerged_values()
    specs = {"w": P("x", "y"), "e": P(("x", "y")), "r": P()}
    tree = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
            for k, v in vals.items()}
    tree = {"params": {"w": tree["w"], "e": tree["e"]}, "r": tree["r"], "step": 5}
    for name, handler in (("zarr2", ocp.StandardCheckpointHandler()),
                          ("zarr3", ocp.PyTreeCheckpointHandler(use_zarr3=True))):
        path = os.path.join(out, name)
        if rank == 0:
            os.makedirs(path)
        multihost_utils.sync_global_devices(f"mkdir {name}")
        args = ocp.args.StandardSave(tree) if name == "zarr2" else ocp.args.PyTreeSave(tree)
        handler.save(epath.Path(path), args=args)  # no handler.finalize(): the per-process databases stay apart
        multihost_utils.sync_global_devices(f"saved {name}")
        if rank == 0 and name == "zarr3":
            Path(path, "commit_success.txt").write_text("committed, never merged")
    multihost_utils.sync_global_devices("done")
    print(f"OK worker {rank}", flush=True)


@pytest.fixture(scope="module")
def unmerged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two jax.distributed CPU processes (4 devices each) save ``zarr2/`` and ``zarr3/`` there, unmerged."""
    out = tmp_path_factory.mktemp("unmerged")
    port = str(free_port())
    run_processes(lambda r: [os.path.abspath(__file__), "worker", str(r), port, str(out)], 2,
                  lambda r: f"OK worker {r}", timeout=240)
    return out


# -- the checkpoints real Orbax writes in this process ------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every layout, written once by Orbax: v1 save, v1 checkpointables, v1 without OCDBT, CheckpointManager
    steps (named items with a JSON item; one unnamed item), a v1 training.Checkpointer step."""
    root = tmp_path_factory.mktemp("orbax")
    tree = _numpy_tree()
    jtree = _jax_tree(tree)
    out = {"v1": root / "v1", "v1_named": root / "v1_named", "v1_plain": root / "v1_plain"}
    ocpv1.save(out["v1"], dict(jtree, name="run-3"))
    ocpv1.save_checkpointables(out["v1_named"], {"state": jtree, "extra": {"mu": np.arange(5.0), "tag": "x"}})
    ctx = ocpv1.Context()
    ctx.array.saving.use_ocdbt = False
    with ctx:
        ocpv1.save(out["v1_plain"], jtree)
    with ocp.CheckpointManager(root / "mgr", item_names=("state", "metadata")) as mngr:
        mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(jtree),
                                             metadata=ocp.args.JsonSave({"epoch": 2, "tags": ["a", "b"],
                                                                         "lr": 0.5, "note": None})))
        mngr.wait_until_finished()
    out["mgr"] = root / "mgr" / "3"
    with ocp.CheckpointManager(root / "mgr1") as mngr:
        mngr.save(4, args=ocp.args.StandardSave(jtree))
        mngr.wait_until_finished()
    out["mgr_default"] = root / "mgr1" / "4"
    trainer = ocpv1.training.Checkpointer(root / "train")
    trainer.save_checkpointables(2, {"state": jtree, "opt": {"m": np.zeros(3, np.float32)}})
    trainer.close()
    out["train"] = root / "train" / "2"
    return out


def _no_warnings_load(path: Path, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error", xckpt.XckptWarning)
        return xckpt.load(path, **kw)


# -- reading what Orbax wrote --------------------------------------------------------------------------


def test_layouts_are_found(saved: dict[str, Path], tmp_path: Path) -> None:
    """find_layout names each layout and its items; orbax_item names the one item a load reads."""
    found = {name: layouts.find_layout(path) for name, path in saved.items()}
    kinds = {name: (f.kind, [(i.name, i.kind) for i in f.items]) for name, f in found.items() if f is not None}
    assert kinds == {"v1": ("v1", [("state", "orbax")]), "v1_plain": ("v1", [("state", "orbax")]),
                     "v1_named": ("v1", [("state", "orbax"), ("extra", "orbax")]),
                     "mgr": ("step", [("state", "orbax"), ("metadata", "json")]),
                     "mgr_default": ("step", [("default", "orbax")]),
                     "train": ("step", [("state", "orbax"), ("opt", "orbax")])}
    assert all(f is not None and f.committed for f in found.values())
    # the one Orbax item a load reads (None: several items, read as a dict)
    assert layouts.orbax_item(saved["v1"]) == Location.of(saved["v1"] / "state")
    assert layouts.orbax_item(saved["mgr_default"]) == Location.of(saved["mgr_default"] / "default")
    assert layouts.orbax_item(saved["v1_named"]) is None and layouts.orbax_item(saved["mgr"]) is None
    assert layouts.orbax_item(saved["v1"] / "state").url == str(saved["v1"] / "state")
    # not Orbax layouts: a CheckpointManager root, an empty directory, an xckpt checkpoint
    assert layouts.find_layout(saved["mgr"].parent) is None
    assert layouts.find_layout(tmp_path) is None
    xckpt.save({"a": np.ones(2)}, tmp_path / "x")
    assert layouts.find_layout(tmp_path / "x") is None


def test_v1_save_reads_as_its_tree(saved: dict[str, Path]) -> None:
    """ocp.v1.save (OCDBT, and plain zarr v3): the state checkpointable's tree, also onto a mesh."""
    want = dict(_numpy_tree(), name="run-3")
    _check_equal(_no_warnings_load(saved["v1"]), want)
    _check_equal(_no_warnings_load(saved["v1_plain"]), _numpy_tree())  # zarr v3 arrays without OCDBT
    # one region of one array, onto the target's own sharding
    mesh = _mesh()
    sds = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P(None, "x")))
    got = xckpt.load(saved["v1"], like={"params": {"w": sds}}, partial=True)
    assert isinstance(got["params"]["w"], jax.Array) and got["params"]["w"].sharding == sds.sharding
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), want["params"]["w"])
    assert xckpt.inspect(saved["v1"])["format"] == "orbax"


def test_v1_checkpointables_read_as_a_dict_by_name(saved: dict[str, Path]) -> None:
    """ocp.v1.save_checkpointables: a dict keyed by checkpointable name."""
    got = _no_warnings_load(saved["v1_named"])
    _check_equal(got, {"state": _numpy_tree(), "extra": {"mu": np.arange(5.0), "tag": "x"}})
    # a dict at the root selects items; jax targets go through the items' own sources
    mesh = _mesh()
    like = {"state": {"params": {"emb": jax.ShapeDtypeStruct((4, 8), ml_dtypes.bfloat16,
                                                             sharding=NamedSharding(mesh, P("x")))}}}
    part = xckpt.load(saved["v1_named"], like=like, partial=True)
    np.testing.assert_array_equal(np.asarray(part["state"]["params"]["emb"]), _numpy_tree()["params"]["emb"])
    assert part["state"]["params"]["emb"].sharding == like["state"]["params"]["emb"].sharding
    m = xckpt.inspect(saved["v1_named"])
    assert {leaf["key"] for leaf in m["leaves"]} >= {"state/params/w", "extra/mu", "extra/tag"}


def test_one_item_opens_alone(saved: dict[str, Path]) -> None:
    """An item's own directory is an Orbax item: read today through detect.py's "orbax" kind. An item of a
    v1 checkpoint has no commit_success.txt of its own: the checkpoint's marker counts (no warning)."""
    _check_equal(_no_warnings_load(saved["v1_named"] / "extra"), {"mu": np.arange(5.0), "tag": "x"})
    _check_equal(_no_warnings_load(saved["mgr"] / "state"), _numpy_tree())


def test_checkpoint_manager_steps(saved: dict[str, Path]) -> None:
    """CheckpointManager steps (named items with a JSON item, one default item) and a v1 training step."""
    _check_equal(_no_warnings_load(saved["mgr"]),
                 {"state": _numpy_tree(), "metadata": {"epoch": 2, "tags": ["a", "b"], "lr": 0.5, "note": None}})
    _check_equal(_no_warnings_load(saved["mgr_default"]), _numpy_tree())
    _check_equal(_no_warnings_load(saved["train"]), {"state": _numpy_tree(), "opt": {"m": np.zeros(3, np.float32)}})
    # the JSON item alone, as a target selects it
    assert xckpt.load(saved["mgr"], like={"metadata": {"epoch": 0, "tags": ["", ""], "lr": 0.0, "note": None}},
                      partial=True) == {"metadata": {"epoch": 2, "tags": ["a", "b"], "lr": 0.5, "note": None}}


def test_convert_v1_and_steps_to_xckpt(saved: dict[str, Path], tmp_path: Path,
                                       every_checkpoint_validates: None) -> None:
    """xckpt convert --from orbax takes every layout (no detect.py wiring needed)."""
    orbax_to_xckpt(str(saved["v1_named"]), str(tmp_path / "named"))
    orbax_to_xckpt(str(saved["mgr"]), str(tmp_path / "mgr"))
    orbax_to_xckpt(str(saved["v1"]), str(tmp_path / "v1"))
    _check_equal(xckpt.load(tmp_path / "named"), {"state": _numpy_tree(), "extra": {"mu": np.arange(5.0), "tag": "x"}})
    _check_equal(xckpt.load(tmp_path / "mgr")["metadata"], {"epoch": 2, "tags": ["a", "b"], "lr": 0.5, "note": None})
    _check_equal(xckpt.load(tmp_path / "v1"), dict(_numpy_tree(), name="run-3"))
    assert xckpt.inspect(tmp_path / "named")["producer"]["library"] == "xckpt"
    with pytest.raises(NotACheckpointError) as err:
        orbax_to_xckpt(str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert err.value.code == "orbax.missing"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, fn: Any) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


#: Layout files a parser may choke on: nesting too deep to parse, a number past Python's digit limit, a lone surrogate.
UNPARSABLE = {"deep": "[" * 100_000 + "]" * 100_000, "huge_number": '{"a": ' + "1" * 5000 + "}",
              "lone_surrogate": '{"\\ud800": 1}'}


@pytest.mark.parametrize("bad", list(UNPARSABLE))
def test_layout_json_files_that_cannot_be_parsed(saved: dict[str, Path], tmp_path: Path, bad: str) -> None:
    """A JSON item or a _CHECKPOINT_DELETION record that Python's json cannot parse is ``orbax.invalid`` naming
    it; a _CHECKPOINT_METADATA that cannot be parsed is taken as one without item_handlers (Orbax's items are
    then the subdirectories), so the checkpoint still loads exactly."""
    item = _copy(saved["mgr"], tmp_path / "item")
    (item / "metadata" / "metadata").write_text(UNPARSABLE[bad])
    with pytest.raises(ManifestError) as err:
        xckpt.load(item)
    assert err.value.code == "orbax.invalid" and err.value.file == str(item / "metadata" / "metadata")
    str(err.value)  # printable
    deletion = _copy(saved["v1_named"], tmp_path / "deletion")
    (deletion / "_CHECKPOINT_DELETION").write_text(UNPARSABLE[bad])
    with pytest.raises(ManifestError) as err:
        xckpt.load(deletion)
    assert err.value.code == "orbax.invalid" and err.value.file == str(deletion / "_CHECKPOINT_DELETION")
    top = _copy(saved["v1"], tmp_path / "top")
    (top / "_CHECKPOINT_METADATA").write_text(UNPARSABLE[bad])
    _check_equal(xckpt.load(top), xckpt.load(saved["v1"]))


def test_hostile_and_odd_layouts(saved: dict[str, Path], tmp_path: Path) -> None:
    """Unsafe item names and links are refused; unreadable, deleted and missing items are named."""
    # an item name that leaves the checkpoint is refused before anything is opened
    bad = _copy(saved["v1_named"], tmp_path / "bad")
    _edit_json(bad / "_CHECKPOINT_METADATA", lambda m: m["item_handlers"].update({"../outside": "x.PyTreeHandler"}))
    with pytest.raises(UnsafePathError):
        layouts.find_layout(bad)
    # an item whose directory is a link is refused, not followed
    linked = _copy(saved["v1_named"], tmp_path / "linked")
    shutil.move(str(linked / "extra"), tmp_path / "extra_elsewhere")
    os.symlink(tmp_path / "extra_elsewhere", linked / "extra")
    with pytest.raises(XckptError) as err:
        layouts.find_layout(linked)
    assert err.value.code == "path.link"
    # an item no reader handles is left out, with a warning; a pending deletion hides its checkpointable
    odd = _copy(saved["v1_named"], tmp_path / "odd")
    (odd / "proto").mkdir()
    (odd / "proto" / "data.pbtxt").write_text("x: 1")
    _edit_json(odd / "_CHECKPOINT_METADATA", lambda m: m["item_handlers"].update({"proto": "x.ProtoHandler"}))
    (odd / "_CHECKPOINT_DELETION").write_text(json.dumps({"checkpointable_name": "extra"}))
    layout = layouts.find_layout(odd)
    assert [i.name for i in layout.items] == ["state"] and {n for n, _ in layout.skipped} == {"proto", "extra"}
    with pytest.warns(xckpt.XckptWarning) as record:
        src = layouts.open_layout(layout)
    said = " ".join(str(w.message) for w in record)
    assert "'proto' is left out" in said and "'extra' is left out: its deletion is pending" in said
    try:
        assert {e.key[0] for e in src.manifest.leaves} == {"state"}  # a dict: items were left out
    finally:
        src.close()
    # a pytree item without its _METADATA is an error, not an absence
    broken = _copy(saved["mgr"], tmp_path / "broken")
    (broken / "state" / "_METADATA").unlink()
    with pytest.raises(NotACheckpointError) as err:
        layouts.find_layout(broken)
    assert err.value.code == "orbax.missing" and err.value.file == str(broken / "state" / "_METADATA")
    # an unfinished v1 save is read with one warning about the checkpoint, none per item
    unfinished = _copy(saved["v1"], tmp_path / "unfinished")
    (unfinished / "commit_success.txt").unlink()
    with pytest.warns(xckpt.XckptWarning, match="commit_success.txt") as record:
        layouts.open_layout_at(unfinished).close()
    assert len([w for w in record if issubclass(w.category, xckpt.XckptWarning)]) == 1
    # an item that is an xckpt checkpoint is read by the native reader, beside Orbax's items
    mixed = _copy(saved["v1_named"], tmp_path / "mixed")
    shutil.rmtree(mixed / "extra")
    xckpt.save({"mu": np.arange(5.0), "tag": "x", "t": (1, "a")}, mixed / "extra")
    src = layouts.open_layout_at(mixed)
    try:
        assert src.parts["extra"].format == "xckpt" and src.parts["state"].format == "orbax"
        got = {e.key: src.values()[i] for i, e in enumerate(src.manifest.leaves) if e.key[0] == "extra"
               and not hasattr(e, "shape")}
        assert got == {("extra", "tag"): "x", ("extra", "t", 0): 1, ("extra", "t", 1): "a"}
    finally:
        src.close()
    # a malformed deletion record
    (odd / "_CHECKPOINT_DELETION").write_text("[")
    with pytest.raises(ManifestError):
        layouts.find_layout(odd)


def test_unmerged_multiprocess_ocdbt(unmerged: Path, tmp_path: Path) -> None:
    """Two processes' OCDBT databases, never merged, read as one checkpoint (zarr v2 and v3)."""
    vals = _unmerged_values()
    want = {"params": {"e": vals["e"], "w": vals["w"]}, "r": vals["r"], "step": 5}
    for name in ("zarr2", "zarr3"):
        path = unmerged / name
        assert not (path / "manifest.ocdbt").exists() and (path / "ocdbt.process_1" / "manifest.ocdbt").exists()
        ckpt = open_orbax(path, committed=True)
        try:
            assert ckpt.manifest.metadata["orbax"]["unmerged_ocdbt"] == ["ocdbt.process_0", "ocdbt.process_1"]
            index = ckpt.unmerged
            owners = {index.owners[i] for i, k in enumerate(index.keys) if k.startswith("params.w/")}
            assert owners == {0, 1}  # the chunks of one array are in both databases
        finally:
            ckpt.close()
    with pytest.warns(xckpt.XckptWarning, match="commit_success.txt"):
        got = xckpt.load(unmerged / "zarr2")
    _check_equal(got, want)
    _check_equal(_no_warnings_load(unmerged / "zarr3"), want)
    # one region that spans both processes' shards, onto another mesh
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
    spec = jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh, P("d")))
    got = xckpt.load(unmerged / "zarr3", like={"params": {"w": spec}}, partial=True)
    assert got["params"]["w"].sharding == spec.sharding
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), vals["w"])
    region = xckpt.load(unmerged / "zarr3", like={"params": {"w": xckpt.ReadSpec(region=(slice(6, 10), slice(3, 8)))}},
                        partial=True)
    np.testing.assert_array_equal(region["params"]["w"], vals["w"][6:10, 3:8])
    # a process's database lost: its chunks are missing, an error naming the leaf (never fill values)
    lost = _copy(unmerged / "zarr3", tmp_path / "lost")
    shutil.rmtree(lost / "ocdbt.process_1")
    with pytest.raises(XckptError) as err:
        xckpt.load(lost)
    assert err.value.code == "chunk.missing" and err.value.leaf in ("params/w", "params/e"), str(err.value)
    # a root d/ without manifest.ocdbt is a merge that did not finish: no guessing
    half = _copy(unmerged / "zarr3", tmp_path / "half")
    (half / "d").mkdir()
    with pytest.raises(XckptError) as err:
        xckpt.load(half)
    assert err.value.code == "orbax.ocdbt_missing"


def test_layouts_on_an_object_store(saved: dict[str, Path], unmerged: Path, moto: Any) -> None:
    """The same layouts uploaded to S3 (a moto server): found by listing keys, read through TensorStore's s3 driver."""
    bucket = f"orbax-{os.getpid()}"
    moto.client.create_bucket(Bucket=bucket)
    for name, local in (("v1_named", saved["v1_named"]), ("mgr", saved["mgr"]), ("unmerged", unmerged / "zarr3")):
        for f in local.rglob("*"):
            if f.is_file():
                moto.client.upload_file(str(f), bucket, f"{name}/{f.relative_to(local)}")
    layout = layouts.find_layout(f"s3://{bucket}/v1_named")
    assert layout.kind == "v1" and [i.name for i in layout.items] == ["state", "extra"]
    src = layouts.open_layout(layout)
    try:
        assert {e.key[0] for e in src.manifest.leaves} == {"state", "extra"}
        assert src.values()[next(i for i, e in enumerate(src.manifest.leaves) if e.key == ("extra", "tag"))] == "x"
    finally:
        src.close()
    tmp = saved["v1"].parent / "from_s3"
    orbax_to_xckpt(f"s3://{bucket}/mgr", str(tmp / "mgr"))
    _check_equal(xckpt.load(tmp / "mgr"), {"state": _numpy_tree(),
                                            "metadata": {"epoch": 2, "tags": ["a", "b"], "lr": 0.5, "note": None}})
    vals = _unmerged_values()
    orbax_to_xckpt(f"s3://{bucket}/unmerged", str(tmp / "unmerged"))
    _check_equal(xckpt.load(tmp / "unmerged"),
                 {"params": {"e": vals["e"], "w": vals["w"]}, "r": vals["r"], "step": 5})


# -- Orbax v1 reading what xckpt wrote ------------------------------------------------------------------


def test_orbax_v1_loads_xckpt_without_warnings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """orbax.checkpoint.v1 recognises, lists and loads an xckpt checkpoint without any warning."""
    tree = dict(_numpy_tree(), name="run-9", nothing=None)
    path = tmp_path / "c"
    xckpt.save(tree, path)
    marker = json.loads((path / orbax_view.MARKER).read_bytes())
    assert marker["zarr_format"] == 2 and marker["shape"] == [0]
    assert ocpv1.is_orbax_checkpoint(path)
    caplog.set_level(logging.WARNING)
    caplog.set_level(logging.WARNING, logger="absl")  # another test module may have raised absl's level
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ocpv1.load(path)
        meta = ocpv1.metadata(path)
        mesh = _mesh()
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()))
                                if isinstance(a, np.ndarray) else a, tree)
        on_mesh = ocpv1.load(path, abstract)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    for k in ("w", "emb", "ids"):
        np.testing.assert_array_equal(np.asarray(got["params"][k]), tree["params"][k])
        assert np.asarray(got["params"][k]).dtype == tree["params"][k].dtype
        assert isinstance(on_mesh["params"][k], jax.Array)
        np.testing.assert_array_equal(np.asarray(on_mesh["params"][k]), tree["params"][k])
    np.testing.assert_array_equal(np.asarray(got["layers"][1]["k"]), tree["layers"][1]["k"])
    assert got["step"] == 11 and got["lr"] == 0.125 and got["name"] == "run-9" and got["nothing"] is None
    assert set(meta.metadata) >= {"params", "layers", "step", "name"}
    # steps xckpt saved under a root are listed by v1's training.Checkpointer
    xckpt.save(tree, tmp_path / "run" / "7")
    assert [c.step for c in ocpv1.training.Checkpointer(tmp_path / "run").checkpoints] == [7]


def test_every_layout_through_detection(saved: dict[str, Path]) -> None:
    """xckpt.load and inspect find each layout through detect.py's table, without a warning."""
    _check_equal(_no_warnings_load(saved["v1"]), dict(_numpy_tree(), name="run-3"))
    assert set(_no_warnings_load(saved["v1_named"])) == {"state", "extra"}
    assert set(_no_warnings_load(saved["mgr"])) == {"state", "metadata"}
    _check_equal(_no_warnings_load(saved["mgr_default"]), _numpy_tree())
    assert xckpt.inspect(saved["train"])["format"] == "orbax"


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
