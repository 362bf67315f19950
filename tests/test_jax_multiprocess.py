"""Two real jax.distributed processes on CPU (4 host devices each) save; 1 and 2 processes restore on other meshes."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import xckpt

jax = pytest.importorskip("jax")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

@pytest.fixture(autouse=True)
def _every_checkpoint_validates(tmp_path):
    """After each test: ``xckpt validate --deep`` passes on every xckpt checkpoint it wrote."""
    yield
    found = [p.parent for p in tmp_path.rglob("xckpt.json")]
    assert len(found) >= 3, found
    for path in found:
        report = xckpt.validate(path, deep=True)
        assert report.ok, (str(path), [str(f) for f in report.findings])


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import jax_workers  # noqa: E402
from spawn import free_port, run_processes  # noqa: E402


def _run_group(phase: str, workdir: str, nprocs: int = 2, timeout: float = 180) -> None:
    port = str(free_port())
    run_processes(lambda r: [os.path.join(HERE, "jax_workers.py"), phase, str(r), str(nprocs), port, workdir], nprocs,
                  lambda r: f"OK {phase} {r}", timeout=timeout)


def test_save_from_two_processes_and_restore_on_other_meshes(tmp_path):
    workdir = str(tmp_path)
    (tmp_path / "blocker").write_bytes(b"a file where a directory would have to be")
    _run_group("save", workdir)
    _run_group("load", workdir)

    # one process with 8 devices restores what two processes wrote, on a (2, 4) mesh and a (8,) mesh
    exp = jax_workers.expected()
    mesh24 = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    mesh8 = Mesh(np.array(jax.devices()), ("d",))
    shardings = {"w": NamedSharding(mesh24, P("y", "x")), "e": NamedSharding(mesh8, P("d")),
                 "i": NamedSharding(mesh24, P("x")), "r": NamedSharding(mesh24, P()),
                 "f8": NamedSharding(mesh8, P(None, "d"))}
    for name in ("sync", "async"):
        path = os.path.join(workdir, name)
        report = xckpt.validate(path, deep=True)
        assert report.ok, [str(f) for f in report.findings]
        like = {"params": {k: jax.ShapeDtypeStruct(exp[k].shape, exp[k].dtype, sharding=shardings[k])
                           for k in ("w", "e", "i")},
                "opt": {k: jax.ShapeDtypeStruct(exp[k].shape, exp[k].dtype, sharding=shardings[k])
                        for k in ("r", "f8")},
                "n": None, "step": 0, "name": ""}
        out = xckpt.load(path, like=like)
        for group, keys in (("params", ("w", "e", "i")), ("opt", ("r", "f8"))):
            for k in keys:
                jax_workers.check_local(out[group][k], exp[k], shardings[k])
        assert out["n"] is None and out["step"] == 1000 and out["name"] == "run-1"
        manifest = xckpt.inspect(path)
        w = next(leaf for leaf in manifest["leaves"] if leaf["key"] == "params/w")
        assert w["sharding"]["mesh_shape"] == [4, 2] and w["sharding"]["dim_axes"] == [["x"], ["y"]]
    # the save that followed the refused one (under a regular file) holds the saved array whole
    after = xckpt.load(os.path.join(workdir, "after"))
    assert set(after) == {"after"} and after["after"].dtype == exp["w"].dtype
    np.testing.assert_array_equal(after["after"], exp["w"])
    # saved through page-locked host copies: the values of each call, the second one's arrays doubled
    for name, factor in (("pinned1", 1), ("pinned2", 2)):
        got = xckpt.load(os.path.join(workdir, name))
        for group, keys in (("params", ("w", "e", "i")), ("opt", ("r", "f8"))):
            for k in keys:
                assert got[group][k].dtype == exp[k].dtype, (name, k)
                want = (exp[k].astype(np.float64) * factor).astype(exp[k].dtype)
                np.testing.assert_array_equal(got[group][k], want, err_msg=f"{name} {k}")
        np.testing.assert_array_equal(got["n"], exp["n"])
        assert got["step"] == 1000 and got["name"] == "run-1"
    assert (tmp_path / "blocker").read_bytes() == b"a file where a directory would have to be"
