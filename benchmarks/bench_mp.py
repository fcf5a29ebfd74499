"""Model-parallel runtime on this machine: the placer's placement of inception_mini over 2 local gloo
ranks, measured side by side with single-process training in one run.

Prints and writes (HYBRIDPAR_BENCH_OUT) ratios only:
- executor_overhead_vs_eager: MP engine with every node on device 0 (fx interpreter, token chain,
  no crossings) over plain eager training: the runtime's own overhead;
- mp2_vs_serial_step_ratio / measured_speedup vs predicted_speedup: the placement's step against one
  process (predicted by the placer's cost model for `localhost`, where ranks share the CPU cores);
- gpipe4_vs_mp2_step_ratio: 4 GPipe micro-batches against none, same placement;
- p2p_bytes_measured_vs_predicted: activation + gradient bytes that crossed devices per step, over
  the placer's transfer bytes for the same assignment (its coarse graph counts whole outputs).
Step times are medians over the measured steps after warm-up. On 2 shared CPU cores the ratios show
overheads, not the GPU speedups the paper projects.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from hybridpar.graph.models import load_model
from hybridpar.plans import Plan
from hybridpar.runtime.launch import spawn
from hybridpar.runtime.mp import MPEngine, loss_sum
from hybridpar.search.placer.module_placement import placement_from_outcome, predicted_p2p_bytes

MODEL, BATCH, WARMUP, STEPS = "inception_mini", 32, 2, 6


def _batches(n: int):
    g = torch.Generator().manual_seed(0)
    shape = load_model(MODEL).input_shape
    return [(torch.randn(BATCH, *shape, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(n)]


def _eager_step_s() -> float:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = load_model(MODEL).module
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    times = []
    for i, (x, y) in enumerate(_batches(WARMUP + STEPS)):
        t0 = time.perf_counter()
        (loss_sum(m(x), y) / len(y)).backward()
        opt.step()
        opt.zero_grad()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _mp_cases(cases: list[tuple[str, dict, int]]) -> dict:
    """In each rank: train every (label, placement, micro_batches) case; rank 0 gets the results."""
    out = {}
    for label, placement, mbs in cases:
        torch.manual_seed(0)
        plan = Plan(model=MODEL, world_size=2, batch=BATCH, mp=2, placement=placement)
        eng = MPEngine(load_model(MODEL).module, plan, micro_batches=mbs)
        opt = torch.optim.SGD(eng.parameters(), lr=0.01)
        times = []
        for i, (x, y) in enumerate(_batches(WARMUP + STEPS)):
            dist.barrier()
            t0 = time.perf_counter()
            eng.train_step(*eng.local_batch(x, y))
            opt.step()
            opt.zero_grad()
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        sent = torch.tensor([sum(r.bytes_ for r in eng.comm_log.step_records() if r.kind == "send")])
        dist.all_reduce(sent)
        out[label] = {"step_s": statistics.median(times), "p2p_bytes": int(sent)}
    return out


def main() -> None:
    from hybridpar.search.placer import place_model

    t_start = time.perf_counter()
    outcome = place_model(MODEL, "localhost", 2, batch=BATCH, time_limit_s=10)
    placement = placement_from_outcome(outcome, load_model(MODEL).module)
    eager = _eager_step_s()
    res = spawn(_mp_cases, 2, [("all_on_0", {}, 1), ("placer", placement, 1), ("gpipe4", placement, 4)])
    summary = {
        "model": MODEL, "batch": BATCH, "devices": 2, "placement": placement,
        "eager_step_s": eager, "cases": res,
        "executor_overhead_vs_eager": res["all_on_0"]["step_s"] / eager,
        "mp2_vs_serial_step_ratio": res["placer"]["step_s"] / eager,
        "measured_speedup": eager / res["placer"]["step_s"],
        "predicted_speedup": outcome.speedup,
        "gpipe4_vs_mp2_step_ratio": res["gpipe4"]["step_s"] / res["placer"]["step_s"],
        "p2p_bytes_measured_vs_predicted": res["placer"]["p2p_bytes"] / max(predicted_p2p_bytes(outcome), 1),
        "wall_s": time.perf_counter() - t_start,
    }
    print(f"{MODEL}, batch {BATCH}, 2 gloo ranks on this machine (placer: {outcome.result.solver}, "
          f"{len(set(placement.values()))} device(s) used)")
    for key in ("executor_overhead_vs_eager", "mp2_vs_serial_step_ratio", "measured_speedup",
                "predicted_speedup", "gpipe4_vs_mp2_step_ratio", "p2p_bytes_measured_vs_predicted"):
        val = summary[key]
        print(f"  {key:34s} {val:8.3f}" if val is not None else f"  {key:34s}      n/a")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(main())
