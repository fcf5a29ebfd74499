"""Channels-last against NCHW per op kind on this machine (issue 34 item 2): the records `hybridpar
profile --channels-last` writes, summed per op kind over the model's shapes (forward + backward).

    .venv/bin/python benchmarks/bench_channels_last.py [--model small_cnn] [--batch 32] [--repeats 10]
        [--splits 1] [--json]

The figures are single-thread CPU times of one rank (hybridpar.profile.timing), as the calibration file
holds them; docs/cluster-cost.md quotes a run of this script with its date and how quiet the machine was.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def per_kind(records: dict) -> dict[str, tuple[float, float]]:
    """op kind -> (NCHW seconds, channels-last seconds), forward + backward summed over the shapes that
    have both records."""
    def total(r) -> float:
        return r.fwd.median_s + r.bwd_data.median_s + (r.bwd_weight.median_s if r.bwd_weight else 0.0)

    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for key, rec in records.items():
        base = records.get(key.replace("#cl|", "|", 1)) if rec.op.endswith("#cl") else None
        if base is not None:
            out[base.op][0] += total(base)
            out[base.op][1] += total(rec)
    return {op: (a, b) for op, (a, b) in sorted(out.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--splits", default="1", help="comma-separated, as `hybridpar profile --splits`")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from hybridpar.profile.run import ProfileOptions, model_ops

    opts = ProfileOptions(model=args.model, batch=args.batch, repeats=args.repeats, channels_last=True,
                          splits=tuple(int(k) for k in args.splits.split(",")))
    records, untimed = model_ops(opts)
    kinds = per_kind(records)
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "untimed": len(untimed),
                          "kinds": {op: {"nchw_s": a, "channels_last_s": b} for op, (a, b) in kinds.items()}}))
        return
    print(f"{args.model} batch {args.batch}: fwd + bwd summed over shapes, ms, NCHW -> channels-last")
    for op, (a, b) in kinds.items():
        print(f"  {op:18s} {a * 1e3:9.3f} -> {b * 1e3:9.3f}  ({b / a:.2f}x)")
    if untimed:
        print(f"{len(untimed)} op shape(s) could not be timed (the roofline prices them)")


if __name__ == "__main__":
    main()
