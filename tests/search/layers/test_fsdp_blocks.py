"""Issue 31: the planner's per-block choice under the memory limit (search.layers.fsdp_blocks): which
blocks shard their parameters (zero=2|3) and which recompute, jointly with the split; composed zero
layouts (sample x channel with zero); the memory rule per block (cost.memory.sharded_step_memory)."""

from __future__ import annotations

import pytest
import torch
from tests.parallel._fsdp_mixed_workers import MixNet
from tests.search.layers.fsdp_models import activation_heavy_cnn, wide_cnn

from hybridpar.cost.memory import block_of, predict_rank_memory
from hybridpar.parallel.fsdp import sharding_refusal
from hybridpar.plans import LayerLayout
from hybridpar.search.layers import fsdp_baseline
from hybridpar.search.layers.decomposition import all_layouts
from hybridpar.search.layers.planner import PlannerConfig, _setup, plan_model


def _rule(s, plan) -> int:
    """The memory `hybridpar train` reports the plan against (cost.memory.predict_rank_memory)."""
    rec = plan.recompute_blocks if plan.recompute_blocks is not None else (plan.recompute or "none")
    return int(predict_rank_memory(s.lg.graph, plan.default_layout, layers=plan.layers, batch=s.ctx.batch,
                                   optimizer=s.ctx.optimizer, momentum=s.ctx.momentum, dtype=s.ctx.dtype,
                                   framework_bytes=s.ctx.framework_bytes, recompute=rec).total_bytes)


def test_recomputes_only_the_blocks_that_pay():
    model = activation_heavy_cnn()
    dp = plan_model(model, "lassen", 4, 8).baseline.memory_bytes[0]
    limit = int(dp * 0.85)  # data parallelism does not fit; recomputing every block is more than needed
    res = plan_model(model, "lassen", 4, 8, memory_limit=limit)
    plan = res.plan
    assert plan.recompute is None and 0 < len(plan.recompute_blocks) < 8
    assert res.prediction.memory_bytes[0] <= limit
    s = _setup(model, "lassen", 4, 8, PlannerConfig(memory_limit=limit))
    assert res.prediction.memory_bytes[0] == _rule(s, plan)  # one rule with what train reports against
    every = fsdp_baseline.price(s, LayerLayout(sample=4, zero=3), "all", "buckets").prediction
    assert res.prediction.step_time_s < every.step_time_s
    # tighter: more blocks recompute
    tighter = plan_model(model, "lassen", 4, 8, memory_limit=int(dp * 0.7)).plan
    assert len(tighter.recompute_blocks or ()) > len(plan.recompute_blocks) or tighter.recompute == "all"


def test_composed_zero_layouts_are_proposed_when_fastest_that_fit():
    model = wide_cnn()
    others = tuple(lay.to_strategy() for lay in all_layouts(4) if lay.sample != 2)  # the S=2 splits only
    res = plan_model(model, "lassen", 4, 8, optimizer="adamw", memory_limit=50 * 2**20, exclude_layouts=others)
    plan = res.plan
    # a composed zero layout: every layer on one sample=2 x channel/filter=2 split, some of it sharded
    lays = [plan.default_layout, *plan.layers.values()]
    assert len({lay.model_copy(update={"zero": 0}) for lay in lays}) == 1, lays
    assert lays[0].sample == 2 and lays[0].g_size == 2 and any(lay.zero for lay in lays), lays
    assert res.prediction.memory_bytes[0] <= 50 * 2**20
    looser = plan_model(model, "lassen", 4, 8, optimizer="adamw", memory_limit=60 * 2**20, exclude_layouts=others)
    zeros = {lay.zero for lay in looser.plan.layers.values()}
    assert len(zeros) > 1 and looser.plan.default_layout.channel * looser.plan.default_layout.filter == 2  # mixed
    for p in (plan, looser.plan):  # the runtime runs them
        assert sharding_refusal([p.default_layout, *p.layers.values()], 1, "none", dict(p.layers)) is None
    s = _setup(model, "lassen", 4, 8, PlannerConfig(optimizer="adamw"))
    assert looser.prediction.memory_bytes[0] == _rule(s, looser.plan)
    # the JSON's breakdown: no single level for a mixed plan, each block's instead
    assert looser.breakdown.zero == "mixed" and res.breakdown.zero == 3
    per_block = looser.breakdown.zero_per_block
    assert per_block[""] == looser.plan.default_layout.zero
    assert all(per_block[block_of(m)] == lay.zero for m, lay in looser.plan.layers.items())


def test_pruning_bound_is_below_every_per_block_choice():
    """A split is left unsearched when its bound is no faster than the best found: the bound must be below
    every choice on it, mixed levels included (on Lassen they beat every uniform level here)."""
    import itertools

    from hybridpar.search.layers import fsdp_blocks as fb

    s = _setup(wide_cnn(), "lassen", 4, 8, PlannerConfig())
    mixed_wins = False
    for lay in (LayerLayout(sample=4), LayerLayout(sample=2, channel=2)):
        sp = fb._split(s, lay, "buckets")
        names = ["", *sp.named]
        steps = {zs: fb._price(s, sp, (dict(zip(names, zs)), frozenset()))[0]
                 for zs in itertools.product((0, 2, 3), repeat=len(names))}
        uniform = min(steps[(z,) * len(names)] for z in (0, 2, 3))
        mixed_wins |= min(steps.values()) < uniform * (1 - 1e-6)
        bound = fb._lower_bound(s, sp)
        assert bound <= min(steps.values()) * (1 + 1e-12)
        every = frozenset(sp.blocks)  # recomputation only adds time
        assert bound <= fb._price(s, sp, (dict.fromkeys(names, 2), every))[0]
    assert mixed_wins  # the uniform levels' best is no bound


def test_memory_rule_per_block():
    from hybridpar.graph import trace

    g = trace(MixNet(), (torch.randn(8, 3, 6, 6),))
    m = MixNet()
    size = {b: sum(p.numel() for p in m.get_submodule(b).parameters()) * 4 for b in ("stem", "cells.0", "cells.1",
                                                                                      "head")}
    lay = LayerLayout(sample=2)
    plain = predict_rank_memory(g, lay, framework_bytes=0, optimizer="adamw")
    uniform = predict_rank_memory(g, LayerLayout(sample=2, zero=3), framework_bytes=0, optimizer="adamw")
    mods = {"stem": "stem.conv", "cells.0": "cells.0.conv", "cells.1": "cells.1.conv", "head": "head"}
    as3 = predict_rank_memory(g, lay, layers={m: lay.model_copy(update={"zero": 3}) for m in mods.values()},
                              framework_bytes=0, optimizer="adamw")
    assert as3.total_bytes == pytest.approx(uniform.total_bytes)  # every block at 3: the uniform rule
    levels = {"stem": 3, "cells.0": 0, "cells.1": 2, "head": 0}
    mixed = predict_rank_memory(g, lay, layers={mods[b]: lay.model_copy(update={"zero": z}) for b, z in levels.items()},
                                framework_bytes=0, optimizer="adamw")
    held = size["stem"] / 2 + size["cells.1"] / 2 + size["cells.0"] + size["head"]
    assert mixed.grads_bytes == pytest.approx(held) and mixed.optimizer_bytes == pytest.approx(2 * held)
    # the zero=2 block whole from forward to backward, the largest zero=3 block in flight
    assert mixed.weights_bytes == pytest.approx(held + size["cells.1"] + size["stem"])
    assert plain.total_bytes > mixed.total_bytes > uniform.total_bytes
    # recomputation of some blocks: their activations freed but the largest one's, their inputs kept
    from hybridpar.cost.memory import block_memory

    parts = block_memory(g, lay, framework_bytes=0)
    acts = {b: sum(x.activations_bytes for x, o in zip(parts.layers, parts.owners) if o == b) for b in levels}
    redo = ["cells.0", "cells.1"]
    some = predict_rank_memory(g, lay, framework_bytes=0, recompute=redo)
    want = (plain.activations_bytes - sum(acts[b] for b in redo) + sum(parts.block_inputs[b] for b in redo)
            + max(acts[b] for b in redo))
    assert some.activations_bytes == pytest.approx(want) and some.weights_bytes == plain.weights_bytes
    assert parts.block_inputs["cells.0"] > 0 and acts["cells.0"] > parts.block_inputs["cells.0"]
