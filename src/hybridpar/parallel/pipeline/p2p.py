"""Activation and gradient transfers as autograd functions.

Each rank threads a scalar *token* through its p2p events in forward order: every Send/Recv
takes the previous token and returns the next. In backward the token's gradient therefore reaches
the events in exactly the reverse order, on every rank, whatever order autograd prefers; with
non-blocking sends this is deadlock-free for any placement, including a->b->a crossings
(a blocked rank always waits on an event at a later forward position than its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridpar.parallel.comm.log import CommLog


def p2p_tag(phase: str, peer: int) -> str:
    """The CommLog tag of a transfer: both ends log it ("send"/"recv", group size 2), so a rank's
    totals are its own traffic."""
    return f"{phase}:dev{peer}"


@dataclass
class Link:
    """p2p endpoint of one rank: global rank of each device of its MP group, message tags,
    the comm log, and the async sends still in flight (waited at the end of the step).

    `directions` (up, down): two process groups over the replica's stages, the first carrying every
    transfer to a higher device, the second every transfer to a lower one (None: the default group).
    Why: gloo's TCP pair serialises its two directions on one lock. A send writes its bytes with the
    lock held; the peer's transfer arriving on the same socket wakes the pair's event thread, which
    on a full machine takes the sender's core and spins on that lock (epoll is level-triggered)
    until the scheduler ends its slice. The wavefront sends both ways at once: on lstm4 with 4 time
    chunks (2 ranks, 2 cores, 30 steps) 24 and 32 of each rank's 360 isend calls (196 KB) took over
    1 ms, up to 9 ms, the caller preempted ("R" in perf's sched_switch) while an event thread ran;
    7 and 6 with a group per direction, the step 88.3 ms against 93.6
    (benchmarks/probe_p2p_directions.py, 2026-12-04)."""

    rank_of_device: Callable[[int], int]
    log: CommLog
    prepost: bool  # post gradient receives during forward (gloo: safe and overlaps)
    pending: list = field(default_factory=list)
    device: int = 0  # this rank's device in the replica (which direction a transfer takes)
    directions: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None

    def _group(self, src_dev: int, dst_dev: int) -> dist.ProcessGroup | None:
        if self.directions is None:
            return None
        return self.directions[0] if src_dev < dst_dev else self.directions[1]

    def isend(self, t: torch.Tensor, dst_dev: int, tag: int, phase: str) -> None:
        buf = t.detach().contiguous().clone()  # the caller may modify t in place later
        group = self._group(self.device, dst_dev)
        self.pending.append((dist.isend(buf, self.rank_of_device(dst_dev), tag=tag, group=group), buf))
        self.log.record("send", 2, buf.numel() * buf.element_size(), p2p_tag(phase, dst_dev))

    def irecv(self, like: torch.Tensor, src_dev: int, tag: int, phase: str) -> _Incoming:
        buf = torch.empty_like(like, memory_format=torch.contiguous_format)
        self.log.record("recv", 2, buf.numel() * buf.element_size(), p2p_tag(phase, src_dev))
        src, group = self.rank_of_device(src_dev), self._group(src_dev, self.device)
        if self.prepost:
            return _Incoming(buf, dist.irecv(buf, src, tag=tag, group=group), None)
        return _Incoming(buf, None, lambda: dist.recv(buf, src, tag=tag, group=group))

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


@dataclass
class _Incoming:
    buf: torch.Tensor
    work: dist.Work | None
    blocking: Callable[[], object] | None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        elif self.blocking is not None:
            self.blocking()
        return self.buf


def new_token(device: torch.device) -> torch.Tensor:
    return torch.zeros((), device=device, requires_grad=True)


class Send(torch.autograd.Function):
    """forward: send the tensors to dst; backward: receive their gradients from dst."""

    @staticmethod
    def forward(ctx, link: Link, dst: int, tag: int, diff: tuple[bool, ...], token, *tensors):
        for i, t in enumerate(tensors):
            link.isend(t, dst, 2 * (tag + i), "fwd")
        ctx.link, ctx.dst, ctx.tag, ctx.diff = link, dst, tag, diff
        # gradients of the differentiable ones; posted now when safe so they land during compute
        ctx.incoming = [link.irecv(t, dst, 2 * (tag + i) + 1, "bwd") if d else None
                        for i, (t, d) in enumerate(zip(tensors, diff))] if link.prepost else None
        ctx.likes = [torch.empty_like(t, device="meta") for t in tensors]
        return token.detach().clone()

    @staticmethod
    def backward(ctx, grad_token):
        incoming = ctx.incoming
        if incoming is None:
            incoming = [ctx.link.irecv(torch.empty_like(like, device=grad_token.device), ctx.dst,
                                       2 * (ctx.tag + i) + 1, "bwd") if d else None
                        for i, (like, d) in enumerate(zip(ctx.likes, ctx.diff))]
        grads = tuple(inc.wait() if inc is not None else None for inc in incoming)
        return (None, None, None, None, grad_token, *grads)


class Recv(torch.autograd.Function):
    """forward: receive tensors from src; backward: send their gradients back to src."""

    @staticmethod
    def forward(ctx, link: Link, src: int, tag: int, diff: tuple[bool, ...], incoming: list[_Incoming],
                token):
        outs = tuple(inc.wait() for inc in incoming)
        ctx.link, ctx.src, ctx.tag, ctx.diff = link, src, tag, diff
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, diff) if not d])
        return (token.detach().clone(), *outs)

    @staticmethod
    def backward(ctx, grad_token, *grads):
        for i, (g, d) in enumerate(zip(grads, ctx.diff)):
            if d:  # unused outputs arrive as zeros (materialised), the sender still waits for them
                ctx.link.isend(g, ctx.src, 2 * (ctx.tag + i) + 1, "bwd")
        return None, None, None, None, None, grad_token
