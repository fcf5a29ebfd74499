"""A user's own torchrun script gets the pre-start check too: `parallelize(..., check_inputs=x)` (and
`hybridpar.check`) runs the layout on meta tensors over a fake world on each rank alone, with the
real process group already up, and raises one UserError naming op and module before any collective;
the real world is untouched by it (a model that passes the check then trains as in one process)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tests.parallel.refusal_models import Counting
from torch import nn

import hybridpar
from hybridpar.errors import UserError
from hybridpar.train.launch import spawn


class Good(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _rank() -> dict:
    import torch.distributed as dist

    x, y = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(4)
    try:
        hybridpar.parallelize(Counting(), "channel=2", check_inputs=x)
        refused = None
    except UserError as err:
        refused = str(err)
    torch.manual_seed(0)
    ref = Good()
    model = copy.deepcopy(ref)
    hybridpar.parallelize(model, "channel=2", check_inputs=x)
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    got = hybridpar.full_state_dict(model)  # the real world still gathers: its groups are intact
    err = max(float((got[n] - p).abs().max()) for n, p in ref.state_dict().items() if p.is_floating_point())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.step()
    after = hybridpar.full_state_dict(model)
    step_err = max(float((after[n] - p).abs().max()) for n, p in ref.state_dict().items() if p.is_floating_point())
    return {"rank": dist.get_rank(), "refused": refused, "err": err, "step_err": step_err,
            "grads": len(grads)}


def test_check_without_a_process_group_names_op_and_module():
    with pytest.raises(UserError, match=r"channel=2: op aten\._unique2.* in module '<model>'"):
        hybridpar.check(Counting(), "channel=2", torch.randn(4, 3, 8, 8), world_size=2)
    dry = hybridpar.check(Good(), "channel=2", torch.randn(4, 3, 8, 8), world_size=2)
    assert dry.output_shapes == [(4, 10)]


@pytest.mark.slow
def test_check_inputs_under_a_live_process_group():
    r = spawn(_rank, 2)
    assert r["refused"] is not None and "aten._unique2" in r["refused"] and "'<model>'" in r["refused"], r
    assert "\n" not in r["refused"]
    assert r["err"] <= 1e-6 and r["step_err"] <= 1e-6, r  # running statistics after one forward; weights after a step
