"""Is a process's speed on this machine drawn at its start, for every op alike? (not part of `make bench`)

Runs `--processes` fresh Python processes one after another, each timing three single-thread ops
(an LSTM, a convolution and a linear layer, forward and backward, CPU time of the thread, medians of 12
after 3 warm-up), twice in a row. Prints one line per process and, per op, how far the slowest and
fastest processes are from the median process. A per-process draw shows as a process slow in every
op and in both passes; drift within a process as the two passes disagreeing. Why `hybridpar profile`
records `process_draw` (cluster.calibration.ProcessDraw) and scales the op table it times by it.

    python benchmarks/probe_process_draw.py [--processes 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, statistics, time, torch
torch.set_num_threads(1); torch.manual_seed(0)
lstm, xs = torch.nn.LSTM(64, 128, batch_first=True), torch.randn(32, 32, 64)
conv, xc = torch.nn.Conv2d(32, 32, 3, padding=1), torch.randn(16, 32, 32, 32)
lin, xl = torch.nn.Linear(512, 512), torch.randn(256, 512)
ops = {"lstm": lambda: lstm(xs)[0].sum().backward(), "conv": lambda: conv(xc).sum().backward(),
       "linear": lambda: lin(xl).sum().backward()}
def t(f):
    for _ in range(3): f()
    ts = []
    for _ in range(12):
        c = time.thread_time(); f(); ts.append(time.thread_time() - c)
    return statistics.median(ts)
print(json.dumps([{k: t(f) for k, f in ops.items()} for _ in range(2)]))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=10)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = []
    for i in range(args.processes):
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        passes = json.loads(out.stdout)
        runs.append(passes)
        print(f"process {i}: " + " | ".join(" ".join(f"{k} {v * 1e3:.2f}" for k, v in p.items()) for p in passes)
              + " ms")
    for op in runs[0][0]:
        per = [statistics.fmean(p[op] for p in r) for r in runs]
        mid = statistics.median(per)
        print(f"{op}: processes {min(per) / mid - 1:+.0%} to {max(per) / mid - 1:+.0%} of the median process")


if __name__ == "__main__":
    main()
