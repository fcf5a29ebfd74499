"""DLPlacer benchmark: predicted per-step MP speedups over one device, optimality gaps and solve times.

Side by side in one run, Inception-V3 (64 coarse nodes) on 2 and 4 GPUs of dgx1-v100 with the
current placer and with the placer of an earlier commit (`--baseline REV`, default the commit before
the decomposition, in a git worktree), each in a fresh process with the same time limit (default 60 s;
the acceptance: proven optimal or a gap <= 5% within 60 s on this machine). The current placer is run
twice per case to show that a fixed seed and worker count give the same placement.

Then GNMT and BigLSTM (4 time chunks, and without: --time-chunks 0) on 2 and 4 GPUs, and the effect
of coarsening: inception_mini's proven optimum at several coarse-graph sizes (a coarser graph only
restricts the placements, so its optimum can only be higher), and Inception-V3 at 32/48/64 nodes with
the projection's 5 s and the full time limit. Batch 32 per MP group, fp32. All step times are the cost
model's predictions (roofline on V100 figures), not measurements; solve times are wall-clock here.

    python benchmarks/bench_placer.py [--time-limit 60] [--seed 0] [--workers 2] [--quick] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _baseline import worktree_src  # benchmarks/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "a0d4b3f"  # the commit before the decomposition and the deterministic time limits


def worker(model: str, devices: int, time_limit: float, seed: int, workers: int, chunks: int | None,
           coarsen: int | None) -> dict:
    """One placement in this process (whichever hybridpar is on the path)."""
    import inspect

    from hybridpar.search.placer.api import place_model

    kw = {"time_limit_s": time_limit, "workers": workers, "time_chunks": chunks, "coarsen": coarsen}
    if "seed" in inspect.signature(place_model).parameters:  # older placers have no seed
        kw["seed"] = seed
    t0 = time.perf_counter()
    out = place_model(model, "dgx1-v100", devices, **kw)
    wall = time.perf_counter() - t0
    s = out.summary()
    best = max((out.single_step_s / v for v in out.baselines.values()), default=float("nan"))
    return {**{k: s[k] for k in ("model", "devices", "nodes", "fine_nodes", "step_time_s", "single_device_step_s",
                                 "single_device_fits", "speedup", "gap", "solve_time_s", "status")},
            "time_chunks": dict(out.graph.meta).get("time_chunks", 0), "best_baseline_speedup": best,
            "wall_s_with_trace": wall, "assignment": list(out.result.assignment), "seed": seed, "workers": workers,
            "time_limit_s": time_limit}


def run(src: Path, model: str, devices: int, args, chunks: int | None = None, coarsen: int | None = None,
        time_limit: float | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", json.dumps([model, devices, time_limit or args.time_limit, args.seed,
                                                            args.workers, chunks, coarsen])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=1800, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{model} on {devices} ({src}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def _row(label: str, r: dict) -> str:
    gap = "-" if r["gap"] is None else f"{r['gap']:.2%}"
    fits = "" if r["single_device_fits"] else "  (model does not fit on one GPU)"
    return (f"{label:22} {r['devices']:>4} {r['nodes']:>5} {r['step_time_s'] * 1e3:9.2f} "
            f"{r['single_device_step_s'] * 1e3:9.2f} {r['speedup']:8.3f} {r['best_baseline_speedup']:10.3f} "
            f"{gap:>7} {r['solve_time_s']:8.1f}  {r['status']}{fits}")


HEADER = (f"{'model':22} {'GPUs':>4} {'nodes':>5} {'step ms':>9} {'1-GPU ms':>9} {'speedup':>8} "
          f"{'best base':>10} {'gap':>7} {'solve s':>8}  status")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the placer to compare with")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--quick", action="store_true", help="Inception-V3 side by side only")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        model, devices, tl, seed, workers, chunks, coarsen = json.loads(args.worker)
        print("RESULT " + json.dumps(worker(model, devices, tl, seed, workers, chunks, coarsen)), flush=True)
        return 0
    here = ROOT / "src"
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; time limit {args.time_limit:g} s, "
          f"seed {args.seed}, {args.workers} workers")
    print(HEADER)
    side: dict = {}
    for devices in (2, 4):
        now = [run(here, "inception_v3", devices, args) for _ in range(2)]
        side[devices] = {"after": now[0], "deterministic": now[0]["assignment"] == now[1]["assignment"]
                         and now[0]["step_time_s"] == now[1]["step_time_s"]}
        print(_row("inception_v3", now[0]) + f"   (again: same placement: {side[devices]['deterministic']})",
              flush=True)
        if not args.no_baseline:
            old = run(worktree_src(args.baseline), "inception_v3", devices, args)
            side[devices]["before"] = old
            print(_row(f"  before ({args.baseline})", old), flush=True)
    rows = []
    if not args.quick:
        for model in ("gnmt", "biglstm"):
            for chunks in (None, 0):
                for devices in (2, 4):
                    r = run(here, model, devices, args, chunks=chunks)
                    rows.append(r)
                    print(_row(model if chunks is None else f"{model} K=0", r), flush=True)
    study = [] if args.quick else coarsening_study(here, args)
    result: dict = {"time_limit_s": args.time_limit, "seed": args.seed, "workers": args.workers,
                    "baseline": None if args.no_baseline else args.baseline, "inception_v3": side,
                    "placements": rows, "coarsening": study}
    for devices, s in side.items():
        result[f"inception_v3_{devices}gpu_speedup"] = s["after"]["speedup"]
        result[f"inception_v3_{devices}gpu_gap"] = s["after"]["gap"]
        if "before" in s:
            result[f"inception_v3_{devices}gpu_speedup_before"] = s["before"]["speedup"]
            result[f"inception_v3_{devices}gpu_gap_before"] = s["before"]["gap"]
    for r in rows:
        suffix = "" if r["time_chunks"] else "_no_time_chunks"
        result[f"{r['model']}_{r['devices']}gpu_speedup{suffix}"] = r["speedup"]
    if os.environ.get("HYBRIDPAR_BENCH_OUT"):
        with open(os.environ["HYBRIDPAR_BENCH_OUT"], "w") as f:
            json.dump(result, f, indent=2)
    return 0


def coarsening_study(src: Path, args) -> list[dict]:
    print("\ncoarsening: ILP step vs coarse-graph size and time limit")
    print(f"{'model':14} {'GPUs':>4} {'nodes':>5} {'limit s':>7} {'step ms':>9} {'speedup':>8} {'gap':>7} "
          f"{'solve s':>8}  status")
    out = []
    cases = [("inception_mini", 2, n, args.time_limit) for n in (20, 16, 12, 8)]
    cases += [("inception_v3", d, n, tl) for d in (2, 4) for n in (32, 48, 64) for tl in (5.0, args.time_limit)]
    for model, devices, n, tl in cases:
        r = run(src, model, devices, args, coarsen=n, time_limit=tl)
        gap = "-" if r["gap"] is None else f"{r['gap']:.2%}"
        print(f"{model:14} {devices:>4} {r['nodes']:>5} {tl:7.0f} {r['step_time_s'] * 1e3:9.3f} {r['speedup']:8.3f} "
              f"{gap:>7} {r['solve_time_s']:8.1f}  {r['status']}", flush=True)
        out.append({"model": model, "devices": devices, "max_nodes": n, "nodes": r["nodes"], "time_limit_s": tl,
                    "step_time_s": r["step_time_s"], "speedup": r["speedup"], "gap": r["gap"], "status": r["status"],
                    "solve_time_s": r["solve_time_s"]})
    return out


if __name__ == "__main__":
    sys.exit(main())
