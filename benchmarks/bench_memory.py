"""Memory benchmark: measured peak resident memory per rank vs the planner's prediction (issue 17).

For `resnet50_w8` at 3x32x32, batch 2, under sample=2, channel=2, filter=2 and channel=2,filter=2 (4
ranks), one layout at a time (never two trainings at once: the model is 3.2 GB of fp32 weights):

- runs `hybridpar train ... --metrics FILE` and samples, from outside, the resident set (VmRSS, and the
  kernel's high-water mark VmHWM) of the launcher and of every rank process every `--interval` seconds;
- start-up peak: each rank's VmHWM when rank 0 has written its first step record (building its own
  pieces of the model: hybridpar.parallel.materialize, its pieces plus about one whole layer);
- steady peak: each rank's peak after that first step record (steps 2..N: weights, gradients,
  optimizer state, activations, buffers of a training step): its VmHWM reset at that moment
  ("5" > /proc/PID/clear_refs) and read until it exits, and its largest sampled VmRSS, whichever is larger;
- prediction: `hybridpar plan --strategy S --cluster localhost --json` (the same layout), whose
  memory is hybridpar.cost.memory.predict_rank_memory; the steady peak is compared with it (20%).

    .venv/bin/python benchmarks/bench_memory.py [--models resnet50_w8,resnet50_w4] [--steps 4]
        [--layouts "channel=2;filter=2"] [--out bench_memory.json]

A layout whose run would not fit this machine's free memory now (the launcher plus every rank's
predicted peak, 20% to spare) is left out with the figure it would need, after waiting `--wait-s`.

Acceptance (issue 17), printed at the end: every layout's peak per rank (the larger of start-up and
steady) within 20% of the prediction; each channel/filter layout's measured peak below data
parallelism's (`sample=2`) by at least the predicted factor; the launcher's peak under 1 GiB.

The machine may be shared with other work: the figures are resident memory of our processes only.

`--spatial [--quick]`: issue 30's rows instead (benchmarks/_spatial_memory.py): a U-Net under height=2,
width=2, height=2,width=2 and CosmoFlow under depth=2, each rank's step memory (from the CPU allocator's
events) against one process's and the prediction, and each rank's resident peak against `plan`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridpar.procs import children

ROOT = Path(__file__).resolve().parents[1]
MODEL, SHAPE, BATCH, LR = "resnet50_w8", "3,32,32", 2, 0.001
LAYOUTS = {"sample=2": 2, "channel=2": 2, "filter=2": 2, "channel=2,filter=2": 4}
TOLERANCE = 0.20
GiB = 2**30
TRAIN_EXTRA: list[str] = []  # more `hybridpar train` options (the spatial rows': --synthetic-size, --loss)


def _status(pid: int) -> dict[str, int] | None:
    """VmRSS and VmHWM of a process in bytes (None when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out if len(out) == 2 else None


def _reset_hwm(pid: int) -> bool:
    """Reset a process's VmHWM to its current resident set (Linux >= 4.0: "5" > /proc/PID/clear_refs)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_rank(pid: int) -> bool:
    """A rank: a spawned child running multiprocessing's spawn_main, or a child of the fork server
    (hybridpar.train.launch starts ranks from one: they carry its command line; not the server itself,
    nor the resource tracker)."""
    cmd = _cmdline(pid)
    if "spawn_main" in cmd:
        return True
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return "forkserver" in cmd and "forkserver" in _cmdline(ppid)


def _steps_done(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def measure(strategy: str, nproc: int, steps: int, interval: float, run_args: list[str] | None = None,
            batch: int | None = None) -> dict:
    """One training run of `strategy` (or of `run_args`, e.g. --plan FILE), sampled from outside;
    returns the per-rank figures."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cmd = [sys.executable, "-m", "hybridpar.cli.main", "train", "--model", MODEL, "--input-shape", SHAPE,
               "--batch", str(batch or BATCH), "--steps", str(steps), *(run_args or ["--strategy", strategy]),
               "--nproc", str(nproc), "--metrics", str(metrics), "--log-every", "1000", "--json",
               "--lr", str(LR), *TRAIN_EXTRA]  # memory does not depend on lr; at 0.1 sample=2 reaches NaN at step 2
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        launcher: dict[str, int] = {}
        ranks: dict[int, dict] = {}  # pid -> {"startup_hwm", "steady_rss", "hwm"}
        first_step_at = None
        while proc.poll() is None:
            st = _status(proc.pid)
            if st:
                launcher = {"rss": max(launcher.get("rss", 0), st["VmRSS"]), "hwm": st["VmHWM"]}
            done = _steps_done(metrics)
            if done and first_step_at is None:
                first_step_at = time.time() - t0
            stack = children(proc.pid)
            while stack:
                pid = stack.pop()
                stack += children(pid)
                if not _is_rank(pid):
                    continue
                st = _status(pid)
                if st is None:
                    continue
                r = ranks.setdefault(pid, {"startup_hwm": 0, "steady_rss": 0, "hwm": 0, "samples_after": 0,
                                           "hwm_reset": False, "steady_hwm": 0})
                r["hwm"] = max(r["hwm"], st["VmHWM"])
                if not done:
                    r["startup_hwm"] = r["hwm"]
                else:
                    if not r["hwm_reset"]:  # from here VmHWM is the peak of the steady steps
                        r["hwm_reset"] = _reset_hwm(pid)
                    elif st["VmHWM"] < r["startup_hwm"]:
                        r["steady_hwm"] = max(r["steady_hwm"], st["VmHWM"])
                    r["steady_rss"] = max(r["steady_rss"], st["VmRSS"])
                    r["samples_after"] += 1
            time.sleep(interval)
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"train {strategy} failed ({proc.returncode}): {err[-2000:]}")
        recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"strategy": strategy, "nproc": nproc, "steps": steps, "wall_s": time.time() - t0,
            "first_step_s": first_step_at, "launcher_peak_bytes": launcher.get("hwm", 0),
            "ranks": sorted(({**r, "steady_rss": max(r["steady_rss"], r["steady_hwm"])} for r in ranks.values()),
                            key=lambda r: -r["steady_rss"]),
            "rank0_reported_peak_bytes": recs[-1].get("peak_memory_bytes") if recs else None}


def predict(strategy: str, nproc: int) -> dict:
    """`hybridpar plan --strategy` for the same layout on localhost (per-rank memory), and its breakdown
    from hybridpar.cost.memory.predict_rank_memory (the same sum; tests/cost/test_memory.py checks they
    agree). Where `plan` refuses the layout, the breakdown's total stands for it (said in `source`)."""
    from hybridpar.cost.memory import predict_rank_memory
    from hybridpar.search.graph_cache import traced_graph

    graph, _ = traced_graph(MODEL, tuple(int(x) for x in SHAPE.split(",")))
    rank = predict_rank_memory(graph, strategy, batch=BATCH)
    whole = predict_rank_memory(graph, "sample=1", batch=BATCH)
    cmd = [sys.executable, "-m", "hybridpar.cli.main", "plan", "--model", MODEL, "--input-shape", SHAPE,
           "--batch", str(BATCH), "--gpus", str(nproc), "--strategy", strategy, "--cluster", "localhost", "--json"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode == 0:
        memory, source = json.loads(res.stdout)["predicted"]["memory_bytes_per_device"], "hybridpar plan"
    else:
        memory = rank.total_bytes
        lines = res.stderr.strip().splitlines() or ["no message"]
        why = next((ln.strip() for ln in lines if "error" in ln.lower() and "Traceback" not in ln), lines[-1])
        source = f"predict_rank_memory (plan refused: {why[:120]})"
    return {"memory_bytes": memory, "source": source, "breakdown": rank.breakdown(),
            "whole_model_bytes": whole.weights_bytes, "framework_bytes": rank.framework_bytes}


def _available_bytes(field: str = "MemAvailable:") -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


LAUNCHER_BYTES = 0.6 * GiB  # the launcher: interpreter, torch, the model on meta (0.34 GiB measured)


MARGIN = 1.2  # --margin: predicted peaks times this must fit in 90% of the available memory


def needed_bytes(p: dict, nproc: int) -> float:
    """What a run needs at once: the launcher (the model on meta only) and, per rank, its predicted
    peak; start-up holds the rank's pieces plus about one whole layer (hybridpar.parallel.materialize),
    below the steady peak; MARGIN to spare for the prediction's error."""
    return LAUNCHER_BYTES + nproc * MARGIN * p["memory_bytes"]


def _wait_for(need: float, wait_s: float) -> float:
    """Available memory once it covers `need` with 10% to spare, or after `wait_s` (other jobs share
    this machine: their memory comes and goes)."""
    total = _available_bytes("MemTotal:")
    deadline = time.time() + (wait_s if need <= 0.9 * total else 0.0)  # never fits: no wait
    avail = _available_bytes()
    while need > 0.9 * avail and time.time() < deadline:
        time.sleep(5)
        avail = _available_bytes()
    return avail


def run_layout(strategy: str, args) -> dict:
    nproc = LAYOUTS.get(strategy) or 2
    p = predict(strategy, nproc)
    need = needed_bytes(p, nproc)
    avail = _wait_for(need, args.wait_s)
    tag = f"{MODEL} {strategy} ({nproc} ranks)"
    if need > 0.9 * avail:
        print(f"{tag:>40}: predicted {p['memory_bytes'] / GiB:6.2f} GiB per rank; NOT RUN: "
              f"needs about {need / GiB:.1f} GiB at once, {avail / GiB:.1f} GiB available", flush=True)
        return {"model": MODEL, "batch": BATCH, "strategy": strategy, "nproc": nproc,
                "predicted_bytes": p["memory_bytes"], "predicted_source": p["source"],
                "predicted_breakdown": p["breakdown"], "skipped": True, "needed_bytes": need, "available_bytes": avail}
    try:
        m = measure(strategy, nproc, args.steps, args.interval)
    except RuntimeError as err:  # a layout the runtime refuses: said in the table, the others still run
        why = next((ln.strip() for ln in str(err).splitlines() if "error" in ln.lower()), str(err)[-200:])
        print(f"{tag:>40}: predicted {p['memory_bytes'] / GiB:6.2f} GiB per rank; TRAIN FAILED: {why[:160]}",
              flush=True)
        return {"model": MODEL, "batch": BATCH, "strategy": strategy, "nproc": nproc,
                "predicted_bytes": p["memory_bytes"], "predicted_source": p["source"],
                "predicted_breakdown": p["breakdown"], "skipped": True, "failed": why}
    steady = max(r["steady_rss"] for r in m["ranks"])
    startup = max(r["startup_hwm"] for r in m["ranks"])
    peak = max(steady, startup)
    err = steady / p["memory_bytes"] - 1 if p["memory_bytes"] else float("nan")
    peak_err = peak / p["memory_bytes"] - 1 if p["memory_bytes"] else float("nan")
    per_rank = ", ".join(f"{r['steady_rss'] / GiB:.2f}" for r in m["ranks"])
    print(f"{tag:>40}: predicted {p['memory_bytes'] / GiB:6.2f} GiB  steady {steady / GiB:6.2f} GiB ({err:+.0%})  "
          f"start-up {startup / GiB:6.2f} GiB  launcher {m['launcher_peak_bytes'] / GiB:5.2f} GiB  ranks steady "
          f"[{per_rank}]", flush=True)
    return {**m, "model": MODEL, "batch": BATCH, "predicted_bytes": p["memory_bytes"],
            "predicted_breakdown": p["breakdown"], "predicted_source": p["source"], "steady_peak_bytes": steady,
            "startup_peak_bytes": startup, "peak_bytes": peak, "peak_rel_error": peak_err,
            "rel_error": err, "within_tolerance": abs(peak_err) <= TOLERANCE}


def make_run_check(args) -> dict:
    """`make run`'s plan (resnet50_w8 on 256 Lassen GPUs, batch 512, 3x224x224) states per-GPU memory
    for its layout: 32 sample groups of a channel x filter grid of 8 with its per-layer layouts. Here
    one sample group of that layout (8 ranks, sample degree 1, the group's 16 samples) trains at
    3x32x32; its measured peak per rank is compared with what the same cost model states for this run
    (the figure `make run` prints is for 224x224 on a GPU: activations 49x larger, no framework)."""
    from hybridpar.cost.memory import predict_rank_memory
    from hybridpar.plans import load_plan
    from hybridpar.search.graph_cache import traced_graph

    with tempfile.TemporaryDirectory() as tmp:
        lassen_path, local_path = Path(tmp) / "lassen.json", Path(tmp) / "local.json"
        cmd = [sys.executable, "-m", "hybridpar.cli.main", "plan", "--model", MODEL, "--cluster", "lassen",
               "--gpus", "256", "--batch", "512", "--json", "--out", str(lassen_path)]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        lassen_bytes = json.loads(res.stdout)["predicted"]["memory_bytes_per_device"]
        doc = json.loads(lassen_path.read_text())
        d = doc["default_layout"]
        g, groups = d["channel"] * d["filter"], d["sample"]
        local_batch = doc["batch"] // groups
        doc.update(world_size=g, dp=g, batch=local_batch, cluster="localhost", input_shape=[3, 32, 32],
                   default_layout={**d, "sample": 1},
                   layers={k: {**v, "sample": 1} for k, v in doc.get("layers", {}).items()})
        local_path.write_text(json.dumps(doc))
        plan = load_plan(local_path)
        graph, _ = traced_graph(MODEL, (3, 32, 32))
        predicted = predict_rank_memory(graph, plan.default_layout, layers=plan.layers, batch=local_batch).total_bytes
        need = LAUNCHER_BYTES + g * MARGIN * predicted
        avail = _wait_for(need, args.wait_s)
        row = {"model": MODEL, "strategy": f"make run's layout, 1 of {groups} sample groups", "nproc": g,
               "batch": local_batch, "shape": "3,32,32", "lassen_predicted_bytes": lassen_bytes,
               "predicted_bytes": predicted, "lassen_layout": d}
        if need > 0.9 * avail:
            print(f"make run's layout: NOT RUN: needs about {need / GiB:.1f} GiB, {avail / GiB:.1f} GiB available")
            return {**row, "skipped": True, "needed_bytes": need, "available_bytes": avail}
        m = measure(row["strategy"], g, args.steps, args.interval, ["--plan", str(local_path)], local_batch)
    peak = max(max(r["steady_rss"], r["startup_hwm"]) for r in m["ranks"])
    err = peak / predicted - 1
    print(f"make run's layout ({d}, 1 of {groups} sample groups = {g} ranks, batch {local_batch}, 3x32x32): "
          f"Lassen plan states {lassen_bytes / GiB:.2f} GiB per GPU at 224x224; here predicted "
          f"{predicted / GiB:.2f} GiB, measured peak {peak / GiB:.2f} GiB ({err:+.0%}): "
          f"{'met' if abs(err) <= TOLERANCE else 'MISSED'} (within {TOLERANCE:.0%})", flush=True)
    return {**m, **row, "peak_bytes": peak, "peak_rel_error": err, "within_tolerance": abs(err) <= TOLERANCE}


def main() -> None:
    global MODEL, BATCH, MARGIN
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--layouts", default=";".join(LAYOUTS), help="';'-separated strategies (default: all four)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--models", default=MODEL,
                    help="comma-separated zoo models, each under every layout (default resnet50_w8)")
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch (default 2)")
    ap.add_argument("--wait-s", type=float, default=120.0,
                    help="wait this long for enough free memory before leaving a layout out")
    ap.add_argument("--make-run", action="store_true",
                    help="only `make run`'s layout (one sample group of it, 8 ranks, at 3x32x32) vs its prediction")
    ap.add_argument("--margin", type=float, default=MARGIN,
                    help="run a layout only when its predicted peaks times this fit 90%% of the free memory")
    ap.add_argument("--spatial", action="store_true",
                    help="only the spatial rows (issue 30): U-Net under height=2, width=2, height=2,width=2 and "
                         "CosmoFlow under depth=2, step memory against one process and the prediction")
    ap.add_argument("--quick", action="store_true", help="with --spatial: small inputs (about 2 minutes)")
    args = ap.parse_args()
    BATCH, MARGIN = args.batch, args.margin
    if args.spatial:
        from _spatial_memory import run_spatial

        rows = run_spatial(args, sys.modules[__name__])
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
        return
    if args.make_run:
        row = make_run_check(args)
        if args.out:
            Path(args.out).write_text(json.dumps(row, indent=2))
        return
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        MODEL = model
        rows += [run_layout(strategy, args) for strategy in args.layouts.split(";") if strategy]
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    ran = [r for r in rows if not r.get("skipped")]
    summary = {"rows": rows, "worst_rel_error": max((abs(r["rel_error"]) for r in ran), default=None),
               **{f"{r['model']}.{r['strategy']}.steady_vs_predicted_error": r["rel_error"] for r in ran},
               **{f"{r['model']}.{r['strategy']}.startup_vs_predicted_ratio":
                  r["startup_peak_bytes"] / r["predicted_bytes"] for r in ran}}
    if os.environ.get("HYBRIDPAR_BENCH_OUT"):  # benchmarks/run_all.py's contract
        Path(os.environ["HYBRIDPAR_BENCH_OUT"]).write_text(json.dumps(summary, indent=2))
    print("\n| model | layout | ranks | batch | predicted / rank | measured steady peak / rank (max) | error "
          "| start-up peak / rank | peak vs predicted | launcher peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = (f"| {r['model']} | `{r['strategy']}` | {r['nproc']} | {r['batch']} | "
                f"{r['predicted_bytes'] / GiB:.2f} GiB |")
        if r.get("failed"):
            print(f"{head} train failed: {r['failed'][:100]} | | | | |")
            continue
        if r.get("skipped"):
            print(f"{head} not run: needs ~{r['needed_bytes'] / GiB:.1f} GiB at once, "
                  f"{r['available_bytes'] / GiB:.1f} GiB free | | | | |")
            continue
        print(f"{head} {r['steady_peak_bytes'] / GiB:.2f} GiB | {r['rel_error']:+.0%} | "
              f"{r['startup_peak_bytes'] / GiB:.2f} GiB | {r['peak_rel_error']:+.0%} | "
              f"{r['launcher_peak_bytes'] / GiB:.2f} GiB |")
    for line in acceptance(rows):
        print(line)


def acceptance(rows: list[dict]) -> list[str]:
    """Issue 17's three checks, one line each (met / missed, with the figures)."""
    ran = [r for r in rows if not r.get("skipped")]
    out = ["", "acceptance:"]
    for r in ran:
        out.append(f"  {r['model']} {r['strategy']}: peak {r['peak_bytes'] / GiB:.2f} GiB vs predicted "
                   f"{r['predicted_bytes'] / GiB:.2f} GiB ({r['peak_rel_error']:+.0%}): "
                   f"{'met' if r['within_tolerance'] else 'MISSED'} (within {TOLERANCE:.0%})")
    for model in sorted({r["model"] for r in ran}):
        dp = next((r for r in ran if r["model"] == model and r["strategy"] == "sample=2"), None)
        for r in (r for r in ran if r["model"] == model and r["strategy"] != "sample=2"):
            if dp is None:
                out.append(f"  {model} {r['strategy']} vs sample=2: not measured (sample=2 did not run)")
                continue
            got, want = dp["peak_bytes"] / r["peak_bytes"], dp["predicted_bytes"] / r["predicted_bytes"]
            out.append(f"  {model} {r['strategy']}: sample=2's peak / this peak = {got:.2f}, predicted factor "
                       f"{want:.2f}: {'met' if got >= want else 'MISSED'}")
    for r in ran:
        ok = r["launcher_peak_bytes"] < GiB
        out.append(f"  {r['model']} {r['strategy']}: launcher peak {r['launcher_peak_bytes'] / GiB:.2f} GiB: "
                   f"{'met' if ok else 'MISSED'} (< 1 GiB)")
    return out


if __name__ == "__main__":
    main()
