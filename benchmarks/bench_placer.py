"""DLPlacer benchmark: predicted per-step MP speedups over one device and solve times.

For Inception-V3, GNMT and BigLSTM on 2 and 4 GPUs of dgx1-v100 (batch 32 per MP group, fp32):
ILP step, one-device step, speedup, optimality gap, solve time, and the best baseline's speedup;
GNMT and BigLSTM also without time chunks (--time-chunks 0: each LSTM layer one node, no wavefront).
Then the effect of coarsening: inception_mini's proven optimum at several coarse-graph sizes (a
coarser graph only restricts the placements, so its optimum can only be higher), and Inception-V3 on
2 and 4 GPUs at 32/48/64 nodes with the projection's 5 s and the CLI's 30 s time limits (how the
default coarsening was chosen). All times are the cost model's predictions (roofline on V100 figures), not measurements;
the solve times are wall-clock on this machine.

    python benchmarks/bench_placer.py [--time-limit 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hybridpar.search.placer import place_model
from hybridpar.search.placer.api import DEFAULT_COARSEN


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="Inception-V3 only, no coarsening study")
    args = ap.parse_args(argv)
    models = ["inception_v3"] if args.quick else ["inception_v3", "gnmt", "biglstm"]
    rows = []
    print(f"{'model':14} {'GPUs':>4} {'nodes':>5} {'step ms':>9} {'1-GPU ms':>9} {'speedup':>8} "
          f"{'best base':>10} {'gap':>7} {'solve s':>8}  status")
    runs = [(m, d, None) for m in models for d in (2, 4)]
    runs += [] if args.quick else [(m, d, 0) for m in ("gnmt", "biglstm") for d in (2, 4)]
    for model, devices, chunks in runs:
        t0 = time.perf_counter()
        out = place_model(model, "dgx1-v100", devices, time_limit_s=args.time_limit, time_chunks=chunks)
        wall = time.perf_counter() - t0
        s = out.summary()
        best = max((out.single_step_s / v for v in out.baselines.values()), default=float("nan"))
        rows.append({**{k: s[k] for k in ("model", "devices", "nodes", "fine_nodes", "step_time_s",
                                          "single_device_step_s", "single_device_fits", "speedup",
                                          "gap", "solve_time_s", "status", "memory_bytes")},
                     "time_chunks": dict(out.graph.meta).get("time_chunks", 0),
                     "best_baseline_speedup": best, "wall_s_with_trace": wall})
        gap = "-" if s["gap"] is None else f"{s['gap']:.2%}"
        fits = "" if s["single_device_fits"] else "  (model does not fit on one GPU)"
        label = model if chunks is None else f"{model} K=0"
        print(f"{label:14} {devices:>4} {s['nodes']:>5} {s['step_time_s'] * 1e3:9.2f} "
              f"{s['single_device_step_s'] * 1e3:9.2f} {s['speedup']:8.3f} {best:10.3f} {gap:>7} "
              f"{s['solve_time_s']:8.1f}  {s['status']}{fits}", flush=True)
    study = [] if args.quick else coarsening_study(args.time_limit)
    result = {"default_coarsen": DEFAULT_COARSEN, "placements": rows, "coarsening": study}
    for r in rows:
        suffix = "" if r["time_chunks"] or r["model"] == "inception_v3" else "_no_time_chunks"
        result[f"{r['model']}_{r['devices']}gpu_speedup{suffix}"] = r["speedup"]
    if os.environ.get("HYBRIDPAR_BENCH_OUT"):
        with open(os.environ["HYBRIDPAR_BENCH_OUT"], "w") as f:
            json.dump(result, f, indent=2)
    return 0


def coarsening_study(time_limit_s: float) -> list[dict]:
    print("\ncoarsening: ILP step vs coarse-graph size and time limit")
    print(f"{'model':14} {'GPUs':>4} {'nodes':>5} {'limit s':>7} {'step ms':>9} {'speedup':>8} {'gap':>7} "
          f"{'solve s':>8}  status")
    out = []
    cases = [("inception_mini", 2, n, time_limit_s) for n in (20, 16, 12, 8)]
    cases += [("inception_v3", d, n, tl) for d in (2, 4) for n in (32, 48, 64) for tl in (5.0, time_limit_s)]
    for model, devices, n, tl in cases:
        o = place_model(model, "dgx1-v100", devices, coarsen=n, time_limit_s=tl)
        r = o.result
        gap = "-" if r.gap is None else f"{r.gap:.2%}"
        print(f"{model:14} {devices:>4} {len(o.graph):>5} {tl:7.0f} {r.step_time_s * 1e3:9.3f} {o.speedup:8.3f} "
              f"{gap:>7} {r.solve_time_s:8.1f}  {r.status}", flush=True)
        out.append({"model": model, "devices": devices, "max_nodes": n, "nodes": len(o.graph), "time_limit_s": tl,
                    "step_time_s": r.step_time_s, "speedup": o.speedup, "gap": r.gap, "status": r.status,
                    "solve_time_s": r.solve_time_s})
    return out


if __name__ == "__main__":
    sys.exit(main())
