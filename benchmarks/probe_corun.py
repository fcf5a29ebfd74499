"""Does an op run slower when a second process runs at the same time? (not part of `make bench`)

Two persistent processes, phases interleaved `--cycles` times: process 0 alone, both at once,
process 1 alone; each phase times `--iters` forward+backward passes of one op (an LSTM or a conv) as
CPU time of the thread, medians per phase. Prints, per process, its times alone and together and the
ratio of their medians: a co-run slowdown shows as a ratio above 1 in both processes; a per-process
speed (the same op, same moment, different process) shows as two processes' different times.

On this 2-core VM (2026-12-01 04:07 UTC, quiet): ratios 0.99-1.01 (LSTM) and 0.86-1.00 (conv), so no
co-run slowdown; but the same LSTM took 8.0-8.6 ms in process 0 and 5.8-6.1 ms in process 1 in the
same phases (process 1 later 11-15 ms): a process's speed is drawn anew and drifts, which is why
`bench_validation` and `bench_mp` take medians over fresh processes.

    python benchmarks/probe_corun.py [--op lstm|conv] [--cycles 6] [--iters 12]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _work(rank: int, bar, q, op: str, cycles: int, iters: int) -> None:
    import torch

    from hybridpar.host_allocator import keep_freed_memory

    keep_freed_memory()  # as the ranks and the profile run
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if op == "lstm":
        m, x = torch.nn.LSTM(64, 128, batch_first=True), torch.randn(32, 32, 64)

        def step(xx):
            m(xx)[0].sum().backward()
    else:
        m, x = torch.nn.Conv2d(32, 32, 3, padding=1), torch.randn(16, 32, 32, 32)

        def step(xx):
            m(xx).sum().backward()

    def burst() -> float:
        ts = []
        for _ in range(iters):
            xx = x.clone().requires_grad_()
            t = time.thread_time()
            step(xx)
            ts.append(time.thread_time() - t)
        return statistics.median(ts[2:]) * 1e3

    res: dict[str, list[float]] = {"alone": [], "both": []}
    for _ in range(cycles):
        for phase in ("0", "both", "1"):
            bar.wait()
            if phase == "both":
                res["both"].append(burst())
            elif phase == str(rank):
                res["alone"].append(burst())
            bar.wait()
    q.put((rank, res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=("lstm", "conv"), default="lstm")
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    bar, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_work, args=(r, bar, q, args.op, args.cycles, args.iters)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    for r in (0, 1):
        alone, both = out[r]["alone"], out[r]["both"]
        print(f"{args.op} process {r}: alone {' '.join(f'{v:.2f}' for v in alone)} ms; together "
              f"{' '.join(f'{v:.2f}' for v in both)} ms; together/alone (medians) "
              f"{statistics.median(both) / statistics.median(alone):.3f}")


if __name__ == "__main__":
    main()
