"""Issue 33 item 1's cost: the finiteness guard is one fused check per step. The tensors come from a
module walk (checked once against what a checkpoint holds, replaced by that list where they differ),
and a step needs at most one collective for the loss, the gradients and the state together."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hybridpar.train.guard import StateGuard

pytestmark = pytest.mark.timeout(300)


class _Engine:
    """An engine as named_state sees it (the MP engine's form: whole tensors by name)."""

    def __init__(self, module: nn.Module, extra: dict | None = None, **attrs):
        self.module, self.extra = module, extra or {}
        self.__dict__.update(attrs)

    @property
    def _local_state(self) -> dict:  # live, as ChannelFilterEngine's state_dict is
        return {**self.module.state_dict(keep_vars=True), **self.extra}

    def parameters(self):
        return self.module.parameters()


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("mask", torch.full((3,), -math.inf), persistent=False)  # a causal mask's kind

    def forward(self, x):
        return self.bn(self.lin(x)) + self.mask.clamp(min=0)


def _stepped(module: nn.Module):
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(4, 3)).sum().backward()
    opt.step()
    return opt


def test_the_walk_finds_what_a_checkpoint_holds_and_sees_reassigned_buffers():
    torch.manual_seed(0)
    m = _Masked()
    opt = _stepped(m)
    guard = StateGuard(_Engine(m), opt, "cpu", agreed=True)
    assert guard.after_update() is None  # the -inf mask is not saved: not checked
    assert guard._walk_ok  # the cheap walk, checked against named_state
    assert {id(t) for t in guard.state_tensors()} == {id(t) for t in m.state_dict(keep_vars=True).values()
                                                     if t.is_floating_point()} | \
        {id(opt.state[m.lin.weight]["momentum_buffer"]), id(opt.state[m.lin.bias]["momentum_buffer"]),
         id(opt.state[m.bn.weight]["momentum_buffer"]), id(opt.state[m.bn.bias]["momentum_buffer"])}
    m.bn.running_var = torch.full((3,), math.inf)  # a new tensor, not an in-place update
    assert guard.after_update() == "bn.running_var"


def test_a_checkpoint_tensor_the_walk_misses_is_still_checked():
    torch.manual_seed(0)
    m = _Masked()
    opt = _stepped(m)
    extra = torch.zeros(2)  # in what a checkpoint holds, in no module (e.g. a state_dict hook's entry)
    guard = StateGuard(_Engine(m, {"extra": extra}), opt, "cpu", agreed=True)
    assert guard.after_update() is None and guard._walk_ok is False
    extra[1] = math.nan
    assert guard.after_update() == "extra"


def test_loss_gradients_and_state_in_one_verdict():
    torch.manual_seed(0)
    m = _Masked()
    opt = _stepped(m)
    guard = StateGuard(_Engine(m), opt, "cpu", agreed=True)
    m(torch.randn(4, 3)).sum().backward()
    assert guard.check_step(guard.before_update(1.0)) is None
    assert guard.check_step(guard.before_update(math.nan)) == "loss"
    m.lin.bias.grad[0] = math.inf
    pending = guard.before_update(1.0)
    m.lin.bias.grad = None  # zero_grad(set_to_none) runs before the verdict: the peaks were taken
    assert guard.check_step(pending) == "gradients"
    m.bn.running_mean[1] = math.nan
    assert guard.check_step(guard.before_update(2.0)) == "state:bn.running_mean"
    assert guard.check_step(guard.before_update(math.nan)) == "loss"  # the loss first, as before


def _collectives_per_step(strategy: str, bn_stats: str) -> dict:
    """Collectives of `hybridpar train`'s step outside the engine's own train_step, per step."""
    import hybridpar.parallel.comm.collectives as coll
    from hybridpar.train import trainer
    from hybridpar.train.config import run_config

    cfg = run_config(model="small_cnn", strategy=strategy, batch=8, steps=3, bn_stats=bn_stats).config
    run = trainer._RankRun(cfg, None)
    counts: dict = {}
    inside = {"on": False}
    real_train_step = run.engine.train_step

    def train_step(*a, **k):
        inside["on"] = True
        try:
            return real_train_step(*a, **k)
        finally:
            inside["on"] = False
    run.engine.train_step = train_step
    real = {"all_reduce": dist.all_reduce, "all_gather_object": dist.all_gather_object,
            "all_reduce_": coll.all_reduce_}

    def counted(name, fn):
        def w(*a, **k):
            if not inside["on"]:
                counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return w
    dist.all_reduce = counted("all_reduce", real["all_reduce"])
    dist.all_gather_object = counted("all_gather_object", real["all_gather_object"])
    coll.all_reduce_ = counted("all_reduce_", real["all_reduce_"])
    try:
        feed = run.feed()
        steps = 0
        for step, x, y in feed:
            assert run.step(step, x, y), run.error
            steps += 1
        feed.close()
    finally:
        dist.all_reduce, dist.all_gather_object = real["all_reduce"], real["all_gather_object"]
        coll.all_reduce_ = real["all_reduce_"]
    return {"per_step": sum(counts.values()) / steps, "counts": counts}


@pytest.mark.parametrize(("strategy", "bn_stats", "expected"), [("channel=2", "global", 1.0),
                                                                 ("sample=2", "global", 0.0),
                                                                 ("sample=2", "local", 0.0)])
def test_at_most_one_collective_per_step_for_the_checks(strategy, bn_stats, expected):
    from hybridpar.train.launch import spawn

    r = spawn(_collectives_per_step, 2, strategy, bn_stats)
    assert r["per_step"] == expected, r


def _inf_buffer_on_rank_1() -> tuple:
    """sample=2 with per-rank batch-norm statistics: rank 1's running_var turns Inf before step 1."""
    from hybridpar.train import trainer
    from hybridpar.train.config import run_config

    cfg = run_config(model="small_cnn", strategy="sample=2", batch=8, steps=4, bn_stats="local").config
    run = trainer._RankRun(cfg, None)
    feed, went = run.feed(), []
    for step, x, y in feed:
        if step == 1 and dist.get_rank() == 1:
            bn = next(m for m in run.engine.module.modules() if getattr(m, "running_var", None) is not None)
            bn.running_var[0] = math.inf
        went.append(run.step(step, x, y))
        if not went[-1]:
            break
    feed.close()
    return run.error, went, run.guard.buffer_rider


def test_a_rank_local_buffer_going_inf_stops_every_rank_without_a_collective_of_its_own():
    from hybridpar.train.launch import spawn

    error, went, rider = spawn(_inf_buffer_on_rank_1, 2)  # rank 0's view: its own buffers are finite
    assert rider and went == [True, False], (error, went)
    assert error.startswith("step 1: ") and "running_var is not finite after the update" in error, error
