"""Functions run inside spawned gloo ranks by the runtime tests (importable by module name)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.parallel.api import as_layouts, grid_shape, parallelize
from hybridpar.parallel.mesh import build_grid
from hybridpar.parallel.state import gather_full_state

_GRIDS: dict = {}


def grid_for(strategy: str):
    """One grid per (S, G), with every P_C x P_F factorisation of G: groups are reused across cases."""
    s, g = grid_shape(as_layouts(strategy, dist.get_world_size()))
    if (s, g) not in _GRIDS:
        _GRIDS[(s, g)] = build_grid(s, g, [(c, g // c) for c in range(1, g + 1) if g % c == 0])
    return _GRIDS[(s, g)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a - b).norm() / b.norm().clamp_min(1e-30))

def train_side_by_side(eng, ref: nn.Module, batches, lr: float, momentum: float = 0.0) -> float:
    """SGD the distributed engine and the serial reference on the same (x, y) batches; the max
    relative error of the gathered weights against the reference (0 on ranks other than 0)."""
    import torch.nn.functional as F

    opt = torch.optim.SGD(eng.parameters(), lr=lr, momentum=momentum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    for x, y in batches:
        eng.train_step(*eng.local_batch(x, y))
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = eng.full_state_dict()
    if full is None:
        return 0.0
    return max(_rel(full[k], v) for k, v in ref.state_dict().items() if v.is_floating_point())



def build_case(case: dict) -> tuple[nn.Module, torch.Tensor]:
    """The case's layer and input in float64: a split sum's rounding in float32 reached the 1e-5
    tolerance for a 20-term dot product into one output (drawn once in ~10 runs); a wrong split is off by
    O(1) in either precision."""
    torch.manual_seed(case["seed"])
    if case["kind"] == "linear":
        m = nn.Sequential(nn.Linear(case["cin"], case["cout"], bias=case["bias"]))
        x = torch.randn(case["n"], case["cin"])
    else:
        k, d = case["k"], case["dilation"]
        m = nn.Sequential(nn.Conv2d(case["cin"], case["cout"], k, case["stride"], case["padding"], d,
                                    bias=case["bias"]))
        x = torch.randn(case["n"], case["cin"], case["hw"], case["hw"])
    return m.double(), x.double()


def conv_errors(cases: list[dict], strategies: list[str]) -> list[dict]:
    """Relative errors (max over ranks) of output, input grad and weight grads for every
    (strategy, case), distributed vs the serial computation on the whole batch."""
    out = []
    for strategy in strategies:
        grid = grid_for(strategy)
        for ci, case in enumerate(cases):
            ref, x = build_case(case)
            model = copy.deepcopy(ref)
            xr = x.clone().requires_grad_(True)
            yr = ref(xr)
            dy = torch.randn_like(yr)
            yr.backward(dy)
            parallelize(model, strategy, grid=grid)
            xg = x.clone().requires_grad_(True)
            y = model(xg)  # the global batch in, whole outputs out, on every rank
            y.backward(dy)  # gradients are synchronised during backward
            per = x.shape[0] // grid.sample
            rows = slice(grid.s * per, (grid.s + 1) * per)  # the input rows this rank's samples touch
            errs = torch.tensor([_rel(y.detach(), yr.detach()), _rel(xg.grad[rows], xr.grad[rows]), 0.0])
            grads = {k: p.grad for k, p in model.named_parameters()}
            full = gather_full_state(grads, model.hybridpar.shards())
            if full is not None:
                errs[2] = max(_rel(full[k], p.grad) for k, p in ref.named_parameters())
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            out.append({"strategy": strategy, "case": ci, "y": float(errs[0]), "dx": float(errs[1]),
                        "dw": float(errs[2])})
    return out


def comm_and_memory(strategies: list[str], batch: int = 8, shape=(4, 16, 16)) -> list[dict]:
    """Per strategy and rank: measured bytes per kind of the first step after warm_up, the cost
    model's bytes for the same layout and grid position, and parameter bytes (before and after)."""
    from hybridpar.cost.layout_comm import bytes_by_kind, model_collectives
    from hybridpar.graph.tracing import trace
    from hybridpar.graph.zoo.small import small_resnet
    from hybridpar.train.engine import ChannelFilterEngine

    rows = []
    for strategy in strategies:
        torch.manual_seed(0)
        ref = small_resnet(in_channels=shape[0], width=8)
        graph = trace(copy.deepcopy(ref), torch.randn(batch, *shape))
        eng = ChannelFilterEngine(ref, strategy, grid=grid_for(strategy))
        eng.warm_up(shape)  # shape exchanges now: step 1 is already a steady-state step
        before = eng.param_bytes_by_type()
        opt = torch.optim.SGD(eng.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        for _ in range(1):
            x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
            eng.train_step(*eng.local_batch(x, y))
            opt.step()
            opt.zero_grad()
        lay = as_layouts(strategy, dist.get_world_size()).default
        mine = {"strategy": strategy, "rank": dist.get_rank(),
                "measured": eng.comm_log.step_bytes_by_kind(),
                "seconds": eng.comm_log.step_seconds_by_kind(),
                "model": bytes_by_kind(model_collectives(graph, lay, position=eng.grid.g)),
                "param_bytes": eng.param_bytes_by_type(), "param_bytes_before": before,
                "serial_conv_bytes": sum(p.numel() * 4 for m in small_resnet(in_channels=shape[0], width=8).modules()
                                         if isinstance(m, nn.Conv2d) for p in m.parameters())}
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        rows += got
    return rows


def mixed_plan(layers: dict[str, str], default: str, steps: int = 3, batch: int = 8, shape=(3, 16, 16)) -> list:
    """Train small_resnet with per-layer layouts for `steps` SGD steps; per rank: max relative error of
    the gathered weights against serial SGD, and measured vs modelled bytes of the last step."""

    from hybridpar.cost.layout_comm import bytes_by_kind, model_collectives
    from hybridpar.graph.tracing import trace
    from hybridpar.graph.zoo.small import small_resnet
    from hybridpar.plans import Plan, parse_strategy
    from hybridpar.train.engine import ChannelFilterEngine

    world = dist.get_world_size()
    plan = Plan(model="small_resnet", world_size=world, dp=world, batch=batch,
                default_layout=parse_strategy(default, world).layout,
                layers={k: parse_strategy(v, world).layout for k, v in layers.items()})
    torch.manual_seed(0)
    ref = small_resnet(width=8)
    graph = trace(copy.deepcopy(ref), torch.randn(batch, *shape))
    eng = ChannelFilterEngine(copy.deepcopy(ref), plan)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(steps)]
    err = train_side_by_side(eng, ref, batches, lr=0.05, momentum=0.9)
    mine = {"rank": dist.get_rank(), "err": err, "measured": eng.comm_log.step_bytes_by_kind(),
            "model": bytes_by_kind(model_collectives(graph, plan, rank=dist.get_rank()))}
    got = [None] * world
    dist.all_gather_object(got, mine)
    return got


class CatNet(nn.Module):
    """Two branches concatenated on channels (uneven: 5 + 3), as Inception/DenseNet blocks do."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 5, 3, padding=1)
        self.b = nn.Conv2d(3, 3, 1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.c = nn.Conv2d(8, 6, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 10)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), self.b(x)], dim=1)
        y = torch.relu(self.bn(y))
        return self.fc(torch.flatten(self.pool(torch.relu(self.c(y))), 1))


def concat_model(strategies: list[str], steps: int = 2, batch: int = 8) -> list:
    """Per strategy and rank: weight error vs serial SGD, measured vs modelled bytes."""

    from hybridpar.cost.layout_comm import bytes_by_kind, model_collectives
    from hybridpar.graph.tracing import trace
    from hybridpar.train.engine import ChannelFilterEngine

    rows = []
    for strategy in strategies:
        torch.manual_seed(0)
        ref = CatNet()
        graph = trace(copy.deepcopy(ref), torch.randn(batch, 3, 8, 8))
        eng = ChannelFilterEngine(copy.deepcopy(ref), strategy, grid=grid_for(strategy))
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g))
                   for _ in range(steps)]
        err = train_side_by_side(eng, ref, batches, lr=0.1)
        lay = as_layouts(strategy, dist.get_world_size()).default
        mine = {"strategy": strategy, "rank": dist.get_rank(), "err": err,
                "measured": eng.comm_log.step_bytes_by_kind(),
                "model": bytes_by_kind(model_collectives(graph, lay, rank=dist.get_rank()))}
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        rows += got
    return rows
