"""The engine's collective steps on 4 thread 'ranks': every rank learns every failing rank's error."""

from __future__ import annotations

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
