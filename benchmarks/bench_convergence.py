"""Statistical efficiency measured for real: small_cnn on sklearn digits to 95% held-out accuracy at
batch 16..1024 (3 seeds), the McCandlish fit E(B) = E_min (1 + B/B_noise), and the online
gradient-noise-scale estimate (per-micro-batch vs whole-batch gradient norms, as a DP run would see
them) beside the fitted B_noise. McCandlish et al. predict that the two agree in order of magnitude.

    python benchmarks/bench_convergence.py [--seeds N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from hybridpar.convergence.gns import GradientNoiseScale
from hybridpar.convergence.measure import LRRule, build_model, digits_split, measure


def gns_during_training(batch: int = 256, ranks: int = 8, epochs: int = 3, seed: int = 0) -> list[float]:
    """Train at `batch` and feed the estimator each step as `ranks` data-parallel workers would:
    each micro-batch's gradient is a rank's local gradient, their mean the allreduced one."""
    torch.manual_seed(seed)
    xtr, ytr, _, _ = digits_split()
    net = build_model("small_cnn", seed)
    rule = LRRule()
    opt = torch.optim.SGD(net.parameters(), lr=rule.peak_lr(batch), momentum=rule.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    est = GradientNoiseScale(ema_decay=0.9)
    per_epoch = []
    gen = torch.Generator().manual_seed(seed)
    n = len(xtr)
    b_local = batch // ranks
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for i in range(0, n - batch + 1, batch):
            idx = order[i:i + batch]
            local = []
            total = None
            for r in range(ranks):
                net.zero_grad(set_to_none=True)
                sl = idx[r * b_local:(r + 1) * b_local]
                loss_fn(net(xtr[sl]), ytr[sl]).backward()
                g = torch.cat([p.grad.flatten() for p in net.parameters()])
                local.append(float(g.pow(2).sum()))
                total = g if total is None else total + g
            glob = total / ranks
            est.update(sum(local) / ranks, float(glob.pow(2).sum()), b_local, batch)
            # the step itself uses the whole-batch gradient
            off = 0
            for p in net.parameters():
                p.grad = glob[off:off + p.numel()].view_as(p).clone()
                off += p.numel()
            opt.step()
        per_epoch.append(est.estimate())
    return per_epoch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="3 batch sizes, 1 seed")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    batches = [32, 128, 512] if args.quick else [16, 32, 64, 128, 256, 512, 1024]
    seeds = 1 if args.quick else args.seeds
    con = Console()
    t0 = time.perf_counter()
    m = measure("small_cnn", "digits", 0.95, batches, seeds)
    meas_s = time.perf_counter() - t0
    t = Table(title="small_cnn on digits: epochs to 95% held-out accuracy")
    for c in ("batch", "peak lr", "epochs (mean)", "sd", "reached", "fit", "fit / measured"):
        t.add_column(c, justify="right")
    rows = m.per_batch()
    for r in rows:
        fit = m.curve.epochs(r["batch"]) if m.curve else None
        e = r["epochs_mean"]
        t.add_row(str(r["batch"]), f"{r['lr_peak']:.3g}", f"{e:.3g}" if e else "-", f"{r['epochs_sd']:.2g}",
                  f"{r['reached']}/{r['seeds']}", f"{fit:.3g}" if fit else "-",
                  f"{fit / e:.2f}" if fit and e else "-")
    con.print(t)
    t1 = time.perf_counter()
    gns = gns_during_training()
    gns_s = time.perf_counter() - t1
    c = m.curve
    result = {"per_batch": rows, "measure_wall_s": meas_s, "gns_wall_s": gns_s, "gns_per_epoch": gns}
    if c:
        con.print(f"fit: E_min = {c.e_min:.3g} +- {c.e_min_sd:.2g} epochs, "
                  f"B_noise = {c.b_noise:.4g} +- {c.b_noise_sd:.2g}")
        ratio = gns[-1] / c.b_noise
        con.print(f"online gradient noise scale (batch 256 as 8 ranks x 32), per epoch: "
                  f"{', '.join(f'{g:.4g}' for g in gns)}; last / fitted B_noise = {ratio:.2f}")
        epochs_ratio = rows[-1]["epochs_mean"] / rows[0]["epochs_mean"] if rows[-1]["epochs_mean"] else None
        result.update(e_min=c.e_min, b_noise=c.b_noise, b_noise_sd=c.b_noise_sd, gns_vs_fit_ratio=ratio,
                      epochs_ratio_largest_vs_smallest_batch=epochs_ratio)
    con.print(f"wall: measurement {meas_s:.1f} s, GNS run {gns_s:.1f} s")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
