"""The cost model's FSDP/recomputation blocks (cost.memory.block_of, from module names) are the
runtime's (parallel.fsdp.blocks, from the modules): memory and bytes are priced per block."""

from __future__ import annotations

import pytest
from torch import nn

from hybridpar.cost.memory import block_of
from hybridpar.parallel.fsdp import blocks


class Stages(nn.Module):  # a ResNet's shape: a stem, Sequential stages of numbered blocks, a head
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.layer1 = nn.Sequential(nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)), nn.Conv2d(8, 8, 1))
        self.fc = nn.Linear(8, 2)
        self.scale = nn.Parameter(nn.init.ones_(nn.Parameter(nn.Linear(1, 1).weight.detach())))


class Layers(nn.Module):  # a transformer's shape: a ModuleList of blocks
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(3))
        self.head = nn.Linear(8, 10)


MODELS = {
    "stages": Stages,
    "layers": Layers,
    "root_sequential": lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Sequential(nn.Conv2d(4, 4, 3)),
                                             nn.Flatten(), nn.LazyLinear(2)),
    "named_sequential": lambda: nn.Sequential(nn.Linear(2, 2), nn.Sequential(
        __import__("collections").OrderedDict(a=nn.Linear(2, 2), b=nn.Linear(2, 2)))),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cost_blocks_are_the_runtime_blocks(name):
    model = MODELS[name]()
    priced = {block_of(m) for m, mod in model.named_modules()
              if m and any(True for _ in mod.parameters(recurse=False))}
    if any(True for _ in model.parameters(recurse=False)):
        priced.add("")
    run = {n for n, _ in blocks(model)} | ({""} if "" in priced else set())
    assert priced == run
