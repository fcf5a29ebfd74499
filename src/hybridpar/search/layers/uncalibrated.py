"""A localhost plan's label when its figures rest on the roofline, not on this machine's measurements
(issue 35: Conv3d priced at 7x its real time, nothing said so). hybridpar.cost.coverage finds the
nodes; this puts the note on the plan, so the table, the JSON and the report all carry it."""

from __future__ import annotations

import dataclasses

from hybridpar.cluster import Cluster, load_cluster
from hybridpar.cost.coverage import LABEL, Coverage, coverage
from hybridpar.graph.types import Node
from hybridpar.plans import Plan


def plan_coverage(res, model, cluster, config) -> Coverage | None:
    """Coverage of the plan in `res` (a PlanResult of plan_model with `config`), None on a GPU preset
    or for a model given as an nn.Module (no cached graph to price again)."""
    from hybridpar.search.layers.planner import _scaled, _traced

    if isinstance(model, tuple):
        return None
    plan: Plan = res.plan
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, gpus=plan.world_size)
    if cl.device.kind != "cpu":
        return None
    graph, _, _ = _traced(model, tuple(config.input_shape) if config.input_shape else None)
    graph = _scaled(graph, plan.batch)

    def fractions(n: Node) -> tuple[float, float, float]:
        lay = plan.layers.get(n.module or "", plan.default_layout)
        return 1 / lay.sample, 1 / lay.channel, 1 / lay.filter

    return coverage(graph, cl.device, fractions, dtype=config.dtype, calibration=config.calibration)


def with_uncalibrated_note(res, model, cluster, config):
    """`res` with the plan's LABEL note first when some op time is the roofline's (unchanged otherwise)."""
    cov = plan_coverage(res, model, cluster, config)
    if cov is None:
        return res
    p = res.plan
    shape = f" --input-shape {','.join(map(str, config.input_shape))}" if config.input_shape else ""
    note = cov.note(f"--model {model if isinstance(model, str) else p.model}{shape} --batch {p.batch} "
                    f"--splits {p.world_size}")
    notes = [n for n in res.plan.notes if not n.startswith(LABEL)]
    if note:
        notes.insert(0, note)
    return dataclasses.replace(res, plan=res.plan.model_copy(update={"notes": notes}))
