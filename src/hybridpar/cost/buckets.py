"""DDP's gradient buckets and when their allreduces end: shared by the projection's DP and DP x MP
points (search.projection) and the placer's hybrid step (search.placer.hybrid_step)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def ddp_buckets(ready: Sequence[tuple[float, int]], bucket_bytes: int) -> list[tuple[float, int]]:
    """(launch time, bytes) of each bucket: gradients fill buckets in backward order, a bucket is
    launched when full (the last one when backward ends), as DDP does."""
    buckets: list[tuple[float, int]] = []
    fill, last = 0, 0.0
    for t, nbytes in ready:
        fill += nbytes
        last = t
        if fill >= bucket_bytes:
            buckets.append((t, fill))
            fill = 0
    if fill:
        buckets.append((last, fill))
    return buckets


def overlapped_end(ready: Sequence[tuple[float, int]], bucket_bytes: int, ar_s: Callable[[int], float]) -> float:
    """When the last gradient bucket finishes its allreduce, measured from the start of backward.

    Buckets (ddp_buckets) go over the network one after another, as DDP does."""
    net = 0.0
    for t, nbytes in ddp_buckets(ready, bucket_bytes):
        net = max(net, t) + ar_s(nbytes)
    return net


def shared_links_end(queues: Sequence[Sequence[tuple[float, int]]], ar_s: Callable[[int, int], float]) -> float:
    """When the last bucket of several device groups finishes, the groups sharing the network while
    they allreduce at the same time: each group runs its buckets (launch time, bytes) one after
    another; while k groups are busy, a bucket progresses at 1 / ar_s(bytes, k) of itself per second
    (ar_s(bytes, k): that bucket's allreduce with k groups on the links at once)."""
    pos = [0] * len(queues)  # next bucket of each group
    left: dict[int, float] = {}  # group -> fraction of its running bucket still to go
    now = 0.0
    while True:
        for g, q in enumerate(queues):  # start every bucket whose launch time has come
            if g not in left and pos[g] < len(q) and q[pos[g]][0] <= now + 1e-15:
                left[g] = 1.0
        waiting = [q[pos[g]][0] for g, q in enumerate(queues) if g not in left and pos[g] < len(q)]
        if not left:
            if not waiting:
                return now
            now = min(waiting)
            continue
        k = len(left)
        dur = {g: ar_s(queues[g][pos[g]][1], k) for g in left}
        finish = min(left[g] * dur[g] for g in left)
        step = min([finish, *(t - now for t in waiting)])
        now += step
        for g in list(left):
            left[g] -= step / dur[g] if dur[g] > 0 else 1.0
            if left[g] <= 1e-12:
                del left[g]
                pos[g] += 1
