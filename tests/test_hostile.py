"""A reader that trusts nothing: links and special files are refused without being read through or
waited on, by every read path; chunk objects are bound to their place; manifests hold valid Unicode.

Outside copies are watched with inotify (:mod:`opened`) during each operation: an operation that
opened or read them through a link is caught, however the file system is mounted.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import xckpt
import xckpt.mapping as M
from xckpt.errors import XckptError

from opened import Opened, probe
from threaded import within

CONF = Path(__file__).resolve().parents[1] / "spec" / "conformance"
SHARDED = CONF / "valid" / "sharded" / "checkpoint"
W = np.arange(48, dtype=np.float32).reshape(8, 6)  # what SHARDED's 'w' holds


def _dcp_read(path: Path) -> Any:
    import torch
    import torch.distributed.checkpoint as dcp
    sd = {"w": torch.zeros(8, 6), "v": torch.zeros(10, dtype=torch.int64), "bias": torch.zeros(6, dtype=torch.float16)}
    dcp.load(sd, storage_reader=xckpt.torch.XckptStorageReader(path), no_dist=True)
    return sd


#: Every read path, by name: each takes the checkpoint's path.
OPS: dict[str, Callable[[Path], Any]] = {
    "load": lambda p: xckpt.load(p),
    "validate": lambda p: xckpt.validate(p, deep=True),
    "inspect": lambda p: xckpt.inspect(p),
    "convert": lambda p: xckpt.convert.convert(str(p), str(p) + "_copy"),
    "to_dcp": lambda p: xckpt.convert.convert(str(p), str(p) + "_dcp", target="dcp"),
    "mapped": lambda p: xckpt.load(p, mapping=M.Mapping(M.rename("w", "w_t", M.transpose()))),
    "dcp_reader": _dcp_read,
}
#: What a link or FIFO replaces; the operations that must read it (so must refuse it).
TARGETS: dict[str, set[str]] = {
    "xckpt.json": set(OPS),
    "values.msgpack": {"load", "validate", "convert", "to_dcp", "mapped"},
    "w/zarr.json": set(OPS) - {"inspect"},
    "w/c/0/1": set(OPS) - {"inspect"},
    "w": set(OPS) - {"inspect"},
    "w/c": set(OPS) - {"inspect"},
    "_METADATA": {"validate"},
    "_CHECKPOINT_METADATA": {"validate"},
    "step": {"validate"},  # the 0-d mirror of a value, for Orbax
}


def _run(op: str, path: Path, timeout: float = 60.0) -> tuple[Any, BaseException | None]:
    """Run an operation on a thread; a hang fails the test (a blocked open cannot be interrupted)."""
    return within(lambda: OPS[op](path), timeout, f"{op} on {path}")


def _code(op: str, error: BaseException | None) -> str | None:
    """The xckpt code an operation failed with. ``dcp_reader`` is DCP's own ``dcp.load``, which wraps every
    storage reader's exception in its ``CheckpointException`` (it keeps the message with the code)."""
    if isinstance(error, XckptError):
        return error.code
    if op == "dcp_reader" and error is not None and type(error).__name__ == "CheckpointException":
        for code in ("path.link", "path.special"):
            if f"[{code}]" in str(error):
                return code
    return None


@pytest.fixture(scope="module")
def torch_adapter(tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("torch")
    xckpt.torch  # noqa: B018 - registers the adapter
    probe(tmp_path_factory.mktemp("probe"))  # the watch below sees reads here


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_links_are_refused_and_never_read_through(tmp_path: Path, target: str, torch_adapter: None) -> None:
    for op in OPS:
        ckpt = tmp_path / op / "c"
        shutil.copytree(SHARDED, ckpt)
        outside = tmp_path / op / "outside"
        shutil.move(ckpt / target, outside)
        os.symlink(outside, ckpt / target)
        with Opened(outside) as seen:
            result, error = _run(op, ckpt)
            read = seen.paths()
        assert not read, f"{op} opened {read} through the link {target}"
        if op == "validate":
            assert error is None, f"validate raised {error!r}"
            assert "path.link" in result.codes() and not result.ok, (target, result.codes())
            link = next(f for f in result.findings if f.code == "path.link")
            assert link.file == str(ckpt / target)
        elif op in TARGETS[target]:
            assert _code(op, error) == "path.link", (op, target, error)
            assert str(ckpt / target) in str(error), (op, error)  # names the link (convert: in its cause)
        else:
            assert error is None, (op, target, error)


@pytest.mark.parametrize("target", [t for t in sorted(TARGETS) if (SHARDED / t).is_file()])
def test_fifos_are_refused_without_blocking(tmp_path: Path, target: str, torch_adapter: None) -> None:
    for op in OPS:
        ckpt = tmp_path / op / "c"
        shutil.copytree(SHARDED, ckpt)
        (ckpt / target).unlink()
        os.mkfifo(ckpt / target)
        result, error = _run(op, ckpt)
        if op == "validate":
            assert error is None and "path.special" in result.codes(), (target, error, result and result.codes())
        elif op in TARGETS[target]:
            assert _code(op, error) == "path.special", (op, target, error)
        else:
            assert error is None, (op, target, error)


def test_a_linked_root_or_parent_directory_is_read_normally(tmp_path: Path, torch_adapter: None) -> None:
    real = tmp_path / "real" / "runs"
    shutil.copytree(SHARDED, real / "c")
    (tmp_path / "root_link").symlink_to(real / "c")
    (tmp_path / "parent_link").symlink_to(real)
    for path in (tmp_path / "root_link", tmp_path / "parent_link" / "c"):
        report = xckpt.validate(path, deep=True)
        assert report.ok and report.findings == [], [str(f) for f in report.findings]
        np.testing.assert_array_equal(xckpt.load(path)["w"], W)
        assert xckpt.inspect(path)["arrays"] == 3
        np.testing.assert_array_equal(_run("mapped", path)[0]["w_t"], W.T)
        np.testing.assert_array_equal(_dcp_read(path)["w"].numpy(), W)
        out = Path(str(path) + "_copy")
        xckpt.convert.convert(str(path), str(out))
        np.testing.assert_array_equal(xckpt.load(out)["w"], W)
        shutil.rmtree(out)


@pytest.mark.parametrize("repo,allowed", [("models--org--name", True), ("datasets--org--name", True),
                                           ("anything", False)])
def test_links_into_blobs_are_followed_only_in_a_hub_cache_snapshot(tmp_path: Path, repo: str, allowed: bool) -> None:
    """A checkpoint at ``<repo>/snapshots/<rev>`` whose chunk is a link to ``<repo>/blobs/<hash>`` (how the
    Hugging Face hub cache stores files) reads through it only when ``<repo>`` is named as the cache names
    a repository; elsewhere that link is refused like any other."""
    snap = tmp_path / repo / "snapshots" / "0123abcd"
    shutil.copytree(SHARDED, snap)
    chunk = next(p for p in sorted((snap / "w").rglob("*")) if p.is_file() and p.name != "zarr.json")
    (tmp_path / repo / "blobs").mkdir()
    blob = tmp_path / repo / "blobs" / "4f2a"
    os.rename(chunk, blob)
    os.symlink(os.path.relpath(blob, chunk.parent), chunk)
    if allowed:
        np.testing.assert_array_equal(xckpt.load(snap)["w"], W)
        return
    with pytest.raises(XckptError) as info:
        xckpt.load(snap)
    assert info.value.code == "path.link" and info.value.file == str(chunk)


def test_a_linked_manifest_is_not_read_as_an_orbax_checkpoint(tmp_path: Path) -> None:
    """The Orbax files are there too: a symlinked xckpt.json must not make the reader fall back to them."""
    ckpt = tmp_path / "c"
    shutil.copytree(SHARDED, ckpt)
    (tmp_path / "m.json").write_bytes((ckpt / "xckpt.json").read_bytes())
    (ckpt / "xckpt.json").unlink()
    (ckpt / "xckpt.json").symlink_to(tmp_path / "m.json")
    with pytest.raises(XckptError) as err:
        xckpt.load(ckpt)
    assert err.value.code == "path.link"


# -- chunk objects bound to their place ----------------------------------------------------------


def _sharded_save(path: Path, scale: float) -> None:
    """'w' (8x6) in one chunk object."""
    xckpt.save({"w": np.arange(48, dtype=np.float32).reshape(8, 6) * scale}, path)


def _objects(ckpt: Path, array: str) -> list[Path]:
    return sorted(p for p in (ckpt / array / "c").rglob("*") if p.is_file())


def _expect_refused(ckpt: Path, code: str) -> None:
    with pytest.raises(XckptError) as err:
        xckpt.load(ckpt)
    assert err.value.code == code, err.value
    report = xckpt.validate(ckpt, deep=True)
    assert code in report.codes() and not report.ok, report.codes()


def test_swapped_chunk_objects_are_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    shutil.copytree(SHARDED, ckpt)
    a, b = _objects(ckpt, "w")[0], _objects(ckpt, "w")[3]  # (0, 0) and (1, 1): same size
    data_a, data_b = a.read_bytes(), b.read_bytes()
    assert len(data_a) == len(data_b) and data_a != data_b
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    _expect_refused(ckpt, "chunk.place")
    # a mapped load (TensorStore views) refuses them too
    with pytest.raises(XckptError) as err:
        xckpt.load(ckpt, mapping=M.Mapping(M.rename("w", "w_t", M.transpose())))
    assert err.value.code == "chunk.place"


def test_a_chunk_object_from_another_checkpoint_is_refused(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    _sharded_save(one, 1.0)
    _sharded_save(two, 1.0)  # the very same bytes of data, another save
    (one / "w" / "c" / "0" / "0").write_bytes((two / "w" / "c" / "0" / "0").read_bytes())
    _expect_refused(one, "chunk.place")


def _edit_index(obj: Path, n_inner: int, edit: Callable[[np.ndarray], None], prefix: bytes = b"") -> None:
    """Change a shard index (crc32c and place tag recomputed, so that only the structural defect remains)."""
    import crc32c
    from xckpt.format import shard
    data = bytearray(obj.read_bytes())
    start = len(data) - (16 * n_inner + 4)
    pairs = np.frombuffer(bytes(data[start:-4]), dtype="<u8").reshape(-1, 2).copy()
    edit(pairs)
    body = pairs.astype("<u8").tobytes()
    data[start:] = body + crc32c.crc32c(body).to_bytes(4, "little")
    ckpt = obj.parents[3]
    gen = json.loads((ckpt / "xckpt.json").read_text())["generation"]
    place = shard.place_of(gen, obj.relative_to(ckpt).as_posix())
    data[start - shard.TAG_NBYTES:start] = shard.place_tag(place, bytes(data[start:]))
    obj.write_bytes(prefix + bytes(data))


def _inner_ckpt(tmp_path: Path) -> Path:
    """'w' (4x4 float32) in one object of 2 inner chunks of 2 rows."""
    ckpt = tmp_path / "c"
    xckpt.save({"w": np.arange(16, dtype=np.float32).reshape(4, 4)}, ckpt, inner_chunk_bytes=32)
    assert len(_objects(ckpt, "w")) == 1
    return ckpt


def test_overlapping_index_entries_are_refused(tmp_path: Path) -> None:
    ckpt = _inner_ckpt(tmp_path)
    _edit_index(_objects(ckpt, "w")[0], 2, lambda p: p.__setitem__(1, p[0]))  # both entries: the same bytes
    _expect_refused(ckpt, "chunk.overlap")


def test_an_index_with_a_gap_is_refused(tmp_path: Path) -> None:
    ckpt = _inner_ckpt(tmp_path)

    def shift(pairs: np.ndarray) -> None:
        pairs[:, 0] += 8
    _edit_index(_objects(ckpt, "w")[0], 2, shift, prefix=b"\0" * 8)  # 8 bytes no entry covers
    _expect_refused(ckpt, "chunk.gap")


def test_a_lone_surrogate_in_a_manifest_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    xckpt.save({"w": np.ones(3, np.float32), "s": 1}, ckpt)
    raw = (ckpt / "xckpt.json").read_bytes()
    (ckpt / "xckpt.json").write_bytes(raw.replace(b'["s"]', b'["\\udc80"]'))
    _expect_refused(ckpt, "manifest.unicode")
    # a pair of surrogate escapes is one valid character, and fine
    (ckpt / "xckpt.json").write_bytes(raw.replace(b'"s"', b'"\\ud83d\\ude00"'))
    assert xckpt.load(ckpt)["\U0001F600"] == 1
