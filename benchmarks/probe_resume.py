"""Does the first op after a blocking receive run slower than the next one? (not part of `make bench`)

Two gloo ranks take turns, as the stages of a model-parallel step do: a rank runs an op twice, then
sends a 4-byte token to the other and blocks in its receive until the token comes back. Each op's CPU
time of the thread is recorded, the first after the wait apart from the second; per op kind the
medians and the difference (the resume cost). The ops are an LSTM over a time chunk (the wavefront's
chunk of benchmarks/_wavefront_model.py: batch 32, 8 steps, 192 units, and a smaller one), a 3x3
convolution and matrix products, each forward and backward.

On this 2-vCPU VM (2026-12-04 16:00 and 16:45 UTC, quiet; two runs, both ranks) the first op after the
wait cost 7-11% more than the second for the LSTM chunk (+0.45-0.66 ms on 5.6-6.6 ms), 6-27% for the
small LSTM, 5-16% for the convolution, 8-16% for 128x128 products and 1-5% for 512x512 ones; in a
variant the second ran as fast as the same op in a loop with no waits. The MP
step's ranks block in a receive several times a step (docs/mp-runtime.md, *The ranks' own work*):
a cost the one-process op table does not hold and the placer does not price.

    python benchmarks/probe_resume.py [--cycles 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

KINDS = ("lstm192x8", "lstm96x4", "conv", "mm128", "mm512")


def _op(kind: str):
    import torch

    torch.manual_seed(0)
    if kind == "mm128":
        a = torch.randn(128, 128)
        return lambda: [torch.mm(a, a) for _ in range(8)]
    if kind == "mm512":
        a = torch.randn(512, 512)
        return lambda: [torch.mm(a, a) for _ in range(4)]
    if kind.startswith("lstm"):
        hidden, steps = (int(v) for v in kind[4:].split("x"))
        lstm, x = torch.nn.LSTM(hidden, hidden, batch_first=True), torch.randn(32, steps, hidden, requires_grad=True)
        return lambda: lstm(x)[0].sum().backward()
    conv, x = torch.nn.Conv2d(32, 32, 3, padding=1), torch.randn(8, 32, 32, 32)
    return lambda: conv(x).sum().backward()


def _ranks(cycles: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, token = dist.get_rank(), torch.zeros(1)
    out = {}
    for kind in KINDS:
        op = _op(kind)
        op(), op()  # warm-up
        first, second = [], []
        for _ in range(cycles):
            for turn in range(12):
                if (turn + rank) % 2:
                    dist.recv(token, 1 - rank)  # blocks until the other rank's two ops are done
                    continue
                t0 = time.thread_time()
                op()
                t1 = time.thread_time()
                op()
                first.append(t1 - t0)
                second.append(time.thread_time() - t1)
                dist.send(token, 1 - rank)
        out[kind] = (statistics.median(first), statistics.median(second))
    both: list = [None, None]
    dist.all_gather_object(both, out)
    return both


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=4, help="12 turns each, per op kind")
    args = ap.parse_args()
    from hybridpar.train.launch import spawn

    per_rank = spawn(_ranks, 2, args.cycles)
    for kind in KINDS:
        cells = []
        for r, res in enumerate(per_rank):
            first, second = res[kind]
            cells.append(f"rank {r}: first {first * 1e3:.2f} ms, second {second * 1e3:.2f} ms, "
                         f"resume cost {(first - second) * 1e3:+.3f} ms ({first / second - 1:+.1%})")
        print(f"{kind:10s} " + "; ".join(cells))


if __name__ == "__main__":
    main()
