"""The per-step schedule of a placement: forward, backward and transfer operations and their timing.

For a fixed assignment (task -> device) a step is a set of operations:
  fwd:<t> and bwd:<t> on the task's device (bwd includes the weight update),
  send:<u>@<b>: u's output to device b, once, when some consumer of u is on b != device(u),
  grad:<u>@<b>: the gradient of that output back from b, after every consumer on b ran backward;
  post:<u>@<b> / gpost:<u>@<b>: where the problem has a sender's cost (PlacementProblem.post_time_s),
  the sending device's own work to start send:<u>@<b> (on u's device) and grad:<u>@<b> (on b).
A device runs one operation at a time; a link carries one transfer at a time.
The ILP (ilp.py) encodes exactly these rules; `list_schedule` and `replay` evaluate them in floats.

The MP runtime (hybridpar.parallel.pipeline) runs one order only, `program_schedule`: every rank runs its
forward nodes in the traced program's order and blocks on a receive until the value arrives (it does
not run a later node meanwhile), then autograd runs its backward in reverse creation order (CPU
autograd's ready queue takes the highest sequence number first, and the highest one left is always
ready), blocking in each gradient receive. Measured on inception_mini (2 gloo ranks, load 0.6): a
placement priced 66 ms in a free schedule ran a median 99 ms; program order prices it 88 ms.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridpar.search.placer.problem import PlacementProblem


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # "fwd" | "bwd" | "send" | "grad"
    task: int
    device: int  # compute device, or the receiving device of a transfer
    resources: tuple[str, ...]
    duration: float
    preds: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    ops: tuple[Op, ...]
    start: tuple[float, ...]
    end: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)


def device_resource(d: int) -> str:
    return f"dev{d}"


def build_ops(problem: PlacementProblem, assignment: Sequence[int],
              scale: Callable[[float], float] = float) -> list[Op]:
    """All operations of one step under `assignment`, each after its predecessors in the list.

    `scale` maps seconds to the time unit used (identity for seconds; rounding to integer units for
    the ILP's hint so that the hint is exactly feasible)."""
    n = len(problem.tasks)
    ops: list[Op] = []
    fwd: list[int] = [0] * n
    send: dict[tuple[int, int], int] = {}
    for u, t in enumerate(problem.tasks):
        d = assignment[u]
        ps = []
        for p in problem.preds[u]:
            ps.append(fwd[p] if assignment[p] == d else send[(p, d)])
        fwd[u] = len(ops)
        ops.append(Op(f"fwd:{t.name}", "fwd", u, d, (device_resource(d),), scale(t.fwd_s[d]), tuple(ps)))
        post = problem.post_time_s(t.out_bytes)
        prev = fwd[u]
        for b in sorted({assignment[v] for v in problem.succs[u]} - {d}):
            if post > 0:  # the runtime posts each send right after the producer, one after the other
                ops.append(Op(f"post:{t.name}@{b}", "post", u, d, (device_resource(d),), scale(post), (prev,)))
                prev = len(ops) - 1
            send[(u, b)] = len(ops)
            ops.append(Op(f"send:{t.name}@{b}", "send", u, b, problem.links[d][b],
                          scale(problem.transfer_s(t.out_bytes, d, b)), (prev,)))
    # Backward in reverse task order. The gradient of u's output goes back from device b once b has run
    # the backward of u's first consumer there: the runtime receives u lazily, just before that
    # consumer, so its reverse pass sends the gradient right after it (transfers received at one
    # place: the later transfer first). Listing each gradient there keeps the list in the runtime's
    # order on links too (program_schedule).
    succ = problem.succs
    back_at: dict[int, list[tuple[int, int]]] = {}  # first consumer on b -> [(u, b)]
    for u in range(n):
        first: dict[int, int] = {}
        for v in succ[u]:
            b = assignment[v]
            if b != assignment[u]:
                first[b] = min(first.get(b, v), v)
        for b, v in first.items():
            back_at.setdefault(v, []).append((u, b))
    bwd: list[int] = [0] * n
    grad: dict[tuple[int, int], int] = {}
    for w in reversed(range(n)):
        t = problem.tasks[w]
        d = assignment[w]
        ps = [fwd[w]] + [bwd[v] for v in succ[w] if assignment[v] == d]
        ps += [grad[(w, b)] for b in sorted({assignment[v] for v in succ[w]} - {d})]
        bwd[w] = len(ops)
        ops.append(Op(f"bwd:{t.name}", "bwd", w, d, (device_resource(d),), scale(t.bwd_s[d]), tuple(ps)))
        for u, b in sorted(back_at.get(w, ()), reverse=True):
            a = assignment[u]
            name, nbytes = problem.tasks[u].name, problem.tasks[u].out_bytes
            deps = tuple(bwd[v] for v in succ[u] if assignment[v] == b)
            post = problem.post_time_s(nbytes)
            if post > 0:
                ops.append(Op(f"gpost:{name}@{b}", "gpost", u, b, (device_resource(b),), scale(post), deps))
                deps = (len(ops) - 1,)
            grad[(u, b)] = len(ops)
            ops.append(Op(f"grad:{name}@{b}", "grad", u, a, problem.links[b][a],
                          scale(problem.transfer_s(nbytes, b, a)), deps))
    return ops


def replay(ops: Sequence[Op], order: Sequence[int]) -> Schedule:
    """Semi-active schedule: ops taken in `order` (a topological order), each as early as its
    predecessors and the previous op on each of its resources allow."""
    start = [0.0] * len(ops)
    end = [0.0] * len(ops)
    free: dict[str, float] = {}
    done = [False] * len(ops)
    for i in order:
        op = ops[i]
        if not all(done[p] for p in op.preds):
            raise ValueError(f"replay order is not topological at {op.name}")
        s = max([end[p] for p in op.preds] + [free.get(r, 0.0) for r in op.resources] + [0.0])
        start[i], end[i] = s, s + op.duration
        for r in op.resources:
            free[r] = end[i]
        done[i] = True
    return Schedule(tuple(ops), tuple(start), tuple(end))


def program_schedule(ops: Sequence[Op]) -> Schedule:
    """The schedule of `build_ops`'s operations in the MP runtime's order (module doc): build_ops lists
    every forward in task order, then every backward in reverse task order, so replaying the list as
    it is runs each device, and each link, in that order."""
    return replay(ops, range(len(ops)))


def timed(problem: PlacementProblem, ops: Sequence[Op]) -> Schedule:
    """The schedule a placement is priced with: program order when the problem says the runtime runs
    it (problem.program_order), else earliest-start list scheduling."""
    return program_schedule(ops) if problem.program_order else list_schedule(ops)


def bottom_levels(ops: Sequence[Op]) -> list[float]:
    """Longest path from each op to the end of the step (its own duration included)."""
    succ: list[list[int]] = [[] for _ in ops]
    for i, op in enumerate(ops):
        for p in op.preds:
            succ[p].append(i)
    level = [0.0] * len(ops)
    for i in reversed(range(len(ops))):
        level[i] = ops[i].duration + max((level[s] for s in succ[i]), default=0.0)
    return level


def list_schedule(ops: Sequence[Op]) -> Schedule:
    """Earliest-start list scheduling of a fixed assignment: repeatedly run the ready op that can
    start first, ties to the longest remaining path. Used to time every baseline placement."""
    level = bottom_levels(ops)
    succ: list[list[int]] = [[] for _ in ops]
    missing = [len(op.preds) for op in ops]
    for i, op in enumerate(ops):
        for p in op.preds:
            succ[p].append(i)
    ready_at = [0.0] * len(ops)
    free: dict[str, float] = {}
    # heap keyed by a possibly stale earliest start; re-validated on pop
    heap = [(0.0, -level[i], i) for i, op in enumerate(ops) if not op.preds]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        est, neg, i = heapq.heappop(heap)
        real = max([ready_at[i]] + [free.get(r, 0.0) for r in ops[i].resources])
        if real > est:
            heapq.heappush(heap, (real, neg, i))
            continue
        order.append(i)
        end = real + ops[i].duration
        for r in ops[i].resources:
            free[r] = end
        for s in succ[i]:
            ready_at[s] = max(ready_at[s], end)
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(heap, (ready_at[s], -level[s], s))
    return replay(ops, order)


@dataclass(frozen=True)
class Breakdown:
    """step = compute + exposed transfers along the critical path; idle is the mean device idle time."""

    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    idle_s: float
    busy_s: tuple[float, ...]


def breakdown(schedule: Schedule, num_devices: int) -> Breakdown:
    ops, start, end = schedule.ops, schedule.start, schedule.end
    span = schedule.makespan
    busy = [0.0] * num_devices
    comm = 0.0
    for op, s, e in zip(ops, start, end):
        if op.kind in ("fwd", "bwd"):
            busy[op.device] += e - s
        else:
            comm += e - s
    # walk the critical path back from the last op: each op started when a predecessor or the
    # previous op on one of its resources ended (replay is semi-active, so no gaps)
    last_on: dict[int, list[int]] = {}
    by_res: dict[str, list[int]] = {}
    for i in sorted(range(len(ops)), key=lambda i: (start[i], end[i])):
        for r in ops[i].resources:
            by_res.setdefault(r, []).append(i)
    for lst in by_res.values():
        for a, b in itertools.pairwise(lst):
            last_on.setdefault(b, []).append(a)
    compute = exposed = 0.0
    cur = max(range(len(ops)), key=lambda i: end[i]) if ops else None
    tol = 1e-12 * max(span, 1.0)
    while cur is not None:
        d = end[cur] - start[cur]
        if ops[cur].kind in ("fwd", "bwd"):
            compute += d
        else:
            exposed += d
        nxt = None
        for p in list(ops[cur].preds) + last_on.get(cur, []):
            if abs(end[p] - start[cur]) <= tol:
                nxt = p
                break
        cur = nxt
    idle = sum(span - b for b in busy) / max(num_devices, 1)
    return Breakdown(span, compute, exposed, comm, idle, tuple(busy))
