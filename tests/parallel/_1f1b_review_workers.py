"""Rank functions of tests/parallel/test_mp_1f1b_review.py: the chain MLP trained through
`model.hybridpar.step` with plain SGD (no momentum, fp64), whose update scales with the gradient (AdamW's
barely does), so the micro-batches' weighting 1 / (K x replicas) shows; and step() without a schedule
(torch's GPipe) on a placement that is not a chain."""

from __future__ import annotations

import torch

from . import _1f1b_workers as w

LR = 0.5  # large: a wrong gradient scale moves the weights far from one process's


def serial_sgd(name: str) -> dict:
    m = w.build(name, torch.float64)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for x, y in w.batches(name, torch.float64):
        w.custom_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def run_sgd(cases) -> list[dict]:
    """Each (name, schedule, K): STEPS steps of step() + SGD; the full state after them."""
    import hybridpar
    from hybridpar.plans import Plan

    out = []
    for name, schedule, k in cases:
        plan = Plan(model=name, world_size=2, batch=w.BATCH, dp=1, mp=2, placement=w.MODELS[name][2],
                    default_layout={"sample": 1})
        model = hybridpar.parallelize(w.build(name, torch.float64), plan, micro_batches=k, schedule=schedule,
                                      loss_fn=w.custom_loss)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for x, y in w.batches(name, torch.float64):
            model.hybridpar.step(x, target=y)
            opt.step()
            opt.zero_grad()
        out.append(hybridpar.full_state_dict(model))
    return out


def step_without_schedule_refused(name: str) -> str:
    """step() on a model parallelized without a schedule (torch's GPipe then) over a placement that is not
    a chain: the refusal's text (every rank refuses before any collective of the step)."""
    import hybridpar
    from hybridpar.errors import UserError
    from hybridpar.plans import Plan

    plan = Plan(model=name, world_size=2, batch=w.BATCH, dp=1, mp=2, placement=w.MODELS[name][2],
                default_layout={"sample": 1})
    model = hybridpar.parallelize(w.build(name, torch.float32), plan, micro_batches=2, loss_fn=w.custom_loss)
    x, y = w.batches(name, torch.float32)[0]
    try:
        model.hybridpar.step(x, target=y)
    except UserError as err:
        return str(err)
    return ""
