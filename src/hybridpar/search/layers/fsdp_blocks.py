"""The per-block choice (issue 31, items 1, 2 and 4): under the memory limit, for each runtime block
(`cost.memory.block_of`, what FSDP shards and recomputation checkpoints) whether the sample dimension
replicates its parameters (GradSync, as data parallelism) or shards them (zero=2, zero=3), and whether
it recomputes its activations, jointly with the split (every runnable uniform sample x channel/filter
layout: the runtime shards blocks over one split, `parallel.fsdp.sharding_refusal`).

Search, per split and per number k of recomputed blocks (the k that free the most activation bytes
per second of recomputation: recomputation's saving is not additive, one recomputed block alone
holds its activations again while it recomputes), from every block replicated: while the predicted
peak is over the limit, raise the level (0 -> 2 -> 3) of the block that frees the most bytes per
second it adds; once it fits, lower again what is no longer needed (latest first) where faster. The
uniform choices (every block alike) are candidates too. The fastest that fits over all splits wins.

Time (one step): `fsdp_baseline`'s simulator generalised per block: a sharded block's parameters
all-gathered before its forward (prefetched one ahead on one communication stream), again before its
backward at zero=3, its gradients reduce-scattered when its backward ends; a replicated block's
gradients allreduced over the sample ranks then (GradSync's buckets, one per block); a recomputed
block's backward re-runs its forward first. Memory: `cost.memory.BlockMemory.at` (the rule
`predict_rank_memory` applies to the plan it writes, so `hybridpar train` reports against it).
Blocks the plan can name (a conv/linear of the block has a per-layer layout) take their own level;
the others and the root's own parameters share the default layout's ("" here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridpar.cost.collectives import CommOp
from hybridpar.cost.layout_comm import fsdp_collectives, fsdp_numel
from hybridpar.cost.memory import BlockMemory, LayerMemory, block_memory, block_of
from hybridpar.errors import InfeasibleError
from hybridpar.plans import LayerLayout, Plan, Prediction
from hybridpar.search.layers.decomposition import shard_groups
from hybridpar.search.layers.fsdp_baseline import FsdpBreakdown, _segments, _Stream

__all__ = ["BlockBreakdown", "BlockPlan", "best_per_block", "to_plan"]

# A choice: each nameable block's zero level ("" the default layout's) and the blocks that recompute.
Choice = tuple[Mapping[str, int], frozenset[str]]


@dataclass(frozen=True)
class BlockBreakdown(FsdpBreakdown):
    """FsdpBreakdown of a per-block choice: `zero` is the one level of every block, or "mixed", and
    `zero_per_block` each block's ("" the default layout's: the root's own parameters)."""

    zero: int | str = 0  # type: ignore[assignment]
    zero_per_block: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class BlockPlan:
    """One per-block candidate priced: the split, each nameable block's zero level ("" the default
    layout's: the root's own parameters and the blocks no layer names) and the blocks that recompute."""

    layout: LayerLayout  # the split (zero 0)
    zeros: Mapping[str, int]
    redo: tuple[str, ...]
    prediction: Prediction
    breakdown: FsdpBreakdown
    opts: list
    vertex_choice: list[int]
    blocks: tuple[str, ...] = ()  # every block of the model ("" left out)

    @property
    def uniform(self) -> bool:
        """Every block alike: one level, and recomputation everywhere or nowhere."""
        return len(set(self.zeros.values())) == 1 and (not self.redo or set(self.redo) >= set(self.blocks))

    @property
    def label(self) -> str:
        counts: dict[str, int] = {}
        for z in self.zeros.values():
            key = f"zero={z}" if z else "replicated"
            counts[key] = counts.get(key, 0) + 1
        parts = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
        return (f"{self.layout.to_strategy()} per block ({parts} of {len(self.zeros)} blocks; "
                f"{len(self.redo)} of {len(self.blocks)} recomputed)")


@dataclass
class _Split:
    """One split's fixed parts: the blocks' forward/backward seconds, each collective's seconds, the
    memory terms and the names the plan can carry."""

    layout: LayerLayout
    opts: list
    vertex_choice: list[int]
    fwd: dict[str, float]
    bwd: dict[str, float]
    order: list[str]  # blocks in forward order ("" left out)
    comm: dict[tuple[str, str, str], float]  # (block, kind, phase) -> s; kind allreduce: replicated
    fsdp_bytes: dict[tuple[str, str, str], int]
    memory: BlockMemory
    named: list[str]  # blocks a per-layer layout can name
    extra_s: float  # output gather, loss, the replicated DTensors' allreduce
    extras: list

    @staticmethod
    def level(zeros: Mapping[str, int], block: str) -> int:
        return zeros.get(block, zeros[""])

    @property
    def blocks(self) -> list[str]:
        return [b for b in dict.fromkeys(self.memory.owners) if b]


def _split(s, layout: LayerLayout, grad_sync: str) -> _Split:
    from hybridpar.search.layers.layer_cost import grad_allreduce
    from hybridpar.search.layers.planner import _evaluate_uniform, _output_whole, _step_extras, _to_plan
    from hybridpar.search.layers.planner import grad_bucket_schedule as buckets

    lg, ctx = s.lg, s.ctx
    opts, choice, _, _ = _evaluate_uniform(s, layout, grad_sync)
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    for key, f, b in _segments(s, opts, choice):
        fwd[key], bwd[key] = fwd.get(key, 0.0) + f, bwd.get(key, 0.0) + b
    groups = shard_groups(layout)  # the ranks holding the same pieces: FSDP's (and GradSync's) sample groups
    comm: dict[tuple[str, str, str], float] = {}
    nbytes: dict[tuple[str, str, str], int] = {}
    if layout.sample > 1:
        for key, op in fsdp_collectives(lg.graph, layout.model_copy(update={"zero": 3}), dtype_bytes=ctx.elem):
            comm[(key, op.kind, op.phase)] = ctx.comm_time(CommOp.placed(op.kind, op.phase, op.bytes_, groups,
                                                                         "replica", layout))
            nbytes[(key, op.kind, op.phase)] = op.bytes_
        for key, numel in fsdp_numel(lg.graph, layout.model_copy(update={"zero": 3}), padded=False).items():
            b = numel * ctx.elem
            comm[(key, "allreduce", "grad")] = ctx.comm_time(CommOp.placed("allreduce", "grad", b, groups,
                                                                           "replica", layout))
            nbytes[(key, "allreduce", "grad")] = b
    extras = _step_extras(opts, choice, ctx, _output_whole(lg))
    extras += [grad_allreduce(b, key) for key, b, i in buckets(lg, opts, choice, ctx) if i is None]
    mem = block_memory(lg.graph, layout, batch=ctx.batch, optimizer=ctx.optimizer, momentum=ctx.momentum,
                       weight_decay=ctx.weight_decay, dtype=ctx.dtype, framework_bytes=ctx.framework_bytes)
    plan, _ = _to_plan(s, opts, choice, Prediction(step_time_s=0.0), None, [])
    named = sorted({block_of(m) for m in plan.layers} - {""})
    order = list(dict.fromkeys([*(k for k in fwd if k), *(k for k, _, _ in comm if k)]))
    return _Split(layout, opts, list(choice), fwd, bwd, order, comm, nbytes, mem, named,
                  sum(ctx.comm_time(op) for op in extras), extras)


def _simulate(sp: _Split, pick: Choice, serial: bool) -> tuple[float, float, float]:
    """(end of backward with the last gradient exchange, all-gather s, reduce-scatter/allreduce s):
    fsdp_baseline._simulate with each block at its own level, replicated blocks' gradients allreduced
    when their backward ends and recomputed blocks re-running their forward in backward."""
    zeros, redo = pick
    comm = _Stream()
    totals = {"allgather": 0.0, "grad": 0.0}
    ready: dict[str, float] = {}

    def launch(key: str, kind: str, phase: str, issued: float) -> None:
        level = sp.level(zeros, key)
        if kind == "allgather" and (not level or (phase == "bwd" and level != 3)):
            return
        if phase == "grad":
            kind = "reduce_scatter" if level else "allreduce"
        dt = sp.comm.get((key, kind, phase))
        if dt is None:
            return
        totals["grad" if phase == "grad" else kind] += dt
        ready[key] = comm.run(issued, dt)

    def run(key: str, start: float, seconds: float) -> float:
        return max(start, ready.get(key, 0.0), comm.free if serial else 0.0) + seconds

    launch("", "allgather", "fwd", 0.0)  # the root's own parameters: gathered first, kept
    root_ready = ready.get("", 0.0)
    now = 0.0
    order = sp.order
    for i, key in enumerate(order):
        if i == 0:
            launch(key, "allgather", "fwd", 0.0)
        if i + 1 < len(order):
            launch(order[i + 1], "allgather", "fwd", now)
        now = run(key, now, sp.fwd.get(key, 0.0))
    now = max(now, root_ready) + sp.fwd.get("", 0.0) + sp.bwd.get("", 0.0)
    back = order[::-1]
    for i, key in enumerate(back):
        if i == 0:
            launch(key, "allgather", "bwd", now)
        if i + 1 < len(back):
            launch(back[i + 1], "allgather", "bwd", now)
        now = run(key, now, sp.bwd.get(key, 0.0) + (sp.fwd.get(key, 0.0) if key in redo else 0.0))
        launch(key, "grad", "grad", now)
    launch("", "grad", "grad", now)
    end = comm.free
    if serial:  # the exchanges run on the cores compute runs on: nothing hides
        compute = sum(sp.fwd.values()) + sum(sp.bwd.values()) + sum(sp.fwd.get(b, 0.0) for b in redo)
        end = now = compute + totals["allgather"] + totals["grad"]
    return max(now, end), totals["allgather"], totals["grad"]


def _price(s, sp: _Split, pick: Choice) -> tuple[float, int]:
    """(step s, peak bytes) of one choice."""
    from hybridpar.search.layers.planner import step_extra_s

    zeros, redo = pick
    mem = sp.memory.at({b: sp.level(zeros, b) for b in dict.fromkeys([*sp.memory.owners, *sp.memory.params])},
                       redo)
    t, _, _ = _simulate(sp, pick, s.ctx.cluster.device.comm_takes_compute)
    held = mem.grads_bytes  # this rank's gradient elements: what the optimizer steps over
    t += sp.extra_s + step_extra_s(s.lg, [LayerMemory(weights_bytes=held)], sp.layout.sample, s.ctx)
    return t, int(mem.total_bytes)


def _prediction(s, sp: _Split, pick: Choice) -> tuple[Prediction, FsdpBreakdown]:
    from hybridpar.search.layers.planner import _per_layer

    zeros, redo = pick
    step, peak = _price(s, sp, pick)
    _, ag_s, grad_s = _simulate(sp, pick, s.ctx.cluster.device.comm_takes_compute)
    costs = [vo.costs[k] for vo, k in zip(sp.opts, sp.vertex_choice)]
    layer_comm = sum(c.comm_fwd_s + c.comm_bwd_s for c in costs)
    redo_s = sum(sp.fwd.get(b, 0.0) for b in redo)
    compute = sum(sp.fwd.values()) + sum(sp.bwd.values()) + redo_s - layer_comm
    nbytes: dict[str, int] = {}
    for c in costs:  # the layers' own collectives
        for kind, b in c.comm_bytes.items():
            nbytes[kind] = nbytes.get(kind, 0) + b
    sent = {k: b for k, b in sp.fsdp_bytes.items() if _sends(sp, zeros, k)}
    for (_, kind, _), b in sent.items():
        nbytes[kind] = nbytes.get(kind, 0) + b
    for op in sp.extras:
        if op.phase != "check":
            nbytes[op.kind] = nbytes.get(op.kind, 0) + op.bytes_
    pred = Prediction(step_time_s=step, compute_s=max(compute, 0.0), comm_s=ag_s + grad_s + sp.extra_s + layer_comm,
                      exposed_comm_s=max(0.0, step - compute), memory_bytes=[peak] * s.ctx.ranks, comm_bytes=nbytes,
                      per_layer=_per_layer(s.lg, sp.opts, costs, [0.0] * len(sp.opts),
                                           sp.opts[0].dist(sp.vertex_choice[0]), s.ctx))
    per_block = {b: sp.level(zeros, b) for b in ["", *sp.blocks]}
    brk = BlockBreakdown(grad_s, layer_comm, 0.0, sp.extra_s,
                         sum(b for (_, kind, _), b in sent.items() if kind != "allgather"), ag_s,
                         sum(b for (_, kind, _), b in sent.items() if kind == "allgather"),
                         redo_s, _one_level(per_block), "blocks" if redo else "none", per_block)
    return pred, brk


def _one_level(per_block: Mapping[str, int]) -> int | str:
    levels = set(per_block.values())
    return levels.pop() if len(levels) == 1 else "mixed"


def _sends(sp: _Split, zeros: Mapping[str, int], key: tuple[str, str, str]) -> bool:
    """Whether collective `key` runs under `zeros` (the runtime's FSDP units, or GradSync's allreduce)."""
    block, kind, phase = key
    level = sp.level(zeros, block)
    if kind == "allreduce":
        return not level
    return bool(level) and (phase != "bwd" or level == 3)


def _redo_order(sp: _Split) -> list[str]:
    """Blocks in the order recomputation pays: the activation bytes a block frees (all of them but its
    input) per second of its forward, most first."""
    acts: dict[str, float] = {}
    for m, b in zip(sp.memory.layers, sp.memory.owners):
        if b:
            acts[b] = acts.get(b, 0.0) + m.activations_bytes
    gain = {b: (a - sp.memory.block_inputs.get(b, 0.0)) / max(sp.fwd.get(b, 0.0), 1e-12) for b, a in acts.items()}
    return sorted((b for b in gain if gain[b] > 0), key=lambda b: -gain[b])


def _fit_levels(s, sp: _Split, redo: frozenset[str], allow_zero: bool) -> tuple[float, Choice] | None:
    """Greedy over the zero levels with `redo` fixed: from every block replicated, the level up (0 -> 2
    -> 3, 0 -> 3) that frees the most bytes per second added, until it fits; then levels lowered again
    (latest first) where still fitting and faster. (step s, choice) or None."""
    cur: dict[str, int] = dict.fromkeys(["", *sp.named], 0)
    t, mem = _price(s, sp, (cur, redo))
    steps: list[tuple[str, int]] = []
    while mem > s.capacity:
        best = None
        for b, z in (cur.items() if allow_zero else ()):
            for up in (2, 3):
                if up <= z:
                    continue
                t2, m2 = _price(s, sp, ({**cur, b: up}, redo))
                if m2 < mem:
                    score = (mem - m2) / max(t2 - t, 1e-12)
                    if best is None or score > best[0]:
                        best = (score, b, up, t2, m2)
        if best is None:
            return None
        _, b, up, t, mem = best
        steps.append((b, cur[b]))
        cur = {**cur, b: up}
    for b, before in reversed(steps):
        back = {**cur, b: before}
        t2, m2 = _price(s, sp, (back, redo))
        if m2 <= s.capacity and t2 < t:
            cur, t = back, t2
    return t, (cur, redo)


def _search_split(s, sp: _Split, recompute: str) -> tuple[float, Choice] | None:
    """The fastest fitting choice on one split under --recompute (auto: any k; none; all)."""
    allow_zero = sp.layout.sample > 1
    order = _redo_order(sp)
    every = frozenset(sp.blocks)
    if recompute == "all":
        sets = [every]
    elif recompute == "none":
        sets = [frozenset()]
    else:
        # the k best-paying blocks for every k up to 8, then k = 16, 32, ... (each set is a greedy over the
        # zero levels, and a ResNet's 17 blocks made a weak-scaling plan take ~18 s; the search's budget)
        ks = sorted({*range(9), len(order), *(2**i for i in range(len(order).bit_length()))}
                    & set(range(len(order) + 1)))
        sets = [frozenset(order[:k]) for k in ks] + [every]
    found = []
    for redo in dict.fromkeys(sets):
        x = _fit_levels(s, sp, redo, allow_zero)
        if x is not None:
            found.append(x)
        for z in ((0, 2, 3) if allow_zero else (0,)):  # the uniform levels too (the greedy's order can miss them)
            pick = (dict.fromkeys(["", *sp.named], z), redo)
            t, mem = _price(s, sp, pick)
            if mem <= s.capacity:
                found.append((t, pick))
    return min(found, key=lambda x: x[0]) if found else None


def _block_comm(sp: _Split, block: str, level: int) -> float:
    """Seconds of the collectives `block` issues at `level` (_simulate's `launch` rules)."""
    if not level:
        return sp.comm.get((block, "allreduce", "grad"), 0.0)
    phases = [("allgather", "fwd"), ("reduce_scatter", "grad")] + ([("allgather", "bwd")] if level == 3 else [])
    return sum(sp.comm.get((block, kind, phase), 0.0) for kind, phase in phases)


def _lower_bound(s, sp: _Split) -> float:
    """A step no choice on this split beats (the pruning test): the compute without recomputation, and
    each block's collectives at its own cheapest level, one after the other on the one communication
    stream (the step is at least the longer of the two; their sum where the exchanges take the cores),
    plus the fixed extras and the update of the fewest gradient elements a rank can hold (every block
    sharded). Mixed levels can beat every uniform one, so the uniform steps are no bound."""
    from hybridpar.search.layers.planner import step_extra_s

    levels = (0, 2, 3) if sp.layout.sample > 1 else (0,)
    compute = sum(sp.fwd.values()) + sum(sp.bwd.values())
    comm = sum(min(_block_comm(sp, b, z) for z in levels) for b in dict.fromkeys(["", *sp.order]))
    t = compute + comm if s.ctx.cluster.device.comm_takes_compute else max(compute, comm)
    every = list(dict.fromkeys([*sp.memory.owners, *sp.memory.params]))
    held = min(sp.memory.at(dict.fromkeys(every, z)).grads_bytes for z in levels)
    return t + sp.extra_s + step_extra_s(s.lg, [LayerMemory(weights_bytes=held)], sp.layout.sample, s.ctx)


def best_per_block(s, layouts: Sequence[LayerLayout], recompute: str,
                   grad_sync: str) -> tuple[BlockPlan | None, list[str]]:
    """The fastest per-block choice that fits the memory limit over `layouts` (uniform sample x
    channel/filter splits), and why the splits it could not fit did not."""
    best, reasons = None, []
    splits = []
    for lay in layouts:
        if lay.spatial > 1 or lay.zero:
            continue
        try:
            splits.append(_split(s, lay, grad_sync))
        except InfeasibleError as err:
            reasons.append(f"{lay.to_strategy()}: {err}")
    # splits in the order of their lower bound; one whose bound is no faster than the best choice found
    # is not searched (the search's budget)
    floors = {id(sp): _lower_bound(s, sp) for sp in splits}
    for sp in sorted(splits, key=lambda x: floors[id(x)]):
        if best is not None and floors[id(sp)] >= best[0]:
            continue
        found = _search_split(s, sp, recompute)
        if found is None:
            reasons.append(f"{sp.layout.to_strategy()}: no per-block choice of sharding/recomputation fits")
        elif best is None or found[0] < best[0]:
            best = (found[0], sp, found[1])
    if best is None:
        return None, reasons
    _, sp, pick = best
    pred, brk = _prediction(s, sp, pick)
    return BlockPlan(sp.layout, dict(pick[0]), tuple(sorted(pick[1])), pred, brk, sp.opts, sp.vertex_choice,
                     tuple(sp.blocks)), reasons


def to_plan(s, x: BlockPlan, notes: list[str]) -> tuple[Plan, tuple]:
    """(plan, rows) of a per-block candidate: each layer's layout carries its block's zero level, the
    default layout the "" level, the plan the blocks that recompute (recompute_blocks; "all" when
    every block does)."""
    from hybridpar.search.layers.planner import _to_plan

    plan, rows = _to_plan(s, x.opts, x.vertex_choice, x.prediction, None, notes)

    def with_level(module: str, lay: LayerLayout) -> LayerLayout:
        z = _Split.level(x.zeros, block_of(module))
        return lay.model_copy(update={"zero": z if lay.sample > 1 else 0})

    layers = {m: with_level(m, lay) for m, lay in plan.layers.items()}
    default = plan.default_layout.model_copy(update={"zero": x.zeros[""] if plan.default_layout.sample > 1 else 0})
    upd: dict = {"default_layout": default, "layers": layers, "recompute": None, "recompute_blocks": None}
    if x.redo and set(x.redo) >= set(x.blocks):
        upd["recompute"] = "all"
    elif x.redo:
        upd["recompute_blocks"] = list(x.redo)
    plan = plan.model_copy(update=upd)
    rows = tuple(dataclasses.replace(r, choice=with_level(r.module, r.layout).to_strategy(),
                                     layout=with_level(r.module, r.layout)) if r.layout and r.module else r
                 for r in rows)
    return Plan.model_validate(plan.model_dump()), rows
