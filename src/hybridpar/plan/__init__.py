"""The Plan data type (versioned JSON) shared by search and runtime.

The package is also callable: `hybridpar.plan(model, cluster, gpus, batch, ...)` runs the per-layer
planner (DESIGN.md's Python API). A plain function named `plan` in `hybridpar/__init__.py` would be
shadowed by this subpackage as soon as it is imported, so the module itself carries `__call__`.
"""

from hybridpar._callable import make_module_callable
from hybridpar.plan.schema import (
    SCHEMA_VERSION,
    LayerLayout,
    Plan,
    Prediction,
    load_plan,
    plan_from_dict,
)
from hybridpar.plan.strategy import Strategy, parse_strategy

__all__ = [
    "SCHEMA_VERSION",
    "LayerLayout",
    "Plan",
    "Prediction",
    "Strategy",
    "load_plan",
    "parse_strategy",
    "plan_from_dict",
]


def _plan(*args, **kwargs):
    """Per-layer decomposition planner; see :func:`hybridpar.search.planner.plan_model`."""
    from hybridpar.search.planner import plan_model

    return plan_model(*args, **kwargs)


make_module_callable(__name__, _plan)
