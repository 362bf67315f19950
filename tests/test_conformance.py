"""The conformance vectors of spec/conformance: valid ones validate deeply and load to their
expected trees; invalid ones give their expected code from the validator, the loader and the CLI."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

import xckpt
from xckpt.cli import main as cli_main
from xckpt.errors import XckptError

SPEC = Path(__file__).resolve().parents[1] / "spec"
CONF = SPEC / "conformance"
VALID = sorted(p.name for p in (CONF / "valid").iterdir())
INVALID = sorted(p.name for p in (CONF / "invalid").iterdir())
#: Vectors written by the format 1.0 and 1.1 writers, kept as they were: a 1.2 reader reads them.
VALID_1_0 = sorted(p.name for p in (CONF / "valid_1.0").iterdir())
VALID_1_1 = sorted(p.name for p in (CONF / "valid_1.1").iterdir())
OLD = [("valid_1.0", n) for n in VALID_1_0] + [("valid_1.1", n) for n in VALID_1_1]
SCHEMA = SPEC / "manifest-1.4.schema.json"
#: Defects the task of the vectors is to cover; each must have at least one vector reporting the code.
REQUIRED_CODES = {
    "manifest.missing", "manifest.json", "manifest.version", "manifest.schema", "shape.too_large", "path.unsafe",
    "path.link", "chunk.missing", "chunk.truncated", "chunk.crc32c", "values.crc32c", "array.metadata_mismatch",
    "chunk.unexpected", "orbax.mismatch", "manifest.tree", "manifest.path_collision",
    "chunk.place", "chunk.gap", "chunk.overlap", "manifest.unicode", "orbax.checkpoint_metadata",
}


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("xckpt_conformance_generate", CONF / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def _expected(kind: str, name: str) -> dict[str, Any]:
    return json.loads((CONF / kind / name / "expected.json").read_text())


def assert_same_tree(got: Any, want: Any, where: str = "<root>") -> None:
    """Equal structure, container kinds, value types and every bit of every array and float."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), where
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, got.shape)
        ml = not issubclass(want.dtype.type, (np.number, np.bool_))  # bfloat16, float8: compare as float64
        exact = (lambda a: a.astype(np.float64)) if ml else (lambda a: a)
        np.testing.assert_array_equal(exact(got), exact(want), err_msg=where)
        assert got.tobytes() == want.tobytes(), f"{where}: bits differ (-0.0 or NaN payload)"
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want), (where, got)
        for k in want:
            assert_same_tree(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, tuple) and hasattr(type(want), "_fields"):
        assert type(got).__name__ == type(want).__name__ and got._fields == want._fields, where
        for f, g, w in zip(want._fields, got, want):
            assert_same_tree(g, w, f"{where}/{f}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (where, got)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{where}/{i}")
    elif isinstance(want, float):
        assert type(got) is float and (got == want or math.isnan(got) and math.isnan(want)), (where, got, want)
        assert math.copysign(1, got) == math.copysign(1, want), where
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def test_vector_set_is_complete() -> None:
    assert {"dtypes", "nested_values", "empty_and_scalar", "sharded", "zstd", "segmented", "nested_names",
            "subbyte_dtypes"} <= set(VALID)
    assert {"dtypes", "nested_values", "empty_and_scalar", "sharded", "zstd"} <= set(VALID_1_0)
    # nested names came with format 1.3, sub-byte dtypes with 1.4
    assert set(VALID) - {"nested_names", "subbyte_dtypes"} == set(VALID_1_1)
    versions = {n: json.loads((CONF / "valid" / n / "checkpoint" / "xckpt.json").read_text())["version"]
                for n in VALID}
    assert versions == {n: {"nested_names": "1.3", "subbyte_dtypes": "1.4"}.get(n, "1.2") for n in VALID}, versions
    codes = {_expected("invalid", n)["code"] for n in INVALID}
    assert REQUIRED_CODES <= codes, REQUIRED_CODES - codes
    assert any(_expected("invalid", n)["deep"] for n in INVALID)
    size = sum(p.stat().st_size for p in CONF.rglob("*") if p.is_file() and not p.is_symlink())
    assert size < 1_500_000


def test_vectors_are_what_the_generator_writes() -> None:
    """Regenerating gives the committed bytes: the generator is deterministic and xckpt's output has not
    drifted. If this fails after an intended format change, rerun spec/conformance/generate.py."""
    assert GEN.check(str(CONF)) == []


@pytest.mark.parametrize("kind, name", [("valid", n) for n in VALID] + OLD)
def test_valid_vector(kind: str, name: str) -> None:
    ckpt = CONF / kind / name / "checkpoint"
    report = xckpt.validate(ckpt, deep=True)
    assert report.ok and report.findings == [], [str(f) for f in report.findings]
    assert report.arrays > 0 and report.chunks > 0 and report.bytes_checked > 0
    want = GEN.untagged(_expected(kind, name)["tree"])
    assert_same_tree(xckpt.load(ckpt), want)


@pytest.mark.parametrize("kind, name", [("valid", n) for n in VALID] + OLD)
def test_valid_manifest_matches_published_schema(kind: str, name: str) -> None:
    """Every manifest matches the current schema and the schema of the version it was written in."""
    manifest = json.loads((CONF / kind / name / "checkpoint" / "xckpt.json").read_text())
    jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).validate(manifest)
    own = SPEC / f"manifest-{manifest['version']}.schema.json"
    assert kind == "valid" or manifest["version"] == kind.removeprefix("valid_")
    jsonschema.Draft202012Validator(json.loads(own.read_text())).validate(manifest)


def test_schema_vectors_fail_published_schema() -> None:
    schema = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    # JSON Schema counts 4.0 as an integer; the format (and its reader) does not
    names = [n for n in INVALID if _expected("invalid", n)["code"] == "manifest.schema"
             and n != "schema_float_integer"] + ["shape_dim_2e60"]
    assert len(names) >= 3
    for name in names:
        manifest = json.loads((CONF / "invalid" / name / "checkpoint" / "xckpt.json").read_text())
        assert not schema.is_valid(manifest), name


@pytest.mark.parametrize("name", INVALID)
def test_invalid_vector(name: str) -> None:
    exp = _expected("invalid", name)
    ckpt = CONF / "invalid" / name / "checkpoint"
    deep = xckpt.validate(ckpt, deep=True)
    assert not deep.ok and exp["code"] in deep.codes(), [str(f) for f in deep.findings]
    shallow = xckpt.validate(ckpt, deep=False)
    if exp["deep"]:
        assert shallow.ok, [str(f) for f in shallow.findings]
    else:
        assert exp["code"] in shallow.codes(), [str(f) for f in shallow.findings]
    for f in deep.findings:
        assert f.file, f  # every finding names its file
    finding = next(f for f in deep.findings if f.code == exp["code"])
    if exp["code"].split(".")[0] in ("chunk", "array", "shape", "dtype"):
        assert finding.leaf, finding  # and, for array defects, its leaf
    if exp["load"] is None:
        return
    with pytest.raises(XckptError) as info:
        xckpt.load(ckpt)
    err = info.value
    assert type(err) is not XckptError, "a specific subclass"
    assert err.code == exp["load"], str(err)
    assert err.file and str(ckpt) in err.file, str(err)


def test_defects_that_do_not_stop_a_load() -> None:
    """Orbax-only defects and bytes no read touches: xckpt still loads the exact data."""
    base = xckpt.load(CONF / "invalid" / "orbax_metadata_missing" / "checkpoint")
    np.testing.assert_array_equal(base["w"], np.arange(16, dtype=np.float32).reshape(4, 4))
    assert base["step"] == 3 and base["name"] == "run-1" and base["opt"] == [None, 0.5]
    names = [n for n in INVALID if _expected("invalid", n)["load"] is None]
    assert len(names) >= 5
    for name in names:
        assert_same_tree(xckpt.load(CONF / "invalid" / name / "checkpoint"), base, name)


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(list(args))
    return rc, out.getvalue()


def test_cli_validate_exit_codes_and_json(tmp_path: Path) -> None:
    rc, out = _cli("validate", "--json", str(CONF / "valid" / "sharded" / "checkpoint"))
    report = json.loads(out)
    assert rc == 0 and report["ok"] is True and report["findings"] == [] and report["arrays"] == 3
    rc, out = _cli("validate", "--json", "--deep", str(CONF / "valid" / "zstd" / "checkpoint"))
    assert rc == 0 and json.loads(out)["bytes_checked"] > 0
    for name in ("chunk_missing", "unknown_version", "orbax_metadata_mismatch", "index_crc32c"):
        rc, out = _cli("validate", "--json", str(CONF / "invalid" / name / "checkpoint"))
        report = json.loads(out)
        assert rc == 1 and report["ok"] is False, name
        assert _expected("invalid", name)["code"] in [f["code"] for f in report["findings"]], name
    deep_only = CONF / "invalid" / "data_crc32c" / "checkpoint"
    assert _cli("validate", "--json", str(deep_only))[0] == 0
    rc, out = _cli("validate", "--json", "--deep", str(deep_only))
    assert rc == 1 and [f["code"] for f in json.loads(out)["findings"]] == ["chunk.crc32c"]
    (tmp_path / "not-a-checkpoint").mkdir()
    rc, out = _cli("validate", str(tmp_path / "not-a-checkpoint"))
    assert rc == 1 and "manifest.missing" in out and "INVALID" in out
    assert _cli("validate", str(tmp_path / "nothing-here"))[0] == 2  # nothing to open


def test_every_error_code_is_in_the_spec() -> None:
    """Each code xckpt or an adapter can raise or report is listed in spec/xckpt-1.4.md section 9."""
    root = SPEC.parent
    pattern = re.compile(r'(?:code=|code = |code: str = |Finding\()"([a-z0-9_]+(?:\.[a-z0-9_]+)*)"')
    codes: dict[str, str] = {}
    for path in sorted((root / "xckpt").rglob("*.py")) + sorted((root / "adapters").rglob("*.py")):
        for code in pattern.findall(path.read_text()):
            codes.setdefault(code, str(path.relative_to(root)))
    assert {"manifest.missing", "chunk.crc32c", "path.link", "chunk.size", "error"} <= set(codes)
    text = (SPEC / "xckpt-1.4.md").read_text()
    table = text[text.index("## 9. Error"):text.index("## 10.")]
    missing = {c: where for c, where in codes.items() if f"`{c}`" not in table}
    assert not missing, f"codes not documented in spec/xckpt-1.4.md section 9: {missing}"
