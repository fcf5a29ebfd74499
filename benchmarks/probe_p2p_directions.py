"""Do the MP runtime's sends stall in gloo when both directions share one process group? (not part of
`make bench`)

Two gloo ranks run the wavefront row of bench_mp.py (lstm4, 4 time chunks per LSTM layer, the placer's
placement on 2 `localhost` devices), two engines interleaved step by step: one whose transfers ride a
process group per direction (the runtime's default on gloo, pipeline.p2p.Link) and one with both
directions on the default group (the runtime before 2026-12-04). Every `dist.isend` call is timed on
the calling thread (wall clock). Prints per variant: the calls per step, their median and 99th
percentile, how many took over 1 ms, the isend time per step and the median step (the later rank).

Why it was written: a torch.profiler trace of this model's MP step showed rank 0 inside gloo's isend
for 3-5 ms on some 196 KB gradient sends, and perf's sched_switch events showed the caller preempted
(state R) while the pair's event thread ran: gloo's TCP pair holds one lock for both directions, and
its event thread, woken by the peer's transfer, spins on that lock (try-lock under level-triggered
epoll) on the core the sender needs.

    python benchmarks/probe_p2p_directions.py [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hybridpar.graph.models import load_model  # noqa: E402
from hybridpar.parallel.pipeline import MPEngine  # noqa: E402
from hybridpar.plans import Plan  # noqa: E402
from hybridpar.train.engine import task_loss_sum  # noqa: E402
from hybridpar.train.launch import spawn  # noqa: E402

SPEC = f"{HERE / '_wavefront_model.py'}:lstm4"
BATCH, CHUNKS, WARMUP = 32, 4, 3


def _ranks(placement: dict, steps: int) -> dict:
    torch.set_num_threads(1)
    calls: list[float] = []
    real = dist.isend

    def timed_isend(*a, **k):
        t0 = time.perf_counter()
        work = real(*a, **k)
        calls.append(time.perf_counter() - t0)
        return work

    dist.isend = timed_isend  # the runtime calls torch.distributed.isend through the module
    engines = {}
    for name in ("per_direction", "one_group"):
        torch.manual_seed(0)
        plan = Plan(model=SPEC, world_size=2, batch=BATCH, mp=2, placement=placement, time_chunks=CHUNKS)
        eng = MPEngine(load_model(SPEC, batch=BATCH).module, plan, loss_fn=task_loss_sum)
        if name == "one_group":
            eng.link.directions = None
        engines[name] = (eng, torch.optim.SGD(eng.parameters(), lr=0.01))
    x = load_model(SPEC, batch=BATCH).example_inputs[0]
    g = torch.Generator().manual_seed(0)
    rec: dict[str, dict[str, list]] = {n: {"step": [], "calls": [], "per_step": []} for n in engines}
    for i in range(WARMUP + steps):
        xx, y = torch.randint(0, 64, x.shape, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        for name, (eng, opt) in engines.items():
            dist.barrier()
            calls.clear()
            t0 = time.perf_counter()
            eng.train_step(*eng.local_batch(xx, y))
            opt.step()
            opt.zero_grad()
            eng.link.wait_all()
            wall = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            if i >= WARMUP:
                rec[name]["step"].append(float(wall))
                rec[name]["calls"] += calls
                rec[name]["per_step"].append(sum(calls))
    mine = [rec]
    every: list = [None, None]
    dist.all_gather_object(every, mine[0])
    return {"ranks": every}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="measured steps per variant (after 3 warm-up)")
    args = ap.parse_args()
    from hybridpar.search.placer import place_model
    from hybridpar.search.placer.module_placement import placement_from_outcome

    outcome = place_model(SPEC, "localhost", 2, batch=BATCH, optimizer="sgd", time_chunks=CHUNKS)
    placement = placement_from_outcome(outcome, load_model(SPEC).module)
    load = os.getloadavg()[0]
    out = spawn(_ranks, 2, placement, args.steps)
    print(f"lstm4, {CHUNKS} time chunks, 2 gloo ranks, {args.steps} steps per variant interleaved; "
          f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for name in ("per_direction", "one_group"):
        for r, rec in enumerate(out["ranks"]):
            c = sorted(rec[name]["calls"])
            n_steps = len(rec[name]["step"])
            print(f"  {name:13s} rank {r}: {len(c) / n_steps:.0f} isend/step, "
                  f"median {statistics.median(c) * 1e3:.2f} ms, "
                  f"p99 {c[int(0.99 * (len(c) - 1))] * 1e3:.2f} ms, over 1 ms: {sum(v > 1e-3 for v in c)} of {len(c)}; "
                  f"isend per step {statistics.median(rec[name]['per_step']) * 1e3:.1f} ms; "
                  f"step {statistics.median(rec[name]['step']) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
