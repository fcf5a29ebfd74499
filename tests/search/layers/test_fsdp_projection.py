"""The projection's second baseline, FSDP + full recomputation, beside data parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from tests.search.projection.test_projection import AnalyticCosts, curve

from hybridpar.search.projection import project
from hybridpar.search.projection.model import FSDP_DETAIL, fsdp_recompute_step


@dataclass
class ShardingCosts(AnalyticCosts):
    def fsdp_memory(self, gpus, batch):
        return int(4 * self.param_bytes / gpus + self.mem_per_sample * batch / 4)


def test_fsdp_points_beside_dp_with_recomputation_and_both_collectives():
    costs = ShardingCosts()
    proj = project(costs, curve(), [1, 2, 64], 32)
    fsdp = [p for p in proj.points if p.strategy == "FSDP"]
    assert [p.gpus for p in fsdp] == [2, 64] and all(p.family == "FSDP" and p.detail == FSDP_DETAIL for p in fsdp)
    prof = costs.profile(32)
    for p in fsdp:
        half = costs.allreduce_s(prof.param_bytes, p.gpus) / 2
        want = max(prof.fwd_s, half) + max(prof.fwd_s + prof.bwd_s, 2 * half)  # recomputed forward in backward
        assert p.step_s == pytest.approx(want) and p.memory_bytes == costs.fsdp_memory(p.gpus, 32)
        dp = proj.best(p.gpus, "DP")
        assert p.step_s > dp.step_s and p.memory_bytes < dp.memory_bytes
    assert proj.to_dict()["points"][-1]["family"] in {"FSDP", "DP", "hybrid", "CF"}
    # a backend that does not price FSDP's memory projects no FSDP points
    assert not [p for p in project(AnalyticCosts(), curve(), [1, 2], 32).points if p.strategy == "FSDP"]


def test_fsdp_step_hides_collectives_behind_compute_up_to_its_length():
    from hybridpar.search.projection import Profile

    prof = Profile(1.0, 2.0, 1000, (), 0)
    assert fsdp_recompute_step(prof, lambda nb: 0.0) == (4.0, 0.0)  # forward twice, backward once
    step, exposed = fsdp_recompute_step(prof, lambda nb: 10.0)  # gathers and reduce-scatters dominate
    assert step == pytest.approx(5.0 + 10.0) and exposed == pytest.approx(11.0)


def test_cost_model_backend_prices_fsdp_memory_with_the_runtime_rule():
    from hybridpar.cost.memory import predict_rank_memory
    from hybridpar.layout import LayerLayout
    from hybridpar.search.projection.costs import CostModelBackend

    costs = CostModelBackend("small_cnn", "lassen", use_disk_cache=False)
    want = predict_rank_memory(costs.graph(4), LayerLayout(sample=8, zero=3), batch=32, recompute="all",
                               framework_bytes=0)
    assert costs.fsdp_memory(8, 4) == int(want.total_bytes) < costs.profile(4).memory_bytes
