"""Projection arithmetic on an analytic step-cost model (no tracing, no solver)."""

import math
from dataclasses import dataclass

import pytest

from hybridpar.convergence.builtin import WorkloadCurve
from hybridpar.convergence.curve import McCandlishCurve
from hybridpar.errors import InfeasibleError
from hybridpar.search.projection import MPStep, Profile, overlapped_end, project, shared_links_end
from hybridpar.search.projection.joint import choose, terms_of

GPUS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


@dataclass
class AnalyticCosts:
    """Compute linear in batch, ring allreduce at bw_Bps, MP speedups given per degree."""

    capacity_bytes: float = 16e9
    gpus_per_node: int = 8
    is_cnn: bool = False
    sec_per_sample: float = 2e-3
    param_bytes: int = 100_000_000
    bw_Bps: float = 10e9
    mp_speedup: tuple = ((2, 1.6), (4, 2.2), (8, 2.8))
    mem_per_sample: float = 50e6

    def profile(self, batch):
        c = self.sec_per_sample * batch
        k = 10
        ready = tuple((2 * c / 3 * (i + 1) / k, self.param_bytes // k) for i in range(k))
        mem = int(4 * self.param_bytes + self.mem_per_sample * batch)
        return Profile(c / 3, 2 * c / 3, self.param_bytes, ready, mem)

    def allreduce_s(self, bytes_, ranks):
        return 2 * (ranks - 1) / ranks * bytes_ / self.bw_Bps + 5e-6 * math.log2(ranks)

    def hybrid_allreduce_s(self, bytes_, replicas, mp, active=None):
        return self.allreduce_s(bytes_, replicas)

    def mp_step(self, mp, batch):
        s = dict(self.mp_speedup)[mp]
        mem = self.profile(batch).memory_bytes / mp
        return MPStep(self.profile(batch).compute_s / s, (self.param_bytes // mp,) * mp, (int(mem),) * mp)

    def cf_step(self, gpus, groups, batch_global):
        return None


def curve(e_min=30.0, b_noise=20000.0):
    return WorkloadCurve("m", McCandlishCurve(e_min, b_noise, ((1.0, 0.0), (0.0, (0.1 * b_noise) ** 2))),
                         1_000_000, "target")


def test_overlapped_end_hides_allreduce_behind_backward():
    ready = [(1.0, 10), (2.0, 10), (3.0, 10)]
    # fast network: each bucket done right after it is ready -> ends just after backward
    assert overlapped_end(ready, 10, lambda nb: 0.1) == pytest.approx(3.1)
    # slow network: buckets queue up
    assert overlapped_end(ready, 10, lambda nb: 2.0) == pytest.approx(7.0)
    # one big bucket launched at the end
    assert overlapped_end(ready, 1000, lambda nb: nb / 10) == pytest.approx(6.0)


def test_single_gpu_dp_is_the_baseline():
    p = project(AnalyticCosts(), curve(), [1], 64)
    (dp,) = p.at(1)
    assert dp.strategy == "DP" and dp.speedup == pytest.approx(1.0) and dp.exposed_comm_s == 0.0
    assert p.baseline_time_s == pytest.approx(dp.time_s)


def test_dp_saturates_and_hybrid_wins_beyond_a_crossover():
    p = project(AnalyticCosts(), curve(), GPUS, 64)
    dp = {n: p.best(n, "DP").speedup for n in GPUS}
    # DP-only speedup saturates: going 512 -> 4096 GPUs buys less than 1.5x
    assert dp[4096] < 1.5 * dp[512]
    cross = p.crossover()
    assert cross is not None and 8 < cross < 4096
    assert p.hybrid_wins() == [n for n in GPUS if n >= cross]
    assert p.best(4096).family == "hybrid"
    assert p.best(2).family == "DP"
    assert p.margin_best_vs_best() > 0
    # far past b_noise both need ~S_min steps, so the margin approaches 1 - 1/S_MP(8)
    sat = project(AnalyticCosts(), curve(b_noise=2000.0), [4096], 64)
    assert sat.margin_at_scale() == pytest.approx(1 - 1 / 2.8, abs=0.05)


def test_epoch_band_brackets_speedup_and_bigger_batch_needs_more_epochs():
    p = project(AnalyticCosts(), curve(), [64, 4096], 64)
    for pt in p.points:
        assert pt.speedup_lo <= pt.speedup <= pt.speedup_hi
    assert p.best(4096, "DP").epochs > p.best(64, "DP").epochs


def test_without_statistical_penalty_dp_is_never_beaten():
    # b_noise huge: epochs do not grow with batch, so hybrid's sub-linear MP speedup cannot win
    p = project(AnalyticCosts(bw_Bps=1e15), curve(b_noise=1e12), GPUS, 64)
    assert p.crossover() is None and all(p.best(n).family == "DP" for n in GPUS)


def test_joint_choice_respects_memory_and_names_the_dominant_term():
    costs = AnalyticCosts(capacity_bytes=4 * 100e6 + 50e6 * 40)  # DP fits only up to batch 40/GPU
    jc = choose(costs, curve(), 1024, batch_options=[16, 32, 64, 128])
    assert jc.best.fits and jc.rejected_memory > 0
    assert jc.best.time_s == min(p.time_s for p in jc.candidates if p.fits)
    t = terms_of(jc.best, curve())
    assert t.compute_s + t.allreduce_s + t.extra_epochs_s == pytest.approx(jc.best.time_s)
    assert jc.terms.dominant in jc.explanation and "GPUs" in jc.explanation
    with pytest.raises(InfeasibleError):
        choose(AnalyticCosts(capacity_bytes=1e6), curve(), 8, batch_options=[16])


def test_groups_share_the_links_only_while_they_allreduce_together():
    # ar_s(bytes, k): k groups on the links at once slow every one of them k-fold
    ar = lambda nb, k: nb * k  # noqa: E731
    # one group: exactly DDP's queue
    ready = [(0.0, 2), (1.0, 2)]
    assert shared_links_end([ready], ar) == pytest.approx(overlapped_end(ready, 1, lambda nb: ar(nb, 1)))
    # two groups from t=0: sizes 1 and 3 run at half speed until the first ends at t=2 (the other has
    # 2/3 of itself left), then alone: 2/3 * 3 s more
    assert shared_links_end([[(0.0, 1)], [(0.0, 3)]], ar) == pytest.approx(4.0)
    # never together: no contention
    assert shared_links_end([[(0.0, 1)], [(5.0, 1)]], ar) == pytest.approx(6.0)


@dataclass
class LayeredCosts(AnalyticCosts):
    """Every allreduce pays a fixed latency: a device's one big layer is one bucket (one latency), as DDP
    buckets a tensor larger than the bucket size; device 1 ends its allreduce before device 0 starts."""

    latency_s: float = 0.05

    def allreduce_s(self, bytes_, ranks):
        return self.latency_s + 2 * (ranks - 1) / ranks * bytes_ / self.bw_Bps

    def hybrid_allreduce_s(self, bytes_, replicas, mp, active=None):
        return (active or mp) * self.allreduce_s(bytes_, replicas)

    def mp_step(self, mp, batch):
        step = super().mp_step(mp, batch)
        half = self.param_bytes // 2
        # device 0 holds the first layer (its gradient last), device 1 the last one (its gradient first)
        return MPStep(step.step_s, (half, half), step.memory_bytes, device_grad_ready=(((1.0, half),), ((0.1, half),)))


def test_hybrid_exposure_buckets_each_device_s_own_layers():
    costs = LayeredCosts(param_bytes=10 * 2**25, sec_per_sample=2e-2)  # 5 buckets' worth per device
    p = project(costs, curve(), [8], 64)
    (h,) = [x for x in p.at(8) if x.strategy == "DPxMP2"]
    # device 0's one layer is ready when backward ends: one allreduce of it, alone on the links (device 1
    # finished long before), is exposed; no per-bucket latency, no contention
    assert h.exposed_comm_s == pytest.approx(costs.allreduce_s(5 * 2**25, 4), rel=1e-9)
