"""Spatial layouts (depth/height/width splits with halo exchange, times sample) in the per-layer
planner: priced with the planner's own simulator, offered beside its sample/channel/filter plans.

The runtime runs a spatial layout only uniformly (the whole model under one `sample=S,height=H,...`
layout; spatial x channel/filter and per-layer mixing are refused), so the candidates are the uniform
spatial layouts the runtime can run, as the planner already adds its uniform layouts. One is priced
on one rank's view of the graph (hybridpar.cost.spatial.local_graph: activations at the rank's
spatial piece, each convolution's and pooling's input window copied and kept, B/S samples,
gradients and batch-norm statistics summed over all S x P ranks) as the sample-parallel layout
S x P, with each sliding op's halo exchanges (cost.layout_comm.halo_collectives' bytes,
point-to-point on the cluster's links: cost.spatial.halo_cost) added to its layer's forward and
backward communication. The plan's notes say which layers go spatial and why (time or memory), or
why the best spatial layout lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

from hybridpar.cost.collectives import CommOp
from hybridpar.cost.layout_comm import layout_refusal
from hybridpar.cost.memory import kept_activations
from hybridpar.cost.spatial import SLIDING, halo_cost, local_graph, model_ndim, proxy_layout, spatial_dims
from hybridpar.errors import InfeasibleError, UserError
from hybridpar.layout.halo import SPATIAL_DIMS
from hybridpar.plans import LayerLayout, Plan, Prediction
from hybridpar.search.layers.decomposition import divisors
from hybridpar.search.layers.layer_cost import CostContext
from hybridpar.search.layers.layer_graph import LayerGraph, build_layer_graph
from hybridpar.search.layers.sp_dp import INF


@dataclass(frozen=True)
class SpatialEval:
    """One uniform spatial layout priced: its rank's layer graph and context, options, prediction."""

    layout: LayerLayout
    lg: LayerGraph
    ctx: CostContext
    opts: list
    pred: Prediction
    breakdown: object
    halo_s: float
    sliding: tuple[str, ...]  # the modules that exchange halos (convolutions, pooling)

    @property
    def choice(self) -> list[int]:
        return [0] * len(self.opts)


def _factorisations(p: int, k: int) -> list[tuple[int, ...]]:
    """Ordered k-tuples of positive integers with product p."""
    if k == 1:
        return [(p,)]
    return [(d, *rest) for d in divisors(p) for rest in _factorisations(p // d, k - 1)]


def _splits(p: int, k: int) -> list[tuple[int, ...]]:
    """The splits of p ranks over k dims the planner prices: all of one dim, and the most even ones
    (each costs one pricing of the whole model; halos grow with a piece's surface, so the even
    splits send the least, the one-dim ones exchange along one dim only)."""
    every = _factorisations(p, k)
    one = [t for t in every if sorted(t)[:-1] == [1] * (k - 1)]
    spread = min(max(t) / min(t) for t in every)
    return sorted(set(one) | {t for t in every if max(t) / min(t) == spread}, reverse=True)


def _smallest_sizes(graph, nd: int) -> tuple[int, ...]:
    """Per spatial dim, the smallest size a sliding op's output has (more parts leave ranks idle)."""
    sizes = [n.out_shape[2:] for n in graph.nodes if n.op in SLIDING and len(n.out_shape) == 2 + nd]
    return tuple(min(s[i] for s in sizes) for i in range(nd)) if sizes else (1,) * nd


def spatial_layouts(graph, gpus: int, batch: int) -> list[LayerLayout]:
    """The uniform sample x spatial layouts of `gpus` ranks the runtime can run for `graph` at `batch`
    (at least 2 spatial ranks; no split dim cut into more pieces than its smallest sliding-op output
    has rows), excluding those cost.layout_comm.layout_refusal refuses."""
    nd = model_ndim(graph)
    if not 1 <= nd <= 3:
        return []
    names, smallest = SPATIAL_DIMS[3 - nd:], _smallest_sizes(graph, nd)
    out = []
    for s in divisors(gpus):
        if batch % s or gpus // s == 1:
            continue
        for degrees in _splits(gpus // s, nd):
            if all(d <= m for d, m in zip(degrees, smallest)):
                lay = LayerLayout(sample=s, **dict(zip(names, degrees)))
                if layout_refusal(graph, lay) is None:
                    out.append(lay)
    return out


def _with_halo(vo, nodes: Sequence[str], originals: dict, lay: LayerLayout, ctx: CostContext, inputs: set[str]):
    """`vo` with the halo exchanges of its `nodes` (original, global-shape nodes by name) added to its
    cost's forward and backward communication and bytes (kind "halo")."""
    fwd = bwd = 0.0
    nbytes = 0
    for name in nodes:
        n = originals.get(name)
        if n is None or n.op not in SLIDING:
            continue
        f, b, fb, bb = halo_cost(n, lay, ctx.cluster, ctx.elem)
        if n.inputs and n.inputs[0] in inputs:  # the model's input needs no gradient: no backward halo
            b, bb = 0.0, 0
        fwd, bwd, nbytes = fwd + f, bwd + b, nbytes + fb + bb
    if not nbytes:
        return vo, 0.0
    c = vo.costs[0]
    c = dataclasses.replace(c, comm_fwd_s=c.comm_fwd_s + fwd, comm_bwd_s=c.comm_bwd_s + bwd,
                            comm_bytes={**c.comm_bytes, "halo": c.comm_bytes.get("halo", 0) + nbytes})
    return dataclasses.replace(vo, costs=(c, *vo.costs[1:])), fwd + bwd


def _with_output_gather(vo, graph, lay: LayerLayout, ctx: CostContext):
    """`vo` (the last vertex) with the allgather of each spatially split model output over the spatial
    ranks of its sample group (the runtime hands the loss whole outputs: a U-Net's per-pixel logits),
    bytes the gathered result."""
    nd = model_ndim(graph)
    s, p = lay.sample, lay.spatial
    nbytes = sum(graph.batch // s * prod(graph.node(o).out_shape[1:]) * ctx.elem for o in graph.outputs
                 if len(graph.node(o).out_shape) == 2 + nd)
    if not nbytes:
        return vo
    groups = tuple(tuple(range(i * p, (i + 1) * p)) for i in range(s))
    op = CommOp.placed("allgather", "fwd", nbytes, groups, "spatial", lay)
    c = vo.costs[0]
    c = dataclasses.replace(c, comm_fwd_s=c.comm_fwd_s + ctx.comm_time(op),
                            comm_bytes={**c.comm_bytes, "allgather": c.comm_bytes.get("allgather", 0) + nbytes})
    return dataclasses.replace(vo, costs=(c, *vo.costs[1:]))


def evaluate_spatial(s, lay: LayerLayout, grad_sync: str, contexts: dict | None = None) -> SpatialEval:
    """Price the uniform spatial layout `lay` for the planner's setup `s` (planner._Setup) with the
    planner's simulator (planner.predict_with_breakdown). `contexts`: CostContexts by spatial ranks,
    shared between layouts of one rank count (their memos: the layers' costs by shape)."""
    from hybridpar.search.layers import planner

    graph, ctx0 = s.lg.graph, s.ctx
    local = local_graph(graph, lay)
    lg = build_layer_graph(local)
    contexts = {} if contexts is None else contexts
    ctx = contexts.get(lay.spatial)
    if ctx is None:
        ctx = contexts[lay.spatial] = CostContext(
            ctx0.cluster, local.batch, ctx0.ranks, ctx0.dtype, ctx0.calibration, bn_stats=ctx0.bn_stats,
            optimizer=ctx0.optimizer, momentum=ctx0.momentum, weight_decay=ctx0.weight_decay)
        ctx.kept = frozenset(kept_activations(local))  # node names are the same under every split
    opts = planner._options(lg, ctx, INF, [proxy_layout(lay)], even_only=False, empty_ok=True)
    originals = graph.by_name
    inputs = {n.name for n in graph.nodes if n.op == "input"}
    halo_s = 0.0
    for i, vo in enumerate(opts):
        names = [vo.vertex.node.name, *(f.name for f in vo.vertex.followers)]
        if i == 0:  # the nodes before the first layer run on its ranks (CosmoFlow's first conv3d)
            names += [n.name for n in lg.prefix]
        opts[i], t = _with_halo(vo, names, originals, lay, ctx, inputs)
        halo_s += t
    opts[-1] = _with_output_gather(opts[-1], graph, lay, ctx)
    pred, brk = planner.predict_with_breakdown(lg, opts, [0] * len(opts), ctx, grad_sync)
    sliding = tuple(n.module or n.name for n in graph.nodes if n.op in SLIDING and len(n.in_shapes[0]) > 2)
    return SpatialEval(lay, lg, ctx, opts, pred, brk, halo_s, sliding)


def best_spatial(s, gpus: int, batch: int, grad_sync: str) -> tuple[SpatialEval | None, SpatialEval | None]:
    """(the fastest uniform spatial layout that fits the memory limit, the fastest of all), each None
    when there is none."""
    best = fitting = None
    contexts: dict[int, CostContext] = {}
    for lay in spatial_layouts(s.lg.graph, gpus, batch):
        if lay.to_strategy() in s.excluded:
            continue
        ev = evaluate_spatial(s, lay, grad_sync, contexts)
        if best is None or ev.pred.step_time_s < best.pred.step_time_s:
            best = ev
        fits = ev.pred.memory_bytes[0] <= s.capacity
        if fits and (fitting is None or ev.pred.step_time_s < fitting.pred.step_time_s):
            fitting = ev
    return fitting, best


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f} ms"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _layers_note(ev: SpatialEval) -> str:
    mods = ev.sliding
    listed = ", ".join(mods[:4]) + (f", ... ({len(mods)} in all)" if len(mods) > 4 else "")
    return (f"spatial: {ev.layout.to_strategy()} for every layer; the {len(mods)} convolutions and poolings "
            f"({listed}) split each sample's {_split_text(ev.layout)} with halo exchanges "
            f"({_ms(ev.halo_s)} per step, not overlapped)")


def _split_text(lay: LayerLayout) -> str:
    return " x ".join(f"{k} in {getattr(lay, k)}" for k in SPATIAL_DIMS if getattr(lay, k) > 1)


def compare(s, other: Prediction | InfeasibleError, gpus: int, batch: int, grad_sync: str, label: str = ""
            ) -> tuple[SpatialEval | None, list[str]]:
    """(the spatial layout to plan instead of `other`, or None; notes for the plan either way).
    `other`: the best plan without spatial splits' prediction, or the InfeasibleError its search raised."""
    nd = model_ndim(s.lg.graph)
    if nd not in (1, 2, 3) or gpus == 1:  # no spatial dims (a sequence model), or nothing to split over
        return None, []
    fitting, best = best_spatial(s, gpus, batch, grad_sync)
    if best is None:  # the runtime's reason for the plainest one, when it refuses
        why = layout_refusal(s.lg.graph, LayerLayout(**{SPATIAL_DIMS[3 - nd]: gpus}))
        return None, ["spatial splits not considered: " + (why or f"no uniform sample x spatial layout of {gpus} "
                                                                  f"ranks fits this model's sizes at batch {batch}")]
    if isinstance(other, InfeasibleError):
        if fitting is None:
            return None, []
        return fitting, [_layers_note(fitting), f"spatial chosen for memory: {fitting.pred.step_time_s * 1e3:.1f} ms "
                         f"per step, {_gib(fitting.pred.memory_bytes[0])} per device; no plan without spatial "
                         f"splits fits ({other})"]
    base = other
    if fitting is not None and fitting.pred.step_time_s < base.step_time_s:
        return fitting, [_layers_note(fitting), (
            f"spatial chosen for time: {_ms(fitting.pred.step_time_s)} per step against {_ms(base.step_time_s)} "
            f"for the best plan without spatial splits{label} ({base.step_time_s / fitting.pred.step_time_s:.2f}x "
            f"speed-up); {_gib(fitting.pred.memory_bytes[0])} per device")]
    ev = fitting or best
    why = "slower" if fitting is not None else f"over the memory limit ({_gib(ev.pred.memory_bytes[0])} per device)"
    return None, [f"no layer goes spatial: the best uniform spatial layout, {ev.layout.to_strategy()}, predicts "
                  f"{_ms(ev.pred.step_time_s)} per step (halo exchanges {_ms(ev.halo_s)}) against "
                  f"{_ms(base.step_time_s)} for this plan: {why}"]


def to_plan(s, ev: SpatialEval, strategy: str | None, notes: list[str]):
    """(Plan, rows) of a uniform spatial layout: planner._to_plan's, with the layout itself (not its
    sample-parallel proxy) and the global batch."""
    from hybridpar.search.layers import planner

    proxy_setup = dataclasses.replace(s, lg=ev.lg, ctx=ev.ctx)
    plan, rows = planner._to_plan(proxy_setup, ev.opts, ev.choice, ev.pred, strategy, notes)
    data = plan.model_dump()
    data.update(batch=s.ctx.batch, default_layout=ev.layout, layers={})
    plan = Plan(**data)
    rows = tuple(dataclasses.replace(r, choice=ev.layout.to_strategy(), layout=ev.layout if r.layout else None)
                 for r in rows)
    return plan, rows


def _gradients(s, ev: SpatialEval):
    from hybridpar.search.layers import planner

    return planner._gradients(dataclasses.replace(s, lg=ev.lg, ctx=ev.ctx), ev.opts, ev.choice)


def with_spatial(s, cfg, where: tuple[int, int, float], base: tuple, search: Callable[[], object]):
    """planner.plan_model's result: `search()`'s plan (without spatial splits), or the fastest uniform
    spatial layout that fits when it beats that plan or nothing else fits; the notes say which and why.
    `where`: (gpus, batch, start time); `base`: (DP baseline, its breakdown, its note, the FSDP
    baseline's (prediction, note, breakdown))."""
    import time

    from hybridpar.search.layers.planner import PlanResult

    gpus, batch, t0 = where
    baseline, base_brk, note, fsdp = base
    try:
        result, other = search(), None
    except InfeasibleError as err:
        result, other = _uniform_fallback(s, cfg, (gpus, batch, t0), base, err), err
    if cfg.free_sample:  # a projection-only space: the runtime's uniform spatial layouts are not its question
        if result is None:
            raise other
        return result
    ev, notes = compare(s, other if result is None else result.prediction, gpus, batch, cfg.grad_sync,
                        "" if result is None else f", {result.method}")
    if ev is None:
        if result is None:
            raise other
        return dataclasses.replace(result, plan=result.plan.model_copy(update={"notes": [*result.plan.notes, *notes]}))
    method = f"uniform {ev.layout.to_strategy()}"
    plan, rows = to_plan(s, ev, None, [f"optimiser: {method} (spatial layouts run uniformly)", *notes])
    if result is not None:
        return dataclasses.replace(result, plan=plan, layers=rows, prediction=ev.pred, method=method, pruned={},
                                   solve_s=time.perf_counter() - t0, breakdown=ev.breakdown,
                                   gradients=_gradients(s, ev))
    return PlanResult(plan, rows, ev.pred, baseline, note, method, {}, time.perf_counter() - t0, ev.breakdown,
                      base_brk, _gradients(s, ev), *fsdp)


def _uniform_fallback(s, cfg, where: tuple[int, int, float], base: tuple, err: InfeasibleError):
    """When the search finds nothing (it prunes layouts that leave a layer's pieces empty, e.g. a
    2-channel segmentation head split 8 ways), the fastest uniform sample/channel/filter layout that
    fits and the runtime runs (empty pieces included, as `--strategy` evaluates it), as a PlanResult;
    None if none fits."""
    import time

    from hybridpar.search.layers import planner

    gpus, batch, t0 = where
    baseline, base_brk, note, fsdp = base
    best = None
    for layouts in planner.runtime_layouts(gpus, batch).values():
        for lay in layouts:
            if layout_refusal(s.lg.graph, lay) or lay.zero or lay.to_strategy() in s.excluded:
                continue
            try:
                opts, choice, pred, brk = planner._evaluate_uniform(s, lay, cfg.grad_sync)
            except InfeasibleError:
                continue
            if pred.memory_bytes[0] <= s.capacity and (best is None or pred.step_time_s < best[2].step_time_s):
                best = (opts, choice, pred, brk, lay)
    if best is None:
        return None
    opts, choice, pred, brk, lay = best
    method = f"uniform {lay.to_strategy()}"
    notes = [f"optimiser: {method}; the search found nothing ({err}), so the fastest uniform layout is taken "
             "(layers with fewer channels than pieces run with empty pieces)"]
    plan, rows = planner._to_plan(s, opts, choice, pred, None, notes)
    return planner.PlanResult(plan, rows, pred, baseline, note, method, {}, time.perf_counter() - t0, brk, base_brk,
                              planner._gradients(s, opts, choice), *fsdp)


def fixed(s, cfg, layout: LayerLayout, refusal: str | None):
    """planner._plan_fixed's (plan, rows, prediction, breakdown, options, choice) for a uniform spatial
    `layout` (`--strategy height=2`): evaluated, not searched. A what-if (`runnable_only` False) of
    spatial x channel/filter or of a dim the model lacks is refused: there is nothing to price it by."""
    try:
        spatial_dims(layout, model_ndim(s.lg.graph))
    except ValueError as err:
        raise UserError(f"{layout.to_strategy()}: {err}") from None
    if layout.g_size > 1:
        raise UserError(f"{layout.to_strategy()}: spatial x channel/filter in one layer is not priced "
                        "(the runtime does not run it yet)")
    ev = evaluate_spatial(s, layout, cfg.grad_sync)
    notes = [f"fixed layout {layout.to_strategy()} evaluated (not searched)", _layers_note(ev)]
    notes += [f"WHAT-IF, the runtime cannot run it: {refusal}"] if refusal else []
    if ev.pred.memory_bytes[0] > s.capacity:
        notes.append(f"over the memory limit: {_gib(ev.pred.memory_bytes[0])} per device")
    plan, rows = to_plan(s, ev, layout.to_strategy(), notes)
    return plan, rows, ev.pred, ev.breakdown, ev.opts, ev.choice
