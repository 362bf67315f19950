"""Places where the reader and validator once disagreed with spec/xckpt-1.4.md (and its schemas): each
checkpoint is built as the audit's reproducer built it, and both ``xckpt.validate(deep=True)`` and
``xckpt.load`` must give the code the spec gives (section 9: the same defect, the same code)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import crc32c
import jsonschema
import msgpack
import numpy as np
import pytest

import xckpt
from xckpt.errors import XckptError
from xckpt.format import manifest as manifest_format, values as xvalues, zarr as zarr_format

SPEC = Path(__file__).resolve().parents[1] / "spec"
CONF = SPEC / "conformance"
DEFAULT = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 3, "cfg": {"lr": 0.1}}


def _save(path: Path, tree: Any = None) -> Path:
    xckpt.save(DEFAULT if tree is None else tree, path)
    return path


def _copy(src: Path, path: Path) -> Path:
    shutil.copytree(src, path)
    return path


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "xckpt.json").read_bytes())


def _edit(path: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    m = _manifest(path)
    fn(m)
    (path / "xckpt.json").write_text(json.dumps(m))


def _leaf(m: dict[str, Any], key: list[Any]) -> dict[str, Any]:
    return next(e for e in m["leaves"] if e["key"] == key)


def _set_values(path: Path, blob: bytes) -> None:
    (path / "values.msgpack").write_bytes(blob)
    _edit(path, lambda m: m["values"].update(size=len(blob), crc32c=crc32c.crc32c(blob)))


def _top(pairs: bytes) -> bytes:
    """A values file: the top-level extension type 2 around the msgpack bytes of its [index, value] pairs."""
    return msgpack.packb(msgpack.ExtType(xvalues.EXT_DICT, pairs))


def _zarr_json(path: Path, array: str, fn: Callable[[dict[str, Any]], Any]) -> None:
    z = json.loads((path / array / "zarr.json").read_bytes())
    fn(z)
    (path / array / "zarr.json").write_text(json.dumps(z))


def _codes(path: Path) -> tuple[list[str], str | None]:
    """The error codes of a deep validation, and the code a load raises (None: it loads)."""
    report = xckpt.validate(path, deep=True)
    errors = [f.code for f in report.findings if f.severity == "error"]
    for f in report.findings:
        assert f.file, f  # every finding names its file
    try:
        xckpt.load(path)
    except XckptError as exc:
        assert exc.file, str(exc)
        return errors, exc.code
    return errors, None


def _refused(path: Path, code: str) -> None:
    errors, loaded = _codes(path)
    assert code in errors, errors
    assert loaded == code, (loaded, code)


# -- r01, r02: null is a value, not 'absent' -------------------------------------------------------


def test_generation_null_is_a_schema_violation(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    _edit(p, lambda m: m.update(generation=None))
    _refused(p, "manifest.schema")


def test_generation_null_in_1_1_is_a_schema_violation(tmp_path: Path) -> None:
    p = _copy(CONF / "valid_1.1" / "zstd" / "checkpoint", tmp_path / "c")
    _edit(p, lambda m: m.update(generation=None))
    _refused(p, "manifest.schema")


def test_generation_null_cannot_switch_off_the_place_tags(tmp_path: Path) -> None:
    """With the tags stripped (a 1.1 layout) and two objects swapped, a null generation loaded rows in the
    wrong order; it is refused before any object is read."""
    from xckpt.format.regions import Region
    import importlib.util
    spec = importlib.util.spec_from_file_location("xckpt_conformance_generate_sa", CONF / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    p = tmp_path / "c"
    gen.save({"w": gen.HostShards(np.arange(16, dtype=np.float32).reshape(4, 4),
                                  [Region((0, 0), (2, 4)), Region((2, 0), (2, 4))])}, str(p), inner_chunk_bytes=16)
    _edit(p, lambda m: m.update(generation=None))
    for name in ("w/c/0/0", "w/c/1/0"):
        d = (p / name).read_bytes()
        end = len(d) - (16 * 2 + 4)
        (p / name).write_bytes(d[:end - 16] + d[end:])
    a, b = (p / "w/c/0/0").read_bytes(), (p / "w/c/1/0").read_bytes()
    (p / "w/c/0/0").write_bytes(b)
    (p / "w/c/1/0").write_bytes(a)
    _refused(p, "manifest.schema")


def test_orbax_path_null_is_a_schema_violation(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    _edit(p, lambda m: _leaf(m, ["step"]).update(orbax_path=None))
    _refused(p, "manifest.schema")


def test_values_null_is_a_schema_violation(tmp_path: Path) -> None:
    p = _save(tmp_path / "c", {"w": np.arange(4, dtype=np.float32)})
    _edit(p, lambda m: m.update(values=None))
    _refused(p, "manifest.schema")


def test_sharding_null_is_still_allowed(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    _edit(p, lambda m: _leaf(m, ["w"]).update(sharding=None))
    assert _codes(p) == ([], None)


# -- r03: the code of a zarr.json defect is chosen by the check that failed, not by its message ---------


@pytest.mark.parametrize("edit", [lambda z: z.update(data_type="JSON"), lambda z: z.update(JSON=1)],
                         ids=["data_type_JSON", "member_JSON"])
def test_zarr_json_code_does_not_depend_on_the_message(tmp_path: Path, edit: Callable) -> None:
    p = _save(tmp_path / "c")
    _zarr_json(p, "w", edit)
    _refused(p, "array.metadata_mismatch")


def test_metadata_defect_codes() -> None:
    expected = zarr_format.zarr_metadata([2], "float32", [2], [2])
    ok = zarr_format.encode_metadata(expected)
    assert zarr_format.metadata_defect(ok, expected) is None
    assert zarr_format.metadata_defect(b"{", expected)[0] == "array.metadata_json"
    said_json = ok.replace(b'"float32"', b'"JSON"')
    assert zarr_format.metadata_defect(said_json, expected)[0] == "array.metadata_mismatch"
    assert zarr_format.check_metadata(said_json, expected) == zarr_format.metadata_defect(said_json, expected)[1]


# -- r04: counts that are not shapes ---------------------------------------------------------------------


def test_leaf_index_above_2e53_is_a_schema_violation(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    _edit(p, lambda m: m["tree"]["items"][1][1].update(index=2**53))
    _refused(p, "manifest.schema")


def test_values_size_above_2e53_is_a_schema_violation(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    _edit(p, lambda m: m["values"].update(size=2**53))
    _refused(p, "manifest.schema")


def test_a_dimension_above_2e53_is_still_too_large(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    _edit(p, lambda m: _leaf(m, ["w"]).update(shape=[2**53, 4]))
    _refused(p, "shape.too_large")


# -- r05: NaN and Infinity are not JSON ------------------------------------------------------------------


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_manifest_with_nan_or_infinity_is_not_json(tmp_path: Path, token: bytes) -> None:
    p = _save(tmp_path / "c")
    raw = (p / "xckpt.json").read_bytes()
    (p / "xckpt.json").write_bytes(raw.replace(b'"producer":{', b'"producer":{"x":' + token + b",", 1))
    _refused(p, "manifest.json")


def test_zarr_json_with_nan_is_not_json(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    raw = (p / "w/zarr.json").read_bytes()
    assert b'"attributes":{}' in raw
    (p / "w/zarr.json").write_bytes(raw.replace(b'"attributes":{}', b'"attributes":{"a":NaN}'))
    _refused(p, "array.metadata_json")


# -- r06: segment paths are ASCII digits -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["\u0660", "\u00b2"])
def test_segment_path_with_non_ascii_digit_is_unsafe(tmp_path: Path, name: str) -> None:
    p = _copy(CONF / "valid_1.1" / "segmented" / "checkpoint", tmp_path / "c")
    m = _manifest(p)
    e = m["leaves"][0]
    os.rename(p / e["path"] / "0", p / e["path"] / name)
    e["segments"][0]["path"] = name
    (p / "xckpt.json").write_text(json.dumps(m))
    schema = jsonschema.Draft202012Validator(json.loads((SPEC / "manifest-1.1.schema.json").read_text()))
    assert not schema.is_valid(m)
    _refused(p, "path.unsafe")


# -- r07: values.msgpack encodings the rules of section 5 would not have written --------------------------


def _value_leaf_indexes(p: Path) -> dict[str, int]:
    return {".".join(map(str, e["key"])): i for i, e in enumerate(_manifest(p)["leaves"])}


def test_values_entry_for_no_leaf_is_invalid(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    _set_values(p, _top(msgpack.packb([[1, 3], [2, 0.1], [99, "stray"]])))
    _refused(p, "values.invalid")


def test_values_entry_for_an_array_leaf_is_invalid(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    assert _value_leaf_indexes(p)["w"] == 0
    _set_values(p, _top(msgpack.packb([[0, "not the array"], [1, 3], [2, 0.1]])))
    _refused(p, "values.invalid")


def test_values_float32_is_invalid(tmp_path: Path) -> None:
    p = _save(tmp_path / "c", dict(DEFAULT, cfg={"lr": 0.5}))
    _set_values(p, _top(b"\x92" + b"\x92\x01\x03" + b"\x92\x02\xca" + struct.pack(">f", 0.5)))
    _refused(p, "values.invalid")


def test_complex_of_float32_parts_is_invalid(tmp_path: Path) -> None:
    p = _save(tmp_path / "c", {"w": np.arange(2, dtype=np.float32), "z": 1 + 2j})
    i = _value_leaf_indexes(p)["z"]
    inner = msgpack.ExtType(xvalues.EXT_COMPLEX, msgpack.packb([1.0, 2.0], use_single_float=True))
    _set_values(p, _top(msgpack.packb([[i, inner]])))
    _refused(p, "values.invalid")


@pytest.mark.parametrize("value, pairs", [({"a": 1}, [["a", 1]]), ({}, [])], ids=["str_keys", "empty"])
def test_str_keyed_dict_stored_as_ext2_is_invalid(tmp_path: Path, value: dict, pairs: list) -> None:
    p = _save(tmp_path / "c", {"w": np.arange(4, dtype=np.float32), "d": xckpt.Value(value)})
    i = _value_leaf_indexes(p)["d"]
    assert xckpt.load(p)["d"] == value  # as the writer stores it: a map
    inner = msgpack.ExtType(xvalues.EXT_DICT, msgpack.packb(pairs))
    _set_values(p, _top(msgpack.packb([[i, inner]])))
    _refused(p, "values.invalid")


def test_what_the_rules_allow_still_loads(tmp_path: Path) -> None:
    """Floats as float 64, non-str keys as ext 2 (array keys become tuples), a str byte 0xca in data, and
    ints in wider formats than needed (the rules say 'msgpack int', not the shortest)."""
    tree = {"w": np.arange(2, dtype=np.float32), "d": xckpt.Value({(1, 2): "\xca", 3: 0.5}), "n": 7}
    p = _save(tmp_path / "c", tree)
    idx = _value_leaf_indexes(p)
    d = msgpack.ExtType(xvalues.EXT_DICT, msgpack.packb([[[1, 2], "\xca"], [3, 0.5]]))
    body = b"\x92" + b"\x92" + msgpack.packb(idx["d"]) + msgpack.packb(d) + b"\x92" + msgpack.packb(idx["n"]) \
        + b"\xd3" + struct.pack(">q", 7)  # 7 as int 64
    _set_values(p, _top(body))
    report = xckpt.validate(p, deep=True)
    assert report.ok, [str(f) for f in report.findings]
    got = xckpt.load(p)
    assert got["d"] == {(1, 2): "\xca", 3: 0.5} and got["n"] == 7


# -- r11: integer types take integer fill values -----------------------------------------------------------


def test_int_fill_value_written_as_float_is_a_mismatch(tmp_path: Path) -> None:
    p = _save(tmp_path / "c", {"i": np.arange(4, dtype=np.int32)})
    raw = (p / "i/zarr.json").read_bytes()
    assert b'"fill_value":0,' in raw
    (p / "i/zarr.json").write_bytes(raw.replace(b'"fill_value":0,', b'"fill_value":0.0,'))
    _refused(p, "array.metadata_mismatch")


def test_float_fill_value_may_be_written_as_integer(tmp_path: Path) -> None:
    p = _save(tmp_path / "c")
    _zarr_json(p, "w", lambda z: z.update(fill_value=0))
    assert _codes(p) == ([], None)


# -- r12 (r15's output): the current schema accepts what the parser accepts --------------------------------


def test_schema_and_parser_agree_on_version_specific_members() -> None:
    schema = jsonschema.Draft202012Validator(json.loads((SPEC / "manifest-1.4.schema.json").read_text()))
    old = json.loads((CONF / "valid_1.0" / "zstd" / "checkpoint" / "xckpt.json").read_text())
    seg = json.loads((CONF / "valid" / "segmented" / "checkpoint" / "xckpt.json").read_text())
    seg_1_0 = dict(seg, version="1.0")
    del seg_1_0["generation"]
    cases = {
        "1.0 with a generation": (dict(old, generation="0" * 32), False),
        "1.0 with a segmented leaf": (seg_1_0, False),
        "1.1 without a generation": (dict(seg_1_0, version="1.1"), True),
        "1.2 without a generation": (dict(seg_1_0, version="1.2"), False),
        "1.2 with a null generation": (dict(seg, generation=None), False),
        "1.3 without a generation": (dict(seg_1_0, version="1.3"), False),
        "1.3 with a segmented leaf": (dict(seg, version="1.3"), True),
        "1.0 as written": (old, True),
        "1.2 as written": (seg, True),
    }
    for name, (m, ok) in cases.items():
        assert schema.is_valid(m) is ok, name
        try:
            manifest_format.parse(json.dumps(m).encode())
            parsed = True
        except XckptError as exc:
            assert exc.code == "manifest.schema", (name, str(exc))
            parsed = False
        assert parsed is ok, name


# -- r16: nothing under a segmented leaf's directory but its group zarr.json and its segments ------------------


def test_stray_objects_under_a_segmented_leaf_are_unexpected(tmp_path: Path) -> None:
    src = CONF / "valid" / "segmented" / "checkpoint"
    p = _copy(src, tmp_path / "c")
    (p / "emb" / "junk").write_bytes(b"x")
    (p / "emb" / "2" / "c" / "0").mkdir(parents=True)
    (p / "emb" / "2" / "c" / "0" / "0").write_bytes((p / "emb" / "0" / "c" / "0" / "0").read_bytes())
    report = xckpt.validate(p, deep=True)
    found = {Path(f.file).relative_to(p).as_posix(): f for f in report.findings if f.code == "chunk.unexpected"}
    assert set(found) == {"emb/junk", "emb/2/c/0/0"}, [str(f) for f in report.findings]
    assert all(f.leaf == "emb" for f in found.values())
    assert [f.code for f in report.findings if f.severity == "error"] == ["chunk.unexpected"] * 2
    # like chunk_unexpected (spec/conformance): objects no read touches do not stop a load
    np.testing.assert_array_equal(xckpt.load(p)["emb"], xckpt.load(src)["emb"])


# -- r09: the naming rule is the validator's; a reader checks that paths are safe ------------------------------


def test_names_are_checked_by_the_validator_and_paths_by_every_reader(tmp_path: Path) -> None:
    src = CONF / "valid_1.1" / "zstd" / "checkpoint"
    p = _copy(src, tmp_path / "renamed")
    os.rename(p / "small", p / "renamed")
    _edit(p, lambda m: _leaf(m, ["small"]).update(path="renamed"))
    errors, loaded = _codes(p)
    assert errors == ["manifest.path_name"] and loaded is None
    text = (SPEC / "xckpt-1.4.md").read_text()
    item = text[text.index("\n2. check tree depth"):text.index("\n3. derive each array")]
    assert "manifest.path_name" in item and "2.4" in item
    p = _copy(src, tmp_path / "unsafe")
    _edit(p, lambda m: _leaf(m, ["small"]).update(path="../small"))
    _refused(p, "path.unsafe")
