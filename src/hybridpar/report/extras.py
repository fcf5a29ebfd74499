"""Figures that come from other packages: the placer's Gantt chart and the projection's speedup plot.

Each returns (png or None, note or None); a missing package or an unsuitable plan gives a note, never
an error, so a report always renders.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hybridpar.errors import UserError
from hybridpar.jsonfile import read_input
from hybridpar.plans import Plan


def _assignment(plan: Plan, tasks) -> tuple[list[int], int]:
    """Device of each placer task from the plan's module -> device map; tasks without modules (adds,
    functionals) run beside their first input. Returns (assignment, tasks the plan names)."""
    placement, index = plan.placement or {}, {t.name: i for i, t in enumerate(tasks)}
    out: list[int] = []
    named = 0
    for t in tasks:
        devs = [placement[m] for m in getattr(t, "modules", ()) if m in placement]
        if devs:
            named += 1
            out.append(max(set(devs), key=devs.count))
        else:
            ins = [out[index[i]] for i in t.inputs if i in index and index[i] < len(out)]
            out.append(ins[0] if ins else 0)
    return out, named


def gantt_png(plan: Plan) -> tuple[bytes | None, str | None]:
    """Re-time the plan's placement with the placer's list scheduler and draw its Gantt chart."""
    if not plan.placement or plan.mp < 2:
        return None, "no placement in this plan (mp = 1): no Gantt chart"
    try:
        from hybridpar.search.placer.api import build_problem
        from hybridpar.search.placer.gantt import save_gantt
        from hybridpar.search.placer.result import evaluate
    except ImportError:
        return None, "placement Gantt chart omitted: the placer is not in this build"
    try:
        prob, *_ = build_problem(plan.model, plan.cluster, plan.mp, batch=max(1, plan.batch // plan.dp),
                                 input_shape=tuple(plan.input_shape) if plan.input_shape else None)
    except UserError as err:
        return None, f"placement Gantt chart omitted: {err}"
    assignment, named = _assignment(plan, prob.tasks)
    if not named:
        return None, "placement Gantt chart omitted: the plan's placement names none of the model's layers"
    result = evaluate(prob, assignment, "plan")
    with tempfile.TemporaryDirectory() as d:
        path = save_gantt(result, Path(d) / "gantt.png")
        png = path.read_bytes()
    note = (f"schedule re-timed by the placer's list scheduler from the plan's placement "
            f"({named}/{len(prob.tasks)} graph nodes placed by name, the rest beside their inputs): "
            f"step {result.step_time_s * 1e3:.3g} ms")
    if plan.predicted is not None:
        note += f" (the plan predicted {plan.predicted.step_time_s * 1e3:.3g} ms)"
    return png, note


def load_projection(path: str) -> dict:
    """The JSON of `hybridpar project --json`, checked for what the plot needs."""
    try:
        data = json.loads(read_input(path, "projection"))  # bounded, never a FIFO
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise UserError(f"projection {path} is not valid JSON") from None
    points = data.get("points") if isinstance(data, dict) else None
    if not isinstance(points, list) or not points:
        raise UserError(f"projection {path}: no 'points' (expected `hybridpar project --json` output)")
    for i, p in enumerate(points):
        ok = isinstance(p, dict) and isinstance(p.get("strategy"), str) and all(
            isinstance(p.get(k), (int, float)) and not isinstance(p.get(k), bool) and p.get(k) > 0
            for k in ("gpus", "speedup"))
        if not ok:
            raise UserError(f"projection {path}: points[{i}] needs strategy, gpus > 0 and speedup > 0")
    return data


def projection_png(plan: Plan, projection: dict | None = None) -> tuple[bytes | None, str | None]:
    if projection is None:
        return None, ("scaling projection omitted: pass --projection proj.json "
                      f"(from `hybridpar project --model {plan.model} --json > proj.json`)")
    from hybridpar.report.figures import speedup_plot

    note = None
    if projection.get("model") not in (None, plan.model):
        note = f"projection is for {projection.get('model')}, the plan for {plan.model}"
    return speedup_plot(projection), note
