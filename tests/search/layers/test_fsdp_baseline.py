"""The second baseline, FSDP + full recomputation, and the sharded/recomputing candidates priced on
the per-layer planner's simulator (hybridpar.search.layers.fsdp_baseline)."""

from __future__ import annotations

import pytest
from tests.search.layers.fsdp_models import activation_heavy_cnn, wide_cnn

from hybridpar.cost.layout_comm import fsdp_collectives
from hybridpar.errors import UserError
from hybridpar.parallel.fsdp import sharding_refusal
from hybridpar.plans import LayerLayout
from hybridpar.search.layers import fsdp_baseline
from hybridpar.search.layers.planner import PlannerConfig, _setup, plan_model


def _bytes(ops, kind):
    return sum(op.bytes_ for _, op in ops if op.kind == kind)


def test_baseline_bytes_are_the_layouts_fsdp_collectives():
    model = wide_cnn()
    res = plan_model(model, "lassen", 4, 8)
    s = _setup(model, "lassen", 4, 8, PlannerConfig())
    ops = fsdp_collectives(s.lg.graph, LayerLayout(sample=4, zero=3), dtype_bytes=4)
    base = res.fsdp_baseline
    assert base is not None and res.fsdp_note == ""
    assert base.comm_bytes["allgather"] == _bytes(ops, "allgather") > 0
    assert base.comm_bytes["reduce_scatter"] == _bytes(ops, "reduce_scatter") > 0
    # zero=3 gathers every block twice (forward, backward), zero=2 once; the root's own once either way
    two = fsdp_baseline.price(s, LayerLayout(sample=4, zero=2), "all", "buckets")
    z2 = fsdp_collectives(s.lg.graph, LayerLayout(sample=4, zero=2), dtype_bytes=4)
    assert two.prediction.comm_bytes["allgather"] == _bytes(z2, "allgather") < base.comm_bytes["allgather"]
    # no gradient allreduce: FSDP reduce-scatters (what is left is the loss and batch-norm statistics)
    dp = res.baseline
    assert base.comm_bytes.get("allreduce", 0) < dp.comm_bytes["allreduce"] / 100
    brk = res.fsdp_breakdown
    assert brk.zero == 3 and brk.recompute == "all" and brk.allgather_bytes == _bytes(ops, "allgather")


def test_recomputation_adds_forward_time_and_frees_activations():
    model = activation_heavy_cnn()
    s = _setup(model, "lassen", 4, 8, PlannerConfig())
    plain = fsdp_baseline.price(s, LayerLayout(sample=4, zero=3), "none", "buckets")
    rec = fsdp_baseline.price(s, LayerLayout(sample=4, zero=3), "all", "buckets")
    assert rec.breakdown.recompute_s > 0
    assert rec.prediction.compute_s == pytest.approx(plain.prediction.compute_s + rec.breakdown.recompute_s)
    assert rec.prediction.memory_bytes[0] < 0.75 * plain.prediction.memory_bytes[0]
    # the memory is the runtime's rule (what `hybridpar train` reports against)
    from hybridpar.cost.memory import predict_rank_memory

    rule = predict_rank_memory(s.lg.graph, LayerLayout(sample=4, zero=3), batch=8, recompute="all",
                               framework_bytes=s.ctx.framework_bytes)
    assert rec.prediction.memory_bytes[0] == int(rule.total_bytes)


def test_memory_bound_activation_heavy_cnn_gets_a_sharded_recomputing_plan():
    model = activation_heavy_cnn()
    limit = 30 * 2**20  # data parallelism needs ~40 MiB, channel/filter more; recomputation ~24 MiB
    res = plan_model(model, "lassen", 4, 8, memory_limit=limit)
    assert res.baseline is None and "over the" in res.baseline_note
    plan = res.plan
    assert res.prediction.memory_bytes[0] <= limit
    # recomputation where it pays: some blocks, not all (the per-block choice, search.layers.fsdp_blocks)
    assert plan.recompute is None and 0 < len(plan.recompute_blocks) < 10 and plan.default_layout.sample == 4
    assert len({lay.model_copy(update={"zero": 0}) for lay in plan.layers.values()}) == 1
    named = dict(plan.layers)
    assert sharding_refusal([plan.default_layout, *named.values()], plan.mp, tuple(plan.recompute_blocks),
                            named) is None
    why = next(n for n in plan.notes if "chose per block" in n)
    assert "no other layout fits" in why or "faster than" in why
    every = fsdp_baseline.price(_setup(model, "lassen", 4, 8, PlannerConfig()), LayerLayout(sample=4, zero=3),
                                "all", "buckets")
    assert res.prediction.step_time_s < every.prediction.step_time_s  # fewer blocks recomputed: faster
    # it survives its own file (train --plan reads the zero levels and the blocks that recompute)
    from hybridpar.plans.schema import plan_from_dict

    again = plan_from_dict(plan.model_dump())
    assert again.recompute_blocks == plan.recompute_blocks and again.layers == plan.layers


def test_memory_bound_wide_cnn_keeps_channel_filter_when_it_is_faster():
    model = wide_cnn()
    dp_need = plan_model(model, "lassen", 4, 8).baseline.memory_bytes[0]
    res = plan_model(model, "lassen", 4, 8, memory_limit=dp_need // 2)
    assert res.prediction.memory_bytes[0] <= dp_need // 2
    assert any(lay.g_size > 1 for lay in res.plan.layers.values()) and res.plan.recompute is None
    why = next(n for n in res.plan.notes if "weighed" in n)
    assert "kept the best replicated plan" in why and "zero=" in why
    assert res.prediction.step_time_s < res.fsdp_baseline.step_time_s


def test_recompute_option_fixes_or_frees_the_choice():
    model = activation_heavy_cnn()
    with pytest.raises(UserError, match="recompute must be one of auto, none, all"):
        plan_model(model, "lassen", 4, 8, recompute="some")
    forced = plan_model(model, "lassen", 4, 8, recompute="all")  # memory does not bind: still recomputes
    assert forced.plan.recompute == "all" and forced.plan.default_layout.g_size == 1
    free = plan_model(model, "lassen", 4, 8, recompute="none", memory_limit=38 * 2**20)
    assert free.plan.recompute is None and free.plan.default_layout.zero in (2, 3)  # zero=3 alone: ~37 MiB
    fixed = plan_model(model, "lassen", 4, 8, strategy="sample=4,zero=3", recompute="all")
    assert fixed.prediction.step_time_s == pytest.approx(fixed.fsdp_baseline.step_time_s)
    assert fixed.plan.recompute == "all" and fixed.plan.default_layout.zero == 3
    plain = plan_model(model, "lassen", 4, 8, strategy="sample=4,zero=3")
    assert plain.plan.recompute is None and plain.prediction.comm_bytes == fixed.prediction.comm_bytes
