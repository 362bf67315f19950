"""The command line: ``xckpt ls``, ``xckpt diff`` (structure and ``--values``, across formats, in bounded
memory), the tables of ``inspect`` and ``validate``, ``--json`` and every command's ``--help`` example."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.cli import main as cli_main
from xckpt.diff import compare_pieces, diff, pieces, values_equal
from xckpt.engine.copy import lazy_array
from xckpt.format.regions import Region

CONF = Path(__file__).resolve().parents[1] / "spec" / "conformance"
MESH = {"mesh_shape": [2], "axis_names": ["x"], "dim_axes": [["x"], []]}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main(list(args))
    return rc, capsys.readouterr().out


def _sharded(a: np.ndarray, sharding: dict[str, Any]) -> Any:
    """An array leaf to save with a given ``sharding`` entry in the manifest."""
    return lazy_array(a.shape, a.dtype.name, lambda r: a[r.slices()], sharding=sharding)


# -- ls -------------------------------------------------------------------------------------------


def _run(root: Path) -> None:
    """A run: steps 100 and 200 committed, 300 interrupted (partial files, no manifest)."""
    for step in (100, 200):
        xckpt.save({"w": np.full((4, 4), step, np.float32), "step": step}, root / str(step))
    partial = root / "300" / "w"
    partial.mkdir(parents=True)
    (partial / "zarr.json").write_text('{"zarr_format": 3, "node_type": "ar')
    (root / "notes").mkdir()  # not a step


def test_ls_steps_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path)
    sized: list[str] = []  # what tree_size walked: each step once, never the run as a whole (not a checkpoint)
    tree_size = xckpt.manager.tree_size
    monkeypatch.setattr(xckpt.manager, "tree_size", lambda path: sized.append(path) or tree_size(path))
    rc, out = _cli(capsys, "ls", str(tmp_path))
    assert rc == 0
    for header in ("Steps of", "step", "status", "committed at", "size", "leaves", "format"):
        assert header in out, header
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:3] in ("100", "200", "300")}
    assert set(rows) == {"100", "200", "300"}
    assert "committed" in rows["100"] and "xckpt" in rows["200"]
    assert "incomplete" in rows["300"]
    assert "notes" not in out
    assert out.splitlines()[-1] == "3 steps, 2 committed, 1 incomplete, latest committed: 200"

    rc, out = _cli(capsys, "ls", "--json", str(tmp_path))
    assert rc == 0
    got = json.loads(out)
    assert got["root"] == str(tmp_path) and got["checkpoints"] == []
    steps = {s["step"]: s for s in got["steps"]}
    assert sorted(steps) == [100, 200, 300]
    assert steps[100]["committed"] and steps[200]["committed"] and not steps[300]["committed"]
    assert steps[100]["leaves"] == 2 and steps[300]["leaves"] is None
    assert steps[100]["format"] == "xckpt" and steps[300]["format"] is None
    assert isinstance(steps[200]["commit_time"], float) and steps[300]["commit_time"] is None
    assert steps[100]["size_bytes"] > 64 and steps[100]["path"] == str(tmp_path / "100")
    assert sized == [str(tmp_path / s) for s in ("100", "200", "300")] * 2  # text, then --json
    assert [steps[s]["size_bytes"] for s in (100, 200, 300)] == [tree_size(str(tmp_path / str(s)))
                                                                 for s in (100, 200, 300)]


def test_ls_a_directory_of_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    xckpt.save({"w": np.ones(3), "b": np.zeros(2), "step": 1}, tmp_path / "final")
    xckpt.save({"w": np.ones(3)}, tmp_path / "best")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "junk").write_text("x")
    (tmp_path / "a_file").write_text("not a directory")
    rc, out = _cli(capsys, "ls", str(tmp_path))
    assert rc == 0
    for header in ("Checkpoints in", "name", "status", "format", "leaves", "size"):
        assert header in out, header
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["final"], ["best"], ["broken"])}
    assert rows["final"].split()[1:4] == ["ok", "xckpt", "3"]
    assert rows["best"].split()[1:4] == ["ok", "xckpt", "1"]
    assert "unreadable (manifest.missing)" in rows["broken"]
    assert "a_file" not in out
    assert out.splitlines()[-1].endswith("3 directories, 2 checkpoints, 1 unreadable")

    got = json.loads(_cli(capsys, "ls", "--json", str(tmp_path))[1])
    assert got["steps"] == []
    by = {c["name"]: c for c in got["checkpoints"]}
    assert list(by) == ["best", "broken", "final"]
    assert by["final"]["format"] == "xckpt" and by["final"]["leaves"] == 3 and by["final"]["error"] is None
    assert by["broken"]["error"]["code"] == "manifest.missing" and by["broken"]["leaves"] is None
    assert by["final"]["size_bytes"] > 0

    assert cli_main(["ls", str(tmp_path / "nothing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_ls_of_numbered_exports_lists_them_as_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Folders named by numbers holding safetensors exports are not a run's steps (none is an xckpt or Orbax
    checkpoint): they are listed as the checkpoints they are, not as a run of incomplete steps."""
    from safetensors.numpy import save_file

    for step in (5, 6):
        (tmp_path / str(step)).mkdir()
        save_file({"w": np.full(3, float(step), np.float32)}, str(tmp_path / str(step) / "model.safetensors"))
    got = json.loads(_cli(capsys, "ls", "--json", str(tmp_path))[1])
    assert got["steps"] == []
    assert [(c["name"], c["format"], c["leaves"], c["error"]) for c in got["checkpoints"]] == [
        ("5", "safetensors", 1, None), ("6", "safetensors", 1, None)]
    rc, out = _cli(capsys, "ls", str(tmp_path))
    assert rc == 0 and "Checkpoints in" in out and "incomplete" not in out


def test_ls_and_validate_a_checkpoint_a_step_and_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose tree is a list (array folders "0", "1") is listed alone, not as a run of steps;
    validate checks a manager's step through its default/ item, and exits 2 when nothing is at the path;
    an XCKPT_* variable that is not a number is one line and exit 2."""
    xckpt.save([np.arange(10.0), np.ones(3)], tmp_path / "list")
    got = json.loads(_cli(capsys, "ls", "--json", str(tmp_path / "list"))[1])
    assert got["steps"] == [] and [c["name"] for c in got["checkpoints"]] == ["list"]
    assert got["checkpoints"][0]["leaves"] == 2
    with xckpt.CheckpointManager(tmp_path / "run") as m:
        m.save(4, {"w": np.ones(3)}, force=True)
    rc, out = _cli(capsys, "validate", str(tmp_path / "run" / "4"))
    assert rc == 0 and f"OK: {tmp_path / 'run' / '4' / 'default'}" in out
    assert cli_main(["validate", str(tmp_path / "absent")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli_main(["validate", str(tmp_path / "empty")]) == 1  # there, but not a checkpoint
    capsys.readouterr()
    monkeypatch.setenv("XCKPT_STALE_AFTER_S", "1h")
    assert cli_main(["gc", "--dry-run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "config.env" in err and "XCKPT_STALE_AFTER_S='1h'" in err and "Traceback" not in err


# -- diff: structure ------------------------------------------------------------------------------


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = {"w": w, "b": np.ones(4), "i": np.arange(5), "s": _sharded(np.ones((2, 4), np.float32), MESH),
         "step": 3, "name": "run-1", "gone": np.zeros(2)}
    b = {"w": w, "b": np.ones(5), "i": np.arange(5, dtype=np.int32),
         "s": _sharded(np.ones((2, 4), np.float32), {**MESH, "dim_axes": [[], ["x"]]}),
         "step": 3, "name": 7, "new": np.zeros((2, 2), np.float16)}
    xckpt.save(a, tmp_path / "a")
    xckpt.save(b, tmp_path / "b")
    return tmp_path / "a", tmp_path / "b"


def test_diff_structure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _pair(tmp_path)
    rc, out = _cli(capsys, "diff", "--json", str(a), str(b))
    assert rc == 1
    got = json.loads(out)
    assert got["a"]["format"] == got["b"]["format"] == "xckpt" and got["a"]["leaves"] == 7
    assert [d["key"] for d in got["added"]] == ["new"]
    assert got["added"][0]["shape"] == [2, 2] and got["added"][0]["dtype"] == "float16"
    assert [d["key"] for d in got["removed"]] == ["gone"]
    changes = {c["key"]: c["changes"] for c in got["changed"]}
    assert changes == {"b": ["shape"], "i": ["dtype"], "s": ["sharding"], "name": ["type"]}
    s = next(c for c in got["changed"] if c["key"] == "s")
    assert s["a"]["sharding"]["dim_axes"] == [["x"], []] and s["b"]["sharding"]["dim_axes"] == [[], ["x"]]
    assert got["unchanged"] == 2 and got["values"] is None and got["identical"] is False

    rc, out = _cli(capsys, "diff", str(a), str(b))
    assert rc == 1
    for text in ("Added (only in B): 1", "Removed (only in A): 1", "Changed: 4", "key", "what", "dtype / type",
                 "shape", "sharding"):
        assert text in out, text
    assert "mesh [2] [['x'], []]" in out and "mesh [2] [[], ['x']]" in out
    assert out.splitlines()[-1] == "different: 1 added, 1 removed, 4 changed, 2 unchanged"

    rc, out = _cli(capsys, "diff", str(a), str(a))
    assert rc == 0 and out.splitlines()[-1] == "identical: 0 added, 0 removed, 0 changed, 7 unchanged"


# -- diff: values ---------------------------------------------------------------------------------


def _values_pair(tmp_path: Path) -> tuple[Path, Path]:
    f = np.arange(1000, dtype=np.float32).reshape(10, 100)
    g = f.copy()
    g[0, 0] = 0.5          # 0 -> 0.5: abs 0.5, rel 1
    g[5, 7] += 2           # 507 -> 509: abs 2, rel 2/509
    g[9, 99] = np.float32(999.25)  # abs 0.25
    big = np.array([-(2**62), 5, 7], np.int64)
    nan = np.array([np.nan, 1.0, -0.0])
    xckpt.save({"f": f, "big": big, "nan": nan, "flag": np.array([True, False, True]), "same": np.ones(3),
                "cast": np.arange(6, dtype=np.int64), "step": 3, "name": "run", "opt": xckpt.Value([0.5, None, {"b": 2}]),
                "shape": np.ones(3)}, tmp_path / "a")
    xckpt.save({"f": g, "big": np.array([2**62, 5, 7], np.int64), "nan": np.array([np.nan, 1.0, 0.0]),
                "flag": np.array([True, True, True]), "same": np.ones(3), "cast": np.arange(6, dtype=np.int32),
                "step": 4, "name": "run", "opt": xckpt.Value([0.5, None, {"b": 2.0}]), "shape": np.ones(4)}, tmp_path / "b")
    return tmp_path / "a", tmp_path / "b"


def test_diff_values_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _values_pair(tmp_path)
    rc, out = _cli(capsys, "diff", "--values", "--json", str(a), str(b))
    assert rc == 1
    got = json.loads(out)
    vals = got["values"]
    leaves = {v["key"]: v for v in vals["leaves"]}
    f = leaves["f"]
    assert (f["elements"], f["differing"], f["equal"]) == (1000, 3, False)
    assert f["max_abs_diff"] == 2.0 and f["max_rel_diff"] == 1.0
    big = leaves["big"]  # exact even where the difference does not fit in int64
    assert big["differing"] == 1 and big["max_abs_diff"] == 2**63 and big["max_rel_diff"] == 2.0
    assert leaves["nan"]["equal"] and leaves["nan"]["differing"] == 0  # NaN == NaN, 0.0 == -0.0
    assert leaves["flag"]["differing"] == 1 and leaves["flag"]["max_abs_diff"] == 1
    assert leaves["same"]["equal"] and leaves["same"]["max_abs_diff"] is None
    assert leaves["cast"]["equal"] and leaves["cast"]["dtype"] == ["int64", "int32"]  # dtype changed, values same
    assert leaves["step"] == {"key": "step", "kind": "value", "equal": False, "a": "3", "b": "4"}
    assert leaves["name"]["equal"] and leaves["opt"]["equal"]
    assert vals["skipped"] == [{"key": "shape", "reason": "shape [3] in A, [4] in B"}]
    assert vals["compared"] == 9 and vals["differing"] == 4
    assert vals["bytes_read"] == 4000 * 2 + 24 * 2 + 24 * 2 + 3 * 2 + 24 * 2 + 48 + 24
    assert [c["key"] for c in got["changed"]] == ["cast", "shape"]

    # the same counts whatever the piece size (many pieces of one row, and of part of a row)
    for piece in (400, 64, 4):
        again = diff(a, b, values=True, piece_bytes=piece)["values"]
        assert again == vals, piece

    rc, out = _cli(capsys, "diff", "--values", str(a), str(b))
    assert rc == 1
    for text in ("Differing arrays: 3", "max abs diff", "max rel diff", "elements", "differing",
                 "Differing values: 1", "Not compared: 1", "shape [3] in A, [4] in B"):
        assert text in out, text
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["f"])
    assert row == ["f", "float32", "1000", "3", "2", "1"]
    assert next(line.split() for line in out.splitlines() if line.split()[:1] == ["big"])[4] == str(2**63)
    assert out.splitlines()[-1].startswith("different: 0 added, 0 removed, 2 changed, 8 unchanged; "
                                           "values: 4 of 9 leaves compared differ")

    rc, out = _cli(capsys, "diff", "--values", str(a), str(a))
    assert rc == 0 and out.splitlines()[-1].startswith("identical: ")


def test_diff_progress_callback(tmp_path: Path) -> None:
    a, b = _values_pair(tmp_path)
    calls: list[tuple[int, int]] = []
    report = diff(a, b, values=True, progress=lambda done, total: calls.append((done, total)), piece_bytes=800)
    total = report["values"]["bytes_read"]
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(x[0] <= y[0] for x, y in zip(calls, calls[1:])) and len(calls) > 5


def test_pieces_tile_the_array() -> None:
    for shape, itemsize, limit in [((10, 100), 4, 400), ((10, 100), 4, 100), ((7, 3, 5), 8, 40), ((), 4, 1),
                                   ((0, 5), 4, 16), ((5,), 2, 1 << 20), ((3, 1000), 4, 1000), ((9, 4), 1, 8)]:
        seen = np.zeros(shape, np.int32)
        for r in pieces(shape, itemsize, limit):
            assert r.numel * itemsize <= max(limit, itemsize)
            seen[r.slices()] += 1
        assert (seen == 1).all(), shape
    regions = list(pieces((100, 4), 4, 16 * 30, align=(8, 4)))
    assert {r.sizes[0] for r in regions[:-1]} == {24}  # 30 rows fit; cut at whole chunks of 8
    assert list(pieces((4,), 4, 64)) == [Region((0,), (4,))]


@given(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.data(), st.sampled_from(["zstd", "none"]),
       st.integers(4, 4096))
@settings(max_examples=150, deadline=None)
def test_pieces_of_compressed_chunks_decode_each_chunk_once(shape, data, compression, limit) -> None:
    """A compressed chunk is decoded whole however little of it a piece reads: the pieces of a compressed array
    (diff's, the safetensors writer's, a conversion's) hold whole chunks, each in exactly one piece; an
    uncompressed array keeps the bound it is given."""
    from xckpt.engine.copy import piece_bytes_for
    from xckpt.format.manifest import ArrayEntry
    from xckpt.interop.safetensors.writer import pieces as file_pieces

    shape = tuple(shape)
    chunk = tuple(data.draw(st.integers(1, n)) for n in shape)
    entry = ArrayEntry(("w",), "w", shape, "float32", "float32", chunk, chunk, compression)
    size = piece_bytes_for(entry, 4, limit)
    if compression == "none":
        assert size == limit
    for regions in (list(pieces(shape, 4, size, chunk)), list(file_pieces(shape, 4, size))):
        seen = np.zeros(shape, np.int32)
        for r in regions:
            seen[r.slices()] += 1
        assert (seen == 1).all()
        if compression == "zstd" and chunk[0] * math.prod(shape[1:]) * 4 > limit:
            grid = np.zeros(tuple(-(-n // c) for n, c in zip(shape, chunk)), np.int32)  # pieces touching each chunk
            for r in regions:
                grid[tuple(slice(o // c, -(-(o + n) // c)) for o, n, c in zip(r.offsets, r.sizes, chunk))] += 1
            assert (grid == 1).all(), (shape, chunk, limit, regions)


def test_compare_pieces_and_values_equal() -> None:
    got = compare_pieces(np.array([1.0, np.inf, -np.inf, 3.0]), np.array([1.0, np.inf, 0.0, np.nan]))
    assert got == {"elements": 4, "differing": 2, "max_abs_diff": "inf", "max_rel_diff": None, "equal": False}
    got = compare_pieces(np.array([1, 2], np.uint64), np.array([1, 2**64 - 1], np.uint64))
    assert got["max_abs_diff"] == 2**64 - 3 and got["differing"] == 1
    got = compare_pieces(np.array([1 + 1j, 2]), np.array([1 + 1j, 2 + 2j]))
    assert got["differing"] == 1 and math.isclose(got["max_abs_diff"], 2.0)
    assert values_equal({"a": [1, (2.0, float("nan"))]}, {"a": (1, [2, float("nan")])})
    assert values_equal(np.float32(1.5), 1.5) and not values_equal({"a": 1}, {"b": 1})
    assert not values_equal([1, 2], [1, 2, 3]) and not values_equal("x", 1)
    # NaN equals NaN part by part: a complex NaN equals itself, and nan+1j is not nan+2j
    nan = float("nan")
    got = compare_pieces(np.array([complex(1, nan), complex(nan, 0)]), np.array([complex(2, nan), complex(nan, 0)]))
    assert got["differing"] == 1 and not got["equal"]
    assert values_equal(complex(nan, 0), complex(nan, 0)) and not values_equal(complex(nan, 1), complex(nan, 2))
    assert values_equal(np.array([complex(nan, 1)]), np.array([complex(nan, 1)]))
    assert not values_equal(np.array([complex(nan, 1)]), np.array([complex(nan, 2)]))


# -- diff: across formats -------------------------------------------------------------------------


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"params": {"w": rng.standard_normal((8, 16)).astype(np.float32), "b": np.arange(16, dtype=np.int32)},
            "layers": [{"k": rng.standard_normal((2, 3))}, {"k": np.ones(4, np.float32)}], "step": 7}


def test_diff_xckpt_against_orbax(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = _tree()
    xckpt.save(tree, tmp_path / "x")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "orbax", tree)
        changed = _tree()
        changed["params"]["w"][3, 5] += 1.0
        ckptr.save(tmp_path / "orbax2", changed)
    rc, out = _cli(capsys, "diff", "--values", "--json", str(tmp_path / "x"), str(tmp_path / "orbax"))
    got = json.loads(out)
    assert rc == 0 and got["identical"], got
    assert got["a"]["format"] == "xckpt" and got["b"]["format"] == "orbax"
    assert got["values"]["compared"] == 5 and got["values"]["differing"] == 0 and got["unchanged"] == 5
    rc, out = _cli(capsys, "diff", "--values", "--json", str(tmp_path / "x"), str(tmp_path / "orbax2"))
    got = json.loads(out)
    assert rc == 1 and [v["key"] for v in got["values"]["leaves"] if not v["equal"]] == ["params/w"]
    w = next(v for v in got["values"]["leaves"] if v["key"] == "params/w")
    assert w["differing"] == 1 and math.isclose(w["max_abs_diff"], 1.0, rel_tol=1e-6)


def test_diff_xckpt_against_dcp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``diff`` reads a DCP directory in place (no temporary copy left behind)."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import warnings
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.from_numpy(w.copy()), "b": torch.ones(4), "step": 5}, checkpoint_id=str(tmp_path / "dcp"))
    xckpt.save({"w": w, "b": np.ones(4, np.float32), "step": 5}, tmp_path / "x")
    before = set(os.listdir(tempfile.gettempdir()))
    rc, out = _cli(capsys, "diff", "--values", "--json", str(tmp_path / "x"), str(tmp_path / "dcp"))
    got = json.loads(out)
    assert rc == 0 and got["identical"] and got["b"]["format"] == "dcp" and got["values"]["compared"] == 3
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("xckpt-diff")}


def test_diff_values_in_bounded_memory(tmp_path: Path) -> None:
    """``diff --values`` of two 200 MB checkpoints streams them: peak RSS grows by far less than one of them."""
    a = np.arange(50_000_000, dtype=np.float32).reshape(5000, 10000)  # 200 MB
    xckpt.save({"w": a, "step": 1}, tmp_path / "a")
    a[17, 5] += 64.0
    largest = float(a[4999, 9999]) + 1.0
    a[4999, 9999] = -1.0
    xckpt.save({"w": a, "step": 1}, tmp_path / "b")
    del a
    code = textwrap.dedent(f"""
        import contextlib, io, json, resource, sys
        from xckpt.cli import main
        import xckpt.diff, xckpt.engine.copy, xckpt.sources.detect, xckpt.cli_render  # imports are not the diff's
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["diff", "--values", "--json", {str(tmp_path / "a")!r}, {str(tmp_path / "b")!r}])
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        print(json.dumps({{"rc": rc, "grown": grown, "report": json.loads(out.getvalue())}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    w = next(v for v in got["report"]["values"]["leaves"] if v["key"] == "w")
    assert got["rc"] == 1 and w["differing"] == 2 and w["elements"] == 50_000_000
    assert w["max_abs_diff"] == largest and got["report"]["values"]["bytes_read"] == 400_000_000
    assert got["grown"] < 150 << 20, f"peak RSS grew by {got['grown'] >> 20} MiB"


# -- inspect, validate, help ----------------------------------------------------------------------


def test_inspect_and_validate_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    xckpt.save({"w": _sharded(np.ones((2, 4), np.float32), MESH), "step": 3}, tmp_path / "c")
    rc, out = _cli(capsys, "inspect", str(tmp_path / "c"))
    assert rc == 0
    for text in ("Leaves", "key", "dtype / type", "shape", "size", "sharding", "mesh [2] [['x'], []]", "(value)"):
        assert text in out, text
    assert out.splitlines()[-1] == "1 arrays, 1 values, 32 B of array data"
    info = json.loads(_cli(capsys, "inspect", "--json", str(tmp_path / "c"))[1])
    assert info["arrays"] == 1 and info["leaves"][0]["key"] == "w"

    rc, out = _cli(capsys, "validate", str(CONF / "invalid" / "chunk_missing" / "checkpoint"))
    assert rc == 1
    for text in ("Findings", "severity", "code", "message", "ERROR", "chunk.missing"):
        assert text in out, text
    assert out.splitlines()[-1].startswith("INVALID: ")
    rc, out = _cli(capsys, "validate", "--deep", str(tmp_path / "c"))
    report = xckpt.validate(tmp_path / "c", deep=True)
    assert rc == 0 and out.splitlines() == [f"OK: {tmp_path / 'c'} (1 arrays, {report.chunks} chunk objects, "
                                            f"{report.bytes_checked} bytes crc-checked)"]
    assert capsys.readouterr().err == ""  # no progress off a terminal


@pytest.mark.parametrize("command", ["inspect", "validate", "convert", "ls", "diff", "gc"])
def test_help_shows_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"\n  xckpt {command} " in out


# -- failures the command line reports in one line ----------------------------------------------------


def test_gc_refuses_a_missing_path_and_a_bad_age(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, code in (([str(tmp_path / "no" / "nope")], "io.read"), ([str(tmp_path), "--older-than", "-5"], "gc.option"),
                       ([str(tmp_path), "--older-than", "nan"], "gc.option")):
        capsys.readouterr()
        assert cli_main(["gc", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: [{code}]") and err.count("\n") == 1, err


def test_os_errors_are_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A link loop where gc lists a directory: one line naming it, no traceback."""
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    capsys.readouterr()
    assert cli_main(["gc", str(tmp_path / "loop")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path / "loop") in err and "Traceback" not in err, err


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops root's permission override with setpriv")
def test_gc_says_what_it_could_not_remove(tmp_path: Path) -> None:
    """A dead save's temporary directory holding a folder gc may not write: reported as failed, with why, and
    exit status 2 (it said "removed" before, and left it); the others are still removed."""
    gen = "0" * 31
    stuck = tmp_path / f".a.xckpt-tmp-{gen}1"
    (stuck / "ro").mkdir(parents=True)
    (stuck / "ro" / "f").write_bytes(b"x")
    os.chmod(stuck / "ro", 0o500)
    other = tmp_path / f".b.xckpt-tmp-{gen}2"
    other.mkdir()
    try:
        out = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", sys.executable,
                              "-m", "xckpt", "gc", str(tmp_path), "--older-than", "0"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert "failed        tmp    dead" in out.stdout and "Permission denied" in out.stdout, out.stdout
        assert "1 could not be removed" in out.stdout, out.stdout
        assert (stuck / "ro" / "f").exists() and not other.exists()
    finally:
        os.chmod(stuck / "ro", 0o700)


def test_diff_status_survives_a_closed_pipe(tmp_path: Path) -> None:
    """`xckpt diff A B | head -1`: the output is cut short, the verdict (1: they differ) is not."""
    xckpt.save({f"k{i}": np.full(3, i, np.float32) for i in range(200)}, tmp_path / "a")
    xckpt.save({f"k{i}": np.full(3, i + 1, np.float32) for i in range(200)}, tmp_path / "b")
    out = subprocess.run(f"{sys.executable} -m xckpt diff --values {tmp_path / 'a'} {tmp_path / 'b'} | head -1; "
                         "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, (out.stdout, out.stderr)


def test_json_output_is_strict_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN metric (or difference) is written as the string "NaN", which every JSON parser reads."""
    with xckpt.CheckpointManager(tmp_path / "run", async_save=False) as m:
        m.save(1, {"x": np.zeros(2)}, metrics={"loss": float("nan"), "acc": float("inf")}, force=True)
    rc, out = _cli(capsys, "ls", "--json", str(tmp_path / "run"))
    assert rc == 0
    metrics = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))["steps"][0]["metrics"]
    assert metrics == {"loss": "NaN", "acc": "Infinity"}


def test_diff_compares_int64_and_uint64_exactly() -> None:
    """No numpy type holds both: they were compared as float64, where 2**53 + 1 equals 2**53."""
    a = np.array([2**53 + 1, 3, -5], np.int64)
    b = np.array([2**53, 3, 2**64 - 1], np.uint64)
    for x, y in ((a, b), (b, a)):
        got = compare_pieces(x, y)
        assert got["differing"] == 2 and got["max_abs_diff"] == 2**64 + 4, got
    assert compare_pieces(np.array([1, 2], np.int32), np.array([1, 2], np.uint64))["equal"]


def test_convert_says_which_conversions_exist_and_the_flag_to_overwrite(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    xckpt.save({"w": np.ones(3, np.float32)}, tmp_path / "a")
    capsys.readouterr()
    assert cli_main(["convert", "--to", "orbax", str(tmp_path / "a"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "does not convert xckpt to orbax" in err and "orbax to xckpt" in err and "dcp to xckpt" in err, err
    xckpt.save({"w": np.ones(3, np.float32)}, tmp_path / "b")
    assert cli_main(["convert", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err, err


def test_ls_of_one_checkpoint_lists_it_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its array folders are not checkpoints (they were listed as unreadable ones)."""
    xckpt.save({"w": np.ones(3, np.float32), "b": np.zeros(2, np.float32), "step": 1}, tmp_path / "c")
    rc, out = _cli(capsys, "ls", "--json", str(tmp_path / "c"))
    got = json.loads(out)["checkpoints"]
    assert rc == 0 and [(c["name"], c["format"], c["leaves"], c["error"]) for c in got] == [("c", "xckpt", 3, None)]
    rc, out = _cli(capsys, "ls", "--json", str(tmp_path))
    assert [c["name"] for c in json.loads(out)["checkpoints"]] == ["c"]
    manifest = tmp_path / "c" / "xckpt.json"  # damaged: listed alone, with its error
    manifest.write_bytes(manifest.read_bytes()[:30])
    rc, out = _cli(capsys, "ls", "--json", str(tmp_path / "c"))
    got = json.loads(out)["checkpoints"]
    assert [(c["name"], (c["error"] or {}).get("code")) for c in got] == [("c", "manifest.json")], got


# -- found in an audit of the command line ---------------------------------------------------------------


def _all_unicode(obj: Any) -> bool:
    """Whether every string of a parsed JSON document (keys too) is valid Unicode (no lone surrogate)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return True
        except UnicodeEncodeError:
            return False
    if isinstance(obj, dict):
        return all(_all_unicode(k) and _all_unicode(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_all_unicode(v) for v in obj)
    return True


def test_json_output_names_files_that_are_not_utf8_in_valid_unicode(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A file name that is not UTF-8 came out as a lone surrogate escape ("\\udcff"), which strict JSON
    parsers refuse; its undecodable bytes are now written as the text \\xff."""
    ckpt = tmp_path / "c"
    xckpt.save({"w": np.ones(3, np.float32)}, ckpt)
    os.close(os.open(os.fsencode(ckpt) + b"/left\xffhere", os.O_CREAT | os.O_WRONLY, 0o644))
    os.rename(ckpt, os.fsdecode(os.fsencode(tmp_path) + b"/ck\xfe"))
    ckpt = Path(os.fsdecode(os.fsencode(tmp_path) + b"/ck\xfe"))
    for args, rc_want in ((["validate", "--json", str(ckpt)], 0), (["ls", "--json", str(tmp_path)], 0),
                          (["inspect", "--json", str(ckpt)], 0), (["diff", "--json", str(ckpt), str(ckpt)], 0)):
        rc, out = _cli(capsys, *args)
        assert rc == rc_want, (args, out)
        assert "\\udc" not in out, out
        got = json.loads(out)
        assert _all_unicode(got), got
    rc, out = _cli(capsys, "validate", "--json", str(ckpt))
    files = [f["file"] for f in json.loads(out)["findings"]]
    assert files == [str(tmp_path) + "/ck\\xfe/left\\xffhere"], files


def test_json_of_a_deeply_nested_sharding_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest's sharding entry nesting 800 levels (the parser takes it, a load too) made `inspect --json`
    die with a RecursionError traceback while printing it."""
    ckpt = tmp_path / "c"
    xckpt.save({"w": np.ones(3, np.float32)}, ckpt)
    manifest = ckpt / "xckpt.json"
    raw = manifest.read_text()
    assert raw.count('"sharding":{') == 1
    manifest.write_text(raw.replace('"sharding":{', '"sharding":{"x":' + "[" * 800 + "]" * 800 + ","))
    assert xckpt.load(ckpt)["w"].tolist() == [1.0, 1.0, 1.0]
    rc, out = _cli(capsys, "inspect", "--json", str(ckpt))
    assert rc == 0
    got = json.loads(out)["leaves"][0]["sharding"]["x"]
    for _ in range(799):
        got = got[0]
    assert got == []


def test_diff_compares_int64_and_float_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An int64 array against a float64 one was compared in float64, where 2**53 + 1 equals 2.0**53: token ids
    written as floats by mistake came out as holding the same values."""
    ids = np.array([2**53 + 1, 2**62 + 1, 7, -(2**63)], np.int64)
    xckpt.save({"ids": ids, "n": np.array([2**64 - 1, 5], np.uint64)}, tmp_path / "a")
    xckpt.save({"ids": ids.astype(np.float64), "n": np.array([2.0**64, 5.0])}, tmp_path / "b")
    rc, out = _cli(capsys, "diff", "--values", "--json", str(tmp_path / "a"), str(tmp_path / "b"))
    leaves = {v["key"]: v for v in json.loads(out)["values"]["leaves"]}
    assert rc == 1
    assert (leaves["ids"]["differing"], leaves["ids"]["max_abs_diff"], leaves["ids"]["equal"]) == (2, 1.0, False)
    assert (leaves["n"]["differing"], leaves["n"]["max_abs_diff"], leaves["n"]["equal"]) == (1, 1.0, False)
    same = compare_pieces(np.array([2**53, 3, -(2**63)], np.int64), np.array([2.0**53, 3.0, -(2.0**63)], np.float32))
    assert same["equal"] and same["differing"] == 0
    nan = compare_pieces(np.array([1, 2], np.uint64), np.array([np.nan, np.inf]))
    assert nan == {"elements": 2, "differing": 2, "max_abs_diff": "inf", "max_rel_diff": None, "equal": False}


def test_relative_difference_of_huge_floats_of_opposite_signs(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """|a - b| overflows to inf for 1e308 and -1e308, and the relative difference (at most 2) came out "inf"."""
    xckpt.save({"x": np.array([1e308, 1.0, -3e307])}, tmp_path / "a")
    xckpt.save({"x": np.array([-1e308, 1.0, 3e307])}, tmp_path / "b")
    rc, out = _cli(capsys, "diff", "--values", "--json", str(tmp_path / "a"), str(tmp_path / "b"))
    x = json.loads(out)["values"]["leaves"][0]
    assert rc == 1 and x["differing"] == 2 and x["max_rel_diff"] == 2.0, x


def test_validate_a_dangling_link_is_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A path that is a link to nothing cannot be opened (status 2, as a missing path), not an invalid
    checkpoint (status 1, manifest.missing); a link to a checkpoint is still validated through it."""
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    capsys.readouterr()
    assert cli_main(["validate", "--json", str(tmp_path / "dangling")]) == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err.startswith("error: [io.read]") and got.err.count("\n") == 1, got
    xckpt.save({"w": np.ones(3, np.float32)}, tmp_path / "c")
    os.symlink(tmp_path / "c", tmp_path / "link")
    assert cli_main(["validate", str(tmp_path / "link")]) == 0
