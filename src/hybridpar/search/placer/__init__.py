"""DLPlacer: device placement for model parallelism (ILP + baselines), its schedule and Gantt chart.

`place_model(model, cluster, gpus, config)` is the entry point (also `hybridpar.place`; `config` is a
PlacerConfig, or its fields given as keywords); the solvers work on the abstract `PlacementProblem` so
they can be used and tested without a model.
"""

from __future__ import annotations

from hybridpar.search.placer.baselines import BASELINES, best_baseline
from hybridpar.search.placer.problem import PlacementProblem, Task, contract, uniform_links
from hybridpar.search.placer.result import PlacementResult, memory_per_device

SOLVERS = ("ilp", *BASELINES)

__all__ = [
    "BASELINES",
    "SOLVERS",
    "PlacementProblem",
    "PlacementResult",
    "Task",
    "best_baseline",
    "contract",
    "memory_per_device",
    "place_model",
    "solve",
    "uniform_links",
]


def solve(problem: PlacementProblem, solver: str = "ilp", *, time_limit_s: float = 30.0,
          workers: int = 2, time_unit_s: float | None = None, seed: int = 0,
          gap: float | None = None) -> PlacementResult:
    """Place `problem` with one solver; the ILP is warm-started from the best of every baseline.
    The ILP's answer depends only on the problem, `time_limit_s`, `workers`, `seed` and `gap` (its
    time limit is deterministic time, not wall time; it stops within `gap` of the proven bound,
    default ilp.DEFAULT_GAP)."""
    from hybridpar.errors import UserError

    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    problem.check_capacity()
    if solver != "ilp":
        return BASELINES[solver](problem)
    from hybridpar.search.placer.ilp import DEFAULT_GAP, solve_ilp

    hint, _ = best_baseline(problem)
    return solve_ilp(problem, time_limit_s=time_limit_s, hint=hint, workers=workers, time_unit_s=time_unit_s,
                     seed=seed, gap=DEFAULT_GAP if gap is None else gap)


def place_model(*args, **kwargs):
    """Place a model (zoo name, nn.Module or Graph) on `gpus` devices of a cluster; see api.place_model."""
    from hybridpar.search.placer.api import place_model as _place

    return _place(*args, **kwargs)
