"""GPipe micro-batches measured (hybridpar.parallelize(model, plan, micro_batches=K), 2 gloo ranks) on a
chain model whose two halves sit on the two devices, against the placer's prediction for the placement
and K it chooses itself (`place_model` on the same module and batch).

    python benchmarks/bench_micro_batches.py [--batch 64] [--width 1024] [--steps 12] [--ks 1,2,4,8]

Prints one JSON object: the measured median step per K (rank 0's wall time of forward, loss, backward
and SGD step, after 2 warm-up steps), and the placer's choice with its predicted steps per K."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hybridpar.train.launch import spawn  # noqa: E402


def chain(width: int, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def measure(args) -> dict:
    import hybridpar
    from hybridpar.plans import Plan

    width, batch, steps, ks = args
    out = {}
    half = 8  # modules 0..7 (4 linear+tanh pairs) on device 0, the rest on device 1
    for k in ks:
        model = chain(width)
        placement = {str(i): 1 for i in range(half, 17)}
        plan = Plan(model="chain", world_size=2, batch=batch, dp=1, mp=2, placement=placement,
                    default_layout={"sample": 1})
        model = hybridpar.parallelize(model, plan, micro_batches=k)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
        times = []
        for step in range(steps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step >= 2:
                times.append(time.perf_counter() - t0)
        out[k] = statistics.median(times)
    return out


def predicted(width: int, batch: int) -> dict:
    from hybridpar.search.placer import place_model

    model = chain(width)
    outcome = place_model((model, (torch.randn(batch, width),)), "localhost", 2, solver="ilp", time_limit_s=10,
                          batch=batch, optimizer="sgd", momentum=0.0)
    from hybridpar.search.placer.micro import choose_micro_batches, micro_batch_step_s

    k, steps = choose_micro_batches(outcome.problem, outcome.result.assignment, batch)
    # the measured placement (modules 8.. on device 1), priced on the same problem
    ours = tuple(1 if any(m.split(".")[0].isdigit() and int(m.split(".")[0]) >= 8 for m in t.modules) else 0
                 for t in outcome.problem.tasks)
    return {"placer_micro_batches": outcome.plan.micro_batches, "placer_chosen": k,
            "placer_predicted_step_s": {str(n): v for n, v in steps.items()},
            "placer_devices_used": outcome.result.devices_used,
            "measured_placement": ours,
            "measured_placement_predicted_step_s": {str(n): micro_batch_step_s(outcome.problem, ours, n)
                                                    for n in (1, 2, 4, 8)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ks", default="1,2,4,8")
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    got = spawn(measure, 2, (a.width, a.batch, a.steps, ks))
    print(json.dumps({"measured_step_s": {str(k): v for k, v in got.items()}, **predicted(a.width, a.batch)},
                     indent=1))


if __name__ == "__main__":
    main()
