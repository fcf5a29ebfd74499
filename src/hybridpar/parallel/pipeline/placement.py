"""The placement an MP plan runs: the plan's own. It is resolved before launch (hybridpar.api.with_placement
runs the placer when a plan has none), so that the runtime never runs a search and every rank runs the
same placement."""

from __future__ import annotations

from torch import nn

from hybridpar.errors import UserError
from hybridpar.plans import Plan


def resolve_placement(plan: Plan, module: nn.Module) -> dict[str, int]:
    """plan.placement; a model-parallel plan without one is an error (resolve it before launch)."""
    if plan.mp == 1:
        return dict(plan.placement or {})
    if plan.placement is None:
        raise UserError("the model-parallel plan has no placement: resolve it before launch "
                        "(hybridpar.api.with_placement, or `hybridpar place --out`)")
    return dict(plan.placement)
