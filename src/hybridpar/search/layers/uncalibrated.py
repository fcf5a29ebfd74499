"""A localhost plan's label when its figures rest on the roofline, not on this machine's measurements
(issue 35: Conv3d priced at 7x its real time, nothing said so). hybridpar.cost.coverage finds the
nodes; this puts the note on the plan, so the table, the JSON and the report all carry it. A
channels-last plan gets a second note the same way: which 4-D ops were priced from channels-last
records and which as NCHW (`with_format_note`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hybridpar.cluster import Cluster, load_cluster
from hybridpar.cost.coverage import LABEL, Coverage, as_run, coverage, format_coverage, profile_keys, whole_nodes
from hybridpar.graph.types import Graph, Node
from hybridpar.plans import Plan

# why a spatial plan's piece and halo-window times stay the roofline's after `hybridpar profile`
SPATIAL_UNPROFILED = "a spatial piece or halo window, not a whole layer's shape"


def plan_coverage(res, model, cluster, config) -> Coverage | None:
    """Coverage of the plan in `res` (a PlanResult of plan_model with `config`; `model` as plan_model
    took it: a (module, inputs) tuple is traced as it does), None on a GPU preset."""
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, gpus=res.plan.world_size)
    if cl.device.kind != "cpu":
        return None
    cl, graph, fractions, profiled = _as_priced(res, model, cl, config)
    return coverage(graph, cl.device, fractions, dtype=config.dtype, calibration=config.calibration,
                    profiled=profiled)


Fractions = Callable[[Node], tuple[float, float, float]]


def _as_priced(res, model, cluster, config) -> tuple[Cluster, Graph, Fractions, tuple[dict, str] | None]:
    """(the cluster, the graph as the plan priced it, each node's (sample, channel, filter) fractions
    there, and for a spatial plan the keys `hybridpar profile` times for it with why no other)."""
    from hybridpar.search.layers.planner import _scaled, _traced

    plan: Plan = res.plan
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster, gpus=plan.world_size)
    graph, _, _ = _traced(model, tuple(config.input_shape) if config.input_shape else None)
    graph = _scaled(graph, plan.batch)
    if plan.default_layout.spatial > 1:
        return (cl, *_spatial_view(graph, plan))

    whole = whole_nodes(graph)

    def fractions(n: Node) -> tuple[float, float, float]:  # at the shape the runtime runs it (a depthwise conv whole)
        lay = plan.layers.get(n.module or "", plan.default_layout)
        s, c, f = as_run(n, (lay.sample, lay.channel, lay.filter), whole)
        return 1 / s, 1 / c, 1 / f

    return cl, graph, fractions, None


def _spatial_view(graph: Graph, plan: Plan) -> tuple[Graph, Fractions, tuple[dict, str]]:
    """A uniform spatial plan is priced on the pieces its first rank holds, halo windows included
    (cost.spatial.local_graph), as the proxy layout's sample groups (cost.spatial.proxy_layout), so
    its op times are looked up there (a piece with no record of its own from its whole layer's:
    cost.compute.op_time), not at the whole graph's shapes."""
    from hybridpar.cost.spatial import local_graph, proxy_layout

    lay = plan.default_layout
    proxy = proxy_layout(lay)
    split = (1 / proxy.sample, 1 / proxy.channel, 1 / proxy.filter)
    whole = (1 / proxy.sample, 1.0, 1.0)  # spatial x channel/filter runs Linear layers whole (_whole_linears)

    runs_whole = whole_nodes(graph)

    def fractions(n: Node) -> tuple[float, float, float]:
        return whole if lay.g_size > 1 and (n.op == "linear" or n.name in runs_whole) else split

    keys: dict[str, str] = {}
    for k in profile_splits(plan):
        keys.update(profiled_keys(graph, k))
    return local_graph(graph, lay), fractions, (keys, SPATIAL_UNPROFILED)


def profile_splits(plan: Plan) -> tuple[int, ...]:
    """The `hybridpar profile --splits` that time what the plan looks up: its rank count, and for a
    spatial plan its sample degree too (the layers after the spatial part, a Linear head, run on B/S
    samples of whole tensors)."""
    lay = plan.default_layout
    return tuple(sorted({plan.world_size, lay.sample} - {1})) if lay.spatial > 1 else (plan.world_size,)


def profiled_keys(graph: Graph, ranks: int) -> dict[str, str]:
    """The op-table keys (with their op kinds) `hybridpar profile --model M --batch B --splits ranks`
    measures for `graph` (at batch B): hybridpar.profile.graph_ops.graph_jobs's rule, one function
    (cost.coverage.profile_keys)."""
    return {key: n.op for key, (n, _) in profile_keys(graph, (ranks,)).items()}


def with_uncalibrated_note(res, model, cluster, config):
    """`res` with the plan's LABEL note first when some op time is the roofline's (unchanged otherwise)."""
    cov = plan_coverage(res, model, cluster, config)
    if cov is None:
        return res
    note = cov.note(_profile_args(res.plan, model, config))
    notes = [n for n in res.plan.notes if not n.startswith(LABEL)]
    if note:
        notes.insert(0, note)
    return dataclasses.replace(res, plan=res.plan.model_copy(update={"notes": notes}))


def _profile_args(p: Plan, model, config) -> str:
    """The `hybridpar profile` options that time what plan `p` looks up."""
    shape = f" --input-shape {','.join(map(str, config.input_shape))}" if config.input_shape else ""
    # an nn.Module has no name `hybridpar profile` can load: the user's factory for it
    name = model if isinstance(model, str) else "path/to/file.py:factory" if isinstance(model, tuple) else p.model
    bf16 = " --precision bf16" if config.dtype == "bf16" else ""  # the op times of a bf16 autocast step
    return f"--model {name}{shape} --batch {p.batch} --splits {','.join(map(str, profile_splits(p)))}{bf16}"


CL_NOTE = "channels-last:"  # the format note's first words


def with_format_note(res, model, cluster, config):
    """A channels-last plan (`config.channels_last`) with its `channels_last` field and a note saying how
    its 4-D ops were priced (FormatCoverage); unchanged otherwise. UserError when the model has no 4-D
    op: the option would change nothing."""
    if not config.channels_last:
        return res
    from hybridpar.errors import UserError

    cl, graph, fractions, _ = _as_priced(res, model, cluster, config)
    cov = format_coverage(graph, cl.device, fractions, dtype=config.dtype, calibration=config.calibration)
    if not cov.measured and not cov.as_nchw:
        raise UserError(f"channels_last: model {res.plan.model!r} has no 4-D (image) op; the memory format "
                        "changes nothing in it", param="channels_last")
    note = cov.note(cl.device, _profile_args(res.plan, model, config))
    notes = [*(n for n in res.plan.notes if not n.startswith(CL_NOTE)), note]
    plan = res.plan.model_copy(update={"notes": notes, "channels_last": cov.status})
    return dataclasses.replace(res, plan=plan)
