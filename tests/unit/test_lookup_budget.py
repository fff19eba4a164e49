"""services.scheduler.lookup_budget: the prefix lookup's adaptive budget and its pause after failures."""
from __future__ import annotations

import pytest

from services.scheduler.lookup_budget import WINDOW, LookupBudget


def test_the_budget_follows_four_times_the_recent_p90_within_its_bounds() -> None:
    budget = LookupBudget(min_s=0.05, max_s=0.5, retry_s=5.0)
    assert budget.timeout_s() == 0.05
    for _ in range(WINDOW):
        budget.on_success(0.001)  # a quiet loop and Redis: the floor
    assert budget.timeout_s() == 0.05
    for _ in range(WINDOW // 2):
        budget.on_success(0.03)  # a CPU-starved loop: lookups answered in 30 ms
    assert budget.timeout_s() == pytest.approx(0.12)
    for _ in range(WINDOW):
        budget.on_success(1.0)
    assert budget.timeout_s() == 0.5


def test_one_timeout_falls_back_for_one_request_and_three_in_a_row_pause_lookups() -> None:
    budget = LookupBudget(min_s=0.05, max_s=0.5, retry_s=5.0)
    assert (budget.on_timeout(10.0), budget.on_timeout(10.1)) == (False, False)
    assert not budget.is_paused(10.1) and budget.timeout_s() == pytest.approx(0.2)  # the timeouts raised it
    assert budget.on_success(0.01) is False  # and the count starts again
    assert [budget.on_timeout(11.0 + i) for i in range(3)] == [False, False, True]
    assert budget.is_paused(17.9) and not budget.is_paused(18.0)
    assert budget.on_success(0.01) is True and not budget.is_paused(18.0)


def test_an_error_pauses_at_once() -> None:
    budget = LookupBudget(min_s=0.05, max_s=0.5, retry_s=5.0)
    budget.on_error(1.0)
    assert budget.is_paused(5.9) and not budget.is_paused(6.0)
    with pytest.raises(ValueError):
        LookupBudget(min_s=0.5, max_s=0.05, retry_s=1.0)
