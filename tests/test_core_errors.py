"""Bad input gives a specific xckpt error naming file and leaf; failed saves damage nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import xckpt
from xckpt.errors import DataError, IntegrityError, ManifestError, NotACheckpointError, SaveError, ShapeError, UnsafePathError, VersionError, XckptError
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard

W = np.arange(64, dtype=np.float32).reshape(8, 8)


@pytest.fixture()
def ckpt(tmp_path):
    path = tmp_path / "c"
    xckpt.save({"params": {"w": W, "b": np.ones(8, np.float32)}, "step": 3}, path, inner_chunk_bytes=64)
    return path


def _edit_manifest(path, fn):
    m = json.loads((path / "xckpt.json").read_text())
    fn(m)
    (path / "xckpt.json").write_text(json.dumps(m))


def _shard_file(path):
    return path / "params.w" / "c" / "0" / "0"


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError) as info:
        xckpt.load(tmp_path / "empty")
    assert info.value.code == "manifest.missing" and info.value.file.endswith("xckpt.json")


@pytest.mark.parametrize("text", ["{", "", "[]", "\xff\xfe", '{"format": "xckpt", "version": "1.0"'])
def test_corrupt_or_truncated_manifest(ckpt, text):
    (ckpt / "xckpt.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ManifestError) as info:
        xckpt.load(ckpt)
    assert info.value.code in ("manifest.json", "manifest.schema") and "xckpt.json" in info.value.file


def test_unknown_version(ckpt):
    _edit_manifest(ckpt, lambda m: m.update(version="2.0"))
    with pytest.raises(VersionError, match="'2.0' is not supported"):
        xckpt.load(ckpt)


def test_huge_shape_refused_before_any_allocation(ckpt):
    def grow(m):
        leaf = next(x for x in m["leaves"] if x["key"] == ["params", "w"])
        leaf["shape"] = [2**30, 2**30]
    _edit_manifest(ckpt, grow)
    with pytest.raises(ShapeError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "shape.too_large" and info.value.leaf == "params/w"


def test_path_outside_checkpoint(ckpt):
    def escape(m):
        next(x for x in m["leaves"] if x["key"] == ["params", "w"])["path"] = "../elsewhere"
    _edit_manifest(ckpt, escape)
    with pytest.raises(UnsafePathError) as info:
        xckpt.load(ckpt)
    assert info.value.leaf == "params/w"


def test_missing_chunk(ckpt):
    os.remove(_shard_file(ckpt))
    with pytest.raises(DataError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "chunk.missing" and info.value.leaf == "params/w"
    assert info.value.file.endswith("params.w/c/0/0")  # the missing chunk object itself


def test_truncated_chunk(ckpt):
    f = _shard_file(ckpt)
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(DataError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "chunk.truncated" and info.value.leaf == "params/w"


def test_crc_mismatch(ckpt):
    f = _shard_file(ckpt)
    data = bytearray(f.read_bytes())
    data[3] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "chunk.crc32c" and info.value.leaf == "params/w"
    # Another leaf is still readable on its own, and a region not touching the bad chunk too.
    ok = xckpt.load(ckpt, like={"params": {"b": np.zeros(8, np.float32), "w": None}})
    np.testing.assert_array_equal(ok["params"]["b"], np.ones(8, np.float32))


def test_values_crc_mismatch(ckpt):
    f = ckpt / "values.msgpack"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "values.crc32c" and info.value.file.endswith("values.msgpack")


def test_zarr_json_disagreeing_with_manifest(ckpt):
    meta = json.loads((ckpt / "params.w" / "zarr.json").read_text())
    meta["shape"] = [8, 9]
    (ckpt / "params.w" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(XckptError) as info:
        xckpt.load(ckpt)
    assert info.value.leaf == "params/w"


def test_existing_checkpoint_not_overwritten_by_default(ckpt):
    before = (ckpt / "xckpt.json").read_bytes()
    with pytest.raises(SaveError) as info:
        xckpt.save({"x": np.zeros(2)}, ckpt)
    assert info.value.code == "save.exists"
    assert (ckpt / "xckpt.json").read_bytes() == before


def _failing_source() -> ArraySource:
    def boom() -> np.ndarray:
        raise RuntimeError("device lost")
    return ArraySource((4,), "float32", [Shard(Region((0,), (4,)), boom)])


def test_failed_overwrite_leaves_previous_checkpoint_whole(ckpt):
    with pytest.raises(SaveError, match="device lost"):
        xckpt.save({"params": {"w": np.zeros((8, 8), np.float32)}, "bad": _failing_source()}, ckpt, overwrite=True)
    out = xckpt.load(ckpt)
    np.testing.assert_array_equal(out["params"]["w"], W)
    assert xckpt.validate(ckpt, deep=True).ok
    assert sorted(os.listdir(ckpt.parent)) == ["c"]  # no temporary directory left behind


def test_successful_overwrite_replaces(ckpt):
    xckpt.save({"x": np.full(3, 7.0)}, ckpt, overwrite=True)
    out = xckpt.load(ckpt)
    assert list(out) == ["x"]
    np.testing.assert_array_equal(out["x"], np.full(3, 7.0))
    assert sorted(os.listdir(ckpt.parent)) == ["c"]


def test_shards_that_do_not_tile_are_refused(tmp_path):
    src = ArraySource((10,), "float32", [Shard(Region((0,), (4,)), lambda: np.zeros(4, np.float32)),
                                         Shard(Region((6,), (4,)), lambda: np.zeros(4, np.float32))])
    with pytest.raises(ShapeError, match="cover 8 of 10"):
        xckpt.save({"x": src}, tmp_path / "c")
    assert not os.listdir(tmp_path)


def test_shard_data_of_wrong_shape_is_refused(tmp_path):
    src = ArraySource((4,), "float32", [Shard(Region((0,), (4,)), lambda: np.zeros(3, np.float32))])
    with pytest.raises(SaveError, match="shape"):
        xckpt.save({"x": src}, tmp_path / "c")
    assert not os.listdir(tmp_path)


def test_symbolic_link_to_a_chunk_is_refused_on_load(ckpt):
    shard = _shard_file(ckpt)
    moved = ckpt.parent / "elsewhere"
    os.rename(shard, moved)
    os.symlink(moved, shard)
    M = xckpt.mapping
    for mapping in (None, M.Mapping(M.rename("params/w", "params/wt", M.transpose(1, 0)), M.drop("params/b"))):
        with pytest.raises(UnsafePathError) as info:
            xckpt.load(ckpt, like={"params": {"w" if mapping is None else "wt": np.zeros((8, 8), np.float32),
                                              "b": None}}, mapping=mapping)
        assert info.value.code == "path.link" and info.value.leaf == "params/w"
    # reading only another array touches no link and works
    part = xckpt.load(ckpt, like={"params": {"w": None, "b": np.zeros(8, np.float32)}})
    np.testing.assert_array_equal(part["params"]["b"], np.ones(8, np.float32))


def test_save_async_staging_failure_is_raised_by_wait_and_commits_nothing(ckpt):
    from xckpt.engine import background

    big = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # staged before the failure
    handle = xckpt.save_async({"a": big, "z": _failing_source()}, ckpt, overwrite=True)
    with pytest.raises(SaveError, match="device lost") as info:
        handle.wait()
    assert "nothing was committed" in str(info.value)
    np.testing.assert_array_equal(xckpt.load(ckpt)["params"]["w"], W)  # the previous checkpoint is whole
    assert sorted(os.listdir(ckpt.parent)) == ["c"]
    kept = background._staging._free
    assert sum(len(v) for v in kept.values()) >= 1  # the staged buffer went back to the pool
    xckpt.release_buffers()
    assert not background._staging._free
