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

- train sample=2 / channel=2 / filter=2 / channel=2,filter=2 / height=2: `hybridpar train --model
  hf_families.py:<family>_train --strategy S --batch 4 --steps 2 --lr 0.01 --no-shuffle --init-from
  --save` (dropout off) against plain PyTorch SGD in one process: exact when every weight and running
  statistic is within 1e-4; refused when `train`'s checks before any rank starts (for channel/filter
  layouts, the dry run on meta tensors) refuse it with one line (exit 2). height=2 splits each
  sample's rows over 2 ranks (spatial parallelism, halo exchange; docs/spatial.md). Runs share one
  spawned world per rank count (tests/conformance/train_checks.py says how this is the CLI's code path);
- grad bytes: `hybridpar plan --strategy sample=2 --gpus 2 --batch 4 --json`'s predicted allreduce
  bytes against the bytes the sample=2 run logged in its last step, within 1%.

Each cell is exact (ran; equal where there is a figure), exact (fp64) (train only, for a family whose
one-process float32 and float64 runs differ by more than 1e-4 themselves: the layout's `train
--precision fp64` run within 1e-4 of the float64 one-process run, its float32 run still run:
tests/conformance/train_checks.py), refused (exit 2 with one line: the reason), or failed.
Writes bench-results/conformance.md and, with HYBRIDPAR_BENCH_OUT, a JSON summary;
`--readme` also replaces the README's conformance section with the table.

    python benchmarks/bench_conformance.py [--families vit,resnet] [--graph-only | --no-train | --train-only]
        [--layouts "sample=2;channel=2;height=2"] [--cf-families resnet,bit] [--readme]
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

GRAPH = ("inspect", "params", "fwd_flops", "bwd_flops", "plan_b1", "plan_b8", "place")
TRAIN = ("sample=2", "channel=2", "filter=2", "channel=2,filter=2", "height=2", "grad_bytes")
CHECKS = GRAPH + TRAIN
CHUNK = 6  # families per spawned world (a dead world costs one chunk at most; rows written as they come)


def run_family(name: str, graph_only: bool) -> dict:
    from checks import Result, check_graph, check_inspect, check_place, check_plan

    fam = hf_families.tiny_family(name)
    if fam.refused:
        r = Result("refused", f"not built: {fam.refused}")
        return {"family": name, "model": fam.model_class, "built": False, "checks": {c: r for c in CHECKS}, "fam": fam}
    out: dict = {"inspect": check_inspect(fam), **check_graph(fam)}
    if not graph_only:
        out["plan_b1"] = check_plan(fam, gpus=1, batch=1)
        out["plan_b8"] = check_plan(fam, gpus=2, batch=8)
        out["place"] = check_place(fam)
    return {"family": name, "model": fam.model_class, "built": True, "image_size": fam.image_size,
            "params": sum(p.numel() for p in fam.build().parameters()), "shrunk": list(fam.shrunk), "checks": out,
            "fam": fam}


def _cell(r) -> str:
    if r.status == "exact" and r.precision == "fp64":
        return "exact (fp64)"
    return {"exact": "exact", "ran": "ran", "refused": "refused", "failed": "**FAILED**",
            "not run": "not run"}[r.status]


HEADERS = {"fwd_flops": "fwd FLOPs", "bwd_flops": "bwd FLOPs", "plan_b1": "plan b1", "plan_b8": "plan b8",
           "sample=2": "train s=2", "channel=2": "train c=2", "filter=2": "train f=2",
           "channel=2,filter=2": "train c=2,f=2 (4 ranks)", "height=2": "train h=2", "grad_bytes": "grad bytes"}


def table(rows: list[dict], checks: tuple[str, ...], command: str, started: str) -> str:
    import torch
    import transformers

    built = [r for r in rows if r["built"]]
    lines = [
        f"Image-classification families of transformers {transformers.__version__} (torch {torch.__version__}), "
        f"{started}: {len(rows)} families, {len(built)} built (tiny configs by the rule in "
        f"tests/conformance/hf_families.py, random init, offline). Produced by `{command}`.",
        "",
        "| family | params | input | " + " | ".join(HEADERS.get(c, c) for c in checks) + " |",
        "|---|---:|---:|" + "---|" * len(checks),
    ]
    for r in rows:
        cells = [_cell(r["checks"][c]) if c in r["checks"] else "-" for c in checks]
        size = f"{r['image_size']}²" if r["built"] else "-"
        params = f"{r['params']:,}" if r["built"] else "-"
        lines.append(f"| {r['family']} | {params} | {size} | " + " | ".join(cells) + " |")
    # "ran": the command exited 0 and nothing was compared (plan, place); never counted as exact
    lines += ["", "| check | exact | ran | of which in fp64 | refused | failed | not run |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for c in checks:
        got = [r["checks"][c] for r in built if c in r["checks"]]
        n = {k: sum(g.status == k for g in got) for k in ("exact", "ran", "refused", "failed", "not run")}
        fp64 = sum(g.status == "exact" and g.precision == "fp64" for g in got)
        lines.append(f"| {HEADERS.get(c, c)} | {n['exact']}/{len(got) - n['not run']} | {n['ran']} | {fp64} | "
                     f"{n['refused']} | "
                     f"{n['failed']} | {n['not run']} |")
    lines += ["", "Reasons (refused, failed, or exact in fp64 with the float32 spread that needs it):", ""]
    for r in rows:
        if not r["built"]:
            lines.append(f"- {r['family']}: not built: {r['checks']['inspect'].detail[len('not built: '):]}")
            continue
        for c in checks:
            res = r["checks"].get(c)
            if res is not None and res.status not in ("not run", "ran") and (res.status != "exact"
                                                                             or res.precision != "fp32"):
                lines.append(f"- {r['family']} {HEADERS.get(c, c)}: {_cell(res).strip('*').lower()}: "
                             f"{_one_line(res.detail)}")
    return "\n".join(lines) + "\n"


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


README_START, README_END = "<!-- conformance:start -->", "<!-- conformance:end -->"


def write_readme(text: str) -> None:
    """Replace the README's conformance section (between the markers) with the table as produced."""
    path = ROOT / "README.md"
    readme = path.read_text()
    if README_START not in readme or README_END not in readme:
        raise SystemExit(f"README.md has no {README_START} ... {README_END} section")
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    path.write_text(f"{head}{README_START}\n{text}{README_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", help="comma-separated subset (default: every family)")
    ap.add_argument("--graph-only", action="store_true", help="inspect, params and FLOPs only")
    ap.add_argument("--no-train", action="store_true", help="no train checks")
    ap.add_argument("--train-only", action="store_true", help="train checks only")
    ap.add_argument("--layouts", default="sample=2;channel=2;filter=2;channel=2,filter=2;height=2",
                    help="train layouts, ';'-separated (default: all of sample=2;channel=2;filter=2;"
                         "channel=2,filter=2;height=2). Without sample=2 (with --train-only): no grad bytes "
                         "column, only the layouts given (e.g. --layouts height=2 for the spatial column)")
    ap.add_argument("--cf-families", default=None,
                    help="comma-separated: run the layouts other than sample=2 on these families only (the "
                         "others' cells say 'not run'; default: every family)")
    ap.add_argument("--readme", action="store_true", help="also replace the README's conformance section")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "conformance.md"))
    args = ap.parse_args(argv)
    if not hf_families.available():
        print("transformers is not installed: pip install -e '.[test]'", file=sys.stderr)
        return 2
    import tempfile

    from checks import Result, setup_environment
    from train_checks import check_train

    setup_environment()
    names = args.families.split(",") if args.families else hf_families.family_names()
    unknown = set(names) - set(hf_families.family_names())
    if unknown:
        print(f"unknown families: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    from train_checks import LAYOUTS

    layouts = tuple(lay for lay in LAYOUTS if lay[0] in args.layouts.split(";"))
    # the grad bytes column compares with the sample=2 run: without it only with --train-only, no bytes
    with_bytes = "sample=2" in [lay[0] for lay in layouts]
    if not layouts or not (with_bytes or args.train_only) or (args.cf_families and not with_bytes):
        print(f"--layouts: give sample=2 (or --train-only) and any of {'; '.join(lay[0] for lay in LAYOUTS)}",
              file=sys.stderr)
        return 2
    if with_bytes and layouts[0][0] != "sample=2":
        layouts = (("sample=2", 2), *(lay for lay in layouts if lay[0] != "sample=2"))
    cf_families = set(args.cf_families.split(",")) if args.cf_families else None
    train = tuple(c for c in TRAIN if (c == "grad_bytes" and with_bytes) or c in [lay[0] for lay in layouts])
    checks = GRAPH[:4] if args.graph_only else GRAPH if args.no_train else train if args.train_only else GRAPH + train
    command = "python benchmarks/bench_conformance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows, t0 = [], time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hybridpar-conformance-"))
    for k in range(0, len(names), CHUNK):
        chunk = []
        for name in names[k:k + CHUNK]:
            t = time.perf_counter()
            if args.train_only:
                fam = hf_families.tiny_family(name)
                row = {"family": name, "model": fam.model_class, "built": not fam.refused, "fam": fam,
                       "image_size": fam.image_size, "checks": {},
                       "params": sum(p.numel() for p in fam.build().parameters()) if not fam.refused else 0}
                if fam.refused:
                    row["checks"] = {c: Result("refused", f"not built: {fam.refused}") for c in CHECKS}
            else:
                row = run_family(name, args.graph_only)
            chunk.append(row)
            summary = " ".join(f"{c}={row['checks'][c].status}" for c in checks if c in row["checks"])
            print(f"{name:24s} {time.perf_counter() - t:6.1f}s  {summary}", flush=True)
        fams = [r["fam"] for r in chunk if r["built"]]
        if any(c in TRAIN for c in checks) and fams:
            t = time.perf_counter()
            per_family = {f.name: layouts if cf_families is None or f.name in cf_families else layouts[:1]
                          for f in fams}
            got = check_train(fams, work, layouts=per_family, with_bytes=with_bytes)
            for f in fams:
                for strategy, _ in layouts[len(per_family[f.name]):]:
                    got[f.name][strategy] = Result("not run", "not run in this run (--cf-families)")
            for r in chunk:
                r["checks"].update(got.get(r["family"], {}))
                print(f"{r['family']:24s} train: " + " ".join(f"{c}={r['checks'][c].status}" for c in TRAIN
                                                              if c in r["checks"]), flush=True)
            print(f"  train checks of {len(fams)} families: {time.perf_counter() - t:.0f} s", flush=True)
        rows += chunk
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table(rows, checks, command, started))  # what is done so far
    text = table(rows, checks, command, started)
    Path(args.out).write_text(text)
    print(text)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    if args.readme:
        write_readme(text)
    built = [r for r in rows if r["built"]]
    summary = {"families": len(rows), "built": len(built)}
    for c in checks:
        summary[f"{c}_exact"] = sum(r["checks"][c].status == "exact" for r in built if c in r["checks"])
        summary[f"{c}_ran"] = sum(r["checks"][c].status == "ran" for r in built if c in r["checks"])
        summary[f"{c}_refused"] = sum(r["checks"][c].status == "refused" for r in built if c in r["checks"])
        summary[f"{c}_failed"] = sum(r["checks"][c].status == "failed" for r in built if c in r["checks"])
    out_json = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out_json:
        Path(out_json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
