"""The ILP stops within its relative gap of the proven bound (ilp.DEFAULT_GAP unless asked otherwise):
the gap reaches CP-SAT, a warm start already within it skips the whole-problem search, and a bad gap
is refused before any solve."""

from __future__ import annotations

import pytest
from ortools.sat.python import cp_model
from tests.search.placer.test_place_ilp import random_problem

from hybridpar.search.placer import ilp, solve


@pytest.fixture
def seen_gaps(monkeypatch):
    gaps: list[float] = []
    orig = cp_model.CpSolver.solve

    def spy(self, model, *a, **k):
        gaps.append(self.parameters.relative_gap_limit)
        return orig(self, model, *a, **k)

    monkeypatch.setattr(cp_model.CpSolver, "solve", spy)
    return gaps


def test_the_gap_reaches_the_solver(seen_gaps):
    p = random_problem(12, 2, 5)
    solve(p, "ilp", time_limit_s=2, workers=1, gap=0.02)
    assert seen_gaps and seen_gaps[-1] == pytest.approx(0.02)
    seen_gaps.clear()
    solve(p, "ilp", time_limit_s=2, workers=1)
    assert seen_gaps[-1] == pytest.approx(ilp.DEFAULT_GAP)


def test_a_warm_start_within_the_gap_skips_the_search(monkeypatch):
    p = random_problem(12, 2, 5)
    calls = []
    orig = ilp.run
    monkeypatch.setattr(ilp, "run", lambda *a, **k: calls.append(k["gap"]) or orig(*a, **k))
    exact = solve(p, "ilp", time_limit_s=2, workers=1, gap=0.0)
    assert calls == [0.0]
    calls.clear()
    loose = solve(p, "ilp", time_limit_s=2, workers=1, gap=0.99)
    assert calls == []  # the best baseline is within 99% of the critical-path bound
    assert loose.gap is not None and loose.gap <= 0.99
    assert loose.step_time_s >= exact.step_time_s * (1 - 1e-9)


@pytest.mark.parametrize("gap", [-0.1, 1.0, float("nan")])
def test_a_bad_gap_is_refused(gap):
    import hybridpar
    from hybridpar.cli.main import main
    from hybridpar.errors import UserError

    with pytest.raises(UserError, match=r"^gap must be"):
        hybridpar.place("small_cnn", "dgx1-v100", devices=2, gap=gap)
    assert main(["place", "--model", "small_cnn", "--devices", "2", "--gap", str(gap)]) == 2
