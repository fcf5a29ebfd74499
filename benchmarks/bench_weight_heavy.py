"""Weight-heavy CNN: the planner's layout against PyTorch DDP on 2 ranks, measured side by side, and
the ratio the planner predicted for the two.

The model (`weight_heavy`, here): four 512-channel 3x3 convolutions on 8x8 inputs, global batch 4.
Its weights (9.4 M parameters, 38 MB of gradients per step) dwarf its activations, so splitting the
filters (no gradient allreduce, two small activation collectives per layer) should beat data
parallelism (the whole gradient allreduced every step). Steps:

1. `hybridpar profile` calibrates `localhost` for this model (ops at 1 and 1/2 of each dimension,
   gloo collectives on 2 ranks) into a private calibration file (skip: `--calibration FILE`).
2. `hybridpar plan --cluster localhost --gpus 2 --batch 4` with it: the chosen layout and the
   predicted step times of it and of data parallelism (the planner's DP baseline).
3. One gloo world of 2 ranks holds DDP and our engine running the plan; steps interleaved (DDP's,
   then ours), each timed between barriers; `--trials` fresh worlds; medians.

Prints measured ms per step, the measured ratio DDP / ours, the predicted ratio, and the prediction's
error on the ratio. Only ratios mean anything on a shared machine (`uptime` is printed beside).

    .venv/bin/python benchmarks/bench_weight_heavy.py [--steps 6] [--trials 3] [--calibration FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch import nn

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
BATCH, SHAPE, RANKS = 4, (512, 8, 8), 2


def weight_heavy() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Conv2d(512, 512, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))


def _cli(args: list[str], env: dict) -> str:
    out = subprocess.run([str(ROOT / ".venv/bin/hybridpar"), *args], capture_output=True, text=True, env=env,
                         timeout=1800)
    if out.returncode:
        raise SystemExit(f"hybridpar {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


# --- inside the gloo world ------------------------------------------------------------------------
def world_trial(plan_path: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hybridpar.plans import load_plan
    from hybridpar.train.engine import ChannelFilterEngine

    torch.manual_seed(0)
    model = weight_heavy()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, *SHAPE, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    eng = ChannelFilterEngine(copy.deepcopy(model), load_plan(plan_path))
    opt = torch.optim.SGD(eng.parameters(), lr=0.01)
    xl, yl = eng.local_batch(x, y)
    net = DDP(copy.deepcopy(model))
    dopt = torch.optim.SGD(net.parameters(), lr=0.01)
    n, r = BATCH // dist.get_world_size(), dist.get_rank()

    def ours():
        eng.train_step(xl, yl)
        opt.step()
        opt.zero_grad()

    def ddp():
        F.cross_entropy(net(x[r * n:(r + 1) * n]), y[r * n:(r + 1) * n]).backward()
        dopt.step()
        dopt.zero_grad()

    contenders = {"ddp": ddp, "ours": ours}
    for step in contenders.values():
        step()  # warm-up
    times = {k: [] for k in contenders}
    for _ in range(steps):
        for k, step in contenders.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--calibration", default=None, help="reuse this calibration file (no profiling)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="hybridpar-weight-heavy-"))
    cal = Path(args.calibration) if args.calibration else tmp / "calibration.json"
    env = {**os.environ, "HYBRIDPAR_CALIBRATION": str(cal), "OMP_NUM_THREADS": "1"}
    model = f"{HERE}:weight_heavy"
    shape = ",".join(map(str, SHAPE))
    load = [os.getloadavg()[0]]
    if not args.calibration:
        print("profiling localhost ...", file=sys.stderr, flush=True)
        _cli(["profile", "--out", str(cal), "--model", model, "--batch", str(BATCH), "--input-shape", shape,
              "--ranks", str(RANKS), "--splits", "1,2", "--no-merge"], env)
    plan_path = tmp / "plan.json"
    res = json.loads(_cli(["plan", "--model", model, "--input-shape", shape, "--cluster", "localhost", "--gpus",
                           str(RANKS), "--batch", str(BATCH), "--out", str(plan_path), "--json"], env))
    layouts = sorted({p["layout"] for p in res["parameters"]})
    pred_ours, pred_ddp = res["predicted"]["step_time_s"], res["data_parallel"]["step_time_s"]
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.update(env)
    from hybridpar.train.launch import spawn

    trials = []
    for t in range(args.trials):
        print(f"trial {t + 1}/{args.trials} ...", file=sys.stderr, flush=True)
        trials.append(spawn(world_trial, RANKS, str(plan_path), args.steps))
        load.append(os.getloadavg()[0])
    ours = statistics.median(r["ours"] for r in trials)
    ddp = statistics.median(r["ddp"] for r in trials)
    measured = statistics.median(r["ddp"] / r["ours"] for r in trials)
    predicted = pred_ddp / pred_ours
    summary = {"layouts": layouts, "method": res["method"], "step_s": ours, "ddp_step_s": ddp,
               "measured_speedup": measured, "predicted_speedup": predicted,
               "ratio_error": predicted / measured - 1, "predicted_step_s": pred_ours,
               "predicted_ddp_step_s": pred_ddp, "load": load, "wall_s": time.perf_counter() - t0}
    print(f"weight_heavy (4 x conv 512->512 3x3 on 8x8), batch {BATCH}, {RANKS} gloo ranks; medians of "
          f"{args.trials} worlds x {args.steps} steps interleaved with DDP; load {min(load):.1f}-{max(load):.1f}")
    print(f"planned layouts {', '.join(layouts)} ({res['method']})")
    print(f"{'':10s} {'measured ms':>12s} {'predicted ms':>13s}")
    print(f"{'ours':10s} {ours * 1e3:12.1f} {pred_ours * 1e3:13.1f}")
    print(f"{'DDP':10s} {ddp * 1e3:12.1f} {pred_ddp * 1e3:13.1f}")
    print(f"speedup over DDP: measured {measured:.2f}x, predicted {predicted:.2f}x "
          f"(prediction {summary['ratio_error']:+.0%} on the ratio)")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:  # benchmarks/run_all.py collects this summary
        Path(out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
