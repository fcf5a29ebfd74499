"""What `hybridpar train`'s loop costs per step beyond plain PyTorch, measured side by side.

One gloo world per trial (`hybridpar.train.launch.spawn`, as `hybridpar train --nproc N` starts its
ranks) holds several contenders on the same model, steps interleaved, each step timed between barriers,
the order rotated every round so none is always first:
- `train`: the loop body of `hybridpar train` itself (`hybridpar.train.trainer._RankRun.step` with its
  data feed, checks, StepInfo and the progress queue to the launching process),
- `train, guard off`: the same with the finiteness checks switched off (the loss/gradient check and
  the state check after the update: `hybridpar.train.guard`),
- `ddp` (sample-only strategies): a plain PyTorch loop, DistributedDataParallel, SGD with the same
  learning rate and momentum, cross-entropy, each step indexing its rank's rows of the same in-memory
  data set (no DataLoader: the cheapest way a plain loop reads its data).
Trials are fresh worlds; printed: median step times, and ratios as the median over all rounds of all
trials of the two contenders' steps in the same round (paired: drifting load hits both alike).
`STRATEGY/local`: batch-norm statistics per rank (`--bn-stats local`, DDP's semantics); without it the
default global statistics (one process's semantics: one small allreduce per batch norm in forward and
in backward, which DDP, without SyncBatchNorm on CPU,
does not do). Only ratios mean anything on a shared machine (the load average is printed beside).

    .venv/bin/python benchmarks/bench_train_overhead.py [--quick] [--strategy sample=2 --strategy channel=2]
        [--model small_cnn] [--input-shape C,H,W] [--batch 32] [--steps 30] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


# --- inside the gloo world ---------------------------------------------------------------------------
def _barrier_timed(fn) -> tuple[float, float]:
    """(wall s, this process's CPU s) of one step between barriers."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1 = time.process_time()  # before the barrier: a rank waiting in it may spin
    dist.barrier()
    return time.perf_counter() - t0, c1 - c0


class _Off:
    """A StateGuard that checks nothing (`train, guard off`)."""

    def __init__(self, guard):
        self.guard = guard

    def loss_exploded(self, loss):
        return None

    def before_update(self, loss):
        return None

    def submit(self, pending, step, loss):
        self.judged = step

    bad = None
    judged = -1

    def settle(self):
        return None


def _ours(cfg, queue, guard: bool):
    from hybridpar.train import trainer

    run = trainer._RankRun(cfg, queue)
    if not guard:
        run.guard = _Off(run.guard)
        run.engine.rider = None  # for_run gave the engine the buffers' check to send with the loss
    feed = iter(run.feed())

    def step():
        s, x, y = next(feed)
        if not run.step(s, x, y):
            raise RuntimeError(f"step {s} stopped: {run.error}")
    step.run = run  # type: ignore[attr-defined]
    return step


def _ddp(cfg, ds):
    """A plain loop: DDP, SGD, cross-entropy; each step indexes its rank's rows of the same in-memory
    data set in the same order (the cheapest a plain loop reads its data: no DataLoader, no collate)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hybridpar.train.data.loader import batch_indices
    from hybridpar.train.trainer import build_module

    net = DDP(build_module(cfg).module)
    opt = torch.optim.SGD(net.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    n, r = cfg.batch // dist.get_world_size(), dist.get_rank()
    it = iter(range(10**9))

    def step():
        idx = batch_indices(len(ds), cfg.batch, next(it), shuffle=cfg.data.shuffle, seed=cfg.seed)
        x, y = ds.take(idx[r * n:(r + 1) * n])
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def world_trial(cfg, queue, steps: int, with_ddp: bool) -> dict:
    contenders = {"train": _ours(cfg, queue, True), "train, guard off": _ours(cfg, queue, False)}
    if with_ddp:
        contenders["ddp"] = _ddp(cfg, contenders["train"].run.ds)
    names = list(contenders)
    for _ in range(2):  # warm-up (allocator, one-time exchanges, first optimizer state)
        for k in names:
            contenders[k]()
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(steps):
        for k in names[i % len(names):] + names[:i % len(names)]:  # rotated: none always first
            wall, cpu = _barrier_timed(contenders[k])
            times[k].append(wall)
            times.setdefault(f"{k} cpu", []).append(cpu)
    return times  # per contender, one time per round (the rounds pair the contenders' steps)


# --- the launching process ---------------------------------------------------------------------------
def trial(strategy: str, args) -> dict:
    from hybridpar.train import launch
    from hybridpar.train.config import run_config

    steps = 2 * (args.steps + 2) + 2  # more than a contender runs: no timed step is the run's last (it settles)
    strategy, _, bn = strategy.partition("/")
    shape = {"input_shape": tuple(int(v) for v in args.input_shape.split(","))} if args.input_shape else {}
    setup = run_config(model=args.model, strategy=strategy, batch=args.batch, steps=steps, lr=args.lr,
                       bn_stats=bn or "global", **shape)
    queue = launch.context().Queue()

    def drain():  # what `hybridpar train`'s launcher does with the progress queue
        while not queue.empty():
            queue.get()
    with_ddp = all(k == "sample" or v == 1 for k, v in _parts(strategy).items())
    return launch.spawn(world_trial, setup.world_size, setup.config, queue, args.steps, with_ddp, poll=drain)


def _parts(strategy: str) -> dict[str, int]:
    return {k: int(v) for k, v in (p.split("=") for p in strategy.split(","))}


def _paired(runs: list[dict], a: str, b: str) -> float:
    """Median over every round of every trial of a's step over b's step in the same round."""
    return statistics.median(x / y for r in runs for x, y in zip(r[a], r[b]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", action="append", default=[], help="repeatable; STRATEGY/local: --bn-stats local "
                    "(default sample=2/local, sample=2, channel=2)")
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--input-shape", default=None, help="C,H,W for a model file's factory (e.g. "
                    "benchmarks/_fsdp_bench_models.py:wide_cnn --input-shape 3,8,8 --batch 8)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 trials of 8 steps (a smoke run, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.trials, args.steps = 2, 8
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    strategies = args.strategy or ["sample=2/local", "sample=2", "channel=2"]
    rows = {}
    for s in strategies:
        runs = []
        for t in range(args.trials):
            print(f"{s}: trial {t + 1}/{args.trials} ...", file=sys.stderr, flush=True)
            runs.append(trial(s, args))
        row = {k: statistics.median(t for r in runs for t in r[k]) for k in runs[0]}
        row["guard_overhead"] = _paired(runs, "train", "train, guard off") - 1
        row["guard_overhead_cpu"] = _paired(runs, "train cpu", "train, guard off cpu") - 1
        if "ddp" in runs[0]:
            row["train_vs_ddp"] = _paired(runs, "train", "ddp")
            row["guard_off_vs_ddp"] = _paired(runs, "train, guard off", "ddp")
            row["train_vs_ddp_cpu"] = _paired(runs, "train cpu", "ddp cpu")
        rows[s] = row
    load = os.getloadavg()[0]
    print(f"{args.model}, global batch {args.batch}; medians of {args.trials} trials x {args.steps} interleaved "
          f"steps (order rotated); load average {load:.1f}")
    print(f"{'strategy':16s} {'train ms':>9s} {'guard off':>10s} {'DDP ms':>7s} {'guard cost':>11s} "
          f"{'(CPU time)':>10s} {'train/DDP':>10s} {'(CPU time)':>10s} {'guard off/DDP':>14s}")

    def cell(r, key, fmt, width):
        return format(r[key], fmt) if key in r else f"{'-':>{width}s}"
    for s, r in rows.items():
        print(f"{s:16s} {r['train'] * 1e3:9.2f} {r['train, guard off'] * 1e3:10.2f} "
              f"{cell({k: v * 1e3 for k, v in r.items() if k == 'ddp'}, 'ddp', '7.2f', 7)} "
              f"{r['guard_overhead'] * 100:10.2f}% {r['guard_overhead_cpu'] * 100:9.2f}% "
              f"{cell(r, 'train_vs_ddp', '10.3f', 10)} {cell(r, 'train_vs_ddp_cpu', '10.3f', 10)} "
              f"{cell(r, 'guard_off_vs_ddp', '14.3f', 14)}")
    print("guard cost: train over `train, guard off` - 1; ratios: medians of same-round pairs; CPU time: "
          "rank 0's process time in its step (not the waiting in collectives)")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:  # benchmarks/run_all.py collects this summary
        Path(out).write_text(json.dumps({"model": args.model, "batch": args.batch, "load_average": load,
                                         "strategies": rows}, indent=2))


if __name__ == "__main__":
    main()
