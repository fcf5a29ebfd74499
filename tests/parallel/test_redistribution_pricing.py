"""Every redistribution DTensor runs in a step costs its Python (~0.15 ms here), a collective's or a
local one: the dry run counts them on rank 0 and the plan prices each at the calibration's measured
cost per call (hybridpar.profile.runtime_overhead's `redistribute_s`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hybridpar.cluster.calibration import Calibration, RuntimeOverhead, save_calibration

MODEL = f"{Path(__file__).resolve()}:norm_net"


class _Permute(nn.Module):
    def __init__(self, *dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return x.permute(*self.dims)


def norm_net():
    """A ConvNeXt-like block: a LayerNorm over the channels (channels last), which DTensor gathers
    under a channel split, between two 1x1 convolutions."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 8, 1), _Permute(0, 2, 3, 1), nn.LayerNorm(8), _Permute(0, 3, 1, 2),
                        nn.Conv2d(8, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    return net, (torch.randn(4, 4, 6, 6),)


def _overhead(redistribute_s):
    return RuntimeOverhead(sample_node_fwd_s=0, sample_node_bwd_s=0, dtensor_node_fwd_s=0, dtensor_node_bwd_s=0,
                           layer_fwd_s=0, layer_bwd_s=0, spatial_op_fwd_s=0, spatial_op_bwd_s=0,
                           redistribute_s=redistribute_s)


def test_the_dry_run_counts_every_redistribution():
    from hybridpar.parallel.check import dry_run

    net, x = norm_net()
    split = dry_run(net, "channel=2", x, world_size=2)
    # the norm's input gathered and its output cut again, each way: local cuts count too
    assert split.redistributions >= 4
    assert split.redistributions > len([r for r in split.dtensor if r["group_size"] > 1])
    assert dry_run(net, "sample=2", x, world_size=2).redistributions == 0


def test_the_plan_prices_each_redistribution_at_the_measured_cost(tmp_path, monkeypatch):
    from hybridpar.api import plan
    from hybridpar.cluster import load_cluster
    from hybridpar.parallel.check import dry_run

    def planned(redistribute_s):
        path = tmp_path / f"cal{redistribute_s}.json"
        save_calibration(Calibration(cpu_count=2, peak_flops_fp32=1e10, mem_bw_Bps=1e10,
                                     runtime_overhead=_overhead(redistribute_s)), path)
        monkeypatch.setenv("HYBRIDPAR_CALIBRATION", str(path))
        return plan(MODEL, "localhost", 2, 4, strategy="channel=2", dry_run=True)

    net, x = norm_net()
    moves = dry_run(net, "channel=2", x, world_size=2).redistributions
    bare, priced = planned(None), planned(1e-3)
    share = load_cluster("localhost", gpus=2).device.time_share
    extra = priced.prediction.step_time_s - bare.prediction.step_time_s
    assert extra == pytest.approx(moves * 1e-3 * share, rel=1e-6)
    assert priced.prediction.compute_s - bare.prediction.compute_s == pytest.approx(extra, rel=1e-6)
    assert any(f"{moves} redistribution(s) per step" in n for n in priced.plan.notes)
    assert not any("redistribution(s) per step" in n for n in bare.plan.notes)
