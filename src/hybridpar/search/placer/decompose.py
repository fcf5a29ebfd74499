"""Exact decomposition of a placement problem at articulation tasks (a lower bound and a warm start).

An articulation task lies on every path from the graph's inputs to its main output (the sink with the
most ancestors), with no input after it: Inception-V3's concatenations between its modules, ResNet's
block outputs. Cut there, a step splits into segments that never overlap in time: segment k's
forward runs after the forward of the articulation task a_{k-1} before it and ends with a_k's
forward; its backward starts with a_k's backward and ends before a_{k-1}'s. So the step is

    sum over segments of (forward span + backward span),

each segment depending only on its own tasks' devices and on the devices of its two articulation
tasks. For every pair of boundary devices each segment is solved exactly by the same CP-SAT model
(the entry task a_{k-1} enters as a zero-time copy that only sends its output and receives its
gradient), and a dynamic programme over the chain of articulation tasks picks the devices: the sum of
the segments' optima is the optimum, the sum of their proven bounds a lower bound.

What the decomposition leaves out is only ever a relaxation, so the bound stays valid: tasks off the
main path (side outputs, such as Inception-V3's auxiliary head) are dropped from the bound and placed
afterwards for the warm start; the memory limit is checked per segment only (the joined placement is
checked whole before it is used). Tied tasks (time chunks) would couple segments: problems with ties
are not decomposed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridpar.search.placer.cpsat import build_model, run, wall_net
from hybridpar.search.placer.problem import PlacementProblem, Task
from hybridpar.search.placer.schedule import Op, build_ops, program_schedule, replay
from hybridpar.toposort import topological_order

INF = math.inf


@dataclass(frozen=True)
class Segment:
    entry: int | None  # the articulation task before the segment (None for the first segment)
    tasks: tuple[int, ...]  # in topological order; the last is the segment's exit articulation task


@dataclass(frozen=True)
class Split:
    segments: tuple[Segment, ...]
    side: tuple[int, ...]  # tasks that are not ancestors of the main output


def split(problem: PlacementProblem) -> Split | None:
    """The segments between articulation tasks, or None when there are fewer than two (or ties)."""
    n = len(problem.tasks)
    if n < 3 or any(t.tie for t in problem.tasks):
        return None
    preds, succs = problem.preds, problem.succs
    anc = [0] * n  # ancestor sets as bit masks (tasks are in topological order)
    for t in range(n):
        for u in preds[t]:
            anc[t] |= anc[u] | (1 << u)
    sinks = [t for t in range(n) if not succs[t]]
    main_sink = max(sinks, key=lambda t: (anc[t].bit_count(), t))
    main = anc[main_sink] | (1 << main_sink)
    order = [t for t in range(n) if main >> t & 1]
    side = tuple(t for t in range(n) if not main >> t & 1)
    pos = {t: k for k, t in enumerate(order)}
    cover = [0] * (len(order) + 1)
    for v in order:
        for u in preds[v]:
            cover[pos[u] + 1] += 1
            cover[pos[v]] -= 1
    last_source = max(pos[t] for t in order if not preds[t])
    segments: list[Segment] = []
    jumped, start, entry = 0, 0, None
    for k, t in enumerate(order):
        jumped += cover[k]
        if jumped == 0 and k >= last_source:  # no edge jumps over t and no input comes after it
            segments.append(Segment(entry, tuple(order[start:k + 1])))
            entry, start = t, k + 1
    if len(segments) < 2:
        return None
    return Split(tuple(segments), side)


def subproblem(problem: PlacementProblem, seg: Segment) -> PlacementProblem:
    """The segment alone: its entry as a zero-time copy (it only sends its output and receives the
    gradient), then its tasks with the inputs inside the segment."""
    m = problem.num_devices
    tasks: list[Task] = []
    if seg.entry is not None:
        e = problem.tasks[seg.entry]
        tasks.append(Task(e.name, (), (0.0,) * m, (0.0,) * m, 0, e.out_bytes, e.modules))
    inside = {t.name for t in tasks} | {problem.tasks[t].name for t in seg.tasks}
    for t in seg.tasks:
        task = problem.tasks[t]
        tasks.append(dataclasses.replace(task, inputs=tuple(i for i in task.inputs if i in inside)))
    return dataclasses.replace(problem, name=f"{problem.name}[{tasks[0].name}..{tasks[-1].name}]",
                               tasks=tuple(tasks))


@dataclass(frozen=True)
class _Part:
    """One segment solved with its boundary devices fixed (labels in the solve's own numbering)."""

    objective: float  # INF when no placement was found
    bound: float  # proven lower bound (INF when infeasible)
    assignment: tuple[int, ...] | None
    starts: dict[tuple[str, int, int], int]  # (op kind, task position, receiving device or -1) -> start
    fwd_end: int  # when the exit's forward ends (the segment's forward span)
    wall_stopped: bool = False  # the wall-clock net ended its search (cpsat.run)


@dataclass(frozen=True)
class Decomposed:
    lower: int  # proven lower bound on the whole step, in the ILP's integer time units
    upper: float  # the joined segments' step (INF when some segment found nothing)
    assignment: list[int] | None  # every task's device (side tasks placed greedily), or None
    op_keys: dict[str, float]  # global start of every op of the main tasks, for the replay order
    optimal_segments: int
    solves: int
    note: str

    def relabelled(self, perm: Sequence[int]) -> Decomposed:
        """The same placement with device d renamed perm[d] (op names carry receiving devices)."""
        keys = {}
        for name, k in self.op_keys.items():
            kind, _, rest = name.partition(":")
            if "@" in rest:
                task, _, dev = rest.rpartition("@")
                name = f"{kind}:{task}@{perm[int(dev)]}"
            keys[name] = k
        a = None if self.assignment is None else [perm[d] for d in self.assignment]
        return dataclasses.replace(self, assignment=a, op_keys=keys)

    def keys(self, ops: Sequence[Op]) -> list[float]:
        """A start key per op: the joined segments' start, or (side tasks) right after its inputs."""
        out: list[float] = []
        for op in ops:
            k = self.op_keys.get(op.name)
            out.append(k if k is not None else max((out[p] for p in op.preds), default=0.0))
        return out


def _signature(sub: PlacementProblem) -> tuple:
    """What a segment's solve depends on, without its task names."""
    index = {t.name: i for i, t in enumerate(sub.tasks)}
    return tuple((t.fwd_s, t.bwd_s, t.mem_bytes, t.out_bytes, tuple(index[i] for i in t.inputs)) for t in sub.tasks)


def _automorphisms(problem: PlacementProblem) -> list[tuple[int, ...]] | None:
    """Device relabellings that map the problem to itself (None: every one does). Checked: task times
    per device, memory, bandwidth, latency, and which transfers share a link. Up to 6 devices (720
    relabellings); beyond, only the identity."""
    m = problem.num_devices
    if problem.devices_interchangeable:
        return None
    ident = tuple(range(m))
    if m > 6:
        return [ident]
    pairs = [(a, b) for a in range(m) for b in range(m) if a != b]
    share = {(p, r): bool(set(problem.links[p[0]][p[1]]) & set(problem.links[r[0]][r[1]]))
             for p in pairs for r in pairs}
    cols = [tuple((t.fwd_s[d], t.bwd_s[d]) for t in problem.tasks) for d in range(m)]
    out = []
    for g in itertools.permutations(range(m)):
        if any(cols[g[d]] != cols[d] or problem.mem_capacity_bytes[g[d]] != problem.mem_capacity_bytes[d]
               for d in range(m)):
            continue
        if any(problem.bw_Bps[g[a]][g[b]] != problem.bw_Bps[a][b]
               or problem.latency_s[g[a]][g[b]] != problem.latency_s[a][b] for a, b in pairs):
            continue
        if any(share[((g[p[0]], g[p[1]]), (g[r[0]], g[r[1]]))] != v for (p, r), v in share.items()):
            continue
        out.append(g)
    return out


def _relabel(m: int, pairs: dict[int, int]) -> list[int]:
    """A device permutation sending each key of `pairs` to its value, the rest in increasing order."""
    perm = [-1] * m
    for a, b in pairs.items():
        perm[a] = b
    free = [d for d in range(m) if d not in pairs.values()]
    for a in range(m):
        if perm[a] < 0:
            perm[a] = free.pop(0)
    return perm


def solve_decomposed(problem: PlacementProblem, q: Callable[[float], int], *, budget: float, seed: int = 0,
                     max_share: float = 0.5) -> Decomposed | None:
    """Solve every segment for every pair of boundary devices, join them by dynamic programming.

    `budget`: deterministic seconds for all segment solves together (each gets an equal share and its
    own wall-clock safety net, cpsat.wall_net: no shared deadline, so a busy machine skips nothing and
    answers the same, later). None when the graph does not split, or when
    its largest segment holds more than `max_share` of the tasks: solving that one M^2 times costs
    more than solving the whole graph once (GNMT without time chunks: 30 of 34 tasks)."""
    sp = split(problem)
    if sp is None or max(len(seg.tasks) for seg in sp.segments) > max_share * len(problem.tasks):
        return None
    m = problem.num_devices
    subs = [subproblem(problem, seg) for seg in sp.segments]
    canon = _Canon(m, _automorphisms(problem))
    # one solve per distinct (segment content, representative boundary pair): identical modules
    # (Inception-V3's Mixed_6c and 6d) are solved once
    sigs = [_signature(sub) for sub in subs]
    jobs: dict[tuple, tuple[int, int | None, int]] = {}
    for k, seg in enumerate(sp.segments):
        for d_in in ([None] if seg.entry is None else range(m)):
            for d_out in range(m):
                (r_in, r_out), _ = canon(d_in, d_out)
                jobs.setdefault((sigs[k], r_in, r_out), (k, r_in, r_out))
    share = budget / max(len(jobs), 1)
    solved = {key: _solve_part(subs[k], q, d_in, d_out, (share, seed))
              for key, (k, d_in, d_out) in jobs.items()}

    def part(k: int, d_in: int | None, d_out: int) -> tuple[_Part, list[int]]:
        """The solved part for actual devices (d_in, d_out) and the relabelling from its labels."""
        (r_in, r_out), perm = canon(d_in, d_out)
        return solved[(sigs[k], r_in, r_out)], perm

    lower, upper, exits = _join(len(sp.segments), m, part)
    proven = sum(1 for p in solved.values() if p.objective == p.bound and p.objective < INF)
    note = (f"decomposition: {len(sp.segments)} segments at articulation nodes, {len(solved)} segment solves "
            f"({proven} proven optimal)")
    stopped = sum(1 for p in solved.values() if p.wall_stopped)
    if stopped:
        note += f"; the wall-clock safety net cut {stopped} of them short (a very busy machine)"
    lower_int = 0 if lower == INF else int(math.ceil(lower))
    if upper == INF:
        return Decomposed(lower_int, INF, None, {}, proven, len(solved), note)
    chosen = [part(k, None if k == 0 else exits[k - 1], exits[k]) for k in range(len(sp.segments))]
    assignment, keys = _joined_schedule(problem, sp, chosen)
    if sp.side:
        assignment = _place_side(problem, assignment, sp.side, keys, q)
    return Decomposed(lower_int, upper, assignment, keys, proven, len(solved), note)


class _Canon:
    """The representative of a boundary device pair (d_in, d_out) under the device symmetries
    (`group`: None when all devices are interchangeable), and the relabelling from the
    representative's device labels to the actual ones."""

    def __init__(self, m: int, group):
        self.m, self.group = m, group

    def __call__(self, d_in: int | None, d_out: int) -> tuple[tuple[int | None, int], list[int]]:
        m = self.m
        if self.group is None:  # all devices interchangeable
            if d_in is None:
                return (None, 0), _relabel(m, {0: d_out})
            if d_in == d_out:
                return (0, 0), _relabel(m, {0: d_in})
            return (0, 1), _relabel(m, {0: d_in, 1: d_out})
        g = min(self.group, key=lambda g: (-1 if d_in is None else g[d_in], g[d_out]))
        inv = [0] * m
        for a, b in enumerate(g):
            inv[b] = a
        return (None if d_in is None else g[d_in], g[d_out]), inv


def _solve_part(sub: PlacementProblem, q: Callable[[float], int], d_in: int | None, d_out: int,
                limits: tuple[float, int]) -> _Part:
    """One segment solved exactly with its entry on `d_in` (None: no entry) and its exit on `d_out`.
    `limits`: (deterministic seconds, seed)."""
    share, seed = limits
    m = sub.num_devices
    last = len(sub.tasks) - 1
    fixed = {last: d_out} if d_in is None else {0: d_in, last: d_out}
    fdur = [[q(t.fwd_s[d]) for d in range(m)] for t in sub.tasks]
    bdur = [[q(t.bwd_s[d]) for d in range(m)] for t in sub.tasks]
    horizon = sum(max(f) + max(b) for f, b in zip(fdur, bdur)) + 2 * sum(
        max((q(sub.transfer_s(t.out_bytes, a, b)) for a in range(m) for b in range(m) if a != b), default=0)
        for t in sub.tasks)
    mdl = build_model(sub, q, horizon, fixed=fixed, symmetry=False)
    sol = run(mdl, sub, det_time=share, wall_s=wall_net(share), workers=1, seed=seed)
    if sol.status == "infeasible":
        return _Part(INF, INF, None, {}, 0)
    if sol.assignment is None:
        return _Part(INF, float(sol.bound), None, {}, 0, sol.wall_stopped)
    index = {t.name: i for i, t in enumerate(sub.tasks)}
    starts = {}
    for name, st in sol.starts.items():
        kind, _, rest = name.partition(":")
        task, _, dev = rest.rpartition("@") if "@" in rest else (rest, "", "-1")
        starts[(kind, index[task], int(dev))] = st
    fwd_end = sol.starts[f"fwd:{sub.tasks[last].name}"] + fdur[last][d_out]
    return _Part(float(sol.objective), float(max(sol.bound, 0)), sol.assignment, starts, fwd_end, sol.wall_stopped)


def _join(nseg: int, m: int, part) -> tuple[float, float, list[int]]:
    """(lower bound, best step, exit device of each segment): a dynamic programme over the exit
    device of each segment, for the bound and for the placement."""
    lb = {d: part(0, None, d)[0].bound for d in range(m)}
    ub = {d: part(0, None, d)[0].objective for d in range(m)}
    back: list[dict[int, int | None]] = [{d: None for d in range(m)}]
    for k in range(1, nseg):
        new_lb, new_ub, arg = {}, {}, {}
        for d2 in range(m):
            new_lb[d2] = min(lb[d] + part(k, d, d2)[0].bound for d in range(m))
            cands = [(ub[d] + part(k, d, d2)[0].objective, d) for d in range(m)]
            new_ub[d2], arg[d2] = min(cands)
        lb, ub = new_lb, new_ub
        back.append(arg)
    upper, last_dev = min((v, d) for d, v in ub.items())
    exits = [0] * nseg  # walk back the chosen exit devices
    exits[-1] = last_dev
    for k in range(nseg - 1, 0, -1):
        exits[k - 1] = back[k][exits[k]]
    return min(lb.values()), upper, exits


def _joined_schedule(problem: PlacementProblem, sp, chosen: list[tuple[_Part, list[int]]]
                     ) -> tuple[list[int], dict[str, float]]:
    """(assignment, op start by name) of the chosen parts joined: forwards segment after segment,
    then backwards in reverse."""
    assignment = [-1] * len(problem.tasks)
    for seg, (p, perm) in zip(sp.segments, chosen):
        offset = 0 if seg.entry is None else 1
        for i, t in enumerate(seg.tasks):
            assignment[t] = perm[p.assignment[offset + i]]
    total_fwd = sum(p.fwd_end for p, _ in chosen)
    keys: dict[str, float] = {}
    fwd_off, bwd_off = 0, total_fwd + sum(p.objective - p.fwd_end for p, _ in chosen)
    for seg, (p, perm) in zip(sp.segments, chosen):
        bwd_off -= p.objective - p.fwd_end
        names = [problem.tasks[t].name for t in ([] if seg.entry is None else [seg.entry]) + list(seg.tasks)]
        for (kind, i, dev), s in p.starts.items():
            if seg.entry is not None and i == 0 and kind in ("fwd", "bwd"):
                continue  # the entry's own compute belongs to the segment before
            name = f"{kind}:{names[i]}" + (f"@{perm[dev]}" if dev >= 0 else "")
            keys[name] = fwd_off + s if kind in ("fwd", "send", "post") else bwd_off + (s - p.fwd_end)
        fwd_off += p.fwd_end
    return assignment, keys


def _place_side(problem: PlacementProblem, assignment: list[int], side: Sequence[int], keys: dict[str, float],
                q: Callable[[float], int]) -> list[int]:
    """Side tasks (off the main path) one by one on the device that keeps the replayed step shortest,
    starting next to their first input."""
    a = list(assignment)
    for t in side:  # topological: a side task's inputs are placed before it
        ins = problem.preds[t]
        a[t] = a[ins[0]] if ins else 0
    dec = Decomposed(0, 0.0, a, keys, 0, 0, "")
    for t in side:
        best = None
        for d in range(problem.num_devices):
            trial = list(a)
            trial[t] = d
            ops = build_ops(problem, trial, q)
            ks = dec.keys(ops)
            span = (program_schedule(ops) if problem.program_order else
                    replay(ops, topological_order([op.preds for op in ops], key=lambda i: (ks[i], i)))).makespan
            if best is None or span < best[0]:
                best = (span, d)
        a[t] = best[1]
    return a
