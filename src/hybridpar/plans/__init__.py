"""The Plan data type (versioned JSON) shared by search and runtime.

`hybridpar.plan(...)`, the function that finds a plan, lives in `hybridpar/__init__.py`; this package
only holds what a plan is, and knows nothing of how it was found.
"""

from hybridpar.plans.schema import (
    SCHEMA_VERSION,
    LayerLayout,
    Plan,
    Prediction,
    load_plan,
    plan_from_dict,
)
from hybridpar.plans.strategy import Strategy, parse_strategy

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
