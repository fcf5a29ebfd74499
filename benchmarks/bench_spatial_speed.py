"""Spatial parallelism where sample parallelism cannot split: one large image (batch 1), `height=2` on
2 ranks against one process, side by side in one gloo world (issue 30's speed criterion).

Contenders, each a training step (forward, per-pixel cross-entropy, backward, SGD) timed between
barriers, steps interleaved and the order rotated every round so none is always first:
- `height=2`: the model as `hybridpar.parallelize(model, "height=2")` runs it in a user's loop, both
  ranks (one intra-op thread each);
- `one process`: rank 0 trains an unsplit copy with one intra-op thread, rank 1 idle (the like-for-like
  row: the same threads per process);
- `one process, 2 threads`: the same with `torch.set_num_threads(2)`: one process given both cores.
Printed: median step times and the paired ratios (median over rounds of the two contenders' steps in
the same round: drifting load hits both alike), the load average beside, and `hybridpar plan
--strategy height=2 --json`'s predicted step for the same model, batch and machine. Only ratios mean
anything on a shared machine.

    .venv/bin/python benchmarks/bench_spatial_speed.py [--quick] [--model unet] [--input-shape 3,512,512]
        [--steps 6] [--trials 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from _timing import barrier_timed  # benchmarks/ is sys.path[0] when run as a script


def world_trial(model: str, shape: tuple[int, ...], steps: int) -> dict[str, list[float]]:
    """Inside the 2-rank world: every contender's step times, one per round."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import hybridpar
    from hybridpar.graph.models import load_model

    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(1, *shape)
    whole = load_model(model, batch=1, input_shape=shape).module
    with torch.no_grad():
        y = torch.randint(0, 2, (1, *whole(x).shape[2:]))
    split = load_model(model, batch=1, input_shape=shape).module
    split.load_state_dict(whole.state_dict())
    hybridpar.parallelize(split, "height=2")

    def stepper(net, threads: int | None, ranks: set[int]):
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def step():
            if rank not in ranks:
                return
            before = torch.get_num_threads()
            if threads:
                torch.set_num_threads(threads)
            try:
                F.cross_entropy(net(x), y).backward()
                opt.step()
                opt.zero_grad()
            finally:
                torch.set_num_threads(before)
        return step

    contenders = {"height=2": stepper(split, None, {0, 1}), "one process": stepper(whole, 1, {0}),
                  "one process, 2 threads": stepper(whole, 2, {0})}
    names = list(contenders)
    for k in names:  # warm-up: allocator, DTensor's caches, the optimizer's first step
        barrier_timed(contenders[k])
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(steps):
        for k in names[i % len(names):] + names[:i % len(names)]:
            times[k].append(barrier_timed(contenders[k]))
    return times


def _predicted(model: str, shape: tuple[int, ...]) -> float | None:
    """`hybridpar plan --strategy height=2 --json`'s step on this machine (localhost), in seconds."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "hybridpar.cli.main", "plan", "--model", model, "--input-shape",
                          ",".join(map(str, shape)), "--batch", "1", "--gpus", "2", "--cluster", "localhost",
                          "--strategy", "height=2", "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"plan failed: {out.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout)["predicted"]["step_time_s"]


def _paired(runs: list[dict], a: str, b: str) -> float:
    return statistics.median(p / q for r in runs for p, q in zip(r[a], r[b]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="unet")
    ap.add_argument("--input-shape", default="3,512,512")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3x128x128, 1 trial of 3 steps (a smoke run, not a figure)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.input_shape, args.steps, args.trials = "3,128,128", 3, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = tuple(int(v) for v in args.input_shape.split(","))
    from hybridpar.train.launch import spawn

    runs = []
    for t in range(args.trials):
        print(f"trial {t + 1}/{args.trials} ...", file=sys.stderr, flush=True)
        runs.append(spawn(world_trial, 2, args.model, shape, args.steps))
    load = os.getloadavg()[0]
    med = {k: statistics.median(v for r in runs for v in r[k]) for k in runs[0]}
    ratios = {"height=2 / one process": _paired(runs, "height=2", "one process"),
              "height=2 / one process, 2 threads": _paired(runs, "height=2", "one process, 2 threads")}
    predicted = _predicted(args.model, shape)
    print(f"{args.model} {args.input_shape}, batch 1, 2 ranks; medians of {args.trials} trials x {args.steps} "
          f"interleaved steps (order rotated); load average {load:.1f}")
    for k, v in med.items():
        print(f"  {k:24s} {v * 1e3:9.1f} ms")
    for k, v in ratios.items():
        print(f"  {k:36s} {v:6.3f}")
    if predicted is not None:
        print(f"  plan --strategy height=2 predicts {predicted * 1e3:.1f} ms "
              f"({(predicted / med['height=2'] - 1) * 100:+.1f}% against the measured step)")
    summary = json.dumps({"model": args.model, "input_shape": list(shape), "load": load, "median_s": med,
                          "ratios": ratios, "predicted_s": predicted}, indent=1)
    for out in (args.json, os.environ.get("HYBRIDPAR_BENCH_OUT")):  # `make bench` (run_all.py) reads the latter
        if out:
            Path(out).write_text(summary)


if __name__ == "__main__":
    main()
