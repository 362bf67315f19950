"""A load in a job of several processes is collective: every rank returns, or every rank raises one
CollectiveLoadError, and no rank's in-place target changes when another rank's load fails.

The ranks are threads sharing a :class:`~xckpt.engine.collective.ThreadGroup` (the real gloo
and jax.distributed runs of the same protocol are in ``torch_workers.load2`` and ``jax_workers``);
the targets are torch tensors, which a load fills in place.
"""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xckpt  # noqa: E402
from xckpt.errors import CollectiveLoadError  # noqa: E402
from xckpt.load import MAX_STAGING_BYTES  # noqa: E402

from threaded import run_ranks  # noqa: E402

A = np.arange(64, dtype=np.float32).reshape(8, 8)
B = np.arange(64, 128, dtype=np.float32).reshape(8, 8)


def _outcomes(fn: Any) -> list[Any]:
    """``fn(coord)`` on 2 thread ranks; each rank's result or exception."""
    def body(coord: Any) -> Any:
        try:
            return fn(coord)
        except BaseException as exc:  # noqa: BLE001 - compared by the tests
            return exc
    return run_ranks(2, body)


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "c"
    xckpt.save({"a": A, "b": B, "step": 3}, path, coordinator=xckpt.LocalCoordinator())
    return path


def _blank() -> Any:
    return torch.full((8, 8), -7.0)


def _untouched(t: Any) -> None:
    np.testing.assert_array_equal(t.numpy(), np.full((8, 8), -7.0, np.float32))


def _same_failure(got: list[Any], ranks: list[int], code: str) -> None:
    for g in got:
        assert isinstance(g, CollectiveLoadError), got
        assert sorted(g.failures) == ranks and g.code == code, g
        assert "load of" in str(g), g
    assert str(got[0]) == str(got[1])


def test_every_rank_loads_in_place(ckpt):
    targets = [{"a": _blank(), "b": _blank(), "step": 0} for _ in range(2)]
    got = _outcomes(lambda c: xckpt.load(ckpt, like=targets[c.rank], coordinator=c))
    for rank, g in enumerate(got):
        assert not isinstance(g, BaseException), g
        assert g["step"] == 3 and g["a"] is targets[rank]["a"]
        np.testing.assert_array_equal(targets[rank]["a"].numpy(), A)
        np.testing.assert_array_equal(targets[rank]["b"].numpy(), B)


@pytest.mark.parametrize("staging", [MAX_STAGING_BYTES, 0])
def test_a_target_that_differs_on_one_rank_changes_nothing_anywhere(ckpt, staging):
    """Rank 1 names a key the checkpoint lacks: both ranks raise the same error, naming rank 1's mismatch,
    before either writes in place (also without staging, where the load would write straight in place)."""
    targets = [{"a": _blank()}, {"a": _blank(), "missing": _blank()}]
    got = _outcomes(lambda c: xckpt.load(ckpt, like=targets[c.rank], partial=True, max_staging_bytes=staging,
                                         coordinator=c))
    _same_failure(got, [1], "tree.key_mismatch")
    assert "missing ['missing']" in got[0].failures[1]["message"]
    for t in targets:
        _untouched(t["a"])


def test_a_corrupt_chunk_one_rank_reads_changes_no_staged_target(ckpt):
    """Rank 1 also reads "b", whose chunk is corrupt: both raise; rank 0's read of "a" succeeded, yet its
    in-place target is untouched (the staged copy goes in only once every rank's reads succeeded)."""
    obj = ckpt / "b" / "c" / "0" / "0"
    data = bytearray(obj.read_bytes())
    data[10] ^= 0xFF
    obj.write_bytes(bytes(data))
    targets = [{"a": _blank()}, {"a": _blank(), "b": _blank()}]
    got = _outcomes(lambda c: xckpt.load(ckpt, like=targets[c.rank], partial=True, coordinator=c))
    _same_failure(got, [1], "chunk.crc32c")
    assert got[0].failures[1]["leaf"] == "b" and got[0].failures[1]["file"] == str(obj), got[0].failures
    for t in targets:
        _untouched(t["a"])


def test_a_missing_object_is_found_before_any_rank_writes_in_place(ckpt):
    """Without staging each rank reads straight into its targets: the objects every rank will read are
    checked first, together, so rank 1's missing chunk stops rank 0 before it writes."""
    os.unlink(ckpt / "b" / "c" / "0" / "0")
    targets = [{"a": _blank()}, {"a": _blank(), "b": _blank()}]
    got = _outcomes(lambda c: xckpt.load(ckpt, like=targets[c.rank], partial=True, max_staging_bytes=0,
                                         coordinator=c))
    _same_failure(got, [1], "chunk.missing")
    for t in targets:
        _untouched(t["a"])


def test_a_stored_nan_one_rank_turns_into_an_int_changes_nothing_anywhere(tmp_path):
    """Rank 1 asks a stored NaN as a Python int: its conversion fails in the read step, so both raise one
    error naming that leaf, and neither rank's staged in-place target is written."""
    path = tmp_path / "c"
    xckpt.save({"a": A, "n": np.float64("nan")}, path, coordinator=xckpt.LocalCoordinator())
    targets = [{"a": _blank()}, {"a": _blank(), "n": 0}]
    got = _outcomes(lambda c: xckpt.load(path, like=targets[c.rank], partial=True, coordinator=c))
    _same_failure(got, [1], "tree.key_mismatch")
    assert (got[0].failures[1]["leaf"], got[0].failures[1]["file"]) == ("n", str(path))
    for t in targets:
        _untouched(t["a"])


def test_a_missing_object_of_a_cast_read_is_found_before_anything_is_written_in_place(ckpt):
    """Without staging, a leaf read with a cast (float32 stored, float64 target) is checked ahead with the
    others: its missing chunk stops the load before the same-dtype target "a" is written."""
    os.unlink(ckpt / "b" / "c" / "0" / "0")
    a, b = _blank(), torch.full((8, 8), -7.0, dtype=torch.float64)
    with pytest.raises(xckpt.XckptError) as e:
        xckpt.load(ckpt, like={"a": a, "b": b}, partial=True, max_staging_bytes=0,
                   coordinator=xckpt.LocalCoordinator())
    assert e.value.code == "chunk.missing" and e.value.leaf == "b"
    _untouched(a)


def test_ranks_that_opened_two_generations_start_again_together(ckpt, tmp_path, monkeypatch):
    """Rank 1's first open finds another generation than rank 0's (a save replaced the checkpoint between
    the two opens; here rank 1 is handed another save's checkpoint, while the files rank 0 opened stay
    readable): the ranks start again together, and both return one checkpoint, never one rank the old and
    one the new."""
    load_mod = importlib.import_module("xckpt.load")  # the module: xckpt.load is the function
    other = tmp_path / "other"
    xckpt.save({"a": A + 1000, "b": B, "step": 4}, other, coordinator=xckpt.LocalCoordinator())
    real_open = load_mod.open_checkpoint
    rank_of = threading.local()
    opens = [0, 0]

    def opening(path: Any) -> Any:
        r = rank_of.rank
        opens[r] += 1
        return real_open(other if (r, opens[r]) == (1, 1) else path)
    monkeypatch.setattr(load_mod, "open_checkpoint", opening)

    def body(c: Any) -> Any:
        rank_of.rank = c.rank
        return xckpt.load(ckpt, like={"a": np.zeros((8, 8), np.float32), "step": 0}, partial=True, coordinator=c)
    got = _outcomes(body)
    for g in got:
        assert not isinstance(g, BaseException), g
        assert g["step"] == 3
        np.testing.assert_array_equal(g["a"], A)
    assert opens == [2, 2]


class _State:
    """A target object restoring its own state (a scheduler, a data loader)."""

    def __init__(self, bad_state: bool = False, bad_restore: bool = False) -> None:
        self.bad_state, self.bad_restore = bad_state, bad_restore
        self.got: Any = None

    def state_dict(self) -> dict[str, Any]:
        if self.bad_state:
            raise RuntimeError("no state on this rank")
        return {"x": 0}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.bad_restore:
            raise ValueError("refuses the state")
        self.got = sd


@pytest.fixture()
def with_state(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    xckpt.save({"a": A, "sched": {"x": 1}, "name": "run"}, path, coordinator=xckpt.LocalCoordinator())
    return path


def test_a_target_that_cannot_be_described_on_one_rank_fails_every_rank(with_state):
    """Rank 1's target object cannot give its state (to be matched against the checkpoint): the failure goes
    through the first step, so rank 0 raises it too instead of waiting for rank 1 forever."""
    targets = [{"a": _blank(), "sched": _State()}, {"a": _blank(), "sched": _State(bad_state=True)}]
    got = _outcomes(lambda c: xckpt.load(with_state, like=targets[c.rank], partial=True, coordinator=c))
    _same_failure(got, [1], "torch.state_dict")
    assert "no state on this rank" in str(got[0])
    for t in targets:
        _untouched(t["a"])


def test_an_object_failing_to_restore_on_one_rank_fails_every_rank(with_state):
    """Rank 1's object refuses its state after the arrays are in place (load.restore): every rank raises,
    none returns as if the job were restored."""
    targets = [{"a": _blank(), "sched": _State()}, {"a": _blank(), "sched": _State(bad_restore=True)}]
    got = _outcomes(lambda c: xckpt.load(with_state, like=targets[c.rank], partial=True, coordinator=c))
    _same_failure(got, [1], "load.restore")
    assert got[0].failures[1]["leaf"] == "sched" and "refuses the state" in str(got[0])


@pytest.mark.parametrize("bad", ["conversion", "values file"])
def test_values_are_read_and_converted_before_any_rank_writes_in_place(with_state, bad):
    """Rank 1 also loads a value: one its target cannot take (a string as a tensor: tree.key_mismatch naming
    it), or one whose values file is corrupt. Found in the first step, before rank 0 writes in place."""
    if bad == "values file":
        values = with_state / "values.msgpack"
        data = bytearray(values.read_bytes())
        data[-1] ^= 0xFF
        values.write_bytes(bytes(data))
    targets = [{"a": _blank()}, {"a": _blank(), "name": torch.zeros(()) if bad == "conversion" else ""}]
    got = _outcomes(lambda c: xckpt.load(with_state, like=targets[c.rank], partial=True, max_staging_bytes=0,
                                         coordinator=c))
    _same_failure(got, [1], "tree.key_mismatch" if bad == "conversion" else "values.crc32c")
    assert "(opening it)" in str(got[0])
    for t in targets:
        _untouched(t["a"])


def test_a_mapped_load_checks_the_stored_objects_before_writing_in_place(ckpt):
    """A load through a mapping checks the stored arrays its views are made of, like a plain load: rank 1's
    missing chunk of "b" (mapped to "y") stops rank 0 before it writes "x" in place."""
    import xckpt.mapping as M

    os.unlink(ckpt / "b" / "c" / "0" / "0")
    m = M.Mapping(M.rename("a", "x"), M.rename("b", "y"))
    targets = [{"x": _blank()}, {"x": _blank(), "y": _blank()}]
    got = _outcomes(lambda c: xckpt.load(ckpt, like=targets[c.rank], partial=True, max_staging_bytes=0, mapping=m,
                                         coordinator=c))
    _same_failure(got, [1], "chunk.missing")
    for t in targets:
        _untouched(t["x"])


def test_a_non_strict_loads_warning_points_at_the_callers_line(ckpt):
    """However deep in a collective step the difference is found, the warning names the line calling load."""
    import inspect
    import warnings

    def body(c: Any) -> Any:
        return xckpt.load(ckpt, like={"a": np.zeros((8, 8), np.float32), "zz": 1}, strict=False, coordinator=c)
    line = inspect.getsourcelines(body)[1] + 1
    for run in (lambda: _outcomes(body), lambda: body(xckpt.LocalCoordinator())):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run()
        assert {(x.filename, x.lineno) for x in seen if issubclass(x.category, xckpt.XckptWarning)} \
            == {(__file__, line)}, [(x.filename, x.lineno, str(x.message)) for x in seen]
