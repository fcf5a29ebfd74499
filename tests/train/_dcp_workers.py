"""Spawned-rank workers of tests/train/test_checkpoint_dcp.py (module level, so that spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def bn_local_run(root: str, steps: int, resume: bool) -> list[dict[str, torch.Tensor]]:
    """small_net under sample=2,channel=2 with per-replica batch-norm statistics (`bn_stats="local"`),
    SGD with momentum, fp64; a checkpoint after step 2 (or a resume from the newest one). Every rank's
    local tensors at the end, gathered."""
    from tests.parallel._fsdp_workers import small_net

    from hybridpar.plans import Plan, parse_strategy
    from hybridpar.train import checkpoint as ckpt
    from hybridpar.train.checkpoint import _plain
    from hybridpar.train.engine import make_engine

    s = parse_strategy("sample=2,channel=2", 4)
    plan = Plan(model="small_net", world_size=4, batch=8, dp=4, mp=1, default_layout=s.layout,
                strategy="sample=2,channel=2")
    torch.manual_seed(0)
    engine = make_engine(small_net().double(), plan, bn_stats="local")
    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    start = 0
    if resume:
        info = ckpt.latest_checkpoint(root)
        start = ckpt.restore_training_state(ckpt.load_pieces(info, engine), engine, opt)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 3, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (8,), generator=g)
        if step < start:
            continue
        engine.train_step(*engine.local_batch(x, y))
        opt.step()
        opt.zero_grad()
        if step + 1 == 2 and not resume:
            ckpt.save_checkpoint(root, 2, engine, opt)
    tensors, _ = ckpt.local_tensors(engine)
    mine = {k: _plain(v).detach().clone() for k, v in tensors.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every
