"""Models and the rank function of tests/parallel/test_dtensor_log_bytes.py: the bytes a training step
logs per kind (our layers' collectives and DTensor's redistributions, hybridpar.parallel.dtensor.log)
beside the bytes gloo itself was handed, read off torch.profiler's `gloo:<collective>` events (the
tensors' shapes and dtypes), which see every collective whatever issued it. Issue 30: under height=2
a bilinear F.interpolate's input is gathered inside DTensor's own dispatch, where the log's dispatch
mode did not see it. The factories are `--model` targets (path:factory)."""

from __future__ import annotations

from math import prod

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 2
# 9 rows: uneven pieces (5 and 4), which DTensor pads to 5 before gathering
SHAPES = {"interp_net": (3, 9, 8), "upsample_net": (3, 9, 8)}

# gloo's event name -> our kind; a point-to-point send here is a halo exchange (the only ones these
# models make), counted as the log counts halos: the bytes this rank sends
_GLOO_KINDS = {"gloo:all_gather": "allgather", "gloo:all_reduce": "allreduce",
               "gloo:reduce_scatter": "reduce_scatter", "gloo:broadcast": "broadcast",
               "gloo:all_to_all": "alltoall", "gloo:send": "halo", "gloo:recv": None}
_ELEM = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}


class UpNet(nn.Module):
    """conv -> upsampling by 2 (bilinear) -> conv, per-pixel logits: the U-Net decoder's pattern.
    `module`: an nn.Upsample (our SpatialGathered runs it), else F.interpolate (DTensor runs it)."""

    def __init__(self, module: bool):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear") if module else None
        self.b = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        x = self.up(x) if self.up is not None else F.interpolate(x, scale_factor=2, mode="bilinear")
        return self.b(x)


def interp_net() -> nn.Module:
    torch.manual_seed(0)
    return UpNet(module=False)


def upsample_net() -> nn.Module:
    torch.manual_seed(0)
    return UpNet(module=True)


def _case(factory: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = globals()[factory]()
    c, h, w = SHAPES[factory]
    torch.manual_seed(1)
    return model, torch.randn(BATCH, c, h, w), torch.randint(0, 2, (BATCH, 2 * h, 2 * w))


def gloo_bytes(events, group_size: int) -> dict[str, int]:
    """Bytes per kind of the gloo collectives among profiler `events` (kineto's), by the log's
    convention (allgather: the gathered result). Every collective here runs over `group_size` ranks."""
    out: dict[str, int] = {}
    for e in events:
        if not e.name().startswith("gloo:"):
            continue
        if e.name() not in _GLOO_KINDS:
            raise KeyError(f"a gloo collective this count does not know: {e.name()}")
        kind = _GLOO_KINDS[e.name()]
        if kind is None:
            continue
        shape, dtype = e.shapes()[0], e.dtypes()[0]
        nbytes = prod(shape) * _ELEM[dtype] * (group_size if kind == "allgather" else 1)
        out[kind] = out.get(kind, 0) + nbytes
    return dict(sorted(out.items()))


def logged_and_sent(cases: list[tuple[str, str]]) -> list[list[dict[str, dict[str, int]]]]:
    """Per (factory, strategy): each rank's {"logged", "sent"} bytes per kind in the second training
    step (the first sets DTensor's caches up). Imported here: `plan --model path:factory` loads this
    file outside its package."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from ._step_bytes import second_step_bytes

    def measure(step, log) -> dict:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        return {"logged": log.step_bytes_by_kind(),
                "sent": gloo_bytes(prof.profiler.kineto_results.events(), dist.get_world_size())}

    return second_step_bytes(_case, cases, measure)
