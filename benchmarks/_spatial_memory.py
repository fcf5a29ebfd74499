"""The spatial rows of benchmarks/bench_memory.py (issue 30): `bench_memory.py --spatial [--quick]`.

For a high-resolution U-Net under height=2, width=2 (2 ranks) and height=2,width=2 (4 ranks), and
CosmoFlow (3-D) under depth=2 (2 ranks), at batch 1 (where sample parallelism cannot split):

- step memory, measured from the CPU allocator's own events (hybridpar.profile.step_memory: the peak
  of what a forward + backward allocates above what was live before it) on every rank, against one
  process training the same model and batch (acceptance: <= 0.6x for the 2-rank 2-D layouts) and
  against hybridpar.cost.memory's prediction of the same bytes (activations, largest transient, the
  output gathered whole; acceptance: within 15%);
- the whole process, as `hybridpar train` runs it: each rank's peak resident set (bench_memory.measure,
  steady steps) against `hybridpar plan --strategy S --json`'s memory per device (within 15%). The
  data set is one batch (--synthetic-size), which plan does not count: train holds a synthetic data
  set whole in every rank (1024 samples by default: 1.34 GB at 3x256x256 with per-pixel labels).

    .venv/bin/python benchmarks/bench_memory.py --spatial [--quick] [--out FILE]
"""

from __future__ import annotations

from math import prod

from hybridpar.profile.step_memory import Case, compare

# (model, input shape, batch, layouts), the zoo's models as `hybridpar train --model` builds them. High
# resolution: activations, not weights, should set the peak (at 3x128x128 the U-Net's 9.4 MB bottleneck
# weight gradient does, on every layout)
ROWS = [("unet", (3, 512, 512), 1, ("height=2", "width=2", "height=2,width=2")),
        ("cosmoflow", (4, 64, 64, 64), 1, ("depth=2",))]
QUICK = [("unet", (3, 256, 256), 1, ("height=2", "width=2", "height=2,width=2")),
         ("cosmoflow", (4, 48, 48, 48), 1, ("depth=2",))]
STEP_TOLERANCE = 0.15
RATIO = 0.6  # a 2-rank spatial layout's step peak over one process's
MiB = 2**20


def _ranks(strategy: str) -> int:
    return prod(int(kv.split("=")[1]) for kv in strategy.split(",") if "=" in kv)


def _process(bench, strategy: str, args) -> dict:
    """The `hybridpar train` run of `strategy` (resident set per rank) against `hybridpar plan`."""
    nproc = _ranks(strategy)
    p = bench.predict(strategy, nproc)
    avail = bench._wait_for(bench.needed_bytes(p, nproc), args.wait_s)
    if bench.needed_bytes(p, nproc) > 0.9 * avail:
        return {"predicted_bytes": p["memory_bytes"], "skipped": True, "available_bytes": avail}
    m = bench.measure(strategy, nproc, args.steps, args.interval)
    # one rank runs in the launcher itself (no rank process): its high-water mark then
    ranks = [max(r["steady_rss"], r["startup_hwm"]) for r in m["ranks"]] or [m["launcher_peak_bytes"]]
    peak = max(ranks)
    return {"predicted_bytes": p["memory_bytes"], "predicted_source": p["source"], "peak_bytes": peak,
            "ranks": ranks, "error": peak / p["memory_bytes"] - 1}


def run_spatial(args, bench) -> list[dict]:
    """Every row of ROWS (QUICK with --quick); prints the table and the acceptance lines."""
    rows = []
    for model, shape, batch, layouts in (QUICK if args.quick else ROWS):
        case = Case(model, shape, batch)
        step = compare(case, list(layouts))
        bench.MODEL, bench.SHAPE, bench.BATCH = model, ",".join(map(str, shape)), batch
        bench.TRAIN_EXTRA[:] = ["--synthetic-size", str(batch), "--loss", "cross_entropy"]
        for strategy in ("sample=1", *layouts):
            s = step["one" if strategy == "sample=1" else strategy]
            row = {"model": model, "shape": list(shape), "batch": batch, "strategy": strategy,
                   "nproc": _ranks(strategy), "step_peak_bytes": s["peak_bytes"], "step_ranks": s["ranks"],
                   "step_forward_bytes": s["forward_bytes"], "step_predicted_bytes": s["predicted_bytes"],
                   "step_error": s["peak_bytes"] / s["predicted_bytes"] - 1, "vs_one": s.get("vs_one", 1.0)}
            row["process"] = _process(bench, strategy, args)
            rows.append(row)
            _print_row(row)
    for line in acceptance(rows):
        print(line)
    return rows


def _print_row(r: dict) -> None:
    p = r["process"]
    proc = "not run" if p.get("skipped") else (
        f"{p['peak_bytes'] / MiB:7.0f} MiB vs plan {p['predicted_bytes'] / MiB:7.0f} MiB ({p['error']:+.1%})")
    print(f"{r['model']:>10} {'x'.join(map(str, r['shape'])):>12} {r['strategy']:>17} ({r['nproc']} ranks): step peak "
          f"{r['step_peak_bytes'] / MiB:7.1f} MiB/rank = {r['vs_one']:.3f}x one process, predicted "
          f"{r['step_predicted_bytes'] / MiB:7.1f} MiB ({r['step_error']:+.1%}); process peak {proc}", flush=True)


def acceptance(rows: list[dict]) -> list[str]:
    """Issue 30's memory checks, one line each (met / missed, with the figures)."""
    out = ["", "acceptance (issue 30, memory):"]
    for r in rows:
        tag = f"  {r['model']} {r['strategy']}"
        if r["strategy"] != "sample=1" and r["nproc"] == 2 and r["model"] == "unet":
            ok = r["vs_one"] <= RATIO
            out.append(f"{tag}: step peak {r['vs_one']:.3f}x one process's: {'met' if ok else 'MISSED'} (<= {RATIO})")
        ok = abs(r["step_error"]) <= STEP_TOLERANCE
        out.append(f"{tag}: step peak vs predicted {r['step_error']:+.1%}: {'met' if ok else 'MISSED'} "
                   f"(within {STEP_TOLERANCE:.0%})")
        p = r["process"]
        if not p.get("skipped"):
            ok = abs(p["error"]) <= STEP_TOLERANCE
            out.append(f"{tag}: process peak per rank vs plan {p['error']:+.1%}: {'met' if ok else 'MISSED'} "
                       f"(within {STEP_TOLERANCE:.0%})")
    return out
