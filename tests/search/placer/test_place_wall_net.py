"""The ILP's wall-clock limit is a safety net only: the deterministic budget decides the answer on a
busy machine (CI's second test worker), and a search the net does stop says so in the result's notes."""

from __future__ import annotations

from ortools.sat.python import cp_model
from tests.search.placer.test_place_ilp import random_problem

from hybridpar.search.placer import cpsat, solve


def test_the_wall_net_leaves_room_for_a_busy_machine(monkeypatch):
    # quiet, this machine needed up to 5x the deterministic budget in wall time; a second busy worker
    # doubles that
    walls: list[tuple[float, float]] = []
    orig = cp_model.CpSolver.solve

    def spy(self, model, *a, **k):
        walls.append((self.parameters.max_time_in_seconds, self.parameters.max_deterministic_time))
        return orig(self, model, *a, **k)

    monkeypatch.setattr(cp_model.CpSolver, "solve", spy)
    solve(random_problem(12, 2, 5), "ilp", time_limit_s=3, workers=1, gap=0.0)
    assert walls and all(wall >= 10 * det for wall, det in walls)


def test_a_search_the_wall_net_stops_says_so(monkeypatch):
    p = random_problem(40, 4, 7)
    monkeypatch.setattr(cpsat, "WALL_MARGIN", 0.0)
    monkeypatch.setattr(cpsat, "WALL_SLACK_S", 0.1)
    rushed = solve(p, "ilp", time_limit_s=2, workers=1, gap=0.0)
    assert rushed.status != "optimal"  # 0.1 s of wall time per solve cannot prove this problem
    assert any("wall-clock safety net stopped the search" in n for n in rushed.notes)
