"""Models and the rank function of tests/search/layers/test_spatial_candidates.py (written for those
tests, not the zoo's): a 2-D CNN whose last pooling leaves 1 x 1 before a global average pool, and a
small U-Net-like net with a bilinear nn.Upsample (which the spatial runtime runs on the gathered input,
parallel.styles.spatial_layers.SpatialGathered). The factories are `--model` targets (path:factory)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar

BATCH = 4
SHAPES = {"gap_1x1": (3, 4, 4), "bilinear_unet": (3, 8, 6), "functional_unet": (3, 8, 6)}


def gap_1x1() -> nn.Module:
    """4 x 4 -> two 2x2 max pools -> 1 x 1 (a height=2 split leaves rank 1 an empty piece there) ->
    global average pool -> Linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


class BilinearUNet(nn.Module):
    """Conv, a strided conv down, a bilinear upsample back up, skip concatenation, per-pixel head."""

    def __init__(self, c: int = 4, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.head = nn.Conv2d(2 * c, classes, 3, padding=1)

    def forward(self, x):
        s = F.relu(self.stem(x))
        u = self.up(F.relu(self.down(s)))
        return self.head(torch.cat([u, s], 1))


def bilinear_unet() -> nn.Module:
    torch.manual_seed(0)
    return BilinearUNet()


class FunctionalUNet(BilinearUNet):
    """The same with F.interpolate: no module for the spatial runtime to wrap; DTensor runs it, its rule
    sharding samples and channels only (it gathers the input over the spatial ranks)."""

    def forward(self, x):
        s = F.relu(self.stem(x))
        u = F.interpolate(F.relu(self.down(s)), scale_factor=2, mode="bilinear", align_corners=False)
        return self.head(torch.cat([u, s], 1))


def functional_unet() -> nn.Module:
    torch.manual_seed(0)
    return FunctionalUNet()


def _batch(factory: str, model: nn.Module, dtype):
    torch.manual_seed(1)
    x = torch.randn(BATCH, *SHAPES[factory], dtype=dtype)
    with torch.no_grad():
        out = model(x)
    y = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]))
    return x, y


def train_case(factory: str, strategy: str) -> dict:
    """Two SGD steps of `factory`'s model under `strategy` and in one process (fp32, as `plan` prices
    its bytes): the largest weight
    difference after them, and this rank's bytes per kind in the second step (DTensor's moves too)."""
    from hybridpar.parallel.dtensor.log import recording

    ref = globals()[factory]()
    model = copy.deepcopy(ref)
    x, y = _batch(factory, ref, torch.float32)
    hybridpar.parallelize(model, strategy)
    log = model.hybridpar.grid.comm_log
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for _ in range(2):
        log.mark_step()
        with recording(log):
            F.cross_entropy(model(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = hybridpar.full_state_dict(model)
    err = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items() if v.is_floating_point())
    return {"weights": err, "bytes": log.step_bytes_by_kind()}


def train_cases(cases: list[tuple[str, str]]) -> list[list[dict]]:
    out = []
    for factory, strategy in cases:
        rec = train_case(factory, strategy)
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, rec)
        out.append(got)
    return out
