"""The placement an MP plan runs: the plan's own, or one found by the placer (DLPlacer)."""

from __future__ import annotations

import torch.distributed as dist
from torch import fx, nn

from hybridpar.plans import Plan

PLACER_TIME_LIMIT_S = 10.0  # the ILP is warm-started from the best heuristic; this bounds its search


def find_placement(plan: Plan, module: nn.Module, *, time_limit_s: float = PLACER_TIME_LIMIT_S
                   ) -> dict[str, int]:
    """Place plan.model over plan.mp devices of plan.cluster at the per-replica batch."""
    from hybridpar.search.placer import place_model

    shape = tuple(plan.input_shape) if plan.input_shape else None
    outcome = place_model(plan.model, plan.cluster, plan.mp, batch=max(1, plan.batch // plan.dp),
                          input_shape=shape, time_limit_s=time_limit_s)
    return placement_from_outcome(outcome, module)


def placement_from_outcome(outcome, module: nn.Module) -> dict[str, int]:
    """The placer's plan names modules only; functional nodes (a branch concat, a residual add) are
    added by their fx node name from the placed graph's members, so that they run where the placer
    scheduled them rather than next to their first input."""
    placement = dict(outcome.plan.placement or {})
    fx_nodes = {n.name for n in fx.symbolic_trace(module).graph.nodes}
    for node, dev in zip(outcome.graph.nodes, outcome.result.assignment):
        for member in node.attr("members") or (node.name,):
            if member in fx_nodes:
                placement.setdefault(member, int(dev))
    return placement


def resolve_placement(plan: Plan, module: nn.Module) -> dict[str, int]:
    """plan.placement, or (when it has none and mp > 1) the placer's, computed once on rank 0 and
    broadcast, so that every rank runs the same placement even if the solver is not deterministic."""
    if plan.placement is not None or plan.mp == 1:
        return dict(plan.placement or {})
    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = find_placement(plan, module)
        except Exception as err:  # noqa: BLE001 - forwarded to every rank, raised there
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]  # type: ignore[return-value]


def predicted_p2p_bytes(outcome) -> int:
    """Bytes the placer's cost model moves between devices per step for its assignment: each task's
    output once to every other device consuming it, and its gradient back. The runtime's measured
    send bytes (summed over the ranks of a replica) equal this for the same placement."""
    prob, assign = outcome.problem, outcome.result.assignment
    total = 0
    for i, task in enumerate(prob.tasks):
        consumers = {assign[j] for j in prob.succs[i]} - {assign[i]}
        total += task.out_bytes * len(consumers)
    return 2 * total
