"""How a collective's in-step cost grows with the compute before it (not part of `make bench`).

Each rank runs K iterations of (compute slice, 1 MiB reduce-scatter) and K of the compute alone; the
collective's cost is the difference per iteration (the slowest rank's median), as `hybridpar profile`
measures it, here for compute slices from ~0.4 to ~11 ms. Ranks drift apart during longer slices and
the collective waits for the later one; the cost model has no term for this (docs/planner.md).

    python benchmarks/probe_sync_skew.py [--ranks 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridpar.train.launch import spawn

SLICES = (8, 32, 128, 256)  # 128x128 matmuls per compute slice


def _work(slices: tuple[int, ...], nbytes: int, repeats: int = 9, k: int = 4) -> dict[int, list[float]]:
    import torch.distributed as dist

    mat = torch.randn(128, 128)
    world = dist.get_world_size()
    x = torch.randn(nbytes // 4)
    out = torch.empty(nbytes // 4 // world)
    res = {}
    for reps in slices:
        def compute(reps: int = reps) -> None:
            for _ in range(reps):
                torch.mm(mat, mat)

        for _ in range(3):
            dist.reduce_scatter_single(out, x)
        costs, comp = [], []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                compute()
            alone = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(k):
                compute()
                dist.reduce_scatter_single(out, x)
            costs.append((time.perf_counter() - t0 - alone) / k)
            comp.append(alone / k)
        t = torch.tensor([statistics.median(costs), statistics.median(comp)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[reps] = t.tolist()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    for cost, comp in spawn(_work, args.ranks, SLICES, 1 << 20).values():
        print(f"compute before it {comp * 1e3:6.2f} ms   1 MiB reduce-scatter {cost * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
