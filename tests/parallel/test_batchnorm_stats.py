"""Global batch-norm statistics are exact in fp32 where a one-pass sum of squares is not: channels whose
mean^2 is ~1e4x their variance (HF RegNet's stem has 5,800x), 2 gloo ranks against nn.BatchNorm2d on
the whole batch; the forward's one allreduce does not grow with the replica count."""

import pytest
import torch
from tests.parallel._bn_workers import global_bn_step
from torch import nn

from hybridpar.train.launch import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_global_statistics_equal_whole_batch_where_mean_dominates():
    g = torch.Generator().manual_seed(0)
    c = 6
    x = 10.0 + 0.1 * torch.randn(8, c, 5, 5, generator=g)  # mean^2 / var = 1e4
    x[:, 0] = 0.5 * torch.randn(8, 5, 5, generator=g)  # and an ordinary channel
    dy = torch.randn(8, c, 5, 5, generator=g)
    got = spawn(global_bn_step, 2, x, dy)

    ref_bn = nn.BatchNorm2d(c)
    xr = x.clone().requires_grad_(True)
    y = ref_bn(xr)
    y.backward(dy)
    # float64 truth of the same step, to say how close fp32 can be at all
    bn64 = nn.BatchNorm2d(c).double()
    x64 = x.double().requires_grad_(True)
    y64 = bn64(x64)
    y64.backward(dy.double())

    for name, ours, torch32, truth in (("y", got["y"], y.detach(), y64.detach()),
                                       ("dx", got["dx"], xr.grad, x64.grad),
                                       ("dw", got["dw"], ref_bn.weight.grad, bn64.weight.grad),
                                       ("running_var", got["running_var"], ref_bn.running_var, bn64.running_var),
                                       ("running_mean", got["running_mean"], ref_bn.running_mean, bn64.running_mean)):
        err = (ours.double() - truth).abs().max().item()
        err_torch = (torch32.double() - truth).abs().max().item()
        assert err <= 4 * err_torch + 1e-6, (name, err, err_torch)
    # forward: one allreduce of (count, count*mean, M2, count*mean^2) in float64; backward: (sum dy, sum dy*xhat)
    assert got["bytes"] == {"allreduce": (3 * c + 1) * 8 + 2 * c * 4}
