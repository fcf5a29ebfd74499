"""Rank functions of tests/parallel/test_mp_own_loop.py: models not in the zoo under
hybridpar.parallelize(model, mp plan) in the user's own loop (AdamW, a custom loss), against one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybridpar
from hybridpar.plans import Plan

from . import mp_user_models as um

STEPS, BATCH = 3, 8

# (name, factory, inputs(g) -> tuple, placement): placements that cross back and forth
MODELS = {
    "branchy": (um.BranchyCNN, lambda g: (torch.randn(BATCH, 3, 8, 8, generator=g),),
                {"left": 1, "mix": 1, "head": 1}),
    "two_input": (um.TwoInput, lambda g: (torch.randn(BATCH, 3, 8, 8, generator=g), torch.randn(BATCH, 6, generator=g)),
                  {"vec": 1, "conv2": 1, "aux": 0, "head": 1}),
    "lstm_dict": (um.StackedLSTMLM, lambda g: (torch.randint(0, 32, (BATCH, 5), generator=g),),
                  {"lstm1": 1, "fc": 1}),
    "bn1d": (um.BN1dNet, lambda g: (torch.randn(BATCH, 6, generator=g),), {"bn1": 1, "conv": 1}),
    "bn3d": (um.BN3dNet, lambda g: (torch.randn(BATCH, 2, 3, 4, 4, generator=g),), {"bn1": 1, "bn2": 0, "fc": 1}),
}


def custom_loss(out, y):
    """Not a cross-entropy, and every output takes part (tuple and dict outputs)."""
    if isinstance(out, dict):
        logits = out["logits"]
        margin = F.multi_margin_loss(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return margin + 0.1 * out["hidden"].pow(2).mean()
    if isinstance(out, tuple):
        logits, aux = out
        return F.smooth_l1_loss(logits, F.one_hot(y, logits.shape[-1]).to(logits.dtype)) + aux.square().mean()
    return F.smooth_l1_loss(out, F.one_hot(y, out.shape[-1]).to(out.dtype)) * 3


def batches(name: str, dtype):
    _factory, inputs, _ = MODELS[name]
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs(g))
        y = torch.randint(0, 5, (BATCH, 5) if name == "lstm_dict" else (BATCH,), generator=g)
        out.append((x, y))
    return out


def train(model, name: str, dtype, loss_fn=custom_loss):
    return fit(model, batches(name, dtype), loss_fn)


def fit(model, data, loss_fn) -> list[float]:
    """The user's loop: AdamW over (inputs tuple, target) pairs; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    losses = []
    for x, y in data:
        loss = loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def build(name: str, dtype):
    torch.manual_seed(3)
    return MODELS[name][0]().to(dtype)


def serial(name: str, dtype) -> tuple[dict, list[float]]:
    m = build(name, dtype)
    losses = train(m, name, dtype)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, losses


def run_cases(cases) -> list[dict]:
    """Every rank: each case (name, strategy, dtype name, how) trained in the own loop; rank 0 keeps
    the gathered weights and losses. how: "plan" (a placement Plan) or "strategy" (a strategy string
    with placement=)."""
    out = []
    world = dist.get_world_size()
    for name, dp, dtype_name, how in cases:
        dtype = getattr(torch, dtype_name)
        model = build(name, dtype)
        placement = MODELS[name][2]
        if how == "plan":
            spec = Plan(model=name, world_size=world, batch=BATCH, dp=dp, mp=world // dp, placement=placement,
                        default_layout={"sample": dp})
            model = hybridpar.parallelize(model, spec)
        elif how == "placer":  # rank 0 runs DLPlacer on the example batch and shares its placement
            model = hybridpar.parallelize(model, f"mp={world // dp}", example_inputs=batches(name, dtype)[0][0])
        else:
            model = hybridpar.parallelize(model, f"mp={world // dp},sample={dp}", placement=placement)
        losses = train(model, name, dtype)
        # outputs whole on every rank, and eval mode (running statistics) too
        model.eval()
        with torch.no_grad():
            x, _ = batches(name, dtype)[0]
            out_eval = model(*x)
        model.train()
        flat = torch.cat([t.reshape(-1).double() for t in torch.utils._pytree.tree_flatten(out_eval)[0]])
        every = [None] * world
        dist.all_gather_object(every, flat)
        state = hybridpar.full_state_dict(model)
        sent = model.hybridpar.comm_log.total_bytes_by_kind().get("send", 0)
        held = sum(p.numel() for p in model.parameters() if p.device.type != "meta")
        out.append({"state": state, "losses": losses, "eval_same": all(torch.equal(e, every[0]) for e in every),
                    "eval": flat, "sent": sent, "held": held})
    return out


def run_all(cases, refuse: bool) -> dict:
    """run_cases, then (refuse) the refusal of functional batch norm, in one world."""
    return {"cases": run_cases(cases), "refused": refused_functional_bn() if refuse else None}


def serial_eval(name: str, dtype) -> torch.Tensor:
    """One process: the eval-mode outputs after training, flattened (as run_cases reports them)."""
    m = build(name, dtype)
    train(m, name, dtype)
    m.eval()
    with torch.no_grad():
        out = m(*batches(name, dtype)[0][0])
    return torch.cat([t.reshape(-1).double() for t in torch.utils._pytree.tree_flatten(out)[0]])


def refused_functional_bn(_unused=None) -> str:
    """mp=2 x sample=2 of a model calling F.batch_norm itself: refused before any step, every rank."""
    from torch import nn

    from hybridpar.errors import UserError

    class FunctionalBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.fc2 = nn.Linear(4, 2)

        def forward(self, x):
            h = self.fc(x)
            return self.fc2(F.batch_norm(h, None, None, training=True))

    try:
        hybridpar.parallelize(FunctionalBN(), "mp=2,sample=2", placement={"fc2": 1})
    except UserError as err:
        return str(err)
    return "not refused"
