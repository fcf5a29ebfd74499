"""Rank functions and a model (not in the zoo) for tests/parallel/test_fsdp_mixed.py: a plan whose blocks
differ in zero level and recomputation (issue 31's per-block choice)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.layout import LayerLayout
from hybridpar.plans import Plan


class Cell(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) + x.mean(1, keepdim=True)


class MixNet(nn.Module):
    """Four blocks: stem, two cells in a ModuleList and a linear head (5 outputs: uneven shards)."""

    def __init__(self):
        super().__init__()
        self.stem = Cell(3, 6)
        self.cells = nn.ModuleList([Cell(6, 6), Cell(6, 4)])
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        x = self.stem(x)
        for c in self.cells:
            x = c(x)
        return self.head(x.mean((2, 3)))


def mix_net() -> MixNet:
    """`hybridpar train --model tests/parallel/_fsdp_mixed_workers.py:mix_net --input-shape 3,6,6`."""
    return MixNet()


# block -> (zero level, recomputes): every combination the runtime has, over one split
CHOICE = {"stem": (3, False), "cells.0": (0, True), "cells.1": (2, True), "head": (0, False)}
MODULES = {"stem": "stem.conv", "cells.0": "cells.0.conv", "cells.1": "cells.1.conv", "head": "head"}


def mixed_plan(split: dict[str, int] | None = None, batch: int = 8, choice=None) -> Plan:
    choice = choice or CHOICE
    split = split or {"sample": 2}
    lay = LayerLayout(**split)
    layers = {MODULES[b]: lay.model_copy(update={"zero": z}) for b, (z, _) in choice.items()}
    return Plan(model="tests/parallel/_fsdp_mixed_workers.py:mix_net", input_shape=[3, 6, 6],
                world_size=lay.size, batch=batch, dp=lay.size, default_layout=lay, layers=layers,
                recompute_blocks=[b for b, (_, r) in choice.items() if r])


def make_model() -> MixNet:
    torch.manual_seed(0)
    return MixNet().double()


def run_mixed(split: dict[str, int] | None = None, opts=("sgd", "adamw")) -> dict:
    """The mixed plan through hybridpar.parallelize (its own choice of recomputation: no option passed):
    rank's full_state_dict, losses, which blocks FSDP shards and how often each cell's conv ran."""
    # imported here, not at the top: `--model` loads this file by path, where `tests` is not a package
    from tests.parallel._fsdp_workers import train
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    out = {}
    for opt_name in opts:
        model = make_model()
        calls = {b: [0] for b in CHOICE}
        for b, name in MODULES.items():
            model.get_submodule(name).register_forward_hook(lambda *_, c=calls[b]: c.__setitem__(0, c[0] + 1))
        hybridpar.parallelize(model, mixed_plan(split))
        sharded = sorted(b for b in CHOICE if isinstance(model.get_submodule(b), FSDPModule))
        # blocks holding FSDP's sample-sharded parameters (replicated blocks hold none)
        held = sorted(b for b in CHOICE if any(isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("sample",)
                                               for p in model.get_submodule(b).parameters()))
        losses = train(model, opt_name)
        out[opt_name] = {"state": hybridpar.full_state_dict(model), "losses": losses, "sharded": sharded, "held": held,
                         "calls": {b: c[0] for b, c in calls.items()}, "rank": dist.get_rank()}
    return out


class ActNet(nn.Module):
    """Activation-heavy blocks (a stem, six conv-BN-ReLU cells in a ModuleList, a linear head): under a
    memory limit between data parallelism's and full recomputation's, the planner recomputes some."""

    def __init__(self, width: int = 8, depth: int = 6):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.cells = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width),
                                                 nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        x = self.stem(x)
        for c in self.cells:
            x = c(x)
        return self.head(x.mean((2, 3)))


def act_net() -> ActNet:
    """`--model tests/parallel/_fsdp_mixed_workers.py:act_net --input-shape 3,16,16`."""
    return ActNet()
