"""The abstract placement problem DLPlacer solves: a DAG of tasks, M devices, the links between them.

Kept free of Graph/Cluster so that the solver, the baselines and the brute-force check can be tested on
random graphs; `adapter.problem_from_graph` builds one from a model graph and a cluster preset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from hybridpar.errors import InfeasibleError, UserError
from hybridpar.toposort import topological_order


@dataclass(frozen=True)
class Task:
    """One node of the (coarsened) graph.

    fwd_s / bwd_s: time on each device (bwd_s includes this task's weight update, which runs right
    after its backward on the same device). mem_bytes: resident on its device for the whole step
    (weights, gradients, optimizer state, activations kept for backward). out_bytes: the output
    activation, sent once to every other device that consumes it (its gradient travels back).
    grad_bytes: the task's weight gradients (what data parallelism allreduces).
    tie: tasks with the same non-empty tie must share a device (the time chunks of one module, which
    the runtime places whole); each is still scheduled on its own.
    overhead_s: the part of fwd_s that is the MP runtime's own work (its executor's cost per graph
    node), which one process running the model eagerly does not pay.
    """

    name: str
    inputs: tuple[str, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    mem_bytes: int = 0
    out_bytes: int = 0
    modules: tuple[str, ...] = ()
    grad_bytes: int = 0
    tie: str = ""
    overhead_s: float = 0.0


@dataclass(frozen=True)
class PlacementProblem:
    """Tasks in topological order; bw_Bps/latency_s/links are M x M (diagonal unused).

    links[a][b] are the ids of the links a transfer a->b occupies; transfers sharing a link id are
    serialised (the solver and the simulator both treat a link as one resource).
    step_overhead_s: a fixed cost of every step of the MP runtime, whatever the placement (its loss
    allreduce across the group); added to the schedule's makespan in PlacementResult.step_time_s.
    program_order: each device runs its operations in the MP runtime's order (schedule.program_schedule):
    its forwards in task order, then its backwards in reverse task order, waiting for a value it needs
    rather than running a later operation meanwhile. False: any order (DLPlacer's free schedule, which
    the runtime does not run; a what-if).
    """

    name: str
    tasks: tuple[Task, ...]
    num_devices: int
    mem_capacity_bytes: tuple[int, ...]
    bw_Bps: tuple[tuple[float, ...], ...]
    latency_s: tuple[tuple[float, ...], ...]
    links: tuple[tuple[tuple[str, ...], ...], ...]
    device_ids: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=())
    step_overhead_s: float = 0.0
    program_order: bool = False
    # the sender's own work to start one transfer (the runtime's copy and isend call on its thread),
    # seconds + seconds per byte: the sending device is busy for it (localhost: measured, p2p_post)
    post_s: float = 0.0
    post_s_per_byte: float = 0.0
    # every device's fixed compute once its backward is done: the optimizer's step() and zero_grad()
    # calls (their per-tensor work is in each task's bwd_s); added to the makespan like step_overhead_s
    update_call_s: float = 0.0
    # how much every task's compute is stretched over one process alone on the same machine (ranks
    # sharing cores, a step moving at its slowest rank's pace: DeviceSpec.time_share); 1 on GPUs
    time_share: float = 1.0

    def __post_init__(self) -> None:
        m = self.num_devices
        if m < 1:
            raise UserError(f"number of devices must be >= 1, got {m}")
        if len(self.mem_capacity_bytes) != m:
            raise ValueError("mem_capacity_bytes needs one entry per device")
        for mat in (self.bw_Bps, self.latency_s, self.links):
            if len(mat) != m or any(len(row) != m for row in mat):
                raise ValueError("bw_Bps, latency_s and links must be num_devices x num_devices")
        seen: set[str] = set()
        for t in self.tasks:
            if len(t.fwd_s) != m or len(t.bwd_s) != m:
                raise ValueError(f"task {t.name}: fwd_s/bwd_s need one time per device")
            missing = [i for i in t.inputs if i not in seen]
            if missing:
                raise ValueError(f"task {t.name}: input {missing[0]} not an earlier task (not topological)")
            seen.add(t.name)
        if len(seen) != len(self.tasks):
            raise ValueError("task names must be unique")

    @cached_property
    def index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tasks)}

    @cached_property
    def preds(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.index[i] for i in t.inputs) for t in self.tasks)

    @cached_property
    def tie_root(self) -> tuple[int, ...]:
        """For every task, the first task of its tie group (itself when untied)."""
        first: dict[str, int] = {}
        return tuple(first.setdefault(t.tie, i) if t.tie else i for i, t in enumerate(self.tasks))

    def respects_ties(self, assignment: Sequence[int]) -> bool:
        return all(assignment[i] == assignment[r] for i, r in enumerate(self.tie_root))

    @cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.tasks]
        for v, ps in enumerate(self.preds):
            for u in ps:
                out[u].append(v)
        return tuple(tuple(s) for s in out)

    def transfer_s(self, bytes_: int, a: int, b: int) -> float:
        if a == b or bytes_ <= 0:
            return 0.0
        return self.latency_s[a][b] + bytes_ / self.bw_Bps[a][b]

    def post_time_s(self, bytes_: int) -> float:
        """The sender's busy time to start a transfer of `bytes_` (0 where the problem has none)."""
        if bytes_ <= 0 or not (self.post_s or self.post_s_per_byte):
            return 0.0
        return self.post_s + bytes_ * self.post_s_per_byte

    def serial_time_s(self, device: int = 0) -> float:
        return sum(t.fwd_s[device] + t.bwd_s[device] for t in self.tasks)

    def one_rank_busy(self) -> PlacementProblem:
        """The problem as a placement that computes on one device alone sees it: compute not stretched
        by `time_share` (the other ranks only wait, so no core is shared and there is no slower rank
        to wait for). What the `single` baseline of a group is priced on."""
        k = self.time_share
        if k == 1.0:
            return self
        tasks = tuple(dataclasses.replace(t, fwd_s=tuple(x / k for x in t.fwd_s), bwd_s=tuple(x / k for x in t.bwd_s),
                                          overhead_s=t.overhead_s / k) for t in self.tasks)
        return dataclasses.replace(self, tasks=tasks, update_call_s=self.update_call_s / k, time_share=1.0)

    @property
    def devices_interchangeable(self) -> bool:
        """True when any permutation of devices maps the problem to itself (lets the ILP pin task 0)."""
        m = self.num_devices
        if any(len(set(t.fwd_s)) > 1 or len(set(t.bwd_s)) > 1 for t in self.tasks):
            return False
        off = [(a, b) for a in range(m) for b in range(m) if a != b]
        if len(set(self.mem_capacity_bytes)) > 1:
            return False
        if len({self.bw_Bps[a][b] for a, b in off}) > 1 or len({self.latency_s[a][b] for a, b in off}) > 1:
            return False
        # each ordered pair on its own private link(s), all with the same count
        ids = [self.links[a][b] for a, b in off]
        flat = [i for ls in ids for i in ls]
        return len(set(flat)) == len(flat) and len({len(ls) for ls in ids}) <= 1

    def check_capacity(self) -> None:
        """Raise InfeasibleError naming the bottleneck when no placement can fit in memory."""
        cap = max(self.mem_capacity_bytes)
        big = max(self.tasks, key=lambda t: t.mem_bytes, default=None)
        if big is not None and big.mem_bytes > cap:
            raise InfeasibleError(
                f"node {big.name!r} alone needs {fmt_bytes(big.mem_bytes)} but the largest device holds "
                f"{fmt_bytes(cap)} (reduce the batch, coarsen less, or use a bigger device)")
        total = sum(t.mem_bytes for t in self.tasks)
        if total > sum(self.mem_capacity_bytes):
            raise InfeasibleError(
                f"{self.name} needs {fmt_bytes(total)} (weights, gradients, optimizer state, activations) "
                f"but {self.num_devices} device(s) hold {fmt_bytes(sum(self.mem_capacity_bytes))} in total "
                f"(use more devices or a smaller batch)")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def uniform_links(m: int, bw_Bps: float, latency_s: float = 0.0) -> tuple[tuple, tuple, tuple]:
    """bw, latency and link-id matrices for m devices, every ordered pair on its own full-duplex link."""
    bw = tuple(tuple(bw_Bps for _ in range(m)) for _ in range(m))
    lat = tuple(tuple(latency_s for _ in range(m)) for _ in range(m))
    links = tuple(tuple((f"{a}->{b}",) if a != b else () for b in range(m)) for a in range(m))
    return bw, lat, links


def contract(problem: PlacementProblem, groups: Sequence[Sequence[str]]) -> PlacementProblem:
    """Merge each group of tasks into one (times and memory summed, internal edges dropped).

    Any placement/schedule of the contracted problem is one of the original problem with the group's
    tasks on one device run back to back, so its optimum can only be >= the original optimum.
    The merged task's output is the group's largest output that leaves the group (an approximation
    when several members feed outside). Raises ValueError if the contraction creates a cycle.
    """
    owner = {t.name: t.name for t in problem.tasks}
    for g in groups:
        head = "+".join(g)
        for n in g:
            owner[n] = head
    merged: dict[str, dict] = {}
    order: list[str] = []
    for t in problem.tasks:
        key = owner[t.name]
        if key not in merged:
            order.append(key)
            merged[key] = {"inputs": [], "fwd": [0.0] * problem.num_devices,
                           "bwd": [0.0] * problem.num_devices, "mem": 0, "out": 0, "modules": [], "grad": 0,
                           "ties": set(), "ovh": 0.0}
        d = merged[key]
        d["fwd"] = [x + y for x, y in zip(d["fwd"], t.fwd_s)]
        d["bwd"] = [x + y for x, y in zip(d["bwd"], t.bwd_s)]
        d["mem"] += t.mem_bytes
        d["modules"] += list(t.modules)
        d["grad"] += t.grad_bytes
        d["ovh"] += t.overhead_s
        d["ties"].add(t.tie)
        for i in t.inputs:
            if owner[i] != key and owner[i] not in d["inputs"]:
                d["inputs"].append(owner[i])
    for t in problem.tasks:
        if any(owner[problem.tasks[s].name] != owner[t.name] for s in problem.succs[problem.index[t.name]]):
            merged[owner[t.name]]["out"] = max(merged[owner[t.name]]["out"], t.out_bytes)
    tasks = [Task(k, tuple(merged[k]["inputs"]), tuple(merged[k]["fwd"]), tuple(merged[k]["bwd"]),
                  merged[k]["mem"], merged[k]["out"], tuple(merged[k]["modules"]), merged[k]["grad"],
                  _one_tie(merged[k]["ties"]), merged[k]["ovh"])
             for k in order]
    return _replace_tasks(problem, _toposort(tasks))


def _one_tie(ties: set[str]) -> str:
    """A merged task keeps its members' tie (a merge of two tie groups would have to tie every member
    of both, which one tie name cannot express)."""
    named = ties - {""}
    if len(named) > 1:
        raise ValueError("contraction merges tasks of different tie groups")
    return next(iter(named), "")


def _toposort(tasks: list[Task]) -> list[Task]:
    index = {t.name: k for k, t in enumerate(tasks)}
    try:
        order = topological_order([[index[i] for i in t.inputs] for t in tasks])
    except ValueError:
        raise ValueError("contraction creates a cycle") from None
    return [tasks[k] for k in order]


def _replace_tasks(problem: PlacementProblem, tasks: list[Task]) -> PlacementProblem:
    return dataclasses.replace(problem, tasks=tuple(tasks))
