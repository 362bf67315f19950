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


@pytest.mark.parametrize("keep", [20, -40], ids=["shorter_than_its_index", "its_last_bytes_lost"])
def test_truncated_chunk(ckpt, keep):
    """A chunk object cut short is chunk.truncated for a load and a validator alike, also when it still holds more
    bytes than its index (its last bytes, read as the index, would only fail the index's crc32c)."""
    f = _shard_file(ckpt)
    f.write_bytes(f.read_bytes()[:keep])
    with pytest.raises(DataError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "chunk.truncated" and info.value.leaf == "params/w"
    assert "chunk.truncated" in xckpt.validate(ckpt).codes()


def test_crc_mismatch(ckpt):
    f = _shard_file(ckpt)
    data = bytearray(f.read_bytes())
    data[3] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "chunk.crc32c" and info.value.leaf == "params/w"
    # Another leaf is still readable on its own, and a region not touching the bad inner chunk too (64-byte
    # inner chunks: (4, 4) of float32; the flipped byte 3 lies in the first).
    ok = xckpt.load(ckpt, like={"params": {"b": np.zeros(8, np.float32), "w": None}})
    np.testing.assert_array_equal(ok["params"]["b"], np.ones(8, np.float32))
    rows = xckpt.load(ckpt, like={"params": {"w": xckpt.ReadSpec(region=(slice(4, 8), slice(0, 8))), "b": None}})
    np.testing.assert_array_equal(rows["params"]["w"], W[4:8])
    with pytest.raises(IntegrityError):  # while the region holding it fails
        xckpt.load(ckpt, like={"params": {"w": xckpt.ReadSpec(region=(slice(0, 4), slice(0, 4))), "b": None}})


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

    xckpt.release_buffers()  # the pool starts empty: what it holds below is this save's
    big = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # staged before the failure (smaller first)
    failing = _failing_source()
    failing = ArraySource((2048, 1024), "float32", [Shard(Region((0, 0), (2048, 1024)), failing.shards[0].fetch)])
    handle = xckpt.save_async({"a": big, "z": failing}, ckpt, overwrite=True)
    with pytest.raises(SaveError, match="device lost") as info:
        handle.wait()
    assert "nothing was committed" in str(info.value)
    np.testing.assert_array_equal(xckpt.load(ckpt)["params"]["w"], W)  # the previous checkpoint is whole
    assert sorted(os.listdir(ckpt.parent)) == ["c"]
    kept = background._staging._free
    assert sum(b.nbytes for bufs in kept.values() for b in bufs) >= big.nbytes  # big's buffers went back
    xckpt.release_buffers()
    assert not background._staging._free


# -- manifests, values and metadata files crafted against the reader -------------------------------


def _with_tree_item(ckpt, name, node):
    """Add a container without leaves to the manifest's root dict."""
    _edit_manifest(ckpt, lambda m: m["tree"]["items"].append([name, node]))


@pytest.mark.parametrize("name,fields", [("not valid", ["x"]), ("class", ["x"]), ("NT", ["def"]), ("NT", ["x", "x"]),
                                         ("NT", ["_x"]), ("NT", ["x", "_0"]), ("NT", [""])])
def test_namedtuple_name_and_fields_must_be_identifiers(ckpt, name, fields):
    _with_tree_item(ckpt, "nt", {"kind": "namedtuple", "name": name, "fields": fields,
                                 "items": [{"kind": "list", "items": []} for _ in fields]})
    with pytest.raises(ManifestError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "manifest.tree" and info.value.file == str(ckpt / "xckpt.json")
    report = xckpt.validate(ckpt, deep=True)
    assert [f.code for f in report.findings] == ["manifest.tree"]


def test_namedtuple_with_renamed_fields_round_trips(tmp_path):
    import collections

    NT = collections.namedtuple("NT", ["a", "def", "a"], rename=True)  # fields a, _1, _2
    tree = {"n": NT(np.arange(3, dtype=np.int16), 2, "x")}
    xckpt.save(tree, tmp_path / "c")
    got = xckpt.load(tmp_path / "c")["n"]
    assert type(got).__name__ == "NT" and got._fields == ("a", "_1", "_2")
    np.testing.assert_array_equal(got.a, tree["n"].a)
    assert (got._1, got._2) == (2, "x")


def test_a_key_given_twice_in_one_dict_is_refused(tmp_path):
    """Two leaves under one key: a reader would keep one and silently drop the other."""
    path = tmp_path / "c"
    xckpt.save({"x": b"first", "y": b"second"}, path)

    def twice(m):
        next(item for item in m["tree"]["items"] if item[0] == "y")[0] = "x"
        next(e for e in m["leaves"] if e["key"] == ["y"])["key"] = ["x"]
    _edit_manifest(path, twice)
    with pytest.raises(ManifestError) as info:
        xckpt.load(path)
    assert info.value.code == "manifest.tree" and "'x' is given twice" in str(info.value)
    assert [f.code for f in xckpt.validate(path).findings] == ["manifest.tree"]
    # an int key and a str key of the same digits are two keys
    xckpt.save({1: b"int", "1": b"str"}, tmp_path / "d")
    assert xckpt.load(tmp_path / "d") == {1: b"int", "1": b"str"}


def test_a_manifest_member_given_twice_is_refused(ckpt):
    raw = (ckpt / "xckpt.json").read_bytes()
    assert raw.startswith(b'{"format":"xckpt"')
    (ckpt / "xckpt.json").write_bytes(raw.replace(b'{"format":"xckpt"', b'{"format":"xckpt","leaves":[]', 1))
    with pytest.raises(ManifestError) as info:
        xckpt.load(ckpt)
    assert info.value.code == "manifest.json" and "'leaves' appears twice" in str(info.value)
    assert [f.code for f in xckpt.validate(ckpt).findings] == ["manifest.json"]


def _nested(depth):
    v = 1
    for _ in range(depth):
        v = [v]
    return v


def test_values_files_nest_at_most_64_containers(tmp_path):
    """The values file (a dict of every value) nests at most 64 containers, as written and as read."""
    import crc32c
    import msgpack

    from xckpt.format import values as xvalues

    path = tmp_path / "c"
    xckpt.save({"v": xckpt.Value(_nested(63)), "t": xckpt.Value((1, [2, (3,)]))}, path)  # values 0 and 1
    assert xckpt.load(path) == {"v": _nested(63), "t": (1, [2, (3,)])}
    with pytest.raises(xckpt.XckptError):
        xckpt.save({"v": xckpt.Value(_nested(64))}, tmp_path / "d")
    # written by hand: 64 lists in the file's dict, or lists and tuples (each tuple a payload unpacked on its
    # own) 3,000 deep
    tuple_ = lambda v: msgpack.ExtType(xvalues.EXT_TUPLE, msgpack.packb([v]))  # noqa: E731
    deep_mixed = 1
    for i in range(3000):
        deep_mixed = tuple_(deep_mixed) if i % 50 == 0 else [deep_mixed]
    for bad in (_nested(64), deep_mixed):
        blob = msgpack.packb(msgpack.ExtType(xvalues.EXT_DICT, msgpack.packb(
            [[0, bad], [1, msgpack.ExtType(xvalues.EXT_TUPLE, msgpack.packb([1, [2, tuple_(3)]]))]])))
        (path / "values.msgpack").write_bytes(blob)
        _edit_manifest(path, lambda m: m["values"].update(size=len(blob), crc32c=crc32c.crc32c(blob)))
        with pytest.raises(ManifestError) as info:
            xckpt.load(path)
        assert info.value.code == "values.invalid" and "nest deeper than 64" in str(info.value)
        assert info.value.file == str(path / "values.msgpack")
        assert "values.invalid" in [f.code for f in xckpt.validate(path).findings]


def _sparse(path, nbytes):
    """Make ``path`` a file of ``nbytes`` zero bytes that takes no space."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(nbytes)


@pytest.mark.parametrize("name,code,leaf", [("xckpt.json", "resource.too_large", None),
                                            ("params.w/zarr.json", "resource.too_large", "params/w"),
                                            ("values.msgpack", "values.size", None)])
def test_metadata_files_above_their_bound_are_refused_before_reading(ckpt, name, code, leaf):
    """A manifest above 256 MiB, a zarr.json above 1 MiB, a values file larger than the manifest says: each
    refused from its size (the files here are sparse: reading them would allocate gigabytes)."""
    _sparse(ckpt / name, 2 << 30)
    with pytest.raises(XckptError) as info:
        xckpt.load(ckpt)
    assert info.value.code == code and info.value.file == str(ckpt / name) and info.value.leaf == leaf
    report = xckpt.validate(ckpt, deep=True)  # reports, never raises
    assert not report.ok and code in [f.code for f in report.findings]
    if name == "xckpt.json":
        with pytest.raises(XckptError) as info:
            xckpt.inspect(ckpt)
        assert info.value.code == code


def _interrupting_source() -> ArraySource:
    def interrupt() -> np.ndarray:
        raise KeyboardInterrupt  # as Ctrl-C would, where the shard is read
    return ArraySource((64, 64), "float32", [Shard(Region((0, 0), (64, 64)), interrupt)])


@pytest.mark.parametrize("kind", ["save", "save_async"])
def test_an_interrupted_save_removes_what_it_made(ckpt, kind):
    """Ctrl-C in the middle of a save (a KeyboardInterrupt where a shard is read, after other chunks were
    written or staged): the interrupt goes on up, the previous checkpoint is whole, nothing is left beside it
    and no lease is kept alive (a loop or notebook that catches the interrupt would otherwise hold a partial
    checkpoint that gc and later saves take for a live save)."""
    import threading

    tree = {"a": np.arange(1 << 16, dtype=np.float32), "z": _interrupting_source()}
    with pytest.raises(KeyboardInterrupt):
        if kind == "save":
            xckpt.save(tree, ckpt, overwrite=True)
        else:
            xckpt.save_async(tree, ckpt, overwrite=True).wait()
    assert sorted(os.listdir(ckpt.parent)) == ["c"]
    assert not [t.name for t in threading.enumerate() if t.name == "xckpt-lease"]
    np.testing.assert_array_equal(xckpt.load(ckpt)["params"]["w"], W)
    assert xckpt.gc(ckpt.parent) == []
    xckpt.save({"x": np.ones(2)}, ckpt, overwrite=True)  # the next save goes ahead
    np.testing.assert_array_equal(xckpt.load(ckpt)["x"], np.ones(2))


@pytest.mark.parametrize("kind", ["save", "save_async"])
@pytest.mark.parametrize("bad", ["a\ud800b", 10 ** 5000, xckpt.Value([{1, 2}])], ids=["surrogate", "huge_int", "set"])
def test_a_value_that_cannot_be_stored_is_refused_first_naming_its_leaf(tmp_path, kind, bad):
    """A str that is not valid Unicode, an int beyond 4300 digits, a set inside a Value: refused while the tree is
    described, before any array is written, naming the leaf."""
    tree = {"weights": np.ones(1000, np.float32), "cfg": {"run": {"name": bad}}}
    with pytest.raises(XckptError) as info:
        if kind == "save":
            xckpt.save(tree, tmp_path / "c")
        else:
            xckpt.save_async(tree, tmp_path / "c").wait()
    assert info.value.code == "value.unsupported" and info.value.leaf == "cfg/run/name", info.value
    assert info.value.file == str(tmp_path / "c"), info.value  # the save it stopped
    assert os.listdir(tmp_path) == []  # nothing was written, not even a temporary directory


@pytest.mark.parametrize("tree", [{"a:b": np.ones(2)}, {"m": {"loss:train": 1.5}}, {"n": {"x:y": 3}}],
                         ids=["array", "float", "int"])
def test_a_key_with_a_colon_is_refused_where_it_names_a_path(tmp_path, tree):
    """An array's name and a number's Orbax mirror are paths, which a reader refuses with ':' in them: refused
    before anything is written (it used to commit a checkpoint no reader opens); a string keeps its ':'."""
    with pytest.raises(XckptError) as info:
        xckpt.save(tree, tmp_path / "c")
    assert info.value.code == "tree.invalid" and ":" in info.value.leaf and "':'" in str(info.value)
    assert os.listdir(tmp_path) == []
    xckpt.save({"cfg": {"model:name": "gpt"}}, tmp_path / "s")
    assert xckpt.load(tmp_path / "s") == {"cfg": {"model:name": "gpt"}}


def test_a_target_object_that_fails_to_restore_itself_is_named(tmp_path):
    """An object of the target restores its own state (load_state_dict) and raises: load.restore naming its leaf,
    not the object's raw error."""
    torch = pytest.importorskip("torch")
    xckpt.torch  # noqa: B018 - registers the adapter

    class Loader:
        def __init__(self):
            self.pos = 0

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, sd):
            raise ValueError("this loader cannot seek")

    loader = Loader()
    loader.pos = 7
    xckpt.save({"w": torch.ones(3), "data": loader}, tmp_path / "c")
    with pytest.raises(XckptError) as info:
        xckpt.load(tmp_path / "c", like={"w": torch.zeros(3), "data": Loader()})
    assert info.value.code == "load.restore" and info.value.leaf == "data", info.value
    assert "cannot seek" in str(info.value) and "Loader" in str(info.value)


@pytest.mark.parametrize("staging", [None, 0])
def test_values_a_narrower_target_cannot_hold_are_refused_before_any_target_is_written(tmp_path, staging):
    """An int64 of 2**40 into int32 would wrap to 0, a float64 of 1e39 become inf in float32, a NaN an arbitrary
    integer: each is refused naming its leaf, and no in-place target is written, staged or not
    (``max_staging_bytes=0``); values that fit load exactly, and rounding (float64 into float32) is no refusal."""
    import ml_dtypes

    tree = {"a": np.array([1, 2**40, -5], np.int64), "f": np.array([1e39, 1.5, np.inf]), "n": np.array([np.nan, 1.0]),
            "ok": np.array([1, -7, 127], np.int64), "r": np.array([0.1, np.nan, -np.inf])}
    xckpt.save(tree, tmp_path / "c")
    kw = {} if staging is None else {"max_staging_bytes": staging}
    for key, target, shown in (("a", np.zeros(3, np.int32), "1099511627776"), ("f", np.zeros(3, np.float32), "1e+39"),
                               ("n", np.zeros(2, np.int64), "nan"), ("f", np.zeros(3, ml_dtypes.bfloat16), "1e+39"),
                               ("a", np.zeros(3, np.uint64), "-5")):
        first = np.zeros(3, np.int64)
        with pytest.raises(xckpt.KeyMismatchError) as e:
            xckpt.load(tmp_path / "c", like={"ok": first, key: target}, partial=True, **kw)
        assert (e.value.leaf, e.value.file) == (key, str(tmp_path / "c")) and shown in str(e.value), str(e.value)
        assert (first == 0).all() and (target == 0).all()  # nothing written, to either target
    out = xckpt.load(tmp_path / "c", like={"ok": np.zeros(3, np.int8), "r": np.zeros(3, np.float32)}, partial=True,
                     **kw)
    np.testing.assert_array_equal(out["ok"], np.array([1, -7, 127], np.int8))
    np.testing.assert_array_equal(out["r"], np.array([0.1, np.nan, -np.inf], np.float32))


def test_a_result_that_fails_to_build_leaves_in_place_targets_untouched(tmp_path):
    """A framework's result built from what was read (JAX arrays put on their devices, say) can fail, e.g. out of
    device memory: the in-place targets of the same load, staged, are not written before every such result is
    built."""
    torch = pytest.importorskip("torch")
    from xckpt import registry
    from xckpt.registry import ArrayTarget

    class Flaky:
        """A target whose result cannot be built (a device out of memory)."""

    def flaky_target(like: Flaky, entry) -> ArrayTarget:
        def build(parts):
            raise MemoryError("device out of memory")
        return ArrayTarget(tuple(entry.shape), None, [Region.full(tuple(entry.shape))], build)

    registry.register_target(lambda obj: isinstance(obj, Flaky), flaky_target)
    xckpt.save({"a": np.arange(4, dtype=np.float32), "b": np.arange(6, dtype=np.int64)}, tmp_path / "c")
    a = torch.zeros(4)  # filled in place
    with pytest.raises(BaseException) as e:
        xckpt.load(tmp_path / "c", like={"a": a, "b": Flaky()})
    assert "device out of memory" in str(e.value)
    assert (a == 0).all()  # untouched
    out = xckpt.load(tmp_path / "c", like={"a": a, "b": np.zeros(6, np.int64)})
    assert out["a"] is a
    np.testing.assert_array_equal(a.numpy(), np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(out["b"], np.arange(6))
