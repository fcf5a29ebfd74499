"""Where a 2-rank sample step loses time the model does not price (not part of `make bench`).

`--drift`: one process times the same conv fwd+bwd for 40 s; the median of each 2-s window (CPU time
of the thread). This VM's speed drifts by tens of percent over seconds.

Default: 2 gloo ranks train the two-tower LSTM of bench_validation at batch 16 per rank, 40 steps,
as (1) a plain eager loop with no collective, (2) the same loop with one blocking allreduce of the
flattened gradients after backward, (3) torch's DistributedDataParallel, (4) hybridpar's runtime
(`parallelize(m, "sample=2", inputs="sample_shard")`); per rank the medians of forward, backward (the
gradient sync included), optimizer step, the whole step and the step's CPU time. (1) shows how far
two ranks' compute differs in one run; (2)-(4) that the allreduce waits for the slower rank.

2026-12-01 07:15 UTC, quiet (two runs of each): (1) 7.8 / 11.1 and 11.4 / 10.3 ms per rank, (2)
15.4-16.3 ms, (3) 14.9-15.8 ms, (4) 12.9-15.9 ms; one process alone through `hybridpar train`: 8.6-8.9
ms, 8.7 predicted. 07:28 UTC, this script: (1) 8.8 / 17.0 ms (the same loop, the same moment, no
collective), (2) 16.8 / 17.7, (3) 16.6 / 16.6, (4) 15.9 / 16.2 ms.

    python benchmarks/probe_skew.py [--drift] [--variants plain,plainar,ddp,ours]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent


def drift(seconds: float = 40.0, window: float = 2.0) -> list[float]:
    import torch

    from hybridpar.host_allocator import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m, x = torch.nn.Conv2d(32, 32, 3, padding=1), torch.randn(16, 32, 32, 32)
    for _ in range(5):
        m(x.clone()).sum().backward()
    end, out = time.time() + seconds, []
    while time.time() < end:
        stop, ts = time.time() + window, []
        while time.time() < stop:
            t0 = time.thread_time()
            m(x.clone()).sum().backward()
            ts.append(time.thread_time() - t0)
        out.append(statistics.median(ts) * 1e3)
    return out


def _rank(rank: int, world: int, variant: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._utils import _flatten_dense_tensors

    from hybridpar.host_allocator import keep_freed_memory

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    keep_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, str(HERE))
    from bench_validation import two_tower_lstm

    import hybridpar

    m, _ = two_tower_lstm()
    if variant == "ours":
        m = hybridpar.parallelize(m, f"sample={world}", inputs="sample_shard")
    elif variant == "ddp":
        m = torch.nn.parallel.DistributedDataParallel(m)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randint(0, 64, (16, 32), generator=g), torch.randint(0, 10, (16,), generator=g)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    rec = []
    for _ in range(40):
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = F.cross_entropy(m(x), y)
        t1 = time.perf_counter()
        loss.backward()
        if variant == "plainar":
            dist.all_reduce(_flatten_dense_tensors([p.grad for p in m.parameters()]))
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        rec.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0, time.thread_time() - c0))
    med = [statistics.median(r[k] for r in rec[5:]) * 1e3 for k in range(5)]
    print(f"{variant:8s} rank {rank}: fwd {med[0]:.2f}  bwd+sync {med[1]:.2f}  opt {med[2]:.2f}  "
          f"step {med[3]:.2f}  cpu {med[4]:.2f} ms", flush=True)
    dist.barrier()
    os._exit(0)  # gloo ranks can abort in interpreter teardown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drift", action="store_true", help="one process, 2-s windows of the same conv")
    ap.add_argument("--variants", default="plain,plainar,ddp,ours")
    args = ap.parse_args()
    if args.drift:
        print("conv fwd+bwd, median per 2-s window (ms):", " ".join(f"{t:.2f}" for t in drift()))
        return
    import torch.multiprocessing as mp

    for i, v in enumerate(args.variants.split(",")):
        mp.spawn(_rank, args=(2, v, 29540 + i), nprocs=2, join=True)


if __name__ == "__main__":
    main()
