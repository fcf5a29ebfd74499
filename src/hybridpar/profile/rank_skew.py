"""How much longer a synchronous step of P ranks computes than one process alone, on this machine.

The op table is timed in one process alone. A training step of P ranks ends at the same collective on
every rank (the gradient allreduce; under a channel/filter split every layer's exchange), so it moves
at the pace of the slowest rank. On this 2-vCPU VM two ranks running the same loop at the same moment
took 8.8 and 17.0 ms per step (`benchmarks/probe_skew.py`, 2026-12-01), and the validation's sample
rows came out ~11% under the measured steps run after run, while one process alone showed no one-way
bias. Not a time share: each rank had its own core.

Measured as CPU time of each rank's thread (time.thread_time: waiting for a core, which the time share
prices, does not count), in lockstep: P worker processes run a reference iteration (a convolution and
an LSTM, forward and backward), wait at a barrier, and again; per iteration the slowest rank's CPU
time. Alone: one worker runs the same iterations while the others wait. The phases alternate over
`cycles` so that the machine's drift hits them alike:

  rank_skew[P] = mean over iterations (max over ranks of CPU time) / mean over iterations (CPU time alone)

per cycle; the median over cycles is one launch's. A process's speed on this VM is drawn anew at its
start (benchmarks/probe_corun.py), so one set of workers is one draw of who is slowest: the figure is the
median over `launches` fresh sets of workers, as a run's figure is its median over fresh worlds. With one
launch, three profiles of the same minute said 1.17, 1.68 and 1.06 (2026-12-04, quiet); six launches in a
row 1.00-1.14. The machine's speed also drifts over tens of seconds, and five launches in a row (~2 s) are
one moment of it: three validation profiles of one morning said 1.08, 1.06 and 1.22 (the 1.22 put every
prediction of its run ~14% over, its two worst rows +48% and +40%), while ten launches right after gave
1.00-1.14. So `hybridpar profile` takes its launches at several points of its run (SkewSampler), spread
over the same minutes as the op table it stretches, and keeps the median of all.

`hybridpar.cluster.localhost` stretches compute at P ranks by it (on top of ranks/cores).
"""

from __future__ import annotations

import os
import queue
import statistics
from collections.abc import Sequence

from hybridpar.cluster.calibration import ProcessDraw
from hybridpar.errors import UserError
from hybridpar.train.launch import context


def _iteration():
    import torch

    torch.manual_seed(0)
    conv, x = torch.nn.Conv2d(16, 16, 3, padding=1), torch.randn(8, 16, 24, 24)
    lstm, s = torch.nn.LSTM(32, 64, batch_first=True), torch.randn(8, 24, 32)

    def run() -> None:
        conv(x.clone()).sum().backward()
        lstm(s.clone())[0].sum().backward()

    return run


def _worker(rank: int, phases: Sequence[int], iters: int, start, barriers: dict, q) -> None:
    import time

    import torch

    from hybridpar.host_allocator import keep_freed_memory, no_huge_pages

    keep_freed_memory()  # as the ranks and the op table run
    no_huge_pages()  # as a rank that does not shard weights (the fork server's tunable asks for them)
    torch.set_num_threads(1)
    run = _iteration()
    for _ in range(3):
        run()
    for k, p in enumerate(phases):
        start.wait()  # every worker, every phase: the phases do not overlap
        if rank >= p:
            continue
        cpu = []
        for _ in range(iters):
            t0 = time.thread_time()
            run()
            cpu.append(time.thread_time() - t0)
            barriers[p].wait()
        q.put((k, rank, cpu))


class SkewSampler:
    """Launches of the lockstep measurement taken at several points of a profile (`sample`); the
    figure (`result`) is the median over all of them, per rank count. At each point the reference
    iteration is also timed in this process, which times the op table: `draw` compares the two
    (cluster.calibration.ProcessDraw)."""

    def __init__(self, ranks: Sequence[int], *, cycles: int = 3, iters: int = 15, timeout_s: float = 300.0):
        self.ps = sorted({p for p in ranks if p > 1})
        self.cycles, self.iters, self.timeout_s = cycles, iters, timeout_s
        self.runs: list[dict[int, float]] = []
        self.fresh: list[float] = []  # the reference iteration's CPU time alone in fresh workers, per launch
        self.here: list[float] = []  # the same in this process, per sampling point

    def sample(self, launches: int) -> None:
        if not self.ps:
            return
        self.here.append(reference_here_s(self.iters))
        for _ in range(launches):
            ratios, alone = _one_launch(self.ps, self.cycles, self.iters, self.timeout_s)
            self.runs.append(ratios)
            self.fresh.append(alone)

    def result(self) -> dict[int, float]:
        if not self.runs:
            return {}
        return {p: statistics.median(r[p] for r in self.runs) for p in self.ps}

    def draw(self) -> ProcessDraw | None:
        if not self.fresh or not self.here:
            return None
        return ProcessDraw(here_s=statistics.median(self.here), fresh_s=statistics.median(self.fresh))


def reference_here_s(iters: int) -> float:
    """The reference iteration's mean CPU time in this process (one thread, as the workers run it)."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = _iteration()
        for _ in range(3):
            run()
        t0 = time.thread_time()
        for _ in range(iters):
            run()
        return (time.thread_time() - t0) / iters
    finally:
        torch.set_num_threads(threads)


def measure_rank_skew(ranks: Sequence[int], *, cycles: int = 3, iters: int = 15, launches: int = 5,
                      timeout_s: float = 300.0) -> dict:
    """{P: rank_skew} for each P > 1 in `ranks` (see the module docstring): the median of `launches`
    fresh sets of workers, taken in a row."""
    sampler = SkewSampler(ranks, cycles=cycles, iters=iters, timeout_s=timeout_s)
    sampler.sample(launches)
    return sampler.result()


def _one_launch(ps: list[int], cycles: int, iters: int, timeout_s: float) -> tuple[dict[int, float], float]:
    """({P: skew}, the reference iteration's CPU time in worker 0 alone: median over cycles)."""
    ctx = context()  # the ranks' fork server: torch imported once, not per worker
    width = max(ps)
    phases = [p for _ in range(cycles) for p in (1, *ps)]
    start = ctx.Barrier(width)
    barriers = {p: ctx.Barrier(p) for p in (1, *ps)}
    q = ctx.Queue()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_worker, args=(r, phases, iters, start, barriers, q), daemon=True)
             for r in range(width)]
    try:
        for pr in procs:
            pr.start()
        got: dict[int, dict[int, list[float]]] = {}
        for _ in range(sum(phases)):
            try:
                k, rank, cpu = q.get(timeout=timeout_s)
            except queue.Empty:
                raise UserError(f"the rank-skew measurement did not finish in {timeout_s:.0f} s") from None
            got.setdefault(k, {})[rank] = cpu
        for pr in procs:
            pr.join(timeout=30)
    finally:
        for pr in procs:  # a worker stuck at a barrier (another one died) is not left behind
            if pr.is_alive():
                pr.terminate()
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env
    out: dict[int, float] = {}
    alone = [statistics.fmean(got[c * (len(ps) + 1)][0]) for c in range(cycles)]
    for p in ps:
        ratios = []
        for c in range(cycles):
            together_k = c * (len(ps) + 1) + 1 + ps.index(p)
            slowest = statistics.fmean(max(cpu[i] for cpu in got[together_k].values()) for i in range(iters))
            ratios.append(slowest / alone[c])
        out[p] = max(1.0, statistics.median(ratios))  # a step is never faster for having more ranks
    return out, statistics.median(alone)
