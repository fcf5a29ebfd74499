"""Collectives along one tensor dimension, on a grid Group, each recorded in a CommLog.

Uneven pieces are supported: gloo's all_gather needs equal sizes, so pieces are padded to the
largest for the transfer, while the log records the logical bytes (the cost model's figure).
Each call records its wall time on this rank (CommLog.timed), so a step's communication time can be
measured per kind beside the cost model's prediction.

On gloo (CPU ranks, often more ranks than cores) a collective costs about one scheduler wake-up per
sequential message round, not its bytes: gloo's ring allreduce of a few floats over 4 ranks takes
2(P-1) = 6 rounds, and was measured at ~6.6 ms each between compute on 4 ranks sharing 2 cores,
against ~0 for one all_to_all round (`benchmarks/bench_runtime.py --collectives` measures it).
So on gloo, over more than 2 ranks, a small allreduce sends the whole buffer to every peer in one
all_to_all round (`_one_round`) and sums what arrives; allgather sends this rank's piece to every
peer; reduce_scatter sends piece k to rank k and sums what arrives; a large allreduce is that
reduce_scatter then that allgather (2 rounds, the ring's bytes). 2 ranks keep gloo's own: one round
or two either way, and A/B runs in one world were within noise of each other (-7%..+17%). Sums
run in rank order on every rank, so every rank gets the same bits. NCCL keeps its own algorithms."""

from __future__ import annotations

from math import prod

import torch
import torch.distributed as dist

from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.mesh import Group


class CollectiveClock:
    """CPU time of this thread inside the functions below (outermost calls: copies, padding, the
    collective's Python and any wait). `hybridpar profile` reads it around a step on the fake world to
    take that work out of the step: the gloo fits price it with each collective. Two thread_time calls
    per collective, ~1 us."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0


CLOCK = CollectiveClock()


def _clocked(fn):
    import functools
    import time

    @functools.wraps(fn)
    def run(*args, **kwargs):
        CLOCK.depth += 1
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.depth -= 1
            if CLOCK.depth == 0:
                CLOCK.seconds += time.thread_time() - t0
    return run


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def concat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat by copies: the runtime's own concatenations must not be mistaken for a model's
    channel concatenation by hybridpar.parallel.styles.concat.ChannelCatMode."""
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = parts[0].new_empty(shape)
    off = 0
    for p in parts:
        out.narrow(dim, off, p.shape[dim]).copy_(p)
        off += p.shape[dim]
    return out


SMALL_ALLREDUCE_BYTES = 64 << 10  # up to here an allreduce is one round ((P-1)x the bytes sent)


def _one_round(group: Group) -> bool:
    """Exchange by one all_to_all round instead of the backend's multi-round collective (gloo)."""
    return group.pg is not None and dist.get_backend(group.pg) == "gloo"


def _exchange(send: torch.Tensor, group: Group, async_op: bool = False):
    """send [P, ...]: row q goes to rank q of the group; the result's row q came from rank q."""
    out = torch.empty_like(send)
    work = dist.all_to_all_single(out.view(-1), send.contiguous().view(-1), group=group.pg, async_op=async_op)
    return out, work


@_clocked
def all_gather_dim(t: torch.Tensor, dim: int, group: Group, sizes: list[int], log: CommLog,
                   tag: str = "") -> torch.Tensor:
    """Concatenate along `dim` the pieces held by the group's ranks (piece k has sizes[k] there)."""
    if group.size == 1:
        return t
    big = max(sizes)
    # One flat buffer [G, *piece] (all_gather_single): gloo's list form copies every piece in and
    # out of its own flat buffer, and was measured slower in-step.
    shape = list(t.shape)
    shape[dim] = big
    buf = t.contiguous() if t.shape[dim] == big else _padded(t, dim, big)
    out = t.new_empty([group.size, *shape])
    full_shape = list(t.shape)
    full_shape[dim] = sum(sizes)
    with log.timed("allgather", group.size, prod(full_shape) * t.element_size(), tag):
        if group.size > 2 and _one_round(group):  # gloo's ring takes P-1 rounds
            out, _ = _exchange(buf.unsqueeze(0).expand(group.size, *shape), group)
        else:
            dist.all_gather_single(out.flatten(0, 1), buf, group=group.pg)  # gloo: pieces along dim 0
    return concat([o.narrow(dim, 0, n) for o, n in zip(out.unbind(0), sizes)], dim)


@_clocked
def reduce_scatter_dim(t: torch.Tensor, dim: int, group: Group, sizes: list[int], log: CommLog,
                       tag: str = "", async_op: bool = False):
    """Sum `t` over the group and keep this rank's piece along `dim` (piece k has sizes[k]).
    With async_op, returns a handle whose wait() returns that piece (the exchange runs meanwhile;
    the log records the time wait() blocked: what the step pays)."""
    if group.size == 1:
        return _Done(t) if async_op else t
    big = max(sizes)
    shape = list(t.shape)
    shape[dim] = big
    # Pieces side by side in one [G, *piece] buffer (reduce_scatter_single); gloo's list form was
    # measured up to 3x slower in-step at 4 ranks. Uneven pieces are padded with zeros.
    ins = t.new_zeros([group.size, *shape]) if min(sizes) != big else t.new_empty([group.size, *shape])
    off = 0
    for k, n in enumerate(sizes):
        ins[k].narrow(dim, 0, n).copy_(t.narrow(dim, off, n))
        off += n
    out = t.new_empty(shape)
    mine = sizes[group.index]

    def finish(got):
        if got is not None:
            torch.sum(got, 0, out=out)
        return out.narrow(dim, 0, mine) if mine != big else out

    pending = _ReduceScatter(group, ins, out, log, _nbytes(t), tag, finish)
    return pending if async_op else pending.wait()


class _Done:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def wait(self) -> torch.Tensor:
        return self.t


class _ReduceScatter:
    """An issued reduce_scatter; wait() finishes it and records the time it blocked."""

    @_clocked
    def __init__(self, group: Group, ins, out, log: CommLog, nbytes: int, tag: str, finish):
        import time

        self.log, self.args, self.finish = log, (group.size, nbytes, tag), finish
        t0 = time.perf_counter()
        if group.size > 2 and _one_round(group):  # two ranks: one round either way
            self.got, self.work = _exchange(ins, group, async_op=True)
        else:
            self.got = None
            self.work = dist.reduce_scatter_single(out, ins.flatten(0, 1), group=group.pg, async_op=True)
        self.issue_s = time.perf_counter() - t0

    @_clocked
    def wait(self) -> torch.Tensor:
        import time

        t0 = time.perf_counter()
        self.work.wait()
        self.log.record("reduce_scatter", *self.args, seconds=self.issue_s + time.perf_counter() - t0)
        return self.finish(self.got)


def _padded(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = n
    buf = t.new_zeros(shape)
    buf.narrow(dim, 0, t.shape[dim]).copy_(t)
    return buf


class _SumOnWait:
    """The work handle of a one-round allreduce: wait() waits for the exchange and sums into t."""

    def __init__(self, work, got: torch.Tensor, t: torch.Tensor):
        self.work, self.got, self.t = work, got, t

    @_clocked
    def wait(self) -> bool:
        self.work.wait()
        torch.sum(self.got.view(self.got.shape[0], -1), 0, out=self.t.view(-1))
        return True


@_clocked
def all_reduce_(t: torch.Tensor, group: Group, log: CommLog, tag: str = "", async_op: bool = False,
                log_bytes: int | None = None):
    """In-place sum over the group. With async_op, returns the work handle (None for 1 rank).
    log_bytes: the bytes to log when part of `t` is logged under another tag (a value riding along)."""
    if group.size == 1:
        return None
    logged = _nbytes(t) if log_bytes is None else int(log_bytes)
    small = group.size > 2 and _nbytes(t) <= SMALL_ALLREDUCE_BYTES and t.is_contiguous() \
        and _one_round(group)
    if async_op:  # only issued here: the wait happens elsewhere, so there is no time to record
        if small:
            got, work = _exchange(t.unsqueeze(0).expand(group.size, *t.shape), group, async_op=True)
            work = _SumOnWait(work, got, t)
        else:
            work = dist.all_reduce(t, group=group.pg, async_op=True)
        log.record("allreduce", group.size, logged, tag)
        return work
    with log.timed("allreduce", group.size, logged, tag):
        if small:
            got, _ = _exchange(t.unsqueeze(0).expand(group.size, *t.shape), group)
            torch.sum(got.view(group.size, -1), 0, out=t.view(-1))
        elif group.size > 2 and t.is_contiguous() and _one_round(group):
            _two_rounds(t, group)
        else:
            dist.all_reduce(t, group=group.pg)
    return None


def _two_rounds(t: torch.Tensor, group: Group) -> None:
    """A large allreduce as one-round reduce_scatter then one-round allgather (the ring's bytes)."""
    p, flat = group.size, t.view(-1)
    m = -(-flat.numel() // p)
    ins = flat.new_zeros(p * m)
    ins[:flat.numel()].copy_(flat)
    got, _ = _exchange(ins.view(p, m), group)
    mine = got.sum(0)
    full, _ = _exchange(mine.unsqueeze(0).expand(p, m), group)
    flat.copy_(full.view(-1)[:flat.numel()])


@_clocked
def all_to_all_flat(sends: list[torch.Tensor], send_sizes: list[int], recv_sizes: list[int],
                    like: torch.Tensor, group: Group | None, log: CommLog, tag: str = "") -> torch.Tensor:
    """One all_to_all_single: the flat `sends` (send_sizes[q] elements for rank q of the group, in
    order) go out; what arrives comes back flat, in sender order (recv_sizes[q] from rank q).
    group=None: the whole world. Logged as the bytes this rank sends to the other ranks."""
    pg, index, size = (None, dist.get_rank(), dist.get_world_size()) if group is None else \
        (group.pg, group.index, group.size)
    flat_in = torch.cat(sends) if sends else like.new_empty(0)
    flat_out = like.new_empty(sum(recv_sizes))
    with log.timed("alltoall", size, (sum(send_sizes) - send_sizes[index]) * like.element_size(), tag):
        dist.all_to_all_single(flat_out, flat_in, recv_sizes, send_sizes, group=pg)
    return flat_out
