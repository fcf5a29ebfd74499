"""What pricing split efficiency changes (issue 13 item 4): the planner's choices and predictions on
zoo models at small per-GPU work, with the size factor and without it, side by side: by default this
tree with `hybridpar.cost.compute.size_factor` switched off (every piece 1/k of the whole) against this
tree; or two commits (`--baseline c07b28f`, the commit before the factor, `--after REV`).

For each case: how many weight layers the plan splits over channels/filters, the mean number of
channel x filter pieces per weight layer, the plan's and data parallelism's predicted step time and
compute. Planning only (no training), a few seconds
per case; each tree runs in its own process (PYTHONPATH first).

    python benchmarks/bench_split_efficiency.py [--baseline REV | --baseline-src DIR/src] [--after REV] [--scan]
    hybridpar profile --model small_cnn --batch 8 --splits 2,4 --ranks 2 --out cal.json
    python benchmarks/bench_split_efficiency.py --local cal.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _baseline import worktree_src  # benchmarks/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
# (model, cluster, gpus, global batch): make run's case, then small per-GPU work
CASES = [
    ("resnet50_w8", "lassen", 256, 512),
    ("vgg16", "dgx1-v100", 32, 32),
    ("vgg16", "dgx1-v100", 8, 8),
    ("vgg16", "dgx-h100", 8, 8),
    ("resnet50_w4", "dgx1-v100", 32, 32),
    ("resnet50", "lassen", 8, 8),
    ("inception_v3", "dgx1-v100", 32, 32),
]
# --scan: every model x cluster x GPUs x samples per GPU below (96 plans per side, a few minutes)
SCAN = [(m, c, g, g * per_gpu) for m in ("resnet50", "vgg16", "resnet50_w4", "resnet50_w2")
        for c in ("dgx-h100", "dgx-a100", "dgx1-v100", "lassen") for g in (8, 32) for per_gpu in (1, 4, 16)]
CHILD = r"""
import json, os, sys
from hybridpar.search.layers.planner import plan_model
if os.environ.get("HYBRIDPAR_BENCH_NO_SIZE_FACTOR"):  # the same tree pricing every piece at 1/k
    import hybridpar.cost.compute as compute
    compute.size_factor = lambda *args, **kwargs: 1.0
for m, c, g, b in json.loads(sys.argv[1]):
    r = plan_model(m, c, g, b)
    split = sum(1 for x in r.layers if x.layout is not None and x.layout.channel * x.layout.filter > 1)
    weights = sum(1 for x in r.layers if x.layout is not None)
    pieces = sum(x.layout.channel * x.layout.filter for x in r.layers if x.layout is not None)
    base = r.baseline
    print(json.dumps({"case": f"{m} {c} {g} GPUs batch {b}", "method": r.method, "split": split,
                      "weights": weights, "pieces": pieces / max(1, weights), "step_s": r.prediction.step_time_s,
                      "compute_s": r.prediction.compute_s,
                      "dp_step_s": base.step_time_s if base else None,
                      "dp_compute_s": base.compute_s if base else None}), flush=True)
"""


def run(src: str, no_factor: bool = False, cases=CASES) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    if no_factor:
        env["HYBRIDPAR_BENCH_NO_SIZE_FACTOR"] = "1"
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], env=env, check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def local_pieces(calibration: str) -> None:
    """localhost: each small_cnn conv/linear at a quarter of its samples, channels, filters and at
    sample=2,channel=2, priced from `calibration` (measure it with `hybridpar profile --model small_cnn
    --batch 8 --splits 2,4`), against a quarter of the whole layer's time."""
    from hybridpar.cluster import load_cluster
    from hybridpar.cluster.calibration import load_calibration
    from hybridpar.cost.compute import op_time
    from hybridpar.graph.models import load_model
    from hybridpar.graph.tracing import trace

    cal = load_calibration(calibration, required=True)
    print("matmul (FLOPs: GFLOP/s):", ", ".join(f"{f:.0e}: {r / 1e9:.1f}" for f, r in cal.matmul_curve))
    m = load_model("small_cnn", batch=8)
    g = trace(m.module, m.example_inputs)
    dev = load_cluster("localhost", gpus=2, calibration=calibration).device.model_copy(update={"time_share": 1.0})
    splits = (("samples/4", {"sample_frac": 0.25}), ("channels/4", {"channel_frac": 0.25}),
              ("filters/4", {"filter_frac": 0.25}), ("s2 c2", {"sample_frac": 0.5, "channel_frac": 0.5}))
    for n in g.nodes:
        if n.op in ("conv2d", "linear"):
            whole = op_time(n, dev, calibration=cal).total_s
            cells = [f"{name} {op_time(n, dev, calibration=cal, **kw).total_s / (whole / 4):.2f}x"
                     for name, kw in splits]
            print(f"{n.name:6} {n.op:7} whole {whole * 1e6:8.1f} us; piece / (whole/4): " + ", ".join(cells))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="a commit for the 'before' side (default: this tree "
                                                     "with the size factor switched off)")
    ap.add_argument("--baseline-src", default=None)
    ap.add_argument("--after", default=None, help="a commit for the 'after' side (default: this tree)")
    ap.add_argument("--scan", action="store_true", help="the 96-plan grid (SCAN); print only changed choices")
    ap.add_argument("--local", metavar="CALIBRATION", default=None,
                    help="instead: localhost's measured pieces of small_cnn from this calibration file")
    args = ap.parse_args()
    if args.local:
        local_pieces(args.local)
        return
    cases = SCAN if args.scan else CASES
    after_src = str(worktree_src(args.after)) if args.after else str(ROOT / "src")
    if args.baseline or args.baseline_src:
        before = run(args.baseline_src or str(worktree_src(args.baseline)), cases=cases)
    else:  # the same code with and without the factor: nothing else differs
        before = run(after_src, no_factor=True, cases=cases)
    after = run(after_src, cases=cases)
    if args.scan:
        changed = [(b, a) for b, a in zip(before, after) if (b["split"], b["pieces"]) != (a["split"], a["pieces"])]
        for b, a in changed:
            way = "less" if a["pieces"] < b["pieces"] else "more"
            print(f"{b['case']}: {b['split']}/{b['weights']} layers split, {b['pieces']:.2f} pieces -> "
                  f"{a['split']}/{a['weights']}, {a['pieces']:.2f} ({way} splitting); step {_ms(b['step_s'])} -> "
                  f"{_ms(a['step_s'])} ms, DP {_ms(a['dp_step_s'])} ms")
        less = sum(a["pieces"] < b["pieces"] for b, a in changed)
        print(f"{len(cases)} plans: {len(changed)} choices changed, {less} toward less splitting, "
              f"{len(changed) - less} toward more")
        return
    print(f"load average {os.getloadavg()[0]:.1f} (planning only: predictions do not depend on it)")
    print(f"{'case':40} {'':6} {'split/weights':>13} {'pieces':>6} {'plan ms':>8} {'compute':>8} {'DP ms':>8} "
          f"{'DP comp':>8}")
    for b, a in zip(before, after):
        for tag, r in (("before", b), ("after", a)):
            print(f"{r['case'] if tag == 'before' else '':40} {tag:6} {r['split']:>6}/{r['weights']:<6} "
                  f"{r['pieces']:6.2f} {_ms(r['step_s'])} {_ms(r['compute_s'])} {_ms(r['dp_step_s'])} "
                  f"{_ms(r['dp_compute_s'])}")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps({"before": before, "after": after}, indent=1))


if __name__ == "__main__":
    main()
