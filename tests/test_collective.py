"""The engine's collective steps on 4 thread 'ranks': every rank learns every failing rank's error."""

from __future__ import annotations

import os
from typing import Any

import pytest

from threaded import run_ranks
from xckpt.engine import collective
from xckpt.errors import CollectiveError, SaveError, ShapeError


def _outcome(fn: Any) -> Any:
    """Run ``fn(coord)`` on 4 ranks; per rank, its result or the CollectiveError it raised."""
    def body(coord: collective.ThreadCoordinator) -> Any:
        try:
            return fn(coord)
        except CollectiveError as exc:
            return exc
    return run_ranks(4, body)


def _fail_on(ranks: set[int], coord: collective.Coordinator) -> int:
    if coord.rank in ranks:
        raise ShapeError(f"rank {coord.rank} is wrong", leaf=f"w{coord.rank}")
    return coord.rank * 10


def test_decide_step_decision_reaches_every_rank() -> None:
    out = _outcome(lambda c: collective.decide_step(c, "test", lambda: _fail_on(set(), c), lambda rs: sum(rs)))
    assert out == [60, 60, 60, 60]


def test_decide_step_lists_every_failing_rank_and_skips_decide() -> None:
    decided: list[Any] = []
    out = _outcome(lambda c: collective.decide_step(c, "test", lambda: _fail_on({1, 3}, c), decided.append))
    assert decided == []
    for exc in out:
        assert isinstance(exc, CollectiveError) and isinstance(exc, SaveError)
        assert sorted(exc.failures) == [1, 3]
        assert exc.failures[1]["leaf"] == "w1" and exc.failures[3]["message"] == "rank 3 is wrong"
        assert exc.failures[3]["type"] == "ShapeError"


def test_decide_step_failure_of_the_decision_reaches_every_rank() -> None:
    def decide(results: list[int]) -> None:
        raise ValueError(f"cannot decide on {results}")

    out = _outcome(lambda c: collective.decide_step(c, "test", lambda: _fail_on(set(), c), decide))
    for exc in out:
        assert isinstance(exc, CollectiveError) and list(exc.failures) == [0]
        assert exc.failures[0]["message"] == "cannot decide on [0, 10, 20, 30]"
        assert "rank 0: [ValueError] cannot decide on [0, 10, 20, 30]" in str(exc), str(exc)  # not [error]


@pytest.mark.parametrize("failing", [set(), {0}, {2}])
def test_gather_and_agree_steps(failing: set[int]) -> None:
    gathered = _outcome(lambda c: collective.gather_step(c, "test", lambda: _fail_on(failing, c)))
    agreed = _outcome(lambda c: collective.agree_step(c, "test", lambda: _fail_on(failing, c)))
    if not failing:
        assert gathered == [[0, 10, 20, 30], None, None, None]
        assert agreed == [0, 10, 20, 30]
        return
    for exc in gathered + agreed:
        assert isinstance(exc, CollectiveError) and set(exc.failures) == failing


def test_answer_step_sends_each_rank_its_answer() -> None:
    out = _outcome(lambda c: collective.answer_step(
        c, "test", (lambda: [f"for {r}" for r in range(4)]) if c.rank == collective.ROOT else None))
    assert out == ["for 0", "for 1", "for 2", "for 3"]


def _outcomes(n: int, fn: Any) -> list[Any]:
    """``fn(coord)`` on ``n`` thread ranks; each rank's result or exception."""
    def body(coord: Any) -> Any:
        try:
            return fn(coord)
        except BaseException as exc:  # noqa: BLE001 - compared below
            return exc
    return run_ranks(n, body)


@pytest.mark.parametrize("differ", ["path", "compression", "overwrite", "inner_chunk_bytes"])
def test_ranks_that_disagree_on_the_path_or_options_commit_nothing(tmp_path, differ):
    """Each process writes its own chunks by its own options: ranks that disagree (another path, another
    compression...) would commit a checkpoint whose objects contradict its manifest, or tell a rank it saved
    what was never made. Every rank raises one CollectiveError naming the disagreement; nothing is written."""
    import numpy as np

    import xckpt
    from xckpt.engine import protocol
    from xckpt.engine.commit import SaveOptions
    from xckpt.format.regions import Region
    from xckpt.registry import ArraySource, Shard

    full = np.arange(64, dtype=np.float32).reshape(8, 8)

    def body(coord: Any) -> Any:
        r = coord.rank
        tree = {"w": ArraySource((8, 8), "float32", [Shard(Region((4 * r, 0), (4, 8)), lambda: full[4 * r:4 * r + 4])])}
        opts = {"path": {}, "compression": {"compression": "zstd" if r else "none"},
                "overwrite": {"overwrite": bool(r)}, "inner_chunk_bytes": {"inner_chunk_bytes": 64 if r else 128}}
        path = tmp_path / (f"c{r}" if differ == "path" else "c")
        return protocol.save(tree, path, coordinator=coord, options=SaveOptions(**opts[differ]))
    got = _outcomes(2, body)
    for rank, g in enumerate(got):
        assert isinstance(g, CollectiveError) and g.code == "coord.mismatch", (rank, g)
        assert "disagree on the save" in str(g) and "rank 1 saves to" in str(g), g
    assert sorted(os.listdir(tmp_path)) == []
    same = _outcomes(2, lambda coord: protocol.save(
        {"w": ArraySource((8, 8), "float32", [Shard(Region((4 * coord.rank, 0), (4, 8)),
                                                    lambda r=coord.rank: full[4 * r:4 * r + 4])])},
        tmp_path / "c", coordinator=coord, options=SaveOptions()))
    assert not any(isinstance(g, BaseException) for g in same), same
    np.testing.assert_array_equal(xckpt.load(tmp_path / "c")["w"], full)


def test_a_rank_failing_after_reporting_success_keeps_its_objects(tmp_path, monkeypatch):
    """save_async: rank 1 fails right after writing its success status (a disk error reading the outcome, say).
    The coordinating process may commit with rank 1's objects, so rank 1 must keep them and say the outcome is
    unknown; the committed checkpoint is whole."""
    import numpy as np

    import xckpt
    from xckpt.engine import background
    from xckpt.engine.commit import SaveOptions
    from xckpt.format.regions import Region
    from xckpt.registry import ArraySource, Shard

    monkeypatch.setenv("XCKPT_FAILPOINTS", "after_status@1:raise")
    full = np.arange(64, dtype=np.float32).reshape(8, 8)

    def body(coord: Any) -> Any:
        r = coord.rank
        tree = {"w": ArraySource((8, 8), "float32", [Shard(Region((4 * r, 0), (4, 8)), lambda: full[4 * r:4 * r + 4])])}
        pending = background.start(tree, tmp_path / "c", coordinator=coord, options=SaveOptions(), timeout_s=2.0)
        return pending.wait()
    got = _outcomes(2, body)
    assert not isinstance(got[0], BaseException), got
    assert isinstance(got[1], SaveError) and got[1].code == "save.outcome_unknown", got
    report = xckpt.validate(tmp_path / "c", deep=True)
    assert report.ok, [str(f) for f in report.findings]
    np.testing.assert_array_equal(xckpt.load(tmp_path / "c")["w"], full)


@pytest.mark.parametrize("failing", [{0}, {1}, {0, 1}])
def test_a_failed_save_async_raises_one_collective_error_on_every_rank(tmp_path, monkeypatch, failing):
    """As a synchronous save does: whichever ranks' background writes fail, every rank's wait() raises a
    CollectiveError holding each failing rank's own error, by rank; nothing is committed or left behind."""
    import numpy as np

    from xckpt.engine import background
    from xckpt.engine.commit import SaveOptions
    from xckpt.format.regions import Region
    from xckpt.registry import ArraySource, Shard

    monkeypatch.setenv("XCKPT_FAILPOINTS", f"before_status@{min(failing)}:raise" if len(failing) == 1
                       else "before_status:raise")  # a point is named once: without a rank, it fails on every rank
    full = np.arange(64, dtype=np.float32).reshape(8, 8)

    def body(coord: Any) -> Any:
        r = coord.rank
        tree = {"w": ArraySource((8, 8), "float32", [Shard(Region((4 * r, 0), (4, 8)), lambda: full[4 * r:4 * r + 4])])}
        return background.start(tree, tmp_path / "c", coordinator=coord, options=SaveOptions(), timeout_s=5.0).wait()
    got = _outcomes(2, body)
    for g in got:
        assert isinstance(g, CollectiveError), got
        assert sorted(g.failures) == sorted(failing), g.failures
        for r in failing:
            assert g.failures[r]["message"] == f"failpoint before_status on rank {r}", g.failures
            assert g.failures[r]["type"] == "OSError", g.failures
    assert str(got[0]) == str(got[1])
    assert os.listdir(tmp_path) == []


def test_ranks_saving_different_values_under_one_key_name_it(tmp_path):
    """The same trees but for one value (a step that differs between ranks): every rank raises one
    CollectiveError naming that leaf; nothing is committed."""
    from xckpt.engine import protocol

    got = _outcomes(2, lambda coord: protocol.save({"cfg": {"lr": 0.1, "step": 100 + coord.rank, "name": "run"}},
                                                   tmp_path / "c", coordinator=coord))
    for g in got:
        assert isinstance(g, CollectiveError) and g.code == "coord.mismatch" and g.leaf == "cfg/step", g
    assert os.listdir(tmp_path) == []


def test_a_rank_kept_waiting_warns_once_and_goes_on(tmp_path, monkeypatch):
    """A process whose peers are late (or never come: one rank loading alone in a distributed job)
    says so after XCKPT_WAIT_WARN_S, naming the step and the way out, and still finishes when they arrive."""
    import time
    import warnings

    import numpy as np
    import xckpt

    monkeypatch.setenv("XCKPT_WAIT_WARN_S", "0.3")
    path = tmp_path / "c"
    xckpt.save({"w": np.arange(6.0)}, path)

    def body(coord: Any) -> Any:
        if coord.rank == 1:
            time.sleep(1.5)
        return xckpt.load(path, coordinator=coord)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = run_ranks(2, body)
    for tree in out:
        np.testing.assert_array_equal(tree["w"], np.arange(6.0))
    texts = [str(w.message) for w in seen if issubclass(w.category, xckpt.XckptWarning)]
    assert len(texts) == 1, texts  # rank 0 waited; rank 1 found rank 0 there
    assert texts[0].startswith("rank 0 has waited 0.3 s for the other 1 process in load of ") and str(path) in texts[0]
    assert "coordinator=xckpt.LocalCoordinator()" in texts[0]

    monkeypatch.setenv("XCKPT_WAIT_WARN_S", "0")  # 0: never
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_ranks(2, body)
    assert not [w for w in seen if issubclass(w.category, xckpt.XckptWarning)]


def test_the_wait_watchdog_outlives_warnings_as_errors_and_huge_thresholds(monkeypatch, capfd):
    """Under warnings-as-errors the late exchange's warning cannot be given (it goes to stderr instead), and a
    threshold of 1e12 s overflows no wait: either way the watchdog thread lives on and warns of the next late
    exchange."""
    import threading
    import time
    import warnings

    from xckpt.engine import collective

    def late(coord: Any) -> Any:
        if coord.rank == 1:
            time.sleep(0.6)
        return collective.all_gather(coord, coord.rank, what="the test's step")

    monkeypatch.setenv("XCKPT_WAIT_WARN_S", "1e12")
    assert run_ranks(2, late) == [[0, 1], [0, 1]]
    monkeypatch.setenv("XCKPT_WAIT_WARN_S", "0.2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_ranks(2, late) == [[0, 1], [0, 1]]
    time.sleep(0.1)
    err = capfd.readouterr().err
    assert "saying so failed: XckptWarning: rank 0 has waited 0.2 s" in err and "the test's step" in err, err
    assert [t for t in threading.enumerate() if t.name == "xckpt-watchdog" and t.is_alive()]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert run_ranks(2, late) == [[0, 1], [0, 1]]
    texts = [str(w.message) for w in seen if "has waited" in str(w.message)]
    assert len(texts) == 1 and texts[0].startswith("rank 0 has waited 0.2 s") and "the test's step" in texts[0], texts
