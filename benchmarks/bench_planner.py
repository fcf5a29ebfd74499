"""Planner speed: a full ResNet-50 per-layer plan on `lassen` at 16 … 1,024 GPUs (target: < 5 s at 1,024),
and `make run` (`hybridpar plan --model resnet50 --cluster dgx1-v100 --gpus 16 --batch 512`) end to end.

Each plan runs in a fresh process, as a user would run it (the traced graph comes from the on-disk cache,
filled by one warm-up call), so the time includes loading the cluster and every collective's cost.
Also reported: the share of the time spent in the exact optimiser itself, and the plan time relative to
evaluating pure data parallelism alone (`--strategy`), measured side by side.

    python benchmarks/bench_planner.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent / "hybridpar"
GPUS = (16, 64, 256, 1024)


def timed(args: list[str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN), *args, "--json"], capture_output=True, text=True, timeout=600, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"hybridpar {' '.join(args)}: {proc.stderr.strip()[-300:]}")
    return wall, json.loads(proc.stdout)


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    timed(["plan", "--model", "resnet50", "--cluster", "lassen", "--gpus", "4", "--batch", "32"])  # fill cache
    rows = []
    for g in GPUS:
        base = ["plan", "--model", "resnet50", "--cluster", "lassen", "--gpus", str(g), "--batch", str(max(512, g))]
        wall, out = timed(base)
        dp_wall, _ = timed([*base, "--strategy", f"sample={g}"])
        rows.append({"gpus": g, "plan_wall_s": wall, "in_process_s": out["solve_s"], "dp_only_wall_s": dp_wall,
                     "plan_vs_dp_eval_ratio": wall / dp_wall, "method": out["method"],
                     "speedup_vs_dp": out["speedup_vs_dp"]})
        print(f"resnet50 @ {g:5d} GPUs: plan {wall:5.2f} s (planner {out['solve_s']:.2f} s in process), "
              f"DP evaluation alone {dp_wall:5.2f} s, ratio {wall / dp_wall:.2f}; {out['method']}")
    make_run, _ = timed(["plan", "--model", "resnet50", "--cluster", "dgx1-v100", "--gpus", "16", "--batch", "512"])
    at_1024 = next(r for r in rows if r["gpus"] == 1024)
    print(f"make run (dgx1-v100, 16 GPUs, batch 512): {make_run:.2f} s")
    print(f"resnet50 at 1,024 GPUs: {at_1024['plan_wall_s']:.2f} s end to end (target < 5 s): "
          f"{'met' if at_1024['plan_wall_s'] < 5 else 'MISSED'}")
    summary = {"rows": rows, "make_run_s": make_run, "plan_1024_gpus_s": at_1024["plan_wall_s"],
               "target_s": 5.0, "met": at_1024["plan_wall_s"] < 5.0}
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
