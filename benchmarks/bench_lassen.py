"""Projection of Dryden et al. (SC19) on the `lassen` preset: per-layer channel/filter plans vs data
parallelism for ResNet-50 and the widened ResNet-50s (x2, x4, x8).

Two sweeps over GPUs: a fixed batch per GPU (weak scaling) and a fixed global batch (strong scaling).
For each point: the planner's predicted step time and data parallelism's (or why DP cannot run),
the training-time reduction (DP step / plan step) and the allreduce-time reduction (DP's gradient
allreduce / the plan's segmented allreduce), beside the paper's "up to 4.1x" and "4x". The training-time
reduction is reported like for like (plan vs DP at the same GPU count and batch) and best vs best
(strong scaling: the plan's fastest step at any GPU count vs DP's fastest at any count). Plots (PNG)
go to docs/planner_img/ (or $HYBRIDPAR_BENCH_PLOTS).

    python benchmarks/bench_lassen.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybridpar.errors import UserError
from hybridpar.search.layers.planner import plan_model

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("resnet50", "resnet50_w2", "resnet50_w4", "resnet50_w8")
GPUS = (4, 16, 64, 256, 1024)
PER_GPU_BATCH = 32
GLOBAL_BATCH = 512
PAPER = {"training_time_reduction": 4.1, "allreduce_time_reduction": 4.0,
         "source": "Dryden et al., 'Channel and Filter Parallelism for Large-Scale CNN Training', SC19 "
                   "(abstract: up to 4.1x less training time for residual networks, 4x less allreduce overhead)"}


def point(model: str, gpus: int, batch: int) -> dict:
    t0 = time.perf_counter()
    try:
        res = plan_model(model, "lassen", gpus, batch)
    except UserError as err:
        return {"model": model, "gpus": gpus, "batch": batch, "error": str(err)}
    pred, base = res.prediction, res.baseline
    out = {
        "model": model, "gpus": gpus, "batch": batch, "method": res.method,
        "plan_step_s": pred.step_time_s, "plan_memory_gib": pred.memory_bytes[0] / 2**30,
        "plan_grad_allreduce_s": res.breakdown.grad_sync_s, "plan_layer_comm_s": res.breakdown.layer_comm_s,
        "layouts": sorted({lay.to_strategy() for lay in res.plan.layers.values()}),
        "dp_step_s": None if base is None else base.step_time_s,
        "dp_grad_allreduce_s": None if res.baseline_breakdown is None else res.baseline_breakdown.grad_sync_s,
        "dp_note": res.baseline_note, "plan_s": time.perf_counter() - t0,
    }
    if base is not None:
        out["training_time_reduction"] = base.step_time_s / pred.step_time_s
        if res.breakdown.grad_sync_s > 0:
            out["allreduce_time_reduction"] = res.baseline_breakdown.grad_sync_s / res.breakdown.grad_sync_s
    return out


def sweep(models, gpus, batch_of) -> list[dict]:
    rows = []
    for m in models:
        for g in gpus:
            rows.append(point(m, g, batch_of(g)))
            r = rows[-1]
            print(f"  {m:12s} {g:5d} GPUs batch {r['batch']:6d}: "
                  + (r.get("error", "")[:70] or f"plan {r['plan_step_s'] * 1e3:8.2f} ms  dp "
                     + (f"{r['dp_step_s'] * 1e3:8.2f} ms" if r["dp_step_s"] else "   -    ")
                     + f"  ({r['plan_s']:.1f} s)"), file=sys.stderr)
    return rows


def strong_vs_best_dp(rows: list[dict]) -> None:
    """Strong scaling: DP cannot use more GPUs than samples; compare with its best at any count <= G."""
    for r in rows:
        if "plan_step_s" not in r:
            continue
        dp = [q["dp_step_s"] for q in rows if q["model"] == r["model"] and q["gpus"] <= r["gpus"]
              and q.get("dp_step_s")]
        if dp:
            r["training_time_reduction_vs_best_dp"] = min(dp) / r["plan_step_s"]


def like_for_like(rows: list[dict], scaling: str) -> list[dict]:
    """Plan vs DP at the same GPU count and the same batch (points where DP runs)."""
    return [{"scaling": scaling, "model": r["model"], "gpus": r["gpus"], "batch": r["batch"],
             "plan_step_s": r["plan_step_s"], "dp_step_s": r["dp_step_s"], "reduction": r["training_time_reduction"]}
            for r in rows if r.get("training_time_reduction")]


def best_vs_best(rows: list[dict]) -> list[dict]:
    """Strong scaling, per model: the plan's fastest step at any GPU count vs DP's fastest at any count
    (DP cannot use more GPUs than samples, so its best is often at fewer GPUs than the plan's)."""
    out = []
    for m in dict.fromkeys(r["model"] for r in rows):
        plans = [r for r in rows if r["model"] == m and r.get("plan_step_s")]
        dps = [r for r in rows if r["model"] == m and r.get("dp_step_s")]
        if plans and dps:
            bp = min(plans, key=lambda r: r["plan_step_s"])
            bd = min(dps, key=lambda r: r["dp_step_s"])
            out.append({"model": m, "batch": bp["batch"], "plan_gpus": bp["gpus"], "plan_step_s": bp["plan_step_s"],
                        "dp_gpus": bd["gpus"], "dp_step_s": bd["dp_step_s"],
                        "reduction": bd["dp_step_s"] / bp["plan_step_s"]})
    return out


def table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title, header_style="bold")
    for c in ("model", "GPUs", "batch", "plan", "DP", "time red.", "allreduce red.", "mem GiB", "layouts"):
        t.add_column(c, justify="left" if c in ("model", "layouts") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["model"], str(r["gpus"]), str(r["batch"]), "infeasible", "-", "-", "-", "-",
                      r["error"][:40])
            continue
        dp = f"{r['dp_step_s'] * 1e3:.1f} ms" if r["dp_step_s"] else "no: " + r["dp_note"].split(":")[0][:28]
        red = r.get("training_time_reduction") or r.get("training_time_reduction_vs_best_dp")
        mark = "" if r.get("training_time_reduction") else "*"
        t.add_row(r["model"], str(r["gpus"]), str(r["batch"]), f"{r['plan_step_s'] * 1e3:.1f} ms", dp,
                  f"{red:.2f}x{mark}" if red else "-",
                  f"{r['allreduce_time_reduction']:.1f}x" if r.get("allreduce_time_reduction") else "-",
                  f"{r['plan_memory_gib']:.2f}", " ".join(r["layouts"])[:40])
    return t


def plot(weak: list[dict], strong: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows, title in (("weak", weak, f"{PER_GPU_BATCH} samples/GPU"),
                              ("strong", strong, f"global batch {GLOBAL_BATCH}")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for m in MODELS:
            pts = [r for r in rows if r["model"] == m and "plan_step_s" in r]
            g = [r["gpus"] for r in pts]
            axes[0].plot(g, [r["batch"] / r["plan_step_s"] for r in pts], "o-", label=f"{m} plan")
            dp = [r for r in pts if r["dp_step_s"]]
            axes[0].plot([r["gpus"] for r in dp], [r["batch"] / r["dp_step_s"] for r in dp], "x--",
                         label=f"{m} DP")
            red = [r for r in pts if r.get("allreduce_time_reduction")]
            axes[1].plot([r["gpus"] for r in red], [r["allreduce_time_reduction"] for r in red], "o-", label=m)
        axes[0].set(xscale="log", yscale="log", xlabel="GPUs", ylabel="samples/s (predicted)",
                    title=f"lassen, {title}")
        axes[1].axhline(PAPER["allreduce_time_reduction"], color="grey", ls=":", label="paper: 4x")
        axes[1].set(xscale="log", yscale="log", xlabel="GPUs", ylabel="DP allreduce / plan allreduce",
                    title="allreduce-time reduction")
        axes[0].legend(fontsize=6, ncol=2)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"lassen_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two models, three GPU counts")
    args = ap.parse_args()
    models = MODELS[::3] if args.quick else MODELS
    gpus = GPUS[::2] if args.quick else GPUS
    t0 = time.perf_counter()
    print("weak scaling:", file=sys.stderr)
    weak = sweep(models, gpus, lambda g: PER_GPU_BATCH * g)
    print("strong scaling:", file=sys.stderr)
    strong = sweep(models, gpus, lambda g: GLOBAL_BATCH)
    strong_vs_best_dp(strong)
    console = Console(width=150)
    console.print(table(f"lassen, weak scaling ({PER_GPU_BATCH} samples/GPU)", weak))
    console.print(table(f"lassen, strong scaling (global batch {GLOBAL_BATCH}); * = vs DP's best at <= GPUs",
                        strong))
    lfl = like_for_like(weak, "weak") + like_for_like(strong, "strong")
    lfl_best = max(lfl, key=lambda r: r["reduction"])
    bvb = best_vs_best(strong)
    bvb_best = max(bvb, key=lambda r: r["reduction"])
    best_time = max((r.get("training_time_reduction") or r.get("training_time_reduction_vs_best_dp") or 0)
                    for r in weak + strong)
    best_ar = max((r.get("allreduce_time_reduction") or 0) for r in weak + strong)
    dp_cannot_fit = sorted({(r["model"], r["gpus"], r["batch"]) for r in weak + strong
                            if r.get("plan_step_s") and not r["dp_step_s"] and "GiB per device" in r["dp_note"]})
    console.print(f"max training-time reduction over DP: {best_time:.2f}x (paper: up to "
                  f"{PAPER['training_time_reduction']}x); max allreduce-time reduction: {best_ar:.1f}x "
                  f"(paper: {PAPER['allreduce_time_reduction']}x)")
    lt = Table(title="like for like: plan vs DP at the same GPU count and batch (best point per model)",
               header_style="bold")
    for c in ("model", "scaling", "GPUs", "batch", "plan", "DP", "reduction"):
        lt.add_column(c, justify="left" if c in ("model", "scaling") else "right")
    for m in dict.fromkeys(r["model"] for r in lfl):
        r = max((q for q in lfl if q["model"] == m), key=lambda q: q["reduction"])
        lt.add_row(m, r["scaling"], str(r["gpus"]), str(r["batch"]), f"{r['plan_step_s'] * 1e3:.1f} ms",
                   f"{r['dp_step_s'] * 1e3:.1f} ms", f"{r['reduction']:.2f}x")
    console.print(lt)
    bt = Table(title=f"best vs best (strong scaling, global batch {GLOBAL_BATCH}): the plan's fastest step at any "
                     "GPU count vs DP's fastest at any count", header_style="bold")
    for c in ("model", "plan GPUs", "plan", "DP GPUs", "DP", "reduction"):
        bt.add_column(c, justify="left" if c == "model" else "right")
    for r in bvb:
        bt.add_row(r["model"], str(r["plan_gpus"]), f"{r['plan_step_s'] * 1e3:.1f} ms", str(r["dp_gpus"]),
                   f"{r['dp_step_s'] * 1e3:.1f} ms", f"{r['reduction']:.2f}x")
    console.print(bt)
    console.print(f"like for like (same GPUs, same batch): up to {lfl_best['reduction']:.2f}x ({lfl_best['model']}, "
                  f"{lfl_best['gpus']} GPUs, batch {lfl_best['batch']}, {lfl_best['scaling']} scaling); best vs best: "
                  f"up to {bvb_best['reduction']:.2f}x ({bvb_best['model']}: plan on {bvb_best['plan_gpus']} GPUs vs "
                  f"DP on {bvb_best['dp_gpus']})")
    console.print(f"points where DP does not fit in memory but a channel/filter plan does: {dp_cannot_fit}")
    plots = plot(weak, strong, Path(os.environ.get("HYBRIDPAR_BENCH_PLOTS", ROOT / "docs" / "planner_img")))
    summary = {"like_for_like_training_time_reduction": lfl_best["reduction"],
               "best_vs_best_training_time_reduction": bvb_best["reduction"],
               "max_training_time_reduction": best_time, "max_allreduce_time_reduction": best_ar,
               "paper": PAPER, "dp_does_not_fit": [list(x) for x in dp_cannot_fit], "plots": plots,
               "like_for_like_best": lfl_best, "best_vs_best_best": bvb_best, "like_for_like": lfl,
               "best_vs_best": bvb, "weak": weak, "strong": strong, "wall_s": time.perf_counter() - t0}
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
