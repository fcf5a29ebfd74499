"""hybridpar: plan and run hybrid-parallel deep-learning training.

Pipeline: model -> graph -> cost -> search -> Plan -> runtime.
Heavy sub-packages (torch, solvers) are imported lazily so `import hybridpar` stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "place", "plan"]

# `hybridpar.plan` is the Plan package, and callable: hybridpar.plan(...) runs the planner.
from hybridpar import plan


def place(*args, **kwargs):
    """DLPlacer device placement; see :func:`hybridpar.search.placer.place_model`."""
    from hybridpar.search.placer import place_model

    return place_model(*args, **kwargs)
