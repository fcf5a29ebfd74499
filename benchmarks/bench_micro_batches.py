"""Micro-batch pipelining measured (2 gloo ranks) on a chain model, against the placer's prediction.

    python benchmarks/bench_micro_batches.py [--batch 512] [--width 1024] [--steps 12] [--ks 1,2,4,8]
    python benchmarks/bench_micro_batches.py --1f1b [--quick]

Default (the GPipe sweep): hybridpar.parallelize(model, plan, micro_batches=K) with the model's two halves
on the two devices, the measured median step per K (rank 0's wall time of forward, loss, backward and SGD
step, after 2 warm-up steps), and the placer's choice with its predicted steps per K (`place_model` on the
same module and batch).

--1f1b: 1F1B at the placer's choice against no pipelining. The placer places the model asked for 1f1b
(`place_model(..., schedule="1f1b")`: its placement, a chain of stages, and K); the same placement then
runs (a) with one micro-batch through the executor (`model(x)`, loss, backward) and (b) 1F1B at the
placer's K through torch.distributed.pipelining (`model.hybridpar.step`), alternating a step of each in
one run (the order swapped every round), after warm-up steps of both. Prints one JSON object: each one's
measured median step and the placer's predicted step, side by side, and their ratios (measured speed-up
of 1F1B over K=1, predicted speed-up, and predicted/measured). --quick: a small model and few steps, to
check that it runs (figures from a loaded machine are not the speed-up)."""

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


def chain_model():
    """The --1f1b chain as a model factory, for `hybridpar profile --model
    benchmarks/bench_micro_batches.py:chain_model --batch 512 --splits 2` (the calibration its run reads)."""
    return chain(1024, 8), (torch.randn(2, 1024),)


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

    compute = outcome.micro_compute  # each micro-batch's ops priced at B/K, as the placer prices them
    k, steps = choose_micro_batches(outcome.problem, outcome.result.assignment, batch, compute=compute)
    # the measured placement (modules 8.. on device 1), priced on the same problem
    ours = tuple(1 if any(m.split(".")[0].isdigit() and int(m.split(".")[0]) >= 8 for m in t.modules) else 0
                 for t in outcome.problem.tasks)
    return {"placer_micro_batches": outcome.plan.micro_batches, "placer_chosen": k,
            "placer_predicted_step_s": {str(n): v for n, v in steps.items()},
            "placer_devices_used": outcome.result.devices_used,
            "measured_placement": ours,
            "measured_placement_predicted_step_s": {str(n): micro_batch_step_s(outcome.problem, ours, n,
                                                                               compute=compute)
                                                    for n in (1, 2, 4, 8)}}


def _one_step(model, x, y, opt, pipelined: bool) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    if pipelined:
        model.hybridpar.step(x, target=y)
    else:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def measure_1f1b(args) -> dict:
    """(a) one micro-batch through the executor and (b) 1F1B at K through torch's schedule, on the same
    placement, one step of each in turn (order swapped every round); rank 0's medians."""
    from torch.distributed.pipelining import Schedule1F1B

    import hybridpar
    from hybridpar.plans import Plan

    width, depth, batch, steps, placement, k = args
    ran = [0]  # steps run by torch's Schedule1F1B: the "1f1b" path is torch's schedule, not a fallback
    real_step = Schedule1F1B.step

    def counted(self, *a, **kw):
        ran[0] += 1
        return real_step(self, *a, **kw)
    Schedule1F1B.step = counted  # type: ignore[method-assign]
    models = {}
    for name, kw in (("k1", {"micro_batches": 1}),
                     ("1f1b", {"micro_batches": k, "schedule": "1f1b",
                               "loss_fn": torch.nn.functional.cross_entropy})):
        plan = Plan(model="chain", world_size=2, batch=batch, dp=1, mp=2, placement=placement,
                    default_layout={"sample": 1})
        model = hybridpar.parallelize(chain(width, depth), plan, **kw)
        models[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    times: dict[str, list[float]] = {"k1": [], "1f1b": []}
    for rnd in range(steps + 2):
        order = ("k1", "1f1b") if rnd % 2 == 0 else ("1f1b", "k1")
        for name in order:
            model, opt = models[name]
            t = _one_step(model, x, y, opt, name == "1f1b")
            if rnd >= 2:  # warm-up: both paths' first steps (stage set-up, the allocator)
                times[name].append(t)
    Schedule1F1B.step = real_step  # type: ignore[method-assign]
    return {"medians": {name: statistics.median(v) for name, v in times.items()}, "torch_1f1b_steps": ran[0]}


def compare_1f1b(width: int, depth: int, batch: int, steps: int) -> dict:
    from hybridpar.search.placer import place_model
    from hybridpar.search.placer.micro import micro_batch_step_s

    torch.manual_seed(0)
    model = chain(width, depth)
    outcome = place_model((model, (torch.randn(batch, width),)), "localhost", 2, solver="ilp", time_limit_s=10,
                          batch=batch, optimizer="sgd", momentum=0.0, schedule="1f1b")
    plan, prob, assign = outcome.plan, outcome.problem, outcome.result.assignment
    k = plan.micro_batches or 1
    predicted = {"k1": micro_batch_step_s(prob, assign, 1), "1f1b": micro_batch_step_s(prob, assign, k, "1f1b",
                                                                                 outcome.micro_compute)}
    got = spawn(measure_1f1b, 2, (width, depth, batch, steps, plan.placement, k))
    measured = got["medians"]
    return {"model": f"chain width {width} depth {depth}", "batch": batch, "placer_micro_batches": k,
            "torch_1f1b_steps": got["torch_1f1b_steps"],
            "placer_schedule": plan.schedule, "placement": plan.placement, "solver": outcome.result.solver,
            "steps_each": steps, "measured_median_step_s": measured, "predicted_step_s": predicted,
            "measured_speedup_1f1b_over_k1": measured["k1"] / measured["1f1b"],
            "predicted_speedup_1f1b_over_k1": predicted["k1"] / predicted["1f1b"],
            "predicted_over_measured": {n: predicted[n] / measured[n] for n in predicted},
            "notes": plan.notes}


def main() -> None:
    ap = argparse.ArgumentParser()
    # 512, not 64: at 64 rows a micro-batch of 16-32 rows runs far below the full batch's per-row speed on one
    # CPU core (measured 24 ms for 32 rows against 33 ms for 64), so no schedule can gain; at 512 compute dominates
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8, help="--1f1b: linear+tanh pairs before the classifier")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--1f1b", dest="one_f_one_b", action="store_true",
                    help="1F1B at the placer's K against no pipelining (K=1), on the placer's placement")
    ap.add_argument("--quick", action="store_true", help="a small model and few steps: that it runs")
    a = ap.parse_args()
    if a.quick:
        a.width, a.batch, a.steps, a.depth, a.ks = 64, 16, 4, 4, "1,2"
    if a.one_f_one_b:
        print(json.dumps(compare_1f1b(a.width, a.depth, a.batch, a.steps), indent=1))
        return
    ks = [int(k) for k in a.ks.split(",")]
    got = spawn(measure, 2, (a.width, a.batch, a.steps, ks))
    print(json.dumps({"measured_step_s": {str(k): v for k, v in got.items()}, **predicted(a.width, a.batch)},
                     indent=1))


if __name__ == "__main__":
    main()
