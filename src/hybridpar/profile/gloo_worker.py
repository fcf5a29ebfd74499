"""One rank of the gloo allreduce benchmark (run as `python -m hybridpar.profile.gloo_worker ...`).

Every rank times each allreduce between barriers; the per-repeat time is the maximum over ranks
(the collective is done when the last rank is done). Rank 0 writes the samples as JSON.
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
    samples: list[list[float]] = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32)
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
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
