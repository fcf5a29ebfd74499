"""The placement an MP plan runs: the plan's own, or one found by the placer (DLPlacer)."""

from __future__ import annotations

import torch.distributed as dist

from hybridpar.plan import Plan

PLACER_TIME_LIMIT_S = 10.0  # the ILP is warm-started from the best heuristic; this bounds its search


def find_placement(plan: Plan, *, time_limit_s: float = PLACER_TIME_LIMIT_S) -> dict[str, int]:
    """Place plan.model over plan.mp devices of plan.cluster at the per-replica batch."""
    from hybridpar.search.placer import place_model

    shape = tuple(plan.input_shape) if plan.input_shape else None
    outcome = place_model(plan.model, plan.cluster, plan.mp, batch=max(1, plan.batch // plan.dp),
                          input_shape=shape, time_limit_s=time_limit_s)
    return dict(outcome.plan.placement or {})


def resolve_placement(plan: Plan) -> dict[str, int]:
    """plan.placement, or (when it has none and mp > 1) the placer's, computed once on rank 0 and
    broadcast, so that every rank runs the same placement even if the solver is not deterministic."""
    if plan.placement is not None or plan.mp == 1:
        return dict(plan.placement or {})
    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = find_placement(plan)
        except Exception as err:  # noqa: BLE001 - forwarded to every rank, raised there
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]  # type: ignore[return-value]
