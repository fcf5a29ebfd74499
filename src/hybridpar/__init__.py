"""hybridpar: plan and run hybrid-parallel deep-learning training.

Pipeline: model -> graph -> cost -> search -> Plan -> runtime.
Heavy sub-packages are imported lazily so `import hybridpar` stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "plan", "place"]


def plan(*args, **kwargs):
    """Per-layer decomposition planner; see :func:`hybridpar.search.planner.plan_model`."""
    from hybridpar.search.planner import plan_model

    return plan_model(*args, **kwargs)


def place(*args, **kwargs):
    """DLPlacer device placement; see :func:`hybridpar.search.placer.place_model`."""
    from hybridpar.search.placer import place_model

    return place_model(*args, **kwargs)
