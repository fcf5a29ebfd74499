"""Runtime benchmark: step-time ratios measured side by side in one run on this machine.

Per strategy (sample=P with local and with global batch-norm statistics, sample=2,channel=2,
sample=2,filter=2, channel=2,filter=2, channel=4) on small_resnet: our step against PyTorch
DistributedDataParallel on the same model and data, and against the runtime of an earlier commit
(`--baseline REV`, default the last commit before the global-semantics runtime), built in a git
worktree and imported from there. Each measurement is a fresh gloo world holding DDP and one layout,
steps interleaved between the two; trials alternate between the two runtimes, so drifting load on a
shared machine hits both alike; medians are reported. Only ratios mean anything, not absolute times.

    .venv/bin/python benchmarks/bench_runtime.py [--nproc 4] [--trials 3] [--steps 4] [--baseline 767c6c5]

`--nproc 2`: sample=2 (local and global statistics), channel=2 and filter=2, each rank on its own core.

`--collectives`: what one collective costs between compute on these ranks (20 convolutions, each
followed by nothing, by gloo's allreduce of 32 floats, or by hybridpar's one-round allreduce of them;
also 9 global batch-norm layers' worth: the runtime's cost floor for global statistics).
`--one-round-ab`: per layout, in one world, the engine with gloo's own collectives against the
runtime's one-round exchanges (hybridpar.parallel.comm.collectives._one_round switched off and on), steps
interleaved with DDP's; medians.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _baseline import worktree_src  # benchmarks/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "767c6c5"  # main before the DTensor global-semantics runtime
CF_STRATEGIES = ["sample=2,channel=2", "sample=2,filter=2", "channel=2,filter=2", "channel=4"]


def cf_strategies(nproc: int) -> list[str]:
    """The channel/filter layouts compared on `nproc` ranks (the 4-rank set is the issue's)."""
    return CF_STRATEGIES if nproc == 4 else [f"channel={nproc}", f"filter={nproc}"]


# --- inside a gloo world (works with the current runtime and the baseline's: same engine API) ---
def _time_steps(step, steps: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ours(model, strategy, x, y, bn_stats):
    import torch

    from hybridpar.train.engine import ChannelFilterEngine

    eng = ChannelFilterEngine(copy.deepcopy(model), strategy, bn_stats=bn_stats)
    if hasattr(eng, "warm_up"):
        eng.warm_up(tuple(x.shape[1:]))
    opt = torch.optim.SGD(eng.parameters(), lr=0.01)
    xl, yl = eng.local_batch(x, y)

    def step():
        eng.train_step(xl, yl)
        opt.step()
        opt.zero_grad()
    return step


def _ddp(model, x, y):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
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


def world_trial(args) -> dict:
    import torch

    from hybridpar.graph.zoo.small import small_resnet

    torch.manual_seed(0)
    model = small_resnet(width=args.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.hw, args.hw, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    layout, bn = args.layout.split("/") if "/" in args.layout else (args.layout, "global")
    contenders = {"ddp": _ddp(model, x, y), "ours": _ours(model, layout, x, y, bn)}
    for step in contenders.values():
        step()  # warm-up (allocator, one-time exchanges)
    times = {k: [] for k in contenders}
    for _ in range(args.steps):  # interleaved: DDP's step, then ours
        for k, step in contenders.items():
            times[k].append(_time_steps(step, 1))
    return {k: statistics.median(v) for k, v in times.items()}


def collectives_trial(args) -> dict:
    """ms per 20 conv steps: alone, each followed by gloo's allreduce, by hybridpar's all_reduce_."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hybridpar.parallel.comm.collectives import all_reduce_
    from hybridpar.parallel.comm.log import CommLog
    from hybridpar.parallel.mesh import Group

    torch.manual_seed(0)
    x, w = torch.randn(8, 16, 32, 32), torch.randn(16, 16, 3, 3)
    world = Group(tuple(range(dist.get_world_size())), dist.group.WORLD, dist.get_rank())
    buf, log = torch.zeros(32), CommLog()
    after = {"compute only": lambda: None, "gloo allreduce": lambda: dist.all_reduce(buf),
             "hybridpar all_reduce_": lambda: all_reduce_(buf, world, log)}

    def run(fn):
        for _ in range(20):
            F.conv2d(x, w, padding=1)
            fn()
    for fn in after.values():
        run(fn)
    times = {k: [] for k in after}
    for _ in range(args.steps * 3):  # interleaved
        for k, fn in after.items():
            dist.barrier()
            t0 = time.perf_counter()
            run(fn)
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def one_round_trial(args) -> dict:
    """Median ms per step of DDP and, per layout, our engine with and without one-round exchanges."""
    import torch

    import hybridpar.parallel.comm.collectives as coll
    from hybridpar.graph.zoo.small import small_resnet

    torch.manual_seed(0)
    model = small_resnet(width=args.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.hw, args.hw, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    one_round = coll._one_round

    def switched(step, on: bool):
        def run():
            coll._one_round = one_round if on else (lambda group: False)
            try:
                step()
            finally:
                coll._one_round = one_round
        return run

    contenders = {"ddp": _ddp(model, x, y)}
    for lay in args.layout.split(";"):
        layout, bn = lay.split("/") if "/" in lay else (lay, "global")
        contenders[f"{lay} gloo's"] = switched(_ours(model, layout, x, y, bn), False)
        contenders[f"{lay} one-round"] = switched(_ours(model, layout, x, y, bn), True)
    for step in contenders.values():
        step()
    times = {k: [] for k in contenders}
    for _ in range(args.steps):
        for k, step in contenders.items():
            times[k].append(_time_steps(step, 1))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def worker_main(args) -> None:
    from hybridpar.train.launch import spawn

    fn = collectives_trial if args.layout == "collectives" else \
        one_round_trial if ";" in args.layout else world_trial
    print("RESULT " + json.dumps(spawn(fn, args.nproc, args)), flush=True)


# --- the parent: alternate the two runtimes, report medians of ratios --------------------------
def _trial(src: Path, args, layout: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--nproc", str(args.nproc), "--steps", str(args.steps),
           "--width", str(args.width), "--hw", str(args.hw), "--batch", str(args.batch), "--layout", layout]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"trial with {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--hw", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the runtime to compare with")
    ap.add_argument("--only", action="append", default=[], metavar="LAYOUT",
                    help="measure only this layout (repeatable), e.g. --only channel=4 --only sample=4/local")
    ap.add_argument("--layout", default="sample=4", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--collectives", action="store_true",
                    help="only measure what one small collective costs between compute (see above)")
    ap.add_argument("--one-round-ab", action="store_true",
                    help="only compare gloo's collectives with the one-round exchanges, in one world")
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    if args.one_round_ab:
        lays = ";".join([f"sample={args.nproc}/local", f"sample={args.nproc}", *cf_strategies(args.nproc)])
        r = _trial(ROOT / "src", args, lays)
        print(f"{args.nproc} gloo ranks, ms per step (medians of {args.steps}, interleaved):")
        for k, v in r.items():
            print(f"  {k:36s} {v:7.1f}")
        return None
    if args.collectives:
        r = _trial(ROOT / "src", args, "collectives")
        print(f"{args.nproc} gloo ranks, ms per 20 convolutions (medians of {args.steps * 3}, interleaved):")
        for k, v in r.items():
            print(f"  {k:24s} {v:7.1f}   per collective {(v - r['compute only']) / 20:6.2f}")
        return None

    base_src = worktree_src(args.baseline)
    layouts = [f"sample={args.nproc}/local", f"sample={args.nproc}", *cf_strategies(args.nproc)]
    if args.only:
        unknown = sorted(set(args.only) - set(layouts))
        if unknown:
            raise SystemExit(f"unknown layout {unknown[0]!r}; choose from {', '.join(layouts)}")
        layouts = [lay for lay in layouts if lay in args.only]
    rows = {}
    for lay in layouts:
        new, old = [], []
        for t in range(args.trials):
            print(f"{lay}: trial {t + 1}/{args.trials} ...", file=sys.stderr, flush=True)
            new.append(_trial(ROOT / "src", args, lay))
            old.append(_trial(base_src, args, lay))
        name = lay.replace("/local", " (local BN)")
        rows[name] = {"step_s": statistics.median(r["ours"] for r in new),
                      "baseline_step_s": statistics.median(r["ours"] for r in old),
                      "ddp_step_s": statistics.median(r["ddp"] for r in new),
                      "vs_ddp": statistics.median(r["ours"] / r["ddp"] for r in new),
                      "baseline_vs_ddp": statistics.median(r["ours"] / r["ddp"] for r in old),
                      "vs_baseline": statistics.median(n["ours"] / o["ours"] for n, o in zip(new, old))}
    print(f"small_resnet(width={args.width}) {args.hw}x{args.hw}, global batch {args.batch}, {args.nproc} gloo "
          f"ranks; medians of {args.trials} alternating trials x {args.steps} steps interleaved with DDP; "
          f"baseline {args.baseline}")
    print(f"{'layout':28s} {'step ms':>8s} {'DDP ms':>7s} {'vs DDP':>7s} {'baseline vs DDP':>16s} {'vs baseline':>12s}")
    for k, r in rows.items():
        print(f"{k:28s} {r['step_s'] * 1e3:8.1f} {r['ddp_step_s'] * 1e3:7.1f} {r['vs_ddp']:7.2f} "
              f"{r['baseline_vs_ddp']:16.2f} {r['vs_baseline']:12.2f}")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:  # benchmarks/run_all.py collects this summary
        Path(out).write_text(json.dumps({"layouts": rows, "baseline": args.baseline, "nproc": args.nproc},
                                        indent=2))


if __name__ == "__main__":
    main()
