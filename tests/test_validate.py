"""The validator beyond the conformance vectors: warnings, Orbax name rules, zarr.json strictness,
deep manifests, and random corruption (never a crash; deep validation catches every flipped byte)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import xckpt
from xckpt.format import names as naming, values as xvalues
from xckpt.format import orbax_view as orbax_files
from xckpt.errors import XckptError
from xckpt.format.manifest import parse
from xckpt.validate import Finding, Report

CONF = Path(__file__).resolve().parents[1] / "spec" / "conformance"
SHARDED = CONF / "valid" / "sharded" / "checkpoint"
SHARDED_1_1 = CONF / "valid_1.1" / "sharded" / "checkpoint"
ZSTD = CONF / "valid" / "zstd" / "checkpoint"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _edit_json(path: Path, fn: Callable[[Any], Any]) -> None:
    """Change a JSON file in place; ``fn`` returning a list replaces the whole document with it."""
    obj = json.loads(path.read_text())
    out = fn(obj)
    path.write_text(json.dumps(out if isinstance(out, list) else obj, indent=1))


def _rewrite_orbax(ckpt: Path) -> None:
    """Recompute _METADATA from the (edited) manifest, so that only the defect under test remains."""
    m = parse((ckpt / naming.MANIFEST).read_bytes())
    strings = {e.key: "" for e in m.leaves if getattr(e, "type", None) == "str"}  # only the records matter here
    (ckpt / naming.ORBAX_METADATA).write_bytes(orbax_files.metadata_json(m, strings))


def _errors(report: Report) -> list[str]:
    return [f.code for f in report.findings if f.severity == "error"]


def test_warnings_do_not_make_a_checkpoint_invalid(tmp_path: Path) -> None:
    ckpt = _copy(SHARDED, tmp_path / "c")
    (ckpt / naming.COMMIT).unlink()
    (ckpt / "notes.txt").write_text("left here by hand")
    report = xckpt.validate(ckpt)
    assert report.ok and _errors(report) == []
    assert sorted(report.codes()) == ["commit.missing", "path.unexpected"]
    unexpected = next(f for f in report.findings if f.code == "path.unexpected")
    assert unexpected.file == str(ckpt / "notes.txt") and unexpected.severity == "warning"
    assert "WARNING path.unexpected" in str(unexpected)


def test_special_files_are_reported(tmp_path: Path) -> None:
    ckpt = _copy(SHARDED, tmp_path / "c")
    os.mkfifo(ckpt / "w" / "c" / "pipe")  # never opened: reading a FIFO would block
    report = xckpt.validate(ckpt)
    assert "path.special" in report.codes() and not report.ok


def test_report_json_and_counts() -> None:
    shallow = xckpt.validate(SHARDED)
    deep = xckpt.validate(SHARDED, deep=True)
    assert shallow.bytes_checked == 0 and deep.bytes_checked > 0
    # 4 + 3 + 1 shard objects of the arrays, plus the 0-d mirror of the value 'step'
    assert shallow.arrays == 3 and shallow.chunks == deep.chunks == 9
    out = deep.to_json()
    assert out == json.loads(json.dumps(out))
    assert out["ok"] is True and out["deep"] is True and out["findings"] == []
    f = Finding("chunk.missing", "gone", "/x/w/c/0", "w")
    assert str(f) == "ERROR chunk.missing: gone [leaf w, /x/w/c/0]"


def test_string_value_sharing_an_orbax_name_with_an_array(tmp_path: Path) -> None:
    """'a.b' as a string leaf and ['a', 'b'] as an array: both would be 'a.b' for Orbax."""
    ckpt = tmp_path / "c"
    xckpt.save({"a": {"b": np.arange(3)}, "s": "text"}, ckpt)

    def rename(m: dict[str, Any]) -> None:
        m["tree"]["items"][1][0] = "a.b"
        m["leaves"][1]["key"] = ["a.b"]
    _edit_json(ckpt / naming.MANIFEST, rename)
    _rewrite_orbax(ckpt)
    (ckpt / "_strings.json").write_text(json.dumps({"a.b": "text"}))
    report = xckpt.validate(ckpt)
    assert report.codes() == ["manifest.path_collision"], [str(f) for f in report.findings]
    assert report.findings[0].leaf == "a.b"


def test_array_path_that_is_not_the_joined_key(tmp_path: Path) -> None:
    ckpt = _copy(SHARDED_1_1, tmp_path / "c")  # format 1.1: chunk objects carry no place tag
    os.rename(ckpt / "v", ckpt / "vv")
    _edit_json(ckpt / naming.MANIFEST, lambda m: m["leaves"][1].update(path="vv"))
    report = xckpt.validate(ckpt)
    assert report.codes() == ["manifest.path_name"] and report.findings[0].leaf == "v"
    np.testing.assert_array_equal(xckpt.load(ckpt)["v"], np.arange(10) * 3 - 7)  # readers follow 'path'


def test_a_renamed_array_directory_is_refused_by_its_place_tags(tmp_path: Path) -> None:
    ckpt = _copy(SHARDED, tmp_path / "c")
    os.rename(ckpt / "v", ckpt / "vv")
    _edit_json(ckpt / naming.MANIFEST, lambda m: m["leaves"][1].update(path="vv"))
    report = xckpt.validate(ckpt)
    # the 3 chunk objects moved with the directory: their place tags still name 'v/c/...'
    assert report.codes() == ["manifest.path_name"] + ["chunk.place"] * 3
    assert [f.file for f in report.findings[1:]] == [str(ckpt / "vv" / "c" / str(i)) for i in range(3)]
    with pytest.raises(XckptError) as err:
        xckpt.load(ckpt)
    assert err.value.code == "chunk.place" and err.value.leaf == "v"


@pytest.mark.parametrize("edit, code", [
    (lambda m: m["leaves"][3].pop("orbax_path"), "orbax.mismatch"),  # an int that Orbax must see
    (lambda m: m["leaves"][3].update(orbax_path="step"), None),  # control: unchanged
])
def test_scalar_mirror_required_exactly_for_mirrorable_values(tmp_path: Path, edit: Callable, code: str | None
                                                               ) -> None:
    ckpt = _copy(SHARDED, tmp_path / "c")
    _edit_json(ckpt / naming.MANIFEST, edit)
    _rewrite_orbax(ckpt)
    if code is None:
        assert xckpt.validate(ckpt).findings == []
        return
    shutil.rmtree(ckpt / "step")
    report = xckpt.validate(ckpt)
    assert report.codes() == [code] and "mirror" in report.findings[0].message
    assert report.findings[0].leaf == "step"


def test_mirror_on_a_value_orbax_cannot_hold(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    xckpt.save({"big": 2**70, "w": np.ones(2)}, ckpt)
    _edit_json(ckpt / naming.MANIFEST, lambda m: m["leaves"][0].update(orbax_path="big"))
    _rewrite_orbax(ckpt)
    report = xckpt.validate(ckpt)
    assert "orbax.mismatch" in report.codes() and report.findings[0].leaf == "big"


@pytest.mark.parametrize("edit, code", [
    (lambda z: z.update(storage_transformers=[{"name": "x"}]), "array.metadata_mismatch"),
    (lambda z: z.update(must_understand_this={"must_understand": True}), "array.metadata_mismatch"),
    (lambda z: z.update(chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}}),
     "array.metadata_mismatch"),
    (lambda z: z.update(chunk_key_encoding={"name": "default", "configuration": {"separator": "."}}),
     "array.metadata_mismatch"),
    (lambda z: z.update(chunk_key_encoding={"name": "default", "configuration": {"seperator": "."}}),
     "array.metadata_mismatch"),  # a misspelt member is not the default separator
    (lambda z: z.update(chunk_key_encoding={"name": "default", "configuration": {"separator": "/", "x": 1}}),
     "array.metadata_mismatch"),
    (lambda z: z.update(chunk_key_encoding={"name": "default", "configuration": {"separator": "/"}, "extra": {}}),
     "array.metadata_mismatch"),
    (lambda z: z.update(fill_value=1.0), "array.metadata_mismatch"),
    (lambda z: z["codecs"][0]["configuration"].update(index_location="start"), "array.metadata_mismatch"),
    (lambda z: [z], "array.metadata_json"),
    (lambda z: z.update(attributes={"note": "free"}, dimension_names=["rows", "cols"]), None),
    (lambda z: z["codecs"][0]["configuration"].update(index_location="end"), None),
    (lambda z: z.update(chunk_key_encoding={"name": "default", "configuration": {"separator": "/"}}), None),
    (lambda z: z.update(chunk_key_encoding={"name": "default"}), None),  # the configuration may be omitted
])
def test_zarr_json_is_checked_strictly(tmp_path: Path, edit: Callable, code: str | None) -> None:
    ckpt = _copy(SHARDED, tmp_path / "c")
    _edit_json(ckpt / "w" / "zarr.json", edit)
    report = xckpt.validate(ckpt)
    assert report.codes() == ([] if code is None else [code]), [str(f) for f in report.findings]


def test_bool_fill_value_must_be_false_not_zero(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    xckpt.save({"mask": np.array([True, False])}, ckpt)
    assert xckpt.validate(ckpt).ok
    _edit_json(ckpt / "mask" / "zarr.json", lambda z: z.update(fill_value=0))
    assert xckpt.validate(ckpt).codes() == ["array.metadata_mismatch"]


def _write_nested(ckpt: Path, depth: int) -> None:
    """A manifest whose tree nests ``depth`` lists around one None value."""
    blob = xvalues.encode({0: None})
    (ckpt / naming.VALUES).write_bytes(blob)
    tree = '{"kind": "leaf", "index": 0}'
    for _ in range(depth):
        tree = '{"kind": "list", "items": [' + tree + "]}"
    leaf = json.dumps({"key": [0] * depth, "kind": "value", "type": "none"})
    values = json.dumps({"path": naming.VALUES, "size": len(blob), "crc32c": crc32c.crc32c(blob)})
    (ckpt / naming.MANIFEST).write_text(
        '{"format": "xckpt", "version": "1.0", "producer": {"library": "x", "library_version": "0"}, '
        f'"tree": {tree}, "leaves": [{leaf}], "values": {values}}}')


@pytest.mark.parametrize("depth, code", [(64, None), (65, "manifest.tree"), (5000, "manifest.json")])
def test_deeply_nested_manifests_are_refused_not_crashed_on(tmp_path: Path, depth: int, code: str | None) -> None:
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    _write_nested(ckpt, depth)
    report = xckpt.validate(ckpt)
    if code is None:  # readable; only the Orbax files and the commit marker are missing
        assert report.codes() == ["commit.missing", "orbax.missing", "orbax.checkpoint_metadata"], report.codes()
        loaded = xckpt.load(ckpt)
        for _ in range(depth):
            assert type(loaded) is list and len(loaded) == 1
            loaded = loaded[0]
        assert loaded is None
        return
    assert report.codes() == [code]
    with pytest.raises(XckptError) as info:
        xckpt.load(ckpt)
    assert info.value.code == code


def test_save_refuses_trees_deeper_than_the_format_allows(tmp_path: Path) -> None:
    tree: Any = np.zeros(1)
    for _ in range(65):
        tree = [tree]
    with pytest.raises(XckptError) as info:
        xckpt.save(tree, tmp_path / "c")
    assert info.value.code == "tree.too_deep" and not (tmp_path / "c").exists()
    xckpt.save(tree[0], tmp_path / "ok")  # 64 levels: saved, and readable
    assert xckpt.validate(tmp_path / "ok").ok
    loaded = xckpt.load(tmp_path / "ok")
    for _ in range(64):
        loaded = loaded[0]
    np.testing.assert_array_equal(loaded, np.zeros(1))


def _data_files(root: Path) -> list[str]:
    """Files every byte of which a crc32c covers: shard objects and values.msgpack."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and (p.name == naming.VALUES or p.parent.name == "c" or p.parent.parent.name == "c"
                                      or p.name == "c"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from([SHARDED, ZSTD]), st.data())
def test_deep_validation_and_load_catch_any_corrupted_byte(tmp_path: Path, base: Path, data: st.DataObject) -> None:
    ckpt = tmp_path / "fuzz"
    shutil.rmtree(ckpt, ignore_errors=True)
    _copy(base, ckpt)
    name = data.draw(st.sampled_from(_data_files(ckpt)))
    blob = bytearray((ckpt / name).read_bytes())
    at = data.draw(st.integers(0, len(blob) - 1))
    blob[at] ^= data.draw(st.integers(1, 255))
    (ckpt / name).write_bytes(bytes(blob))
    report = xckpt.validate(ckpt, deep=True)
    assert not report.ok, (name, at)
    assert any(f.file and f.file.endswith(name) for f in report.findings), [str(f) for f in report.findings]
    if name.split("/")[0] == "step":
        return  # the 0-d mirror of a value exists for Orbax only: xckpt's loader never reads it
    with pytest.raises(XckptError):
        xckpt.load(ckpt)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_corruption_of_any_file_gives_findings_never_a_crash(tmp_path: Path, data: st.DataObject) -> None:
    """Whatever byte of whatever file changes (or however a file is cut), the validator reports findings
    and never raises; when it finds nothing wrong, the load gives exactly the original data."""
    ckpt = tmp_path / "fuzz"
    shutil.rmtree(ckpt, ignore_errors=True)
    _copy(SHARDED, ckpt)
    original = xckpt.load(ckpt)
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    name = data.draw(st.sampled_from(files))
    blob = bytearray((ckpt / name).read_bytes())
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] ^= data.draw(st.integers(1, 255))
    else:
        blob = blob[:data.draw(st.integers(0, len(blob) - 1))]
    (ckpt / name).write_bytes(bytes(blob))
    report = xckpt.validate(ckpt, deep=True)
    try:
        loaded = xckpt.load(ckpt)
    except XckptError:
        assert not report.ok or name in (naming.ORBAX_CHECKPOINT_METADATA,), (name, report.codes())
        return
    if report.ok:
        for key in ("w", "v", "bias"):
            np.testing.assert_array_equal(loaded[key], original[key])
            assert loaded[key].dtype == original[key].dtype
        assert loaded["step"] == original["step"]


# -- found in an audit of the validator ----------------------------------------------------------------


def test_the_same_defect_in_two_leaves_is_reported_for_each(tmp_path: Path) -> None:
    """Findings were deduplicated by code and file alone: the manifest.path_name of a second leaf (same file,
    xckpt.json) was dropped."""
    ckpt = tmp_path / "c"
    xckpt.save({"w": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}, ckpt)

    def rename(m: dict[str, Any]) -> None:
        for e in m["leaves"]:
            os.rename(ckpt / e["path"], ckpt / ("x" + e["path"]))
            e["path"] = "x" + e["path"]

    _edit_json(ckpt / naming.MANIFEST, rename)
    report = xckpt.validate(ckpt)
    named = sorted(f.leaf for f in report.findings if f.code == "manifest.path_name")
    assert named == ["b", "w"], report.findings


def test_links_and_special_files_name_their_leaf(tmp_path: Path) -> None:
    """A link or FIFO inside an array's directory is reported once, naming the leaf (the directory walk's
    finding, which had no leaf, hid the read's, which had it)."""
    ckpt = tmp_path / "c"
    xckpt.save({"model": {"w": np.ones((4, 4), np.float32), "b": np.zeros(2, np.float32)}}, ckpt)
    os.remove(ckpt / "model.w" / "zarr.json")
    os.mkfifo(ckpt / "model.w" / "zarr.json")
    (ckpt / "model.b" / "c" / "0").unlink()
    os.symlink("/etc/passwd", ckpt / "model.b" / "c" / "0")
    report = xckpt.validate(ckpt, deep=True)
    got = sorted((f.code, f.leaf, f.file) for f in report.findings)
    assert got == [("path.link", "model/b", str(ckpt / "model.b" / "c" / "0")),
                   ("path.special", "model/w", str(ckpt / "model.w" / "zarr.json"))], got


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops root's permission override with setpriv")
def test_a_directory_that_cannot_be_listed_is_a_finding(tmp_path: Path) -> None:
    """It stopped the validation with a traceback from xckpt.validate() (exit 2, "cannot be opened", from the
    command line) instead of a finding; the rest of the checkpoint is still checked."""
    import subprocess
    import sys

    ckpt = tmp_path / "c"
    xckpt.save({"w": np.ones((4, 4), np.float32), "b": np.zeros(2, np.float32)}, ckpt)
    os.symlink("/etc/passwd", ckpt / "b" / "c" / "link")
    os.chmod(ckpt / "w" / "c", 0)
    try:
        out = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", sys.executable,
                              "-m", "xckpt", "validate", "--json", str(ckpt)], capture_output=True, text=True,
                             timeout=120)
    finally:
        os.chmod(ckpt / "w" / "c", 0o755)
    assert out.returncode == 1, (out.stdout, out.stderr)
    got = sorted((f["code"], f["leaf"], f["file"]) for f in json.loads(out.stdout)["findings"])
    assert got == [("chunk.unexpected", "b", str(ckpt / "b" / "c" / "link")),
                   ("io.read", "w", str(ckpt / "w" / "c")),
                   ("path.link", "b", str(ckpt / "b" / "c" / "link"))], got


def test_deep_validation_checks_inner_chunks_outside_the_array(tmp_path: Path) -> None:
    """'v' (10 elements, chunks of 4, inner chunks of 2): its last chunk object holds one inner chunk in the
    array and one wholly outside it. Deep validation crc-checked only the first: a stored inner chunk with a
    wrong crc32c went unreported."""
    from xckpt.format import shard

    ckpt = _copy(SHARDED, tmp_path / "c")
    gen = json.loads((ckpt / naming.MANIFEST).read_text())["generation"]
    name = "v/c/2"
    old = (ckpt / name).read_bytes()
    first = old[:20]  # inner chunk 0: 2 int64 and their crc32c
    payload = np.array([5, 6], "<i8").tobytes()
    second = payload + (crc32c.crc32c(payload) ^ 1).to_bytes(4, "little")
    index = np.array([[0, 20], [20, 20]], "<u8").tobytes()
    index += crc32c.crc32c(index).to_bytes(4, "little")
    tag = shard.place_tag(shard.place_of(gen, name), index)
    (ckpt / name).write_bytes(first + second + tag + index)
    assert xckpt.validate(ckpt).ok  # the index is sound
    assert xckpt.load(ckpt)["v"].tolist() == (np.arange(10) * 3 - 7).tolist()  # no read touches it
    report = xckpt.validate(ckpt, deep=True)
    assert [(f.code, f.file, f.leaf) for f in report.findings] == [("chunk.crc32c", str(ckpt / name), "v")]


def test_deep_validation_reads_a_large_inner_chunk_in_pieces(tmp_path: Path) -> None:
    """One 48 MiB inner chunk was read whole into memory to check its crc32c; now in bounded pieces (a flipped
    byte in its middle is still found)."""
    import tracemalloc

    ckpt = tmp_path / "c"
    xckpt.save({"w": np.arange(12 << 20, dtype=np.float32)}, ckpt, inner_chunk_bytes=64 << 20)
    assert json.loads((ckpt / naming.MANIFEST).read_text())["leaves"][0]["inner_chunk_shape"] == [12 << 20]
    tracemalloc.start()
    try:
        report = xckpt.validate(ckpt, deep=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.ok and report.bytes_checked == (48 << 20) + 4
    assert peak < 24 << 20, peak  # pieces of 16 MiB
    chunk = ckpt / "w" / "c" / "0"
    with open(chunk, "r+b") as f:
        f.seek(30 << 20)
        byte = f.read(1)
        f.seek(30 << 20)
        f.write(bytes([byte[0] ^ 1]))
    assert [f.code for f in xckpt.validate(ckpt, deep=True).findings] == ["chunk.crc32c"]
