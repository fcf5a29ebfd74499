"""Rank functions for tests/parallel/test_materialize.py and test_checkpoint_stream.py (importable by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class Net(nn.Module):
    """Conv, batch norm, linear with uneven channel counts and an init loop at the end (as torchvision's
    ResNet re-initialises every conv), so the replay frees weights between their two writes."""

    def __init__(self, trunc: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 7, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(7)
        self.conv2 = nn.Conv2d(7, 5, 3, padding=1, bias=False)
        self.fc = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.tensor([0.5]))  # torch.tensor(data): no op makes it
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
        if trunc:  # a rejection sampler that reads values: cannot run on meta the same way
            nn.init.trunc_normal_(self.fc.weight, std=0.02)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(self.conv2(h).mean((2, 3))) * self.scale


def _plan(strategy: str, layers: dict | None = None):
    from hybridpar.plans import Plan, parse_strategy

    world = dist.get_world_size()
    return Plan(model="net", world_size=world, dp=world, batch=4, default_layout=parse_strategy(strategy, world).layout,
                layers={k: parse_strategy(v, world).layout for k, v in (layers or {}).items()})


def piecewise_engine(strategy: str, layers: dict | None = None, seed: int = 3, trunc: bool = False):
    """The engine built the way `hybridpar train` builds it: the model on meta, this rank's pieces replayed."""
    from hybridpar.parallel.materialize import Materializer, record_build
    from hybridpar.train.engine import ChannelFilterEngine

    def build():
        return Net(trunc)

    meta, record, why = record_build(build)
    mat = Materializer(build, record, seed)
    eng = ChannelFilterEngine(meta, _plan(strategy, layers), materialize=mat)
    return eng, mat


def same_as_serial(cases: list, rows_bytes: int | None = None) -> list:
    """Per case: whether the gathered piecewise weights equal the model built whole (same seed), bit
    for bit, and what the materializer said (fallback notes)."""
    from hybridpar.parallel import materialize

    if rows_bytes is not None:  # weights generated a few rows at a time, the blocks cut across pieces
        materialize.ROWS_BYTES = rows_bytes
    out = []
    for strategy, layers, trunc in cases:
        eng, mat = piecewise_engine(strategy, layers, trunc=trunc)
        full = eng.full_state_dict()
        torch.manual_seed(3)
        ref = Net(trunc).state_dict()
        if full is not None:
            equal = sorted(full) == sorted(ref) and all(torch.equal(full[k], ref[k]) for k in ref)
            out.append({"strategy": strategy, "equal": equal, "notes": list(mat.notes),
                        "local_bytes": sum(p.numel() for p in eng.parameters())})
    return out


def reads_own_pieces(tmp: str) -> list:
    """Per rank: bytes read by --init-from and by a resume (weights, then momentum at the first step)
    against the bytes of this rank's own pieces, and whether the resumed weights are the saved ones."""
    from pathlib import Path

    from hybridpar.train import checkpoint as ckpt
    from hybridpar.train.checkpoint import _plain

    def local_bytes(eng, params_only=False) -> int:
        tensors, _ = ckpt.local_tensors(eng)
        ids = {id(p) for p in eng.parameters()}
        return sum(_plain(t).numel() * t.element_size() for t in tensors.values()
                   if not params_only or id(t) in ids)

    def step(eng, opt):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        eng.train_step(*eng.local_batch(x, y))
        opt.step()
        opt.zero_grad()

    eng, _ = piecewise_engine("channel=2")
    opt = torch.optim.SGD(eng.parameters(), lr=0.1, momentum=0.9)
    step(eng, opt)
    saved = ckpt.save_checkpoint(Path(tmp) / "ckpt", 1, eng, opt, keep=1)
    full = eng.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(full, Path(tmp) / "init.pt")
    dist.barrier()

    fresh, _ = piecewise_engine("channel=2", seed=9)
    ckpt.READ_BYTES[0] = 0
    ckpt.load_init_pieces(Path(tmp) / "init.pt", fresh)
    init_read = ckpt.READ_BYTES[0]

    ckpt.READ_BYTES[0] = 0
    resumed = ckpt.load_pieces(ckpt.checkpoint_info(saved), fresh)
    weights_read = ckpt.READ_BYTES[0]
    same = all(torch.equal(_plain(a), _plain(b)) for a, b in
               zip(ckpt.local_tensors(fresh)[0].values(), ckpt.local_tensors(eng)[0].values()))
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    ckpt.restore_training_state(resumed, fresh, opt2)
    ckpt.READ_BYTES[0] = 0
    step(fresh, opt2)  # the optimizer's slots are cut at its first step
    momentum_read = ckpt.READ_BYTES[0]
    step(eng, opt)
    same_after = all(torch.equal(_plain(a), _plain(b)) for a, b in zip(fresh.parameters(), eng.parameters()))
    mine = {"init_read": init_read, "weights_read": weights_read, "momentum_read": momentum_read,
            "own": local_bytes(fresh), "own_params": local_bytes(fresh, True), "same": same,
            "same_after_step": same_after, "whole": sum(t.numel() * t.element_size() for t in
                                                        (full or {}).values())}
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    return got
