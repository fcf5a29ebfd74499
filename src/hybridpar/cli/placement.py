"""The placement of a model-parallel plan, resolved before any rank starts (the runtime never runs a
search): the plan's own, or DLPlacer's for the plan's model, cluster and per-replica batch."""

from __future__ import annotations

from torch import nn

from hybridpar.plans import Plan

PLACER_TIME_LIMIT_S = 10.0  # the ILP is warm-started from the best heuristic; this bounds its search


def with_placement(plan: Plan, module: nn.Module, *, time_limit_s: float = PLACER_TIME_LIMIT_S,
                   optimizer: str = "sgd", example_inputs: tuple | None = None) -> Plan:
    """`plan` with its placement filled in (unchanged when it has one, or when mp == 1); `optimizer`:
    the run's, in the cost model's names (hybridpar.cost.update.optimizer_kind); `example_inputs`: at
    one forward's batch, for a model the runtime runs on torch.export's graph."""
    if plan.placement is not None or plan.mp == 1:
        return plan
    from hybridpar.search.placer import place_model
    from hybridpar.search.placer.module_placement import placement_from_outcome

    shape = tuple(plan.input_shape) if plan.input_shape else None
    outcome = place_model(plan.model, plan.cluster, plan.mp, batch=max(1, plan.batch // plan.dp),
                          input_shape=shape, time_limit_s=time_limit_s, optimizer=optimizer)
    return plan.model_copy(update={"placement": placement_from_outcome(outcome, module, example_inputs)})
