"""End-to-end projection of Pal et al. (IEEE Micro 2019) for Inception-V3, GNMT and BigLSTM on
dgx1-v100, 1..4096 GPUs: DP-only saturation, the crossover where hybrid DPxMP overtakes DP, and the
margin at scale beside the paper's 26.5% / 8% / 22%. Every figure is a projection (cost model x published
convergence curves), not a run. DPxMP is priced as the MP runtime executes it (each LSTM whole on one
device); the recurrent models are also reported with the placer's time-chunk wavefront, a what-if.

Runs the sweep twice in one process: cold (empty on-disk cache: every trace, placement and allreduce
computed) and warm (a fresh backend reading the cache), and reports both wall times. Plots go to
docs/convergence_img/ (or $HYBRIDPAR_BENCH_PLOTS).

    python benchmarks/bench_projection.py [--placer-time-limit S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("inception_v3", "gnmt", "biglstm")
GPUS = [2**i for i in range(13)]


RECURRENT = ("gnmt", "biglstm")  # the placer can split their LSTMs into time chunks (a what-if)


def sweep(placer_time_limit: float, models=MODELS, time_chunks: bool = False) -> tuple[dict, float]:
    """time_chunks=False: DPxMP as the MP runtime executes it (each recurrent layer whole);
    True: the placer's time-chunk wavefront, a what-if the runtime cannot run."""
    from hybridpar.convergence.builtin import builtin_curve
    from hybridpar.search.projection import default_batch_per_gpu, project
    from hybridpar.search.projection.costs import CostModelBackend

    t0 = time.perf_counter()
    out = {}
    for m in models:
        costs = CostModelBackend(m, "dgx1-v100", placer_time_limit_s=placer_time_limit, time_chunks=time_chunks)
        out[m] = project(costs, builtin_curve(m), GPUS, default_batch_per_gpu(m), model=m, cluster="dgx1-v100")
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--placer-time-limit", type=float, default=3.0)
    args = ap.parse_args(argv)
    plots = Path(os.environ.get("HYBRIDPAR_BENCH_PLOTS", ROOT / "docs" / "convergence_img"))
    plots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["HYBRIDPAR_CACHE"] = cache
        projs, cold_s = sweep(args.placer_time_limit)
        _, warm_s = sweep(args.placer_time_limit)
        whatif, _ = sweep(args.placer_time_limit, RECURRENT, time_chunks=True)

    from hybridpar.cli.commands.project import _plot
    from hybridpar.search.projection import paper_margin

    t = Table(title="Projection on dgx1-v100, 1..4096 GPUs (time to target, speedup over 1 GPU; an extrapolation)")
    for c in ("model", "b/GPU", "DP x(512)", "DP x(4096)", "DP gain 512->4096", "best hybrid x(4096)", "crossover",
              "margin @4096", "best vs best", "paper", "MP2 speedup"):
        t.add_column(c, justify="right" if c != "model" else "left")
    rows = {}
    for m, p in projs.items():
        dp512, dp4k = p.best(512, "DP"), p.best(4096, "DP")
        h4k = p.best(4096, "hybrid")
        mp2 = p.best(2, "hybrid")
        # MP speedup alone: the 2-GPU hybrid is one MP worker at the same batch as 1 GPU
        rows[m] = {
            "batch_per_gpu": p.batch_per_gpu, "dp_speedup_512": dp512.speedup, "dp_speedup_4096": dp4k.speedup,
            "dp_gain_512_to_4096_ratio": dp4k.speedup / dp512.speedup,
            "hybrid_speedup_4096": h4k.speedup if h4k else None, "crossover_gpus": p.crossover(),
            "hybrid_wins_at": p.hybrid_wins(), "margin_at_4096": p.margin_at_scale(),
            "margin_best_vs_best": p.margin_best_vs_best(), "paper_margin": paper_margin(m),
            "mp2_step_speedup_vs_1gpu": mp2.speedup if mp2 else None,
            "dp_fits_in_memory": dp512.fits, "curve_borrowed": p.curve.borrowed,
        }
        r = rows[m]
        t.add_row(m, str(p.batch_per_gpu), f"{dp512.speedup:.0f}", f"{dp4k.speedup:.0f}",
                  f"{r['dp_gain_512_to_4096_ratio']:.2f}x", f"{h4k.speedup:.0f}" if h4k else "-",
                  str(p.crossover() or "none"), _pct(p.margin_at_scale()), _pct(p.margin_best_vs_best()),
                  _pct(paper_margin(m)), f"{mp2.speedup:.2f}" if mp2 else "-")
        _plot(p, str(plots / f"projection_{m}.png"))
    w = Table(title="WHAT-IF --time-chunks (placer's time-step wavefront; the MP runtime runs each LSTM whole)")
    for c in ("model", "best hybrid x(4096)", "crossover", "margin @4096", "best vs best", "paper", "MP2 speedup"):
        w.add_column(c, justify="right" if c != "model" else "left")
    for m, p in whatif.items():
        h4k, mp2 = p.best(4096, "hybrid"), p.best(2, "hybrid")
        rows[m]["time_chunks_whatif"] = {
            "hybrid_speedup_4096": h4k.speedup if h4k else None, "crossover_gpus": p.crossover(),
            "margin_at_4096": p.margin_at_scale(), "margin_best_vs_best": p.margin_best_vs_best(),
            "mp2_step_speedup_vs_1gpu": mp2.speedup if mp2 else None}
        w.add_row(m, f"{h4k.speedup:.0f}" if h4k else "-", str(p.crossover() or "none"), _pct(p.margin_at_scale()),
                  _pct(p.margin_best_vs_best()), _pct(paper_margin(m)), f"{mp2.speedup:.2f}" if mp2 else "-")
    con = Console(width=200)
    con.print(t)
    con.print("DPxMP above: as the MP runtime executes it (recurrent layers whole on one device).")
    con.print(w)
    con.print(f"wall: cold cache {cold_s:.1f} s, warm cache {warm_s:.1f} s (3 models x 13 GPU counts); "
              f"warm/cold ratio {warm_s / cold_s:.2f}")
    con.print("notes: inception_v3 and biglstm use BORROWED convergence curves; "
              "biglstm DP-only does not fit a 16 GB V100.")
    result = {"models": rows, "cold_wall_s": cold_s, "warm_wall_s": warm_s, "warm_vs_cold_ratio": warm_s / cold_s,
              "plots": [str(plots / f"projection_{m}.png") for m in MODELS]}
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return 0


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


if __name__ == "__main__":
    sys.exit(main())
