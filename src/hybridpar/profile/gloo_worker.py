"""One rank of the gloo allreduce benchmark (run as `python -m hybridpar.profile.gloo_worker ...`).

What is timed is what a training step pays for a collective: each repeat runs K iterations of
(a slice of compute, then the allreduce) and K iterations of the compute alone, and the sample is the
difference per iteration. Timing an allreduce right after a barrier, with every rank already
waiting in it, measured about a third of that on this machine (2 ranks, 4 KiB: 0.5 ms after a barrier,
1.2-1.7 ms between compute), and the validation against real training runs under-predicted every
layout by that much per collective. The per-repeat sample is the maximum over ranks (the collective
is done when the last rank is done). Rank 0 writes the samples as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--sizes", required=True, help="comma-separated bytes")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    sizes = [int(s) for s in args.sizes.split(",")]
    # The first collectives of a new group pay for connection set-up: run some before timing anything.
    warm = torch.ones(1024)
    for _ in range(10):
        dist.all_reduce(warm)
    # ~0.5 ms of single-thread compute between collectives, as between a training step's layers.
    mat = torch.randn(128, 128)

    def compute() -> None:
        for _ in range(8):
            torch.mm(mat, mat)

    def loop(k: int, buf: torch.Tensor | None) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            compute()
            if buf is not None:
                dist.all_reduce(buf)
        return time.perf_counter() - t0

    k = 4
    samples: list[list[float]] = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32)
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            alone = loop(k, None)
            with_comm = loop(k, buf)
            # Noise can make the difference tiny or negative; a collective never costs less than 1 us.
            times.append(max(1e-6, (with_comm - alone) / k))
        samples.append(times)
    worst = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if args.rank == 0:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"world": args.world, "sizes": sizes, "samples": worst.tolist()}, fh)
        os.replace(tmp, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
