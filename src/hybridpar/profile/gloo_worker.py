"""One rank of the gloo collectives benchmark (run as `python -m hybridpar.profile.gloo_worker ...`).

What is timed is what a training step pays for a collective: each repeat runs K iterations of
(a slice of compute, then the collective) and K iterations of the compute alone, and the sample is the
difference per iteration. Timing an allreduce right after a barrier, with every rank already
waiting in it, measured about a third of that on this machine (2 ranks, 4 KiB: 0.5 ms after a barrier,
1.2-1.7 ms between compute), and the validation against real training runs under-predicted every
layout by that much per collective.

Every kind is timed through the runtime's own functions (hybridpar.parallel.comm.collectives), copies and
padding included, in groups of each requested size: the world split into consecutive blocks, all
blocks running at once, as a layer's channel or replica groups do. Measured per kind because gloo's
kinds differ far more than a ring model says (at 4 ranks its list-based reduce-scatter took 3x an
allreduce of the same buffer). Sizes follow hybridpar.parallel.comm.log's byte convention (allreduce:
the buffer; allgather: the gathered result; reduce_scatter: the input; alltoall: what a rank sends to
the others; p2p: the tensor one rank sends to its pair, timed as the MP runtime sends activations, in
pairs of ranks only). The per-repeat sample is the maximum over ranks (the collective is done when the last
rank is done). Rank 0 writes the samples as JSON.

p2p_post is not a transfer's time but the sender's own work to start one: the CPU time of the MP
runtime's Send (copy, gloo isend, the pre-posted receive of the gradient) on the sending thread (the
socket write happens there), which the sender's compute waits for. On inception_mini's MP step these
calls took 0.3-0.8 ms each (1-2 MB), about 4% of each rank's step, where the transfer model had the
sender free. Timed while the receiver computes, as in a step: with the receiver idle in its wait, a
196 KB post took 84 us (41 us + 0.22 ns/B, fitted), where the wavefront's step took a median of 0.23 ms
per isend call alone (lstm4, 4 time chunks, 2 ranks, 2026-12-04).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

from hybridpar.files import atomic_write

KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "p2p", "p2p_post")
P2P_KINDS = ("p2p", "p2p_post")
P2P_GROUP = 2  # p2p is timed between pairs of ranks only


def _groups(world: int, size: int, rank: int):
    """Consecutive blocks of `size` ranks; every rank creates every group (torch requires it)."""
    import torch.distributed as dist

    from hybridpar.parallel.mesh import Group

    mine = None
    for start in range(0, world, size):
        ranks = tuple(range(start, start + size))
        pg = dist.new_group(list(ranks)) if size < world else dist.group.WORLD
        if rank in ranks:
            mine = Group(ranks, pg, ranks.index(rank))
    return mine


def _collective(kind: str, nbytes: int, group):
    """A closure issuing one `kind` of `nbytes` (CommLog convention) on `group`, as the runtime does."""
    import torch

    from hybridpar.parallel.comm.collectives import all_gather_dim, all_reduce_, all_to_all_flat, reduce_scatter_dim
    from hybridpar.parallel.comm.log import CommLog

    g = group.size
    log = CommLog()
    rows = 8  # a [rows, cols] activation split along dim 1, like a channel split
    if kind == "allreduce":
        buf = torch.ones(max(1, nbytes // 4))
        return lambda: all_reduce_(buf, group, log)
    if kind == "allgather":
        cols = max(1, nbytes // 4 // rows // g)
        piece = torch.ones(rows, cols)
        return lambda: all_gather_dim(piece, 1, group, [cols] * g, log)
    if kind == "reduce_scatter":
        cols = max(1, nbytes // 4 // rows // g)
        full = torch.ones(rows, cols * g)
        return lambda: reduce_scatter_dim(full, 1, group, [cols] * g, log)
    if kind == "p2p":
        return _p2p(nbytes, group)
    if kind == "alltoall":
        per_peer = max(1, nbytes // 4 // (g - 1))
        sends = [torch.ones(per_peer) for _ in range(g)]
        return lambda: all_to_all_flat(sends, [per_peer] * g, [per_peer] * g, sends[0], group, log)
    raise ValueError(f"unknown collective kind {kind!r}")


def _p2p(nbytes: int, group):
    """One activation transfer as the MP runtime makes it (hybridpar.parallel.pipeline.p2p.Link): the lower
    rank of the pair copies the tensor and sends it non-blocking, the other waits for its pre-posted
    receive. The sender waits for its send too, so that repeats do not pile up in flight."""
    import torch
    import torch.distributed as dist

    peer = group.ranks[group.index ^ 1]
    buf = torch.ones(max(1, nbytes // 4))
    if group.index % 2 == 0:
        return lambda: dist.isend(buf.detach().contiguous().clone(), peer).wait()
    return lambda: dist.irecv(buf, peer).wait()


def _p2p_post(nbytes: int, group, directions, compute):
    """The sender's CPU time of Send's forward in the MP runtime (hybridpar.parallel.pipeline.p2p.Link,
    its own code): the activation's copy and isend, and the pre-posted receive of its gradient, on
    the runtime's group per direction, while the receiver computes (as the next stage does in a step:
    its socket's reader then shares the cores with compute). Not counting the wait for delivery. The
    receiver posts its receive, computes, takes the activation, sends the gradient back; it reports 0."""
    import torch

    from hybridpar.parallel.comm.log import CommLog
    from hybridpar.parallel.pipeline.p2p import Link

    me = group.index
    link = Link(rank_of_device=lambda d: group.ranks[d], log=CommLog(), prepost=True, device=me,
                directions=directions)
    buf = torch.ones(max(1, nbytes // 4))
    if me == 0:
        def post() -> float:
            compute()
            t0 = time.thread_time()
            link.isend(buf, 1, 0, "fwd")
            grad = link.irecv(buf, 1, 1, "bwd")
            spent = time.thread_time() - t0
            grad.wait()
            link.wait_all()
            return spent
        return post

    def take() -> float:
        act = link.irecv(buf, 0, 0, "fwd")
        compute()
        compute()
        link.isend(act.wait(), 0, 1, "bwd")
        link.wait_all()
        return 0.0
    return take


def _pair_directions(world: int, rank: int):
    """Two groups per pair of ranks (P2P_GROUP blocks), as the MP runtime makes per replica
    (pipeline.layout.direction_groups); every rank creates every group, in the same order."""
    import torch.distributed as dist

    mine = None
    for start in range(0, world - world % P2P_GROUP, P2P_GROUP):
        ranks = list(range(start, start + P2P_GROUP))
        up, down = dist.new_group(ranks), dist.new_group(ranks)
        if rank in ranks:
            mine = (up, down)
    return mine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--sizes", required=True, help="comma-separated bytes")
    ap.add_argument("--kinds", default="allreduce", help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--group-sizes", default="", help="comma-separated divisors of the world (default: the world)")
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
    kinds = [k for k in args.kinds.split(",") if k]
    group_sizes = [int(g) for g in args.group_sizes.split(",") if g] or [args.world]
    groups = {g: _groups(args.world, g, args.rank) for g in group_sizes}
    directions = _pair_directions(args.world, args.rank) if "p2p_post" in kinds else None
    # ~0.5 ms of single-thread compute between collectives, as between a training step's layers.
    mat = torch.randn(128, 128)

    def compute() -> None:
        for _ in range(8):
            torch.mm(mat, mat)

    def loop(k: int, fn) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            compute()
            if fn is not None:
                fn()
        return time.perf_counter() - t0

    k = 4
    keys, samples = [], []
    for g, group in groups.items():
        for kind in kinds:
            if kind in P2P_KINDS and g != P2P_GROUP:
                continue
            # The first collectives of a new group pay for connection set-up: run some before timing.
            warm = _collective("p2p" if kind == "p2p_post" else kind, 4096, group)
            for _ in range(5):
                warm()
            for size in sizes:
                if kind == "p2p_post":  # the post's own CPU time, while the receiver computes
                    post = _p2p_post(size, group, directions, compute)
                    for _ in range(args.warmup):
                        post()
                    times = []
                    for _ in range(args.repeats):
                        dist.barrier()
                        times.append(max(1e-7, post()))
                    samples.append(times)
                    continue
                fn = _collective(kind, size, group)
                for _ in range(args.warmup):
                    fn()
                times = []
                for _ in range(args.repeats):
                    dist.barrier()
                    alone = loop(k, None)
                    with_comm = loop(k, fn)
                    # Noise can make the difference tiny or negative; a collective never costs < 1 us.
                    times.append(max(1e-6, (with_comm - alone) / k))
                samples.append(times)
            keys.append(f"{kind}/{g}")
    worst = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if args.rank == 0:
        rows = worst.tolist()
        per = len(sizes)
        samples = {key: rows[i * per:(i + 1) * per] for i, key in enumerate(keys)}
        atomic_write(args.out, json.dumps({"world": args.world, "sizes": sizes, "samples": samples}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
