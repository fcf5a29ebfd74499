"""Planner speed, before and after side by side: `hybridpar plan` from the command line, as a user runs
it, for ResNet-50 on 1,024 Lassen GPUs (batch 4096; target: <= 1 s wall, search alone <= 0.3 s) and
for `make run` (8x-wide ResNet-50, 256 GPUs, batch 512), against the planner of an earlier commit
(`--baseline REV`, default 9acd161: the last commit before the second round of speed work) built in a
git worktree, or any other source tree (`--baseline-src PATH`), e.g. HEAD with the speed commits
reverted (8e301f7 d1ae83c 15f2683 359534b), which has the current cost model.

Each run is a fresh process (the traced graph comes from the on-disk cache, filled by one warm-up
call per tree). Runs alternate between the two trees; medians of `--trials` (default 5): wall time,
the process's CPU time (user + system: less sensitive than wall time to other jobs on the machine) and
the search alone (`solve_s`, timed inside the process). The results are compared byte for byte: the
whole `--json` output but its `solve_s` (every layer's layout and costs, the prediction, the data
parallel baseline, the gradient listing), the Plan JSON, and its per-layer decisions alone. A baseline
whose cost model differs can match in its decisions only: 6a56b6d (the first round's: the output
gathered whole since, linear features split as DTensor does, the global batch-norm allreduce), 9acd161
(the memory model's kept activations since, 656567b).
Also the ResNet-50 GPU scan (16 ... 1,024 GPUs) of the current tree, each plan against evaluating pure
data parallelism alone. Say the load (`uptime`) beside any figure taken from here.

    python benchmarks/bench_planner.py [--trials 5] [--baseline 9acd161 | --baseline-src DIR/src] [--no-scan]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _baseline import worktree_src  # benchmarks/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
# before the second round of speed work (issue 16, item 4: 6a56b6d was before the first)
BASELINE = "9acd161"
CASES = {
    "resnet50_1024": ["plan", "--model", "resnet50", "--cluster", "lassen", "--gpus", "1024", "--batch", "4096"],
    "make_run": ["plan", "--model", "resnet50_w8", "--cluster", "lassen", "--gpus", "256", "--batch", "512"],
}
GPUS = (16, 64, 256, 1024)
# --json compared once per tree (no timing): the other grad-sync modes, the free space, a fixed
# strategy, other clusters and models
CHECK_CASES = {
    "resnet50_16": ["plan", "--model", "resnet50", "--cluster", "lassen", "--gpus", "16", "--batch", "512"],
    "resnet50_64_flat": ["plan", "--model", "resnet50", "--cluster", "lassen", "--gpus", "64", "--batch", "512",
                         "--grad-sync", "flat"],
    "resnet50_64_overlap": ["plan", "--model", "resnet50", "--cluster", "dgx-a100", "--gpus", "64", "--batch", "512",
                            "--grad-sync", "overlap"],
    "resnet50_64_free": ["plan", "--model", "resnet50", "--cluster", "lassen", "--gpus", "64", "--batch", "512",
                         "--free-sample"],
    "resnet50_strategy": ["plan", "--model", "resnet50", "--cluster", "lassen", "--gpus", "64", "--batch", "512",
                          "--strategy", "sample=16,channel=2,filter=2"],
    "inception_v3_32": ["plan", "--model", "inception_v3", "--cluster", "dgx-a100", "--gpus", "32", "--batch", "256"],
    "vgg16_64": ["plan", "--model", "vgg16", "--cluster", "dgx-h100", "--gpus", "64", "--batch", "256"],
    "small_resnet_localhost": ["plan", "--model", "small_resnet", "--cluster", "localhost", "--gpus", "4",
                               "--batch", "16"],
}


def same_output(trees: dict[str, Path], tmp: Path) -> dict[str, bool]:
    """CHECK_CASES' --json output (but solve_s) of the two trees, byte for byte."""
    out = {}
    for case, args in CHECK_CASES.items():
        got = [json.dumps(timed(src, args, tmp / f"check-{name}.json")["json"], sort_keys=True)
               for name, src in trees.items()]
        out[case] = got[0] == got[1]
        print(f"  {case}: --json output identical: {out[case]}", flush=True)
    return out


def timed(src: Path, args: list[str], out: Path) -> dict:
    """One fresh `hybridpar` process on the tree `src`: wall, CPU, search time, the JSON and the plan."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "import sys; from hybridpar.cli.main import main; sys.exit(main())",
           *args, "--json", "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=600, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"hybridpar {' '.join(args)} ({src}): {proc.stderr.strip()[-400:]}")
    res = json.loads(proc.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    search = res.pop("solve_s")  # the one field that differs from run to run
    return {"wall_s": wall, "cpu_s": cpu, "search_s": search, "json": res, "plan": out.read_bytes()}


def _decisions(plan: bytes) -> str:
    p = json.loads(plan)
    return json.dumps({k: p.get(k) for k in ("layers", "default_layout", "world_size", "batch", "dp", "mp")},
                      sort_keys=True)


def side_by_side(trees: dict[str, Path], trials: int, tmp: Path) -> dict:
    out: dict = {}
    for case, args in CASES.items():
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for name, src in trees.items():  # warm-up: fills each tree's graph cache
            timed(src, args, tmp / f"{case}-{name}.json")
        for i in range(trials):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order:
                runs[name].append(timed(trees[name], args, tmp / f"{case}-{name}.json"))
        row: dict = {}
        for name, rs in runs.items():
            row[name] = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "search_s")}
            row[name]["wall_all_s"] = [round(r["wall_s"], 3) for r in rs]
        b, a = runs["before"][-1], runs["after"][-1]
        row["json_identical"] = json.dumps(b["json"], sort_keys=True) == json.dumps(a["json"], sort_keys=True)
        row["plan_identical"] = b["plan"] == a["plan"]
        row["decisions_identical"] = _decisions(b["plan"]) == _decisions(a["plan"])
        row["wall_speedup"] = row["before"]["wall_s"] / row["after"]["wall_s"]
        row["cpu_speedup"] = row["before"]["cpu_s"] / row["after"]["cpu_s"]
        row["search_speedup"] = row["before"]["search_s"] / row["after"]["search_s"]
        out[case] = row
        print(f"{case}: `hybridpar {' '.join(args)}`")
        for name in trees:
            r = row[name]
            print(f"  {name:6}  wall {r['wall_s']:6.3f} s  CPU {r['cpu_s']:6.3f} s  search {r['search_s']:6.3f} s"
                  f"   (walls {r['wall_all_s']})")
        print(f"  after/before: wall {row['wall_speedup']:.2f}x faster, CPU {row['cpu_speedup']:.2f}x, "
              f"search {row['search_speedup']:.2f}x; --json output identical: {row['json_identical']}, "
              f"plan identical: {row['plan_identical']}, "
              f"per-layer decisions identical: {row['decisions_identical']}", flush=True)
    return out


def scan(src: Path, tmp: Path) -> list[dict]:
    rows = []
    for g in GPUS:
        base = ["plan", "--model", "resnet50", "--cluster", "lassen", "--gpus", str(g), "--batch", str(max(512, g))]
        plan = timed(src, base, tmp / "scan.json")
        dp = timed(src, [*base, "--strategy", f"sample={g}"], tmp / "scan-dp.json")
        rows.append({"gpus": g, "plan_wall_s": plan["wall_s"], "search_s": plan["search_s"],
                     "dp_only_wall_s": dp["wall_s"], "plan_vs_dp_eval_ratio": plan["wall_s"] / dp["wall_s"],
                     "method": plan["json"]["method"], "speedup_vs_dp": plan["json"]["speedup_vs_dp"]})
        print(f"resnet50 @ {g:5d} GPUs: plan {plan['wall_s']:5.2f} s (search {plan['search_s']:.3f} s), "
              f"DP evaluation alone {dp['wall_s']:5.2f} s; {plan['json']['method']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the planner to compare with")
    ap.add_argument("--baseline-src", default=None, help="a source tree (its src/ folder) to compare with instead")
    ap.add_argument("--no-scan", action="store_true", help="skip the 16 ... 1,024 GPU scan")
    ap.add_argument("--no-check", action="store_true", help="skip comparing the outputs of CHECK_CASES")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs (wall times grow with it; CPU times less)")
    print(f"wall times: median of {args.trials} fresh `hybridpar` processes per tree", flush=True)
    before = Path(args.baseline_src) if args.baseline_src else worktree_src(args.baseline)
    trees = {"before": before, "after": ROOT / "src"}
    with tempfile.TemporaryDirectory() as d:
        result = side_by_side(trees, args.trials, Path(d))
        checks = {} if args.no_check else same_output(trees, Path(d))
        rows = [] if args.no_scan else scan(trees["after"], Path(d))
    r50 = result["resnet50_1024"]["after"]
    # the first keys are what `make bench` puts in its summary table (names with "vs"/"speedup")
    summary = {"wall_s_1024_gpus_vs_1s_target": r50["wall_s"], "search_s_1024_gpus_vs_0.3s_target": r50["search_s"],
               "plan_1024_wall_speedup": result["resnet50_1024"]["wall_speedup"],
               "plan_1024_search_speedup": result["resnet50_1024"]["search_speedup"],
               "make_run_wall_speedup": result["make_run"]["wall_speedup"],
               "json_identical_vs_baseline": all(c["json_identical"] for c in result.values())
               and all(checks.values()), "checked_cases": checks,
               "plans_identical_vs_baseline": all(c["plan_identical"] for c in result.values()),
               "decisions_identical_vs_baseline": all(c["decisions_identical"] for c in result.values()),
               "baseline": args.baseline_src or args.baseline, "trials": args.trials, "load_average": load,
               "cases": result, "scan": rows, "targets": {"wall_s": 1.0, "search_s": 0.3},
               "met": r50["wall_s"] <= 1.0 and r50["search_s"] <= 0.3}
    summary["load_average_after"] = os.getloadavg()[0]
    print(f"resnet50 at 1,024 GPUs: {r50['wall_s']:.2f} s wall (median of {args.trials}), search "
          f"{r50['search_s']:.3f} s (targets 1 s / 0.3 s: {'met' if summary['met'] else 'missed at this load'}; "
          f"load average {load:.1f} -> {summary['load_average_after']:.1f})")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
