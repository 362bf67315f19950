"""A reader's work stays in proportion to the file it reads: crafted files of a few hundred kilobytes
that made a reader recurse past Python's limit, allocate gigabytes or spin for minutes are refused at once
with a specific error (found by an independent hostile-input review).

Every case runs the real reader on a checkpoint that ``xckpt.save`` or Orbax wrote and a few bytes made
hostile, on a thread with a time limit: a reader that hangs fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import warnings
from pathlib import Path
from typing import Any, Callable

import crc32c
import msgpack
import numpy as np
import pytest

import xckpt
from xckpt.errors import XckptError

from threaded import within

#: Seconds a refusal may take (each took tens of seconds or more before).
LIMIT_S = 20.0


def _within(fn: Callable[[], Any], limit: float = LIMIT_S) -> tuple[Any, BaseException | None]:
    """``fn()``'s result or exception; fails when it takes longer than ``limit`` seconds."""
    return within(fn, limit)


def _refused(fn: Callable[[], Any], code: str) -> XckptError:
    """The XckptError ``fn`` raises, checked to carry ``code``."""
    result, exc = _within(fn)
    assert isinstance(exc, XckptError), f"expected {code}, got {result!r} / {exc!r}"
    assert exc.code == code, exc
    return exc


def _found(path: Path, code: str) -> None:
    """``validate(deep=True)`` reports ``code`` (and returns, within the limit)."""
    report, exc = _within(lambda: xckpt.validate(path, deep=True))
    assert exc is None, exc
    assert code in [f.code for f in report.findings], report.findings


def _base(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    xckpt.save({"params": {"w": np.arange(16, dtype=np.float32).reshape(4, 4)}}, path)
    return path


def _edit(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    m = json.loads((path / "xckpt.json").read_text())
    edit(m)
    (path / "xckpt.json").write_text(json.dumps(m))


@pytest.mark.parametrize("parts", [1_000, 60_000])
def test_a_stored_path_longer_than_a_writer_may_store_is_refused(tmp_path: Path, parts: int) -> None:
    """1,000 parts made every reader raise a bare RecursionError (a directory opened per part); 60,000 (a
    120 KB manifest) made parsing hold 3.5 GB of prefixes, quadratic in the path's length."""
    path = _base(tmp_path)

    def nest(m: dict[str, Any]) -> None:
        m["version"] = "1.3"  # nested paths are read from 1.3 on
        m["leaves"][0]["path"] = "a/" * parts + "params.w"

    _edit(path, nest)
    for op in (lambda: xckpt.load(path), lambda: xckpt.inspect(path)):
        err = _refused(op, "path.unsafe")
        assert "longer than a stored path may be" in err.message and err.leaf == "params/w"
        assert len(str(err)) < 1000  # the path is not printed whole
    _found(path, "path.unsafe")


def _crowded_dict_value(path: Path, n: int) -> None:
    """Make the checkpoint's one value a dict of ``n`` keys that all share one hash (tuples of -1 and -2:
    ``hash(-1) == hash(-2)``), msgpack as the spec encodes it (extension type 2)."""
    keys = [[-1 - ((i >> b) & 1) for b in range(20)] for i in range(n)]
    value = msgpack.ExtType(2, msgpack.packb([[k, None] for k in keys]))
    data = msgpack.packb(msgpack.ExtType(2, msgpack.packb([[0, value]])))
    (path / "values.msgpack").write_bytes(data)

    def point(m: dict[str, Any]) -> None:
        m["values"]["size"], m["values"]["crc32c"] = len(data), crc32c.crc32c(data)
        m["leaves"][0]["type"] = "dict"

    _edit(path, point)


def test_a_value_dict_whose_keys_share_one_hash_is_refused(tmp_path: Path) -> None:
    """64,000 such keys (1.6 MB) took every reader more than a minute: building the dict compares them
    pairwise."""
    path = tmp_path / "ckpt"
    xckpt.save({"d": {1: None}}, path)
    _crowded_dict_value(path, 64_000)
    err = _refused(lambda: xckpt.load(path), "values.invalid")
    assert "share one hash" in err.message
    _found(path, "values.invalid")


def test_a_value_dict_with_a_few_colliding_keys_still_reads(tmp_path: Path) -> None:
    """Keys that happen to share a hash in small numbers are a dict like any other."""
    d = {(-1, 0): 1, (-2, 0): 2, -1: 3, -2: 4, 2**61 - 1: 5, 2 * (2**61 - 1): 6, 0: 7}
    xckpt.save({"d": xckpt.Value(d)}, tmp_path / "ckpt")
    assert xckpt.load(tmp_path / "ckpt")["d"] == d


def test_a_manifest_whose_leaf_keys_share_one_hash_is_refused(tmp_path: Path) -> None:
    """A tree of keys -1 and -2, 4,096 leaves deep-indexed by key, made load(like=) and validate quadratic (16,384
    leaves: 67 s and 20 s). The writer saves such a tree; readers refuse it."""
    def tree(depth: int) -> Any:
        return "" if depth == 0 else {-1: tree(depth - 1), -2: tree(depth - 1)}

    path = tmp_path / "ckpt"
    xckpt.save(tree(8), path)  # 256 leaves: small enough to save quickly, far above the limit
    like = tree(8)
    err = _refused(lambda: xckpt.load(path, like=like), "manifest.tree")
    assert "share one hash" in err.message
    _found(path, "manifest.tree")


def test_segments_that_do_not_tile_are_refused_without_comparing_every_pair(tmp_path: Path) -> None:
    """6,000 one-element segments on a diagonal (580 KB) took 50 s: past 2**22 grid cells the check compared
    every pair of segments before counting the elements they cover."""
    path = _base(tmp_path)
    n = 6_000

    def diagonal(m: dict[str, Any]) -> None:
        leaf = m["leaves"][0]
        for k in ("chunk_shape", "inner_chunk_shape", "sharding"):
            leaf.pop(k, None)
        leaf["shape"] = [n, n]
        leaf["segments"] = [{"path": str(i), "offset": [i, i], "shape": [1, 1], "chunk_shape": [1, 1],
                             "inner_chunk_shape": [1, 1]} for i in range(n)]

    _edit(path, diagonal)
    err = _refused(lambda: xckpt.inspect(path), "shape.segments")
    assert "cover 6000 of 36000000" in err.message


def test_a_directory_chain_inside_a_checkpoint_is_walked_in_proportion(tmp_path: Path) -> None:
    """A chain of 3,000 nested directories took validate about 12 s (cubic: 2,000 took 3.7 s, 4,000 took 30 s)
    to report as one unexpected name. (The walk holds a descriptor per level: the soft limit is raised.)"""
    depth = 3_000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < depth + 200:
        pytest.skip(f"the hard limit of open files ({hard}) is below the chain's depth")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, depth + 200), hard))
    path = _base(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for name in ["zz"] + ["x"] * depth:
            os.mkdir(name, dir_fd=fd)
            inner = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    try:
        report, exc = _within(lambda: xckpt.validate(path, deep=True), limit=3.0)
        assert exc is None, exc
        assert [f.code for f in report.findings] == ["path.unexpected"], report.findings
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        _unchain(path / "zz")


def _unchain(top: Path) -> None:
    """Remove a chain of nested directories (``rm``, which needs no recursion: Python's removal, pytest's too,
    passes the interpreter's recursion limit on it)."""
    subprocess.run(["rm", "-rf", str(top)], check=True, timeout=120)


@pytest.mark.parametrize("dtype", ["(-1,)f4", "(99999999999999999999,)f4", "(1000000000,1000000000)u1", "(2,)f4"])
def test_an_orbax_zarr2_dtype_numpy_refuses_is_dtype_unsupported(tmp_path: Path, dtype: str) -> None:
    """A subarray dtype string in a zarr v2 ``.zarray`` let numpy's ValueError escape every reader."""
    pytest.importorskip("orbax.checkpoint")
    import orbax.checkpoint as ocp

    path = tmp_path / "orbax"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)
        ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave({"w": np.arange(6, dtype=np.float32)}))
    zarray = next(p for p in path.rglob(".zarray") if p.parent.name == "w")
    meta = json.loads(zarray.read_text())
    meta["dtype"] = dtype
    zarray.write_text(json.dumps(meta))
    for op in (lambda: xckpt.load(path), lambda: xckpt.inspect(path)):
        err = _refused(op, "dtype.unsupported")
        assert err.leaf == "w"



def test_an_orbax_name_longer_than_an_xckpt_path_still_reads(tmp_path: Path) -> None:
    """The bound on stored paths is xckpt's writer's: Orbax's OCDBT names are keys of its database, not files, and
    Orbax writes longer ones (277 bytes here)."""
    pytest.importorskip("orbax.checkpoint")
    import orbax.checkpoint as ocp

    tree = {"outer_" + "m" * 120: {"k" * 150: np.arange(4.0)}, "short": np.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp_path / "orbax", tree)
        ckptr.wait_until_finished()
    got = xckpt.load(tmp_path / "orbax")
    np.testing.assert_array_equal(got["outer_" + "m" * 120]["k" * 150], np.arange(4.0))
    np.testing.assert_array_equal(got["short"], np.ones(2))
