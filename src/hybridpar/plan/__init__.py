"""The Plan data type (versioned JSON) shared by search and runtime."""

from hybridpar.plan.schema import (
    SCHEMA_VERSION,
    LayerLayout,
    Plan,
    Prediction,
    load_plan,
    plan_from_dict,
)
from hybridpar.plan.strategy import parse_strategy

__all__ = ["SCHEMA_VERSION", "LayerLayout", "Plan", "Prediction", "load_plan", "plan_from_dict",
           "parse_strategy"]
