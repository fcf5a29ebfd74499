"""Rank functions of tests/parallel/test_mp_1f1b.py: chain models (an MLP, a CNN without batch norm) trained
through `model.hybridpar.step` (torch.distributed.pipelining's 1F1B / GPipe) with AdamW and a custom loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH = 3, 8


def chain_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def chain_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 4))


# name -> (factory, inputs(g), placement: the first half on device 0, the rest on device 1)
MODELS = {
    "mlp": (chain_mlp, lambda g: torch.randn(BATCH, 6, generator=g), {str(i): 1 for i in range(4, 7)}),
    "cnn": (chain_cnn, lambda g: torch.randn(BATCH, 2, 6, 6, generator=g), {str(i): 1 for i in range(2, 6)}),
    # the stages in the other order: device 1 first
    "mlp_flip": (chain_mlp, lambda g: torch.randn(BATCH, 6, generator=g),
                 {**{str(i): 1 for i in range(4)}, **{str(i): 0 for i in range(4, 7)}}),
    # device 1 in the middle: a chain 0 -> 1 -> 0 is not one (refused)
    "mlp_back": (chain_mlp, lambda g: torch.randn(BATCH, 6, generator=g), {"2": 1, "3": 1, "4": 0, "5": 0, "6": 0}),
}


def custom_loss(out, y):
    """A mean over the samples, not a cross-entropy: smooth L1 to the one-hot target plus a penalty."""
    return F.smooth_l1_loss(out, F.one_hot(y, out.shape[-1]).to(out.dtype)) * 3 + 0.1 * out.pow(2).mean()


def batches(name: str, dtype):
    g = torch.Generator().manual_seed(7)
    return [(MODELS[name][1](g).to(dtype), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(STEPS)]


def build(name: str, dtype) -> nn.Module:
    torch.manual_seed(3)
    return MODELS[name][0]().to(dtype)


def serial(name: str, dtype) -> tuple[dict, list[float]]:
    m = build(name, dtype)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05)
    losses = []
    for x, y in batches(name, dtype):
        loss = custom_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, losses


def run_step(cases) -> list[dict]:
    """Each (name, schedule, K, dtype): parallelize over the placement, train STEPS steps through step()."""
    import hybridpar
    from hybridpar.plans import Plan

    out = []
    for name, schedule, k, dtype in cases:
        model = build(name, dtype)
        plan = Plan(model=name, world_size=2, batch=BATCH, dp=1, mp=2, placement=MODELS[name][2],
                    default_layout={"sample": 1})
        model = hybridpar.parallelize(model, plan, micro_batches=k, schedule=schedule, loss_fn=custom_loss)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        log = model.hybridpar.comm_log
        losses, micro = [], []
        for x, y in batches(name, dtype):
            log.mark_step()
            loss = model.hybridpar.step(x, target=y, losses=micro)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        p2p = sorted((r.kind, r.tag, r.bytes_) for r in log.step_records() if r.kind in ("send", "recv"))
        out.append({"state": hybridpar.full_state_dict(model), "losses": losses, "micro": len(micro), "p2p": p2p,
                    "order": _every_rank("".join(model.hybridpar._pipeline.trace))})  # noqa: SLF001
    return out


def _every_rank(value):
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def refused(name: str) -> list:
    import hybridpar
    from hybridpar.errors import UserError
    from hybridpar.plans import Plan

    plan = Plan(model=name, world_size=2, batch=BATCH, dp=1, mp=2, placement=MODELS[name][2],
                default_layout={"sample": 1})
    try:
        hybridpar.parallelize(build(name, torch.float32), plan, micro_batches=4, schedule="1f1b",
                              loss_fn=custom_loss)
    except UserError as err:
        return _every_rank(str(err))
    return _every_rank("")


def dataset():
    """`hybridpar train --data tests/parallel/_1f1b_workers.py:dataset`: 24 samples (x [6] float, class id)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 6, generator=g), torch.randint(0, 4, (24,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def run_hybrid(k: int) -> dict:
    """mp=2 x sample=2 (4 ranks): 1F1B in each replica, the gradients summed over the replicas."""
    import hybridpar
    from hybridpar.plans import Plan

    model = build("mlp", torch.float64)
    plan = Plan(model="mlp", world_size=4, batch=BATCH, dp=2, mp=2, placement=MODELS["mlp"][2],
                default_layout={"sample": 2})
    model = hybridpar.parallelize(model, plan, micro_batches=k, schedule="1f1b", loss_fn=custom_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    losses = []
    for x, y in batches("mlp", torch.float64):
        losses.append(float(model.hybridpar.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    return {"state": hybridpar.full_state_dict(model), "losses": losses}


def run_placed(k: int) -> dict:
    """`parallelize(model, "mp=2", example_inputs=..., schedule="1f1b")`: rank 0's placer places the model for
    1F1B (a chain of stages), every rank trains through step()."""
    import hybridpar

    model = build("mlp", torch.float64)
    data = batches("mlp", torch.float64)
    model = hybridpar.parallelize(model, "mp=2", example_inputs=(data[0][0],), micro_batches=k, schedule="1f1b",
                                  loss_fn=custom_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    losses = []
    for x, y in data:
        losses.append(float(model.hybridpar.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    return {"state": hybridpar.full_state_dict(model), "losses": losses,
            "placement": dict(model.hybridpar.plan.placement), "schedule": model.hybridpar.schedule}
