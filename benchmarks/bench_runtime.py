"""Runtime benchmark: ratios measured side by side in one run on this machine.

1. step time of our sample=4 engine vs PyTorch DistributedDataParallel on the same model and data
   (both with per-rank batch-norm statistics, as DDP has; ours with global statistics too);
2. step time of each channel/filter strategy relative to our sample=4;
3. framework overhead: our logged collectives vs raw torch.distributed calls of the same sizes.

Trials alternate between the contenders, and the median is reported, so drifting load on a shared
machine hits both alike. Only ratios are meaningful here, not absolute times.

    .venv/bin/python benchmarks/bench_runtime.py [--nproc 4] [--steps 3] [--width 16] [--hw 32] [--batch 32]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

STRATEGIES = ["sample=2,channel=2", "sample=2,filter=2", "channel=2,filter=2", "channel=4"]


def _time_steps(step, steps: int) -> float:
    step()  # warm-up (shape handshakes, allocator)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def _ours(model, strategy, x, y, bn_stats, grid):
    from hybridpar.runtime.engine import ChannelFilterEngine

    eng = ChannelFilterEngine(copy.deepcopy(model), strategy, bn_stats=bn_stats, grid=grid)
    opt = torch.optim.SGD(eng.parameters(), lr=0.01)
    xl, yl = eng.local_batch(x, y)

    def step():
        eng.train_step(xl, yl)
        opt.step()
        opt.zero_grad()
    return step


def _ddp(model, x, y):
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(copy.deepcopy(model))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    n = x.shape[0] // dist.get_world_size()
    xl, yl = x[dist.get_rank() * n:(dist.get_rank() + 1) * n], y[dist.get_rank() * n:(dist.get_rank() + 1) * n]

    def step():
        F.cross_entropy(net(xl), yl).backward()
        opt.step()
        opt.zero_grad()
    return step


def _collectives(trials: int, numel: int) -> dict[str, float]:
    """Median time ratio ours/raw for allreduce, allgather and reduce-scatter of `numel` floats."""
    from hybridpar.runtime.collectives import all_gather_dim, all_reduce_, reduce_scatter_dim
    from hybridpar.runtime.comm_log import CommLog
    from hybridpar.runtime.grid import Group

    world = dist.get_world_size()
    grp = Group(tuple(range(world)), dist.group.WORLD, dist.get_rank())
    log = CommLog()
    per = numel // world
    x = torch.randn(world * per)
    piece = torch.randn(per)
    outs = [torch.empty(per) for _ in range(world)]
    cases = {
        "allreduce": (lambda: all_reduce_(x.clone(), grp, log), lambda: dist.all_reduce(x.clone())),
        "allgather": (lambda: all_gather_dim(piece, 0, grp, [per] * world, log),
                      lambda: torch.cat((dist.all_gather(outs, piece), outs)[1])),
        "reduce_scatter": (lambda: reduce_scatter_dim(x, 0, grp, [per] * world, log),
                           lambda: dist.reduce_scatter(torch.empty(per), list(x.split(per)))),
    }
    ratios = {}
    for name, (ours, raw) in cases.items():
        r = []
        for _ in range(trials):
            r.append(_time_steps(ours, 5) / _time_steps(raw, 5))
        ratios[name] = statistics.median(r)
    return ratios


def run(args) -> dict:
    from hybridpar.graph.zoo.small import small_resnet
    from hybridpar.runtime.grid import build_grid

    torch.manual_seed(0)
    model = small_resnet(width=args.width)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, 3, args.hw, args.hw, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    world = dist.get_world_size()
    grids = {1: build_grid(world, 1)}
    for gs in (2, 4):
        if world % gs == 0:
            grids[gs] = build_grid(world // gs, gs, [(c, gs // c) for c in range(1, gs + 1) if gs % c == 0])
    from hybridpar.runtime.parallelize import as_layouts, grid_shape

    def grid_of(s):
        return grids[grid_shape(as_layouts(s, world))[1]]

    contenders = {"ddp": _ddp(model, x, y),
                  "ours sample (local BN)": _ours(model, f"sample={world}", x, y, "local", grids[1]),
                  "ours sample (global BN)": _ours(model, f"sample={world}", x, y, "global", grids[1])}
    for s in STRATEGIES:
        contenders[f"ours {s}"] = _ours(model, s, x, y, "global", grid_of(s))
    times = {k: [] for k in contenders}
    for _ in range(args.trials):
        for k, step in contenders.items():
            times[k].append(_time_steps(step, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"step_s": med, "collective_ratio": _collectives(args.trials, args.numel)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--hw", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--numel", type=int, default=1 << 18, help="floats per collective (1 MiB)")
    args = ap.parse_args()
    from hybridpar.runtime.launch import spawn

    res = spawn(run, args.nproc, args)
    st = res["step_s"]
    base = st["ours sample (local BN)"]
    print(f"small_resnet(width={args.width}) {args.hw}x{args.hw}, global batch {args.batch}, "
          f"{args.nproc} gloo ranks; median of {args.trials} interleaved trials x {args.steps} steps")
    print(f"{'contender':32s} {'step ms':>9s} {'vs DDP':>8s} {'vs ours sample':>15s}")
    for k, v in st.items():
        print(f"{k:32s} {v * 1e3:9.1f} {v / st['ddp']:8.2f} {v / base:15.2f}")
    print(f"framework overhead, ours / raw torch.distributed ({args.numel * 4 / 2**20:.1f} MiB):")
    for k, v in res["collective_ratio"].items():
        print(f"  {k:16s} {v:6.2f}")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:  # benchmarks/run_all.py collects this summary
        summary = {"sample_vs_ddp_step_ratio": st["ours sample (local BN)"] / st["ddp"],
                   "sample_global_bn_vs_ddp_step_ratio": st["ours sample (global BN)"] / st["ddp"],
                   **{f"{s}_vs_sample_step_ratio": st[f"ours {s}"] / base for s in STRATEGIES},
                   **{f"{k}_overhead_ratio": v for k, v in res["collective_ratio"].items()},
                   "step_s": st, "nproc": args.nproc}
        Path(out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
