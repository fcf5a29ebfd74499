"""Image ops the model hands NHWC inputs: their time as the model runs them against NCHW copies (issue 35;
not part of `make bench`).

Traces MODEL, captures the real arguments of every op the trace marks `nhwc_in` (one forward pass,
`hybridpar.profile.graph_ops.capture`) and times each op's forward, one thread, median of 30 calls,
(a) on the captured arguments (the strides the model's forward gave them) and (b) on NCHW-contiguous
copies (what `hybridpar profile` timed before 2a2c8cb). Default: HF ConvNeXt (tiny, random init) at
batch 8, whose 7x7 depthwise convolutions get channels-last inputs from the permutes around its
LayerNorms.

    HF_HUB_OFFLINE=1 python benchmarks/probe_nhwc.py [--model tests/conformance/hf_families.py:convnext_train]
        [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hybridpar.graph import trace  # noqa: E402
from hybridpar.graph.models import load_model  # noqa: E402
from hybridpar.graph.types import NHWC_IN  # noqa: E402
from hybridpar.profile.graph_ops import _Weight, capture  # noqa: E402


def _median_ms(fn, calls: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tests/conformance/hf_families.py:convnext_train")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model, batch=args.batch)
    graph = trace(loaded.module, loaded.example_inputs)
    marked = [n for n in graph.nodes if n.attr(NHWC_IN)]
    got = capture(loaded.module, loaded.example_inputs, {n.name for n in marked},
                  dict(graph.meta).get("tracer", "torch.fx"))
    print(f"{args.model} at batch {args.batch}: {len(marked)} ops the model hands NHWC inputs")
    print(f"{'op':12s} {'input':>18s} {'as run (ms)':>12s} {'NCHW copy (ms)':>15s} {'ratio':>6s}")
    for n in marked:
        cap = got.get(n.name)
        if cap is None:
            continue
        run_args = tuple(a.tensor if isinstance(a, _Weight) else a for a in cap.args)
        # fresh NCHW strides (`contiguous` would keep a 1x1 image's channels-last ones)
        nchw = tuple(torch.empty(a.shape, dtype=a.dtype).copy_(a) if isinstance(a, torch.Tensor) and a.dim() == 4
                     else a for a in run_args)

        def call(a, cap=cap):
            with torch.no_grad():
                if isinstance(cap.fn, torch.nn.Module):
                    torch.func.functional_call(cap.fn, cap.weights, a, cap.kwargs)
                else:
                    cap.fn(*a, **cap.kwargs)

        as_run, copy = _median_ms(lambda a=run_args: call(a)), _median_ms(lambda a=nchw: call(a))
        shape = "x".join(map(str, run_args[0].shape))
        print(f"{n.name:12s} {shape:>18s} {as_run:12.3f} {copy:15.3f} {copy / as_run:6.1f}")


if __name__ == "__main__":
    main()
