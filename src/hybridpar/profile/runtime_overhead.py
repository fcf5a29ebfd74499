"""The channel/filter/sample runtime's own CPU cost per graph node and per distributed layer.

`hybridpar train` with a channel/filter/sample layout runs the model with global semantics: every
activation between layers is a DTensor, so each op of the user's code goes through DTensor's
dispatch (sharding propagation, wrapping), and each convolution/linear through our layer wrapper
(to_local, an autograd Function, from_local) — with a channel/filter split, also the collective
functions' Python around each exchange. None of that is in the op table (measured on plain tensors)
nor in the collective fits (measured between compute). On this machine it is ~0.2-0.5 ms per node
per step, against ops of ~0.1-3 ms in the small models that run here: the validation under-predicted
every sample and channel/filter layout by about that much.

Measured as CPU time of this thread (time.thread_time, so other jobs' time does not count), in a
subprocess with PyTorch's fake process group (`torch.testing._internal.distributed.fake_pg`, the
backend torchtitan's memory estimator uses): collectives are no-ops, everything else runs as in a
training step. A chain of tiny conv + batch norm + ReLU blocks (compute negligible, so what remains is
overhead) at `sample=2`, `channel=2` and `filter=2` on a fake world of 2, against the same chain in
eager PyTorch at each rank's batch:

  node_s  = (T[sample=2] - T[eager]) / nodes
  layer_s = (T[channel or filter=2] - T[eager] - nodes * node_s) / split layers
  spatial_op_s = (T_S[height=2] - T_S[eager on the rank's piece] - nodes_S * node_s) / convolutions

where chain "S" is tiny 3x3 convolutions + ReLU, each of which exchanges a halo under height=2: the
spatial runtime's `_HaloOp` (posting the sends and receives, the interior and boundary convolutions, the
window re-assembled in backward, the halo reduction): 0.79 ms per convolution (forward + backward) on
this VM against 0.15 ms eager (2026-12-04), unpriced before.

and per DTensor redistribution (a call of DTensor's `redistribute_local_tensor` that changes the
placements, forward or backward, with a collective or without: Replicate -> Shard takes a piece): a
DTensor bounced between Shard and Replicate 24 and 8 times, each hop after a multiplication, against
the same multiplications without the hops, over the calls counted (`counting_redistributions`):

  redistribute_s = ((T_R[24] - T_R[8]) - (T_M[24] - T_M[8])) / (calls[24] - calls[8])

The dry run counts a step's redistributions on rank 0, and the plan prices each at this (the
collectives' Python inside is in neither the gloo fits nor the per-node terms: the chains above have
no redistribution). ~0.2 ms per call on this VM (2026-12-04): HF ConvNeXt's 54 per step under
channel=2 were ~11 ms unpriced.

where the Python cost of the collectives issued (what the gloo fits' intercepts already hold, since
they time the runtime's own collective functions) is taken out first: the fake-world time of one such
call, times the calls the step logged. Forward and backward are measured apart (forward alone, then the
whole step).
"""

from __future__ import annotations

import json
import statistics
import sys

BLOCKS, CHANNELS, BATCH, HW = 8, 8, 4, 4  # tiny: compute negligible against the overhead
EXTRA = 4  # chain "B": this many more ReLUs per block than chain "A" (DTensor's dispatch per op)


def _chain(extra: int = 0):
    from torch import nn

    layers = []
    for _ in range(BLOCKS):
        layers += [nn.Conv2d(CHANNELS, CHANNELS, 1, bias=False), nn.BatchNorm2d(CHANNELS), nn.ReLU()]
        layers += [nn.ReLU() for _ in range(extra)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, 4))


def _conv_chain():
    from torch import nn

    layers = []
    for _ in range(BLOCKS):
        layers += [nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, 4))


def _interleaved(fns: dict, warmup: int, repeats: int) -> dict[str, float]:
    """Per function, the median CPU time of `repeats` calls, the functions taken in turn (each once,
    then again), so that every median spans the same stretch of time. Each timed call follows an
    untimed one of the same function, as a training step follows a step: timed right after the other
    variants, eager's small steps ran ~30% slower (its caches cold), which is not what a run pays."""
    from hybridpar.profile.timing import clock

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            fn()
            t0 = clock()
            fn()
            samples[k].append(clock() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


HOPS = (8, 24)  # Shard <-> Replicate round trips of the redistribution chains


def _hop_runs(mesh) -> tuple[dict, dict[str, int]]:
    """(variant -> step function, variant -> redistributions per step) of the redistribution chains:
    "R<k>" with k round trips, "M<k>" the same multiplications without them."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hybridpar.parallel.dtensor.log import counting_redistributions

    base = distribute_tensor(torch.randn(BATCH, CHANNELS, HW, HW), mesh, [Shard(1)])

    def chain(k: int, hop: bool):
        def run():
            y = base.detach().requires_grad_(True)
            for _ in range(k):
                y = (y.redistribute(mesh, [Replicate()]) if hop else y) * 1.0
                y = (y.redistribute(mesh, [Shard(1)]) if hop else y) * 1.0
            y.to_local().sum().backward()
        return run

    runs = {f"{v}{k}": chain(k, v == "R") for k in HOPS for v in ("R", "M")}
    calls = {}
    for name, fn in runs.items():
        with counting_redistributions() as count:
            fn()
        calls[name] = count.calls
    return runs, calls


def _layout_runs(builders: dict, x, y, runs: dict) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Each chain under each layout through `hybridpar train`'s engine on the fake world, into `runs`
    as (forward, step) functions; (collective calls per step, split layers per layout, DTensor
    redistributions per forward and per step: "<layout><chain>_fwd" / "_step")."""
    import torch

    from hybridpar.parallel.dtensor.log import counting_redistributions
    from hybridpar.train.engine import ChannelFilterEngine, task_loss

    counts, splits, moves = {}, {}, {}
    for layout, chains in (("sample=2", ("A",)), ("channel=2", ("A", "B")), ("filter=2", ("A", "B")),
                           ("height=2", ("S",))):
        for c in chains:
            eng = ChannelFilterEngine(builders[c](), layout, bn_stats="local")
            xs, ys = (torch.cat([x, x]), torch.cat([y, y])) if layout == "sample=2" else (x, y)
            xl, yl = eng.local_batch(xs, ys)
            for _ in range(2):  # the first step records DTensor's redistributions (a dispatch mode)
                eng.train_step(xl, yl)
            eng.comm_log.mark_step()
            eng.train_step(xl, yl)
            counts[f"{layout}{c}"] = len(eng.comm_log.step_records())
            splits[layout] = sum(1 for m in eng.module.modules() if type(m).__name__ in ("DistConv2d", "DistLinear"))

            def fwd(eng=eng, xl=xl, yl=yl):
                eng.module.train()
                task_loss(eng.forward(xl), yl)

            def step(eng=eng, xl=xl, yl=yl):
                eng.train_step(xl, yl)

            for part, fn in (("fwd", fwd), ("step", step)):
                with counting_redistributions() as count:
                    fn()
                moves[f"{layout}{c}_{part}"] = count.calls
            runs[f"{layout}{c}"] = (fwd, step)
    return counts, splits, moves


def measure(warmup: int = 2, repeats: int = 7, rounds: int = 5) -> dict:
    """In this process (which must not hold a process group): the overheads, forward and backward, in
    seconds of CPU time per training step: `sample_node` per graph node of a sample-only layout (no
    DTensor: plain tensors and the gradient hooks), `dtensor_node` per node of a layout with a
    channel/filter split (DTensor's dispatch or our wrapper), `layer` per conv/linear split over
    channel/filter beyond its node's (the autograd Function, the collectives' bookkeeping),
    `spatial_op` per convolution or pooling exchanging a halo under a spatial split."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridpar.graph.tracing import trace
    from hybridpar.parallel.comm.collectives import all_gather_dim, all_reduce_, reduce_scatter_dim
    from hybridpar.parallel.comm.log import CommLog
    from hybridpar.parallel.mesh import Group

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.manual_seed(0)
    x = torch.randn(BATCH, CHANNELS, HW, HW)
    y = torch.randint(0, 4, (BATCH,))
    builders = {"A": _chain, "B": lambda: _chain(EXTRA), "S": _conv_chain}
    nodes = {c: sum(n.op != "input" for n in trace(b(), (x,)).nodes) for c, b in builders.items()}

    def eager(c: str, inp: torch.Tensor):
        m = builders[c]()
        return (lambda: F.cross_entropy(m(inp), y)), (lambda: F.cross_entropy(m(inp), y).backward())

    # eager "S": the rank's piece of rows under height=2 (its convolutions padded as the whole's)
    runs = {"eagerA": eager("A", x), "eagerB": eager("B", x), "eagerS": eager("S", x[:, :, : HW // 2].contiguous())}
    counts, splits, moves = _layout_runs(builders, x, y, runs)

    # the Python of one collective call on the fake world (the gloo fits hold it already)
    group = Group((0, 1), dist.group.WORLD, 0)
    log = CommLog()
    piece, full, buf = torch.ones(BATCH, CHANNELS // 2, HW, HW), torch.ones(BATCH, CHANNELS, HW, HW), torch.ones(64)
    sizes = [CHANNELS // 2] * 2

    def colls():
        all_gather_dim(piece, 1, group, sizes, log)
        reduce_scatter_dim(full, 1, group, sizes, log)
        all_reduce_(buf, group, log)

    # Each round times every variant (and the collective call) in turn, so that all its medians span the
    # same stretch of time; the median within a round rejects single outliers (a GC pass, a page
    # fault). Per variant, the fastest round's median is kept: another job's work only ever adds CPU
    # time to ours (shared caches and memory bandwidth, the hypervisor, a lower clock), never takes any
    # away, so the least disturbed round is the nearest to a quiet machine. A median over rounds fails
    # once a burst of load covers half of them; this needs one round of each variant in the clear.
    # The fields are differences between variants measured alike, so the small downward bias of a
    # minimum cancels between the terms. (Timed one variant after another with a median over 3
    # rounds, dtensor_node's backward measured 12-203 us in five runs on this 2-core VM at load ~2;
    # this way 23-31 us in four runs at load ~2.5, layer_s's forward 187-211 us.)
    from torch.distributed.device_mesh import init_device_mesh

    hops, hop_calls = _hop_runs(init_device_mesh("cpu", (2,)))
    fns = {"collective_call": colls, **{f"{name}_{part}": fn for name, (fwd, step) in runs.items()
                                         for part, fn in (("fwd", fwd), ("step", step))},
           **{f"hops_{name}": fn for name, fn in hops.items()}}
    got = [_interleaved(fns, warmup, repeats) for _ in range(rounds)]
    med = {k: min(r[k] for r in got) for k in fns}
    per_call = med.pop("collective_call") / 3

    lo, hi = HOPS
    redistribute = max(0.0, ((med[f"hops_R{hi}"] - med[f"hops_R{lo}"]) - (med[f"hops_M{hi}"] - med[f"hops_M{lo}"]))
                       / max(1, hop_calls[f"R{hi}"] - hop_calls[f"R{lo}"]))

    def over(run: str, chain: str, part: str) -> float:
        """The run's time over eager's, less the collectives' Python (half of them in forward: a layer
        issues one each way; the loss rides with the gradients at the end of backward) and less the
        redistributions the run made (priced per call by the dry run's count: not in the terms too)."""
        calls = counts[f"{run}{chain}"] / (2 if part == "fwd" else 1)
        return (med[f"{run}{chain}_{part}"] - med[f"eager{chain}_{part}"] - calls * per_call
                - moves[f"{run}{chain}_{part}"] * redistribute)

    out = {}
    for part in ("fwd", "step"):
        sample_node = over("sample=2", "A", part) / nodes["A"]
        dt_node = statistics.mean((over(r, "B", part) - over(r, "A", part)) / (nodes["B"] - nodes["A"])
                                  for r in ("channel=2", "filter=2"))
        # beyond its own node's share: the planner adds dt_node for every node, split layers included
        layer = statistics.mean((over(r, "A", part) - nodes["A"] * dt_node) / splits[r]
                                for r in ("channel=2", "filter=2"))
        spatial = (over("height=2", "S", part) - nodes["S"] * sample_node) / BLOCKS
        out[part] = {"sample_node_s": max(0.0, sample_node), "dtensor_node_s": max(0.0, dt_node),
                     "layer_s": max(0.0, layer), "spatial_op_s": max(0.0, spatial)}
    dist.destroy_process_group()
    result: dict = {"redistribute_s": redistribute}
    for key in ("sample_node_s", "dtensor_node_s", "layer_s", "spatial_op_s"):
        fwd, step = out["fwd"][key], out["step"][key]
        result[key] = (fwd, max(0.0, step - fwd))  # (forward, backward)
    return {**result, "nodes": nodes, "collective_call_s": per_call, "medians_s": med,
            "collectives_per_step": counts, "redistributions_per_step": {**hop_calls, **moves}, "rounds_s": got}


def runtime_overhead(timeout_s: float = 300.0, repeats: int = 7, rounds: int = 5) -> dict:
    """`measure` in a fresh subprocess (the fake process group is process-global state)."""
    from hybridpar.profile.one_thread import run_module

    out = run_module("hybridpar.profile.runtime_overhead", [str(repeats), str(rounds)],
                     "the runtime overhead measurement", timeout_s)
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    import os

    result = measure(repeats=int(sys.argv[1]), rounds=int(sys.argv[2])) if len(sys.argv) > 2 else measure()
    print(json.dumps(result), flush=True)
    os._exit(0)  # the fake process group's teardown is not needed
