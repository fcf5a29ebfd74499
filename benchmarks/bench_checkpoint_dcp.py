"""Checkpoint cost of sharded state, side by side: hybridpar's rank files (version 1) against
torch.distributed.checkpoint chunks (version 2, what sharded layouts write since issue 31), on the same
engine, in one run, alternating which goes first each round. Prints the median save and load (this
rank's pieces) times per format, their ratio and the bytes on disk.

    .venv/bin/python benchmarks/bench_checkpoint_dcp.py [--quick] [--strategy channel=2] [--nproc 2]

Timings on a loaded machine are only indicative; the ratio is the figure to compare."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from _timing import barrier_timed  # benchmarks/ is sys.path[0] when run as a script
from torch import nn


def _model(width: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def worker(root: str, strategy: str, width: int, rounds: int) -> dict:
    from hybridpar.plans import Plan, parse_strategy
    from hybridpar.train import checkpoint as ckpt
    from hybridpar.train.engine import make_engine

    world = dist.get_world_size()
    s = parse_strategy(strategy, world)
    plan = Plan(model="bench", world_size=world, batch=8, dp=world // s.mp, mp=s.mp, default_layout=s.layout,
                strategy=strategy)
    torch.manual_seed(0)
    engine = make_engine(_model(width), plan)
    opt = torch.optim.SGD(engine.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    engine.train_step(*engine.local_batch(x, y))
    opt.step()
    real = ckpt._use_dcp
    formats = {"own": lambda shards: False, "dcp": real}
    times: dict[str, dict[str, list[float]]] = {f: {"save": [], "load": []} for f in formats}
    sizes = {}
    for r in range(rounds):
        order = list(formats) if r % 2 == 0 else list(reversed(formats))
        for f in order:
            ckpt._use_dcp = formats[f]
            d = Path(root) / f
            times[f]["save"].append(barrier_timed(lambda d=d, r=r: ckpt.save_checkpoint(d, r + 1, engine, opt, keep=1)))
            info = ckpt.latest_checkpoint(d, verify_hashes=False)
            times[f]["load"].append(barrier_timed(lambda info=info: ckpt.load_pieces(info, engine)))
            sizes[f] = sum(p.stat().st_size for p in info.path.iterdir())
    ckpt._use_dcp = real
    med = {f: {k: statistics.median(v) for k, v in t.items()} for f, t in times.items()}
    return {"strategy": strategy, "world": world, "width": width, "rounds": rounds,
            "params": sum(p.numel() for p in _model(width).parameters()), "median_s": med, "bytes": sizes,
            "ratio_dcp_over_own": {k: med["dcp"][k] / med["own"][k] for k in ("save", "load")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model, 3 rounds")
    ap.add_argument("--strategy", default="channel=2")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from hybridpar.train.launch import spawn

    width, rounds = (64, 3) if args.quick else (512, 7)
    root = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        out = spawn(worker, args.nproc, root, args.strategy, width, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['strategy']} on {out['world']} ranks, {out['params'] / 1e6:.2f} M parameters, {rounds} rounds "
          "(medians, alternating order)")
    print(f"{'':6}{'own (s)':>10}{'dcp (s)':>10}{'dcp/own':>9}")
    for k in ("save", "load"):
        print(f"{k:6}{out['median_s']['own'][k]:10.4f}{out['median_s']['dcp'][k]:10.4f}"
              f"{out['ratio_dcp_over_own'][k]:9.2f}")
    print(f"bytes on disk: own {out['bytes']['own']}, dcp {out['bytes']['dcp']}")


if __name__ == "__main__":
    main()
