"""Sample-dimension sharding (FSDP2, `zero=2|3`) and activation recomputation on the per-layer
planner's simulator: the second baseline, "FSDP + full recomputation" (what a torchtitan user runs by
default: `sample=N,zero=3` with every block recomputed), and the sharded/recomputing candidates the
planner weighs against channel/filter when data parallelism does not fit the memory limit.

Time, per step (a uniform sample-only or sample x channel/filter layout, the runtime's blocks
`cost.memory.block_of`; under channel/filter FSDP gathers each rank's local pieces and the replicated
DTensor parameters keep their GradSync allreduce, summed after backward):
- forward: each block's parameters all-gathered before its forward, the next block's gather issued
  when the previous block starts computing (FSDP2's one-ahead prefetch) on one communication stream;
- backward, in reverse: under zero=3 each block gathered again (prefetched one ahead; not the root's
  own parameters, which FSDP2 keeps gathered), recomputation re-runs the block's forward before its
  backward, and the block's gradients are reduce-scattered when its backward ends (replacing the
  data-parallel gradient allreduce);
- the optimizer steps on this rank's shard (1/S of the elements).
Bytes are `cost.layout_comm.fsdp_collectives` of the layout; memory is `cost.memory.predict_rank_memory`
(`sharded_step_memory`'s rule), the figure `hybridpar train` reports against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.cost.collectives import CommOp
from hybridpar.cost.layout_comm import fsdp_collectives
from hybridpar.cost.memory import LayerMemory, block_of, predict_rank_memory
from hybridpar.errors import InfeasibleError
from hybridpar.plans import LayerLayout, Prediction
from hybridpar.search.layers.decomposition import shard_groups

RECOMPUTE_CHOICES = ("auto", "none", "all")  # `plan --recompute`: auto = the planner chooses
BASELINE_NAME = "FSDP + full recomputation"


@dataclass(frozen=True)
class FsdpBreakdown:
    """Where a sharded/recomputing step's communication and extra compute go (seconds, bytes)."""

    grad_sync_s: float  # the gradients' reduce-scatters (zero>0) or allreduce buckets (zero=0)
    layer_comm_s: float  # batch-norm statistics and the like, inside the layers
    redistribution_s: float
    extras_s: float  # output gather and loss allreduce
    grad_bytes: int = 0  # reduce-scatter (or allreduce) bytes on one rank
    allgather_s: float = 0.0  # the parameters' all-gathers, forward and (zero=3) backward
    allgather_bytes: int = 0
    recompute_s: float = 0.0  # the forward FLOPs recomputation adds to backward
    zero: int = 0
    recompute: str = "none"


@dataclass(frozen=True)
class Sharded:
    """One sharded/recomputing candidate priced on the simulator."""

    layout: LayerLayout  # sample=N with its zero level
    recompute: str
    prediction: Prediction
    breakdown: FsdpBreakdown
    opts: list
    choice: list[int]

    @property
    def label(self) -> str:
        rec = "recompute all" if self.recompute == "all" else "no recomputation"
        return f"{self.layout.to_strategy()} + {rec}"


def _owner(vo) -> str:
    v = vo.vertex
    return block_of(next((n.module for n in (v.node, *v.followers) if n.module), ""))


def _with_recompute(opts: list, choice: Sequence[int]) -> tuple[list, float]:
    """Options whose backward also re-runs the block's forward (and its collectives, e.g. batch-norm
    statistics: checkpoint replays the forward as it ran), for every vertex in a block (the root's
    own ops are never recomputed: `sharded_step_memory`), and the seconds added."""
    from hybridpar.search.layers.planner import VertexOptions

    out, extra = [], 0.0
    for vo, k in zip(opts, choice):
        if not _owner(vo):
            out.append(vo)
            continue
        c = vo.costs[k]
        add = c.fwd_s + c.comm_fwd_s
        extra += add
        costs = tuple(dataclasses.replace(x, bwd_s=x.bwd_s + x.fwd_s + x.comm_fwd_s) if i == k else x
                      for i, x in enumerate(vo.costs))
        out.append(VertexOptions(vo.vertex, vo.options, costs, vo.pruned))
    return out, extra


def _memory(lg, ctx, layout: LayerLayout, recompute: str) -> int:
    mem = predict_rank_memory(lg.graph, layout, batch=ctx.batch, optimizer=ctx.optimizer, momentum=ctx.momentum,
                              weight_decay=ctx.weight_decay, dtype=ctx.dtype, framework_bytes=ctx.framework_bytes,
                              recompute=recompute)
    return int(mem.total_bytes)


def price(s, layout: LayerLayout, recompute: str, grad_sync: str) -> Sharded:
    """`layout` (sample-only or sample x channel/filter, any zero level) with `recompute` ("none" | "all") priced on the
    planner's simulator (`s`: the planner's _Setup)."""
    from hybridpar.search.layers.planner import _evaluate_uniform, predict_with_breakdown

    if layout.spatial > 1:
        raise InfeasibleError(f"{layout.to_strategy()}: sharding and recomputation are priced for sample and "
                              "sample x channel/filter layouts, not spatial ones")
    plain = LayerLayout(sample=layout.sample, channel=layout.channel, filter=layout.filter)
    opts, choice, _, _ = _evaluate_uniform(s, plain, grad_sync)
    rec_s = 0.0
    if recompute == "all":
        opts, rec_s = _with_recompute(opts, choice)
    if layout.zero and layout.sample > 1:
        pred, brk = _sharded_step(s, opts, choice, layout)
    else:
        pred, b = predict_with_breakdown(s.lg, opts, choice, s.ctx, grad_sync)
        brk = FsdpBreakdown(b.grad_sync_s, b.layer_comm_s, b.redistribution_s, b.extras_s, b.grad_bytes)
    mem = _memory(s.lg, s.ctx, layout, recompute)
    pred = pred.model_copy(update={"memory_bytes": [mem] * s.ctx.ranks})
    brk = dataclasses.replace(brk, recompute_s=rec_s, zero=layout.zero, recompute=recompute)
    return Sharded(layout, recompute, pred, brk, opts, list(choice))


def _segments(s, opts: list, choice: Sequence[int]) -> list[tuple[str, float, float]]:
    """(block, forward s, backward s) of consecutive runs of one block in forward order (the nodes
    before the first layer first)."""
    from hybridpar.search.layers.layer_cost import nodes_comm
    from hybridpar.search.layers.planner import _prefix_time

    segs: list[tuple[str, float, float]] = []
    lg, ctx = s.lg, s.ctx
    if lg.prefix:
        d0 = opts[0].dist(choice[0])
        pf, pb = _prefix_time(lg, d0, ctx)
        cf, cb, _ = nodes_comm(lg.prefix, d0, ctx, input_grad=False)
        segs.append((block_of(next((n.module for n in lg.prefix if n.module), "")), pf + cf, pb + cb))
    for vo, k in zip(opts, choice):
        c, key = vo.costs[k], _owner(vo)
        f, b = c.fwd_s + c.comm_fwd_s, c.bwd_s + c.comm_bwd_s
        if segs and segs[-1][0] == key:
            segs[-1] = (key, segs[-1][1] + f, segs[-1][2] + b)
        else:
            segs.append((key, f, b))
    return segs


class _Stream:
    """One communication stream: FIFO, each op starts when issued and the stream is free."""

    def __init__(self) -> None:
        self.free = 0.0

    def run(self, issued: float, seconds: float) -> float:
        self.free = max(self.free, issued) + seconds
        return self.free


def _sharded_step(s, opts: list, choice: Sequence[int], layout: LayerLayout) -> tuple[Prediction, FsdpBreakdown]:
    from hybridpar.search.layers.layer_cost import grad_allreduce
    from hybridpar.search.layers.planner import (
        _output_whole,
        _per_layer,
        _step_extras,
        grad_bucket_schedule,
        step_extra_s,
    )

    lg, ctx = s.lg, s.ctx
    plain = LayerLayout(sample=layout.sample, channel=layout.channel, filter=layout.filter)
    groups = shard_groups(plain)  # the ranks holding the same pieces: FSDP's sample groups
    ops = fsdp_collectives(lg.graph, layout, dtype_bytes=ctx.elem)
    t_of = {}
    for key, op in ops:
        placed = CommOp.placed(op.kind, op.phase, op.bytes_, groups, "replica", plain)
        t_of[(key, op.kind, op.phase)] = ctx.comm_time(placed)
    segs = _segments(s, opts, choice)
    extras = _step_extras(opts, choice, ctx, _output_whole(lg))
    # under channel/filter the replicated DTensor parameters stay with GradSync (summed after backward,
    # blocking); FSDP holds every other parameter (cost.layout_comm.fsdp_replaced)
    extras += [grad_allreduce(b, key) for key, b, i in grad_bucket_schedule(lg, opts, choice, ctx) if i is None]
    extra_s = sum(ctx.comm_time(op) for op in extras)
    serial = ctx.cluster.device.comm_takes_compute  # the exchanges run on the cores compute runs on
    t, ag_s_total, rs_total = _simulate(segs, t_of, layout.zero, serial)
    t += extra_s
    costs = [vo.costs[k] for vo, k in zip(opts, choice)]
    held = [LayerMemory(weights_bytes=sum(c.memory.weights_bytes for c in costs if c.memory) / layout.sample)]
    extra_compute = step_extra_s(lg, held, layout.sample, ctx)  # the optimizer on this rank's shard
    step = t + extra_compute
    layer_comm = sum(c.comm_fwd_s + c.comm_bwd_s for c in costs)
    pre_comm = sum(f + b for _, f, b in segs) - sum(c.fwd_s + c.bwd_s + c.comm_fwd_s + c.comm_bwd_s for c in costs)
    compute = sum(c.fwd_s + c.bwd_s for c in costs) + pre_comm + extra_compute  # pre_comm: the prefix's
    nbytes: dict[str, int] = {}
    for c in costs:  # the layers' own collectives (the gradient allreduce is not among them)
        for kind, b in c.comm_bytes.items():
            nbytes[kind] = nbytes.get(kind, 0) + b
    for _, op in ops:
        nbytes[op.kind] = nbytes.get(op.kind, 0) + op.bytes_
    for op in extras:
        if op.phase != "check":
            nbytes[op.kind] = nbytes.get(op.kind, 0) + op.bytes_
    pred = Prediction(step_time_s=step, compute_s=compute, comm_s=ag_s_total + rs_total + extra_s + layer_comm,
                      exposed_comm_s=max(0.0, step - compute), memory_bytes=[], comm_bytes=nbytes,
                      per_layer=_per_layer(lg, opts, costs, [0.0] * len(opts), opts[0].dist(choice[0]), ctx))
    rs_bytes = sum(op.bytes_ for _, op in ops if op.kind == "reduce_scatter")
    ag_bytes = sum(op.bytes_ for _, op in ops if op.kind == "allgather")
    return pred, FsdpBreakdown(rs_total, layer_comm, 0.0, extra_s, rs_bytes, ag_s_total, ag_bytes)


def _simulate(segs: list[tuple[str, float, float]], t_of: dict, zero: int, serial: bool) -> tuple[float, float, float]:
    """(end of backward with the last reduce-scatter, all-gather s, reduce-scatter s) of the segments:
    forward in order, backward in reverse, all-gathers prefetched one block ahead, reduce-scatters
    launched when a block's backward ends. `serial`: communication does not overlap compute. A
    block's segments run together, the root's own after the blocks (the same sums)."""
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    for key, f, b in segs:
        fwd[key], bwd[key] = fwd.get(key, 0.0) + f, bwd.get(key, 0.0) + b
    # blocks in forward order; one whose parameters no layer of the layer graph names goes last
    order = list(dict.fromkeys([*(k for k in fwd if k), *(k for k, _, _ in t_of if k)]))
    comm = _Stream()
    totals = {"allgather": 0.0, "reduce_scatter": 0.0}
    ready: dict[str, float] = {}

    def launch(key: str, kind: str, phase: str, issued: float) -> None:
        dt = t_of.get((key, kind, phase), 0.0)
        totals[kind] += dt
        ready[key] = comm.run(issued, dt)

    def run(key: str, start: float, seconds: float) -> float:
        return max(start, ready.get(key, 0.0), comm.free if serial else 0.0) + seconds

    launch("", "allgather", "fwd", 0.0)  # the root's own parameters: gathered first, kept (FSDP2's root)
    root_ready = ready[""]
    now = 0.0
    for i, key in enumerate(order):
        if i == 0:
            launch(key, "allgather", "fwd", 0.0)
        if i + 1 < len(order):
            launch(order[i + 1], "allgather", "fwd", now)  # the next block's gather, as this one starts
        now = run(key, now, fwd.get(key, 0.0))
    now = max(now, root_ready) + fwd.get("", 0.0) + bwd.get("", 0.0)
    back = order[::-1]
    for i, key in enumerate(back):
        if zero == 3 and i == 0:
            launch(key, "allgather", "bwd", now)
        if zero == 3 and i + 1 < len(back):
            launch(back[i + 1], "allgather", "bwd", now)
        now = run(key, now, bwd.get(key, 0.0))
        launch(key, "reduce_scatter", "grad", now)
    launch("", "reduce_scatter", "grad", now)
    end = comm.free
    if serial:  # the exchanges run on the cores compute runs on: nothing hides
        end = now = sum(fwd.values()) + sum(bwd.values()) + totals["allgather"] + totals["reduce_scatter"]
    return max(now, end), totals["allgather"], totals["reduce_scatter"]


# -- the planner's use -----------------------------------------------------------------------------

def _size(n: float) -> str:
    from hybridpar.search.layers.planner import _size as size

    return size(n)


def check_recompute(recompute: str) -> None:
    from hybridpar.errors import UserError

    if recompute not in RECOMPUTE_CHOICES:
        raise UserError(f"recompute must be one of {', '.join(RECOMPUTE_CHOICES)}, got {recompute!r}",
                        param="recompute")


def baseline(s, grad_sync: str, gpus: int, batch: int) -> tuple[Prediction | None, str, FsdpBreakdown | None]:
    """(prediction, note, breakdown) of "FSDP + full recomputation" over `gpus` (`sample=N,zero=3`,
    every block recomputed), or (None, why, None) when it does not run or does not fit."""
    if batch % gpus:
        return None, f"{BASELINE_NAME} needs the batch ({batch}) divisible by {gpus}", None
    try:
        x = price(s, LayerLayout(sample=gpus, zero=3), "all", grad_sync)
    except InfeasibleError as err:
        return None, f"{BASELINE_NAME} infeasible: {err}", None
    if x.prediction.memory_bytes[0] > s.capacity:
        return None, (f"{BASELINE_NAME} needs {_size(x.prediction.memory_bytes[0])} per device, "
                      f"over the {_size(s.capacity)} limit"), None
    return x.prediction, "", x.breakdown


def candidates(recompute: str, gpus: int) -> list[tuple[int, str]]:
    """(zero, recompute) the planner weighs beside its replicated layouts (whole model, uniform)."""
    recs = {"auto": ("none", "all"), "none": ("none",), "all": ("all",)}[recompute]
    zeros = (0, 2, 3) if gpus > 1 else (0,)
    return [(z, r) for z in zeros for r in recs if (z, r) != (0, "none")]


def best_sharded(s, recompute: str, grad_sync: str, gpus: int, batch: int) -> tuple[Sharded | None, list[str]]:
    """The fastest sample-only candidate (`candidates`) that fits the memory limit, and why the others
    do not."""
    if batch % gpus:
        return None, [f"sharding the sample dimension needs the batch ({batch}) divisible by {gpus}"]
    if f"sample={gpus}" in getattr(s, "excluded", ()):  # the dry run refused the split itself
        return None, [f"sample={gpus} is excluded"]
    best, reasons = None, []
    for zero, rec in candidates(recompute, gpus):
        x = price(s, LayerLayout(sample=gpus, zero=zero), rec, grad_sync)
        if x.prediction.memory_bytes[0] > s.capacity:
            reasons.append(f"{x.label}: needs {_size(x.prediction.memory_bytes[0])} per device")
        elif best is None or x.prediction.step_time_s < best.prediction.step_time_s:
            best = x
    return best, reasons


def to_plan(s, x: Sharded, strategy: str | None, notes: list[str]):
    """(plan, rows) of candidate `x`: every layer's layout carries its zero level, the plan its
    recompute choice (so `hybridpar train --plan` runs it)."""
    from hybridpar.search.layers.planner import _to_plan

    plan, rows = _to_plan(s, x.opts, x.choice, x.prediction, strategy, notes)
    plan = plan.model_copy(update={"default_layout": x.layout, "layers": dict.fromkeys(plan.layers, x.layout),
                                   "recompute": "all" if x.recompute == "all" else None})
    rows = tuple(dataclasses.replace(r, choice=x.layout.to_strategy(), layout=x.layout) if r.layout else r
                 for r in rows)
    return plan, rows


def ms(pred: Prediction) -> str:
    return f"{pred.step_time_s * 1e3:.1f} ms/step, {_size(pred.memory_bytes[0])} per device"


def choice_note(x: Sharded | None, other: Prediction | None, other_method: str, recompute: str,
                reasons: Sequence[str] = ()) -> str:
    """Which the planner chose between its best replicated plan and the best sharded/recomputing
    candidate, and why they were weighed (data parallelism's own note, printed once, says why it is out)."""
    why = (f"without data parallelism, the planner weighed sharding the sample dimension (zero=2|3) and "
           f"recomputation (--recompute {recompute})" if recompute != "all" else
           "--recompute all: every candidate recomputes (sample-only layouts: recomputation runs there)")
    if x is None:
        return f"{why}; none of them runs or fits" + (f" ({reasons[0]})" if reasons else "")
    if other is None:
        return f"{why}; chose {x.label} ({ms(x.prediction)}): no other layout fits"
    if x.prediction.step_time_s < other.step_time_s:
        return (f"{why}; chose {x.label} ({ms(x.prediction)}) over {other_method} ({ms(other)}): "
                f"{other.step_time_s / x.prediction.step_time_s:.2f}x faster")
    return (f"{why}; kept {other_method} ({ms(other)}) over {x.label} ({ms(x.prediction)}): "
            f"{x.prediction.step_time_s / other.step_time_s:.2f}x faster")


def _replicated_notes(s, cfg, found, note: str) -> list[str]:
    from hybridpar.cost.layout_comm import layout_refusal
    from hybridpar.search.layers.planner import _chosen_layouts

    choice, _, method, opts, _ = found
    notes = [f"optimiser: {method}"] + ([note] if note else [])
    notes += sorted({f"WHAT-IF, the runtime cannot run it: {r}" for r in (
        layout_refusal(s.lg.graph, lay) for lay in _chosen_layouts(opts, choice)) if r})
    if cfg.free_sample and len({lay.sample for lay in _chosen_layouts(opts, choice)}) > 1:
        notes.append("layers use different sample degrees: the runtime needs one (plan for projection only)")
    return notes


def plan_with_sharding(s, cfg, spaces: dict, state: tuple, progress):
    """plan_model's search when data parallelism does not fit (or --recompute all): the best
    replicated plan (channel/filter ...) and the best sharded/recomputing sample-only candidate, the
    faster that fits wins; the notes say which and why."""
    import time

    from hybridpar.search.layers.planner import PlanResult, _best_of_spaces, _gradients, _to_plan

    baseline, base_brk, note, fsdp, t0 = state
    gpus, batch = s.ctx.ranks, s.ctx.batch
    x, reasons = best_sharded(s, cfg.recompute, cfg.grad_sync, gpus, batch)
    x, y = _with_per_block(s, cfg, spaces, x)
    found, err = None, None
    if cfg.recompute != "all":
        try:
            found = _best_of_spaces(s, cfg, spaces, progress)
        except InfeasibleError as e:
            err = e
    if y is not None and (found is None or y.prediction.step_time_s < found[1].step_time_s):
        return _per_block_result(s, cfg, y, x, found, state)
    if x is None and found is None:
        why = "; ".join([*([str(err)] if err else []), *reasons[:3]])
        raise InfeasibleError(f"no layout of {s.model_name} fits {_size(s.capacity)} per device on {gpus} devices "
                              f"at batch {batch}, sharded and recomputing ones included ({why})")
    other = None if found is None else found[1]
    method = "" if found is None else found[2]
    cnote = choice_note(x, other, f"the best replicated plan ({method})", cfg.recompute, reasons)
    if x is not None and (found is None or x.prediction.step_time_s < found[1].step_time_s):
        notes = [f"optimiser: {x.label} (uniform, the sharded simulator)", *([note] if note else []), cnote]
        plan, rows = to_plan(s, x, None, notes)
        return PlanResult(plan, rows, x.prediction, baseline, note, x.label, {}, time.perf_counter() - t0,
                          x.breakdown, base_brk, _gradients(s, x.opts, x.choice), *fsdp)
    choice, pred, method, opts, brk = found
    plan, rows = _to_plan(s, opts, choice, pred, None, [*_replicated_notes(s, cfg, found, note), cnote])
    pruned = {vo.vertex.node.module or vo.vertex.name: vo.pruned for vo in opts if vo.pruned}
    return PlanResult(plan, rows, pred, baseline, note, method, pruned, time.perf_counter() - t0, brk, base_brk,
                      _gradients(s, opts, choice), *fsdp)


def _with_per_block(s, cfg, spaces: dict, x: Sharded | None):
    """(x, y): the per-block search (search.layers.fsdp_blocks) over the runnable splits; where its best
    is uniform (every block alike) it is priced as such (`price`) and replaces `x` when faster (composed
    layouts such as sample=2,channel=2,zero=3 come this way), else y is the per-block candidate when it
    beats `x`."""
    from hybridpar.search.layers import fsdp_blocks

    if not s.ctx.ranks > 1 and cfg.recompute == "none":
        return x, None
    layouts = list(dict.fromkeys(lay for lays in spaces.values() for lay in lays))
    y, _ = fsdp_blocks.best_per_block(s, layouts, cfg.recompute, cfg.grad_sync)
    if y is None:
        return x, None
    if y.uniform:
        z, r = y.zeros[""], bool(y.redo)
        if not z and not r:
            return x, None
        u = price(s, y.layout.model_copy(update={"zero": z}), "all" if r else "none", cfg.grad_sync)
        fits = u.prediction.memory_bytes[0] <= s.capacity
        if fits and (x is None or u.prediction.step_time_s < x.prediction.step_time_s):
            return u, None
        return x, None
    if x is not None and x.prediction.step_time_s <= y.prediction.step_time_s:
        return x, None
    return x, y


def _per_block_result(s, cfg, y, x: Sharded | None, found, state: tuple):
    """plan_with_sharding's PlanResult when the per-block candidate `y` is the fastest that fits."""
    import time

    from hybridpar.search.layers import fsdp_blocks
    from hybridpar.search.layers.planner import PlanResult, _gradients

    baseline, base_brk, note, fsdp, t0 = state
    others = [(f"the best replicated plan ({found[2]})", found[1])] if found is not None else []
    others += [(x.label, x.prediction)] if x is not None else []
    vs = "; ".join(f"{o.step_time_s / max(y.prediction.step_time_s, 1e-30):.2f}x faster than "
                   f"{name} ({ms(o)})" for name, o in others)
    cnote = (f"without data parallelism, the planner chose per block between replicated and sharded (zero=2|3) "
             f"parameters and recomputation (--recompute {cfg.recompute}): {y.label}, {ms(y.prediction)}"
             + (f"; {vs}" if vs else "; no other layout fits"))
    notes = [f"optimiser: {y.label} (greedy per block, the sharded simulator)", *([note] if note else []), cnote]
    plan, rows = fsdp_blocks.to_plan(s, y, notes)
    return PlanResult(plan, rows, y.prediction, baseline, note, y.label, {}, time.perf_counter() - t0,
                      y.breakdown, base_brk, _gradients(s, y.opts, y.vertex_choice), *fsdp)


def fixed(s, cfg, layout: LayerLayout, refusal: str | None):
    """_plan_fixed's (plan, rows, prediction, breakdown, options, choice) of `layout` with a zero level
    or --recompute all, on the sharded simulator."""
    from hybridpar.errors import UserError

    recompute = "all" if cfg.recompute == "all" else "none"
    try:
        x = price(s, layout, recompute, cfg.grad_sync)
    except InfeasibleError as err:
        raise UserError(f"strategy {layout.to_strategy()}: {err}") from None
    notes = [f"fixed layout {x.label} evaluated (not searched)"]
    notes += [f"WHAT-IF, the runtime cannot run it: {refusal}"] if refusal else []
    if x.prediction.memory_bytes[0] > s.capacity:
        notes.append(f"over the memory limit: {_size(x.prediction.memory_bytes[0])} per device")
    plan, rows = to_plan(s, x, layout.to_strategy(), notes)
    return plan, rows, x.prediction, x.breakdown, x.opts, x.choice


BASELINES_PREFIX = "against the baselines: "


def baseline_notes(res) -> list[str]:
    """The plan against both baselines (a PlanResult), for the plan's notes (the HTML report shows
    them): each baseline's step and memory with the plan's speed-up over it; where the plan splits
    channels/filters and FSDP + full recomputation fits, whether channel/filter beats it and by how
    much."""
    pr = res.prediction
    parts = []
    for name, q in (("data parallelism", res.baseline), (BASELINE_NAME, res.fsdp_baseline)):
        if q is not None and q.step_time_s > 0 and pr.step_time_s > 0:
            parts.append(f"{name} {ms(q)} (the plan {q.step_time_s / pr.step_time_s:.2f}x faster, "
                         f"{pr.memory_bytes[0] / q.memory_bytes[0]:.2f}x its memory)")
    out = [BASELINES_PREFIX + "; ".join(parts)] if parts else []
    split = any(r.layout is not None and r.layout.g_size > 1 and not r.whole for r in res.layers)
    fsdp = res.fsdp_baseline
    if split and fsdp is not None:
        speedup = fsdp.step_time_s / pr.step_time_s
        mem = pr.memory_bytes[0] / fsdp.memory_bytes[0]
        if speedup >= 1:
            out.append(f"channel/filter still beats {BASELINE_NAME} on {res.plan.model}: {speedup:.2f}x faster "
                       f"per step ({ms(pr)} vs {ms(fsdp)}), holding {mem:.2f}x its memory per device")
        else:
            out.append(f"{BASELINE_NAME} beats this channel/filter plan on {res.plan.model}: {1 / speedup:.2f}x "
                       f"faster per step ({ms(fsdp)} vs {ms(pr)}), the plan holding {mem:.2f}x its memory")
    return out
