"""GPipe micro-batches over a placement, priced as the MP runtime runs them, and their count chosen.

The runtime (hybridpar.parallel.pipeline.module, `micro_batches` K) cuts each replica's batch into K
micro-batches and runs, on every device, the forwards of micro-batch 0, 1, ..., K-1 in a row (its
sends are non-blocking, so device d runs micro-batch k while device d+1 runs k-1), then one backward
whose autograd order takes the last micro-batch first: K-1, ..., 0. `micro_batch_ops` builds exactly
that program: K copies of `schedule.build_ops` of the problem at one micro-batch (each task's compute
and output bytes / K; the executor's own cost per node, `Task.overhead_s`, and every transfer's
latency paid once per micro-batch: the bubble and the price of cutting), forwards in micro-batch
order, then backwards in reverse, replayed in program order. The fixed costs per step
(step_overhead_s, update_call_s) are paid once, as without micro-batches.

Each op of a micro-batch is priced by the cost model at B/K samples (`compute`, adapter.task_compute_s),
not as 1/K of the op at B: a micro-batch still reads every weight and writes every gradient, and small
shapes run below a device's peak, so many micro-batches cost more than their bubble saves (measured
on 2 CPU ranks: 16 micro-batches of a wide MLP several times slower than one, where linear scaling
predicted a speed-up). Without `compute` (unit tests of the schedule) compute scales linearly.

1F1B (hybridpar.parallel.pipeline.schedule: torch.distributed.pipelining's Schedule1F1B, for a chain
placement, `chain_devices`) runs the same operations in another order on each device
(`one_f_one_b_order`): its time has GPipe's bubble, its memory holds at most min(K, S - s) micro-batches'
activations on stage s (`pipeline_memory`). `choose_pipeline` picks K and the schedule together under
the devices' memory; `chain_split` is the balanced chain placement for a 1f1b asked of a placement that
is not one. Torch's schedule's own costs (its blocking send/receive pairs per micro-batch) are not priced."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from hybridpar.graph.types import Graph
from hybridpar.search.placer.problem import PlacementProblem
from hybridpar.search.placer.schedule import Op, build_ops, device_resource, program_schedule, replay

MAX_MICRO_BATCHES = 16  # the most the placer tries (each a replay of K x the step's operations)
TIE_REL = 1e-9  # steps within this relative difference are equal (sums of K scaled durations round differently)


# each task's (forward, backward) op seconds at the whole batch and at one of K micro-batches
# (adapter.task_compute_s at sample_frac 1 and 1/K), by task name
OpSeconds = Mapping[str, tuple[float, float]]
MicroCompute = Callable[[int], tuple[OpSeconds, OpSeconds]]


def micro_problem(problem: PlacementProblem, k: int, compute: MicroCompute | None = None) -> PlacementProblem:
    """The problem at one of K micro-batches: bytes / K; the runtime's per-node cost paid whole; the
    ops priced by the cost model at B/K samples where `compute` gives them (what is left of a task's
    time, the loss and the update's share, / K), else all compute / K (a linear scaling, which is
    optimistic: an op at B/K samples still reads all its weights and writes all its gradients)."""
    if k == 1:
        return problem
    whole, micro = compute(k) if compute is not None else ({}, {})

    def scaled(times: tuple[float, ...], fixed: float, name: str, half: int) -> tuple[float, ...]:
        op_b = whole[name][half] if name in whole and name in micro else 0.0
        op_k = micro[name][half] if op_b else 0.0
        return tuple(fixed + op_k + max(0.0, x - fixed - op_b) / k for x in times)

    tasks = tuple(dataclasses.replace(t, fwd_s=scaled(t.fwd_s, t.overhead_s, t.name, 0),
                                      bwd_s=scaled(t.bwd_s, 0.0, t.name, 1),
                                      out_bytes=-(-t.out_bytes // k)) for t in problem.tasks)
    return dataclasses.replace(problem, tasks=tasks)


def micro_batch_ops(problem: PlacementProblem, assignment: Sequence[int], k: int,
                    compute: MicroCompute | None = None) -> list[Op]:
    """The operations of one step of K micro-batches in the runtime's program order (module doc)."""
    return _tagged_ops(problem, assignment, k, compute)[0]


def _tagged_ops(problem: PlacementProblem, assignment: Sequence[int], k: int,
                compute: MicroCompute | None = None) -> tuple[list[Op], list[tuple[int, str]]]:
    """micro_batch_ops, and each op's (micro-batch, "F" | "B"): the forward or backward half of its step."""
    one = build_ops(micro_problem(problem, k, compute), assignment)
    first_bwd = next((i for i, op in enumerate(one) if op.kind in ("bwd", "gpost", "grad")), len(one))
    if k == 1:
        return one, [(0, "F" if i < first_bwd else "B") for i in range(len(one))]
    ops: list[Op] = []
    tags: list[tuple[int, str]] = []
    index: dict[tuple[int, int], int] = {}  # (micro-batch, op of `one`) -> position in `ops`

    def add(m: int, i: int) -> None:
        op = one[i]
        preds = tuple(index[(m, p)] for p in op.preds)
        index[(m, i)] = len(ops)
        ops.append(dataclasses.replace(op, name=f"{op.name}#{m}", preds=preds))
        tags.append((m, "F" if i < first_bwd else "B"))

    for m in range(k):
        for i in range(first_bwd):
            add(m, i)
    for m in reversed(range(k)):
        for i in range(first_bwd, len(one)):
            add(m, i)
    return ops, tags


def micro_batch_step_s(problem: PlacementProblem, assignment: Sequence[int], k: int,
                       schedule: str = "gpipe", compute: MicroCompute | None = None) -> float:
    """The predicted step of the placement run with K micro-batches: GPipe in the runtime's program order,
    or 1F1B (`one_f_one_b_order`, a chain placement only)."""
    if schedule == "1f1b":
        order = chain_devices(problem, assignment)
        if order is None:
            raise ValueError("1f1b prices a chain placement only")
        # the model's inputs are fed to the first stage by the data loader (chain_devices), wherever the
        # placer put their (free) tasks: priced there, or an input on the last stage would be sent to
        # the first and its 1F1B order could not be kept (the last stage's backward before it sends the
        # next micro-batch's input: a deadlock the replay refused, on the branchy CNN of bench_validation)
        assignment = [order[0] if not problem.preds[u] else d for u, d in enumerate(assignment)]
        ops, tags = _tagged_ops(problem, assignment, k, compute)
        span = replay(ops, one_f_one_b_order(ops, tags, order, k)).makespan
    else:
        span = program_schedule(micro_batch_ops(problem, assignment, k, compute)).makespan
    return span + problem.step_overhead_s + problem.update_call_s


def chain_devices(problem: PlacementProblem, assignment: Sequence[int]) -> tuple[int, ...] | None:
    """The devices in stage order when the placement is a chain of stages over all of them, as the 1F1B
    runtime needs (hybridpar.parallel.pipeline.schedule.chain_order): every value crosses from a stage
    to the next, the model's inputs (tasks without predecessors, wherever placed: the data loader feeds
    their consumers) are read by the first stage only, its outputs computed on the last. Else None."""
    preds, succs = problem.preds, problem.succs
    nxt: dict[int, int] = {}
    prev: dict[int, int] = {}
    for u, d in enumerate(assignment):
        if not preds[u]:
            continue
        for v in succs[u]:
            e = assignment[v]
            if e != d and (nxt.setdefault(d, e) != e or prev.setdefault(e, d) != d):
                return None
    used = {d for u, d in enumerate(assignment) if preds[u]}
    starts = [d for d in used if d not in prev]
    if len(used) != problem.num_devices or len(starts) != 1:
        return None
    order = [starts[0]]
    while order[-1] in nxt and len(order) <= problem.num_devices:
        order.append(nxt[order[-1]])
    if len(order) != problem.num_devices:
        return None
    sources_ok = all(assignment[v] == order[0] for u in range(len(assignment)) if not preds[u] for v in succs[u])
    sinks_ok = all(assignment[u] == order[-1] for u in range(len(assignment)) if preds[u] and not succs[u])
    return tuple(order) if sources_ok and sinks_ok else None


def one_f_one_b_order(ops: Sequence[Op], tags: Sequence[tuple[int, str]], order: Sequence[int], k: int) -> list[int]:
    """A replay order of the K micro-batches' operations in which each device runs torch's Schedule1F1B:
    stage s runs the forwards of min(K, S - s) micro-batches, then alternates one backward and one
    forward, then the remaining backwards; transfers go as soon as their value is ready."""
    n_stages = len(order)
    blocks: dict[int, list[tuple[int, str]]] = {}
    for s, d in enumerate(order):
        warm = min(k, n_stages - s)
        seq = [(m, "F") for m in range(warm)]
        for j in range(k):
            seq.append((j, "B"))
            if warm + j < k:
                seq.append((warm + j, "F"))
        blocks[d] = seq
    device_of = {device_resource(d): d for d in order}
    per_block: dict[tuple[int, int, str], list[int]] = {}
    transfers: list[int] = []
    for i, op in enumerate(ops):
        dev = next((device_of[r] for r in op.resources if r in device_of), None)
        if dev is None:
            transfers.append(i)
        else:
            per_block.setdefault((dev, *tags[i]), []).append(i)
    queues = {d: [i for m, ph in blocks[d] for i in per_block.get((d, m, ph), [])] for d in order}
    return _merge(ops, queues, transfers)


def _merge(ops: Sequence[Op], queues: dict[int, list[int]], transfers: list[int]) -> list[int]:
    """A topological order keeping each device's queue in its order (transfers when their value is ready)."""
    done = [False] * len(ops)
    out: list[int] = []
    heads = dict.fromkeys(queues, 0)
    waiting = list(transfers)
    def flush() -> None:  # each transfer right after the op that made it ready: a link's order is readiness
        nonlocal waiting
        while True:
            ready = [i for i in waiting if all(done[p] for p in ops[i].preds)]
            if not ready:
                return
            for i in ready:
                done[i] = True
                out.append(i)
            waiting = [i for i in waiting if not done[i]]

    flush()
    while len(out) < len(ops):
        moved = False
        for d, q in queues.items():
            while heads[d] < len(q) and all(done[p] for p in ops[q[heads[d]]].preds):
                done[q[heads[d]]] = True
                out.append(q[heads[d]])
                heads[d] += 1
                moved = True
                flush()
        if not moved:
            raise ValueError("1f1b order: the placement is not a chain of stages")
    return out


def pipeline_memory(problem: PlacementProblem, assignment: Sequence[int], k: int, schedule: str,
                    act_bytes: Sequence[int]) -> list[int]:
    """Each device's bytes during the step: as priced for one micro-batch (result.memory_per_device: its
    tasks' weights, gradients, optimizer state and the whole batch's kept activations, and the activations
    it receives) with the activations in flight instead: GPipe holds all K micro-batches' (the whole
    batch's), 1F1B at most min(K, S - s) on stage s. `act_bytes`: each task's kept activations for the
    whole batch (task_activation_bytes)."""
    from hybridpar.search.placer.result import memory_per_device

    mem = memory_per_device(problem, assignment)
    act = [0] * problem.num_devices
    for u, d in enumerate(assignment):
        act[d] += act_bytes[u]
        for b in {assignment[v] for v in problem.succs[u]} - {d}:
            act[b] += problem.tasks[u].out_bytes  # a received activation, kept for its backward
    if schedule != "1f1b":
        return mem
    order = chain_devices(problem, assignment) or ()
    for s, d in enumerate(order):
        in_flight = min(k, len(order) - s)
        mem[d] -= act[d] - -(-act[d] * in_flight // k)
    return mem


def candidate_counts(samples: int, limit: int = MAX_MICRO_BATCHES) -> list[int]:
    """Micro-batch counts worth pricing for `samples` per replica: those that cut it evenly (an
    exported graph needs it; equal pieces keep the pipeline balanced), up to `limit`."""
    return [k for k in range(1, min(samples, limit) + 1) if samples % k == 0]


def choose_micro_batches(problem: PlacementProblem, assignment: Sequence[int], samples: int,
                         limit: int = MAX_MICRO_BATCHES,
                         compute: MicroCompute | None = None) -> tuple[int, dict[int, float]]:
    """(the count with the shortest predicted step, every candidate's step); ties go to fewer: a count
    must beat every smaller one by more than rounding (TIE_REL) to be chosen, so a placement on one
    device (nothing to overlap) keeps one micro-batch."""
    steps = {k: micro_batch_step_s(problem, assignment, k, compute=compute) for k in candidate_counts(samples, limit)}
    fastest = min(steps.values())
    best = min(k for k, v in steps.items() if v <= fastest * (1 + TIE_REL))
    return best, steps


def choose_pipeline(problem: PlacementProblem, assignment: Sequence[int], samples: int,
                    act_bytes: Sequence[int], *, counts: Sequence[int] | None = None,
                    schedules: Sequence[str] = ("gpipe", "1f1b"),
                    compute: MicroCompute | None = None) -> tuple[int, str, dict[tuple[int, str], float], bool]:
    """(K, schedule, every candidate's predicted step, whether it fits) chosen together: the shortest
    step among the candidates whose every device fits its memory (pipeline_memory); 1F1B only for a
    chain placement and K >= its stage count. Ties (within TIE_REL): fewer micro-batches, then the
    smaller peak memory (1F1B's). No candidate fits: the one with the smallest peak memory, and False
    (the caller says so: the plan is over the memory limit)."""
    chain = chain_devices(problem, assignment)
    cap = problem.mem_capacity_bytes
    cands: dict[tuple[int, str], float] = {}
    peak: dict[tuple[int, str], int] = {}
    fits: dict[tuple[int, str], bool] = {}
    for k in counts if counts is not None else candidate_counts(samples):
        for sched in schedules:
            if sched == "1f1b" and (chain is None or k < len(chain)):
                continue
            mem = pipeline_memory(problem, assignment, k, sched, act_bytes)
            cands[(k, sched)] = micro_batch_step_s(problem, assignment, k, sched, compute)
            peak[(k, sched)] = max(mem)
            fits[(k, sched)] = all(m <= c for m, c in zip(mem, cap))
    if not cands:
        raise ValueError("no micro-batch schedule to price (1f1b asked for a placement that is not a chain)")
    ok = [c for c in cands if fits[c]]
    if not ok:
        best = min(cands, key=lambda c: (peak[c], cands[c]))
        return best[0], best[1], cands, False
    fastest = min(cands[c] for c in ok)
    best = min((c for c in ok if cands[c] <= fastest * (1 + TIE_REL)), key=lambda c: (c[0], peak[c]))
    return best[0], best[1], cands, True


def task_activation_bytes(coarse: Graph, fine: Graph, dtype: str = "fp32") -> dict[str, int]:
    """Each coarse node's (task's) kept activations for the whole batch: the activation part of its
    mem_bytes (adapter.problem_from_graph counts them with the same rule)."""
    from hybridpar.cost.memory import kept_activations, node_kept_bytes
    from hybridpar.graph.types import DTYPE_BYTES
    from hybridpar.search.placer.adapter import members
    from hybridpar.search.placer.unroll import chunk_of, share

    b = DTYPE_BYTES[dtype]
    kept = set(kept_activations(fine))
    out = {}
    for n in coarse.nodes:
        c, k = chunk_of(n)
        total = sum(node_kept_bytes(fine.node(x), x in kept, b) for x in members(n) if fine.by_name.get(x) is not None)
        out[n.name] = share(total, c, k)
    return out


def chain_split(problem: PlacementProblem) -> tuple[int, ...] | None:
    """A chain placement over all M devices for 1F1B (PipeDream's kind of split): M contiguous stages of
    the task order on devices 0..M-1, the slowest stage's compute (forward + backward) as short as it
    gets, each fitting its device's memory; None when no such split is a chain (chain_devices: a value
    would skip a stage) or none fits."""
    n, m = len(problem.tasks), problem.num_devices
    if n < m:
        return None
    work = [0.0]
    mem = [0]
    for t in problem.tasks:
        work.append(work[-1] + max(t.fwd_s) + max(t.bwd_s))
        mem.append(mem[-1] + t.mem_bytes)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for s in range(1, m + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or mem[j] - mem[i] > problem.mem_capacity_bytes[s - 1]:
                    continue
                c = max(best[s - 1][i], work[j] - work[i])
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    if best[m][n] == inf:
        return None
    assignment = [0] * n
    j = n
    for s in range(m, 0, -1):
        i = cut[s][j]
        assignment[i:j] = [s - 1] * (j - i)
        j = i
    return tuple(assignment) if chain_devices(problem, assignment) is not None else None
