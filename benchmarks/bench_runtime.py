"""Runtime benchmark: step-time ratios measured side by side in one run on this machine.

Per strategy (sample=P, sample=2,channel=2, sample=2,filter=2, channel=2,filter=2, channel=4) on
small_resnet: our step against PyTorch DistributedDataParallel on the same model and data, and
against the runtime of an earlier commit (`--baseline REV`, default the last commit before the
global-semantics runtime), built in a git worktree and imported from there. Trials alternate
between the two runtimes (each trial is one gloo world measuring DDP and every strategy in turn),
so drifting load on a shared machine hits both alike; medians are reported. Only ratios mean
anything here, not absolute times.

    .venv/bin/python benchmarks/bench_runtime.py [--nproc 4] [--trials 3] [--steps 4] [--baseline 767c6c5]
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

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "767c6c5"  # main before the DTensor global-semantics runtime
CF_STRATEGIES = ["sample=2,channel=2", "sample=2,filter=2", "channel=2,filter=2", "channel=4"]


# --- inside a gloo world (works with the current runtime and the baseline's: same engine API) ---
def _time_steps(step, steps: int) -> float:
    import torch.distributed as dist

    step()  # warm-up (allocator, one-time exchanges)
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

    from hybridpar.runtime.engine import ChannelFilterEngine

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
    import torch.distributed as dist

    from hybridpar.graph.zoo.small import small_resnet

    torch.manual_seed(0)
    model = small_resnet(width=args.width)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.hw, args.hw, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    world = dist.get_world_size()
    contenders = {"ddp": _ddp(model, x, y),
                  f"sample={world} (local BN)": _ours(model, f"sample={world}", x, y, "local"),
                  f"sample={world}": _ours(model, f"sample={world}", x, y, "global")}
    for s in CF_STRATEGIES:
        contenders[s] = _ours(model, s, x, y, "global")
    return {k: _time_steps(step, args.steps) for k, step in contenders.items()}


def worker_main(args) -> None:
    from hybridpar.runtime.launch import spawn

    print("RESULT " + json.dumps(spawn(world_trial, args.nproc, args)), flush=True)


# --- the parent: alternate the two runtimes, report medians of ratios --------------------------
def _worktree(rev: str) -> Path:
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"hybridpar-bench-{rev}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path), rev],
                       check=True, capture_output=True)
    return path / "src"


def _trial(src: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--nproc", str(args.nproc), "--steps", str(args.steps),
           "--width", str(args.width), "--hw", str(args.hw), "--batch", str(args.batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"trial with {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--hw", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the runtime to compare with")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)

    base_src = _worktree(args.baseline)
    new, old = [], []
    for t in range(args.trials):
        print(f"trial {t + 1}/{args.trials} ...", file=sys.stderr, flush=True)
        new.append(_trial(ROOT / "src", args))
        old.append(_trial(base_src, args))
    names = list(new[0])
    med = {k: statistics.median(r[k] for r in new) for k in names}
    med_old = {k: statistics.median(r[k] for r in old) for k in names if k in old[0]}
    vs_ddp = {k: statistics.median(r[k] / r["ddp"] for r in new) for k in names}
    vs_old = {k: statistics.median(n[k] / o[k] for n, o in zip(new, old)) for k in names if k != "ddp"}
    print(f"small_resnet(width={args.width}) {args.hw}x{args.hw}, global batch {args.batch}, {args.nproc} gloo "
          f"ranks; median of {args.trials} alternating trials x {args.steps} steps; baseline {args.baseline}")
    print(f"{'layout':28s} {'step ms':>8s} {'baseline ms':>12s} {'vs DDP':>7s} {'vs baseline':>12s}")
    for k in names:
        print(f"{k:28s} {med[k] * 1e3:8.1f} {med_old.get(k, float('nan')) * 1e3:12.1f} {vs_ddp[k]:7.2f} "
              f"{vs_old.get(k, 1.0):12.2f}")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:  # benchmarks/run_all.py collects this summary
        Path(out).write_text(json.dumps({"step_s": med, "baseline_step_s": med_old, "vs_ddp": vs_ddp,
                                         "vs_baseline": vs_old, "baseline": args.baseline,
                                         "nproc": args.nproc}, indent=2))


if __name__ == "__main__":
    main()
