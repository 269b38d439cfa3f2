import math

import pytest

from dflash_train.train.optim import TimeBudget, lr_factor


def test_cosine_follows_steps_or_time_whichever_is_further():
    assert lr_factor(0, 100, 0.1, 0.0) == pytest.approx(0.1)  # warm-up ignores the clock
    assert lr_factor(0, 100, 0.1, 0.0, time_fraction=0.9) == pytest.approx(0.1)
    by_steps = lr_factor(55, 100, 0.1, 0.0)  # progress 0.5
    assert by_steps == pytest.approx(0.5)
    assert lr_factor(55, 100, 0.1, 0.0, time_fraction=0.2) == pytest.approx(by_steps)
    assert lr_factor(55, 100, 0.1, 0.0, time_fraction=0.75) == pytest.approx(0.5 * (1 + math.cos(0.75 * math.pi)))
    assert lr_factor(20, 100, 0.1, 0.1, time_fraction=1.7) == pytest.approx(0.1)  # past the budget: the floor


def test_time_budget_without_minutes_never_runs_out():
    budget = TimeBudget(None)
    assert budget.fraction() == 0.0 and not budget.spent()
    assert TimeBudget(1e-9).spent()


def test_resumed_budget_continues_from_the_seconds_already_spent():
    budget = TimeBudget(10.0)  # 600 s
    budget.start(already_spent_s=450.0)
    assert budget.fraction() == pytest.approx(0.75, abs=1e-3)
    assert not budget.spent()
    budget.start(already_spent_s=601.0)
    assert budget.spent()
