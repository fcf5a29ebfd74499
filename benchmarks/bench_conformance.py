"""Conformance table: every image-classification family of the installed `transformers` through hybridpar.

Each family is built tiny (random init, offline; the generic shrink rule in
tests/conformance/hf_families.py) and wrapped as `forward(x) -> model(pixel_values=x).logits`. Checks:

- inspect: `hybridpar inspect` runs (at batch 1) and its parameter total equals sum(p.numel());
- params: the traced graph's trainable parameters equal sum(p.numel()) (free parameters included);
- fwd/bwd FLOPs: the graph's matmul-class FLOPs equal torch.utils.flop_counter.FlopCounterMode over
  one training step of the model with eager attention (tests/conformance/reference.py states the one
  correction: FlopCounterMode's grouped-convolution weight gradient is divided by groups);
- plan b1: `hybridpar plan --gpus 1 --batch 1`; plan b8: `--gpus 2 --batch 8`; place: `hybridpar place
  --gpus 2 --batch 8 --time-limit 10` (cluster localhost).

Each cell is exact (ran; equal where there is a figure), refused (exit 2 with one line: the reason),
or failed. Writes bench-results/conformance.md and, with HYBRIDPAR_BENCH_OUT, a JSON summary.

    python benchmarks/bench_conformance.py [--families vit,resnet] [--graph-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "conformance"))

import hf_families  # noqa: E402

CHECKS = ("inspect", "params", "fwd_flops", "bwd_flops", "plan_b1", "plan_b8", "place")


def run_family(name: str, graph_only: bool) -> dict:
    from checks import Result, check_graph, check_inspect, check_place, check_plan

    fam = hf_families.tiny_family(name)
    if fam.refused:
        r = Result("refused", f"not built: {fam.refused}")
        return {"family": name, "model": fam.model_class, "built": False, "checks": {c: r for c in CHECKS}}
    out: dict = {"inspect": check_inspect(fam), **check_graph(fam)}
    if not graph_only:
        out["plan_b1"] = check_plan(fam, gpus=1, batch=1)
        out["plan_b8"] = check_plan(fam, gpus=2, batch=8)
        out["place"] = check_place(fam)
    return {"family": name, "model": fam.model_class, "built": True, "image_size": fam.image_size,
            "params": sum(p.numel() for p in fam.build().parameters()), "shrunk": list(fam.shrunk), "checks": out}


def _cell(r) -> str:
    return {"exact": "exact", "refused": "refused", "failed": "**FAILED**"}[r.status]


def table(rows: list[dict], checks: tuple[str, ...]) -> str:
    import torch
    import transformers

    built = [r for r in rows if r["built"]]
    lines = [
        f"# Conformance: image-classification families of transformers {transformers.__version__}",
        "",
        f"torch {torch.__version__}; tiny configs by the rule in tests/conformance/hf_families.py; "
        f"{len(rows)} families, {len(built)} built. Produced by `python benchmarks/bench_conformance.py`.",
        "",
        "| family | params | input | " + " | ".join(checks) + " |",
        "|---|---:|---:|" + "---|" * len(checks),
    ]
    for r in rows:
        cells = [_cell(r["checks"][c]) if c in r["checks"] else "-" for c in checks]
        size = f"{r['image_size']}²" if r["built"] else "-"
        params = f"{r['params']:,}" if r["built"] else "-"
        lines.append(f"| {r['family']} | {params} | {size} | " + " | ".join(cells) + " |")
    lines += ["", "| check | exact | refused | failed |", "|---|---:|---:|---:|"]
    for c in checks:
        got = [r["checks"][c].status for r in built if c in r["checks"]]
        lines.append(f"| {c} | {got.count('exact')}/{len(got)} | {got.count('refused')} | {got.count('failed')} |")
    lines += ["", "Reasons (refused or failed):", ""]
    for r in rows:
        if not r["built"]:
            lines.append(f"- {r['family']}: not built: {r['checks']['inspect'].detail[len('not built: '):]}")
            continue
        for c in checks:
            res = r["checks"].get(c)
            if res is not None and res.status != "exact":
                lines.append(f"- {r['family']} {c}: {res.status}: {res.detail}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", help="comma-separated subset (default: every family)")
    ap.add_argument("--graph-only", action="store_true", help="inspect, params and FLOPs only")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "conformance.md"))
    args = ap.parse_args(argv)
    if not hf_families.available():
        print("transformers is not installed: pip install -e '.[test]'", file=sys.stderr)
        return 2
    from checks import setup_environment

    setup_environment()
    names = args.families.split(",") if args.families else hf_families.family_names()
    unknown = set(names) - set(hf_families.family_names())
    if unknown:
        print(f"unknown families: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    checks = CHECKS[:4] if args.graph_only else CHECKS
    rows, t0 = [], time.perf_counter()
    for name in names:
        t = time.perf_counter()
        row = run_family(name, args.graph_only)
        rows.append(row)
        summary = " ".join(f"{c}={row['checks'][c].status}" for c in checks if c in row["checks"])
        print(f"{name:24s} {time.perf_counter() - t:6.1f}s  {summary}", flush=True)
    text = table(rows, checks)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    built = [r for r in rows if r["built"]]
    summary = {"families": len(rows), "built": len(built)}
    for c in checks:
        summary[f"{c}_exact"] = sum(r["checks"][c].status == "exact" for r in built if c in r["checks"])
        summary[f"{c}_failed"] = sum(r["checks"][c].status == "failed" for r in built if c in r["checks"])
    out_json = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out_json:
        Path(out_json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
