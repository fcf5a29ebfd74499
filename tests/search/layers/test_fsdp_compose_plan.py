"""Issue 31: the planner prices sample x channel/filter layouts with the sample dimension sharded
(zero=2|3) by the one FSDP rule (cost.layout_comm.fsdp_collectives, cost.memory.predict_rank_memory)."""

from __future__ import annotations

import pytest
from tests.search.layers.fsdp_models import wide_cnn

from hybridpar.cost.layout_comm import fsdp_collectives
from hybridpar.cost.memory import predict_rank_memory
from hybridpar.plans import LayerLayout
from hybridpar.search.layers import fsdp_baseline
from hybridpar.search.layers.planner import PlannerConfig, _setup


@pytest.mark.parametrize("split", [{"channel": 2}, {"filter": 2}])
def test_composed_zero_priced_by_the_fsdp_rule(split):
    s = _setup(wide_cnn(), "lassen", 4, 8, PlannerConfig())
    lay = LayerLayout(sample=2, zero=3, **split)
    plain = fsdp_baseline.price(s, LayerLayout(sample=2, **split), "none", "buckets")
    z3 = fsdp_baseline.price(s, lay, "none", "buckets")
    ops = fsdp_collectives(s.lg.graph, lay, dtype_bytes=4)
    for kind in ("allgather", "reduce_scatter"):  # the layers' own collectives plus FSDP's
        fsdp = sum(op.bytes_ for _, op in ops if op.kind == kind)
        assert z3.prediction.comm_bytes[kind] == plain.prediction.comm_bytes.get(kind, 0) + fsdp > 0
    # the gradient allreduce is FSDP's reduce-scatter now (what is left: batch-norm statistics, the loss)
    assert z3.prediction.comm_bytes.get("allreduce", 0) < plain.prediction.comm_bytes["allreduce"] / 10
    rule = predict_rank_memory(s.lg.graph, lay, batch=8, framework_bytes=s.ctx.framework_bytes)
    assert z3.prediction.memory_bytes[0] == int(rule.total_bytes) < plain.prediction.memory_bytes[0]


@pytest.mark.parametrize("strategy", ["sample=2,channel=2,zero=3", "sample=2,filter=2,zero=2", "sample=4,zero=3"])
def test_planned_bytes_equal_the_runtimes_analytic_bytes(strategy):
    """Per kind, the bytes `hybridpar plan --strategy` prices are model_collectives' (FSDP's gathers and
    reduce-scatters in place of the gradient allreduces FSDP replaces), the runtime's twin."""
    from hybridpar.cost.layout_comm import bytes_by_kind, model_collectives
    from hybridpar.plans import parse_strategy
    from hybridpar.search.layers.planner import _scaled, _traced, plan_model

    res = plan_model("small_resnet", "localhost", 4, 16, strategy=strategy)
    graph = _scaled(_traced("small_resnet", None)[0], 16)
    expected = bytes_by_kind(model_collectives(graph, parse_strategy(strategy, 4).layout))
    assert {k: v for k, v in res.prediction.comm_bytes.items() if v} == expected
