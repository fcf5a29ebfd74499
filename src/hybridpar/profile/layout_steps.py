"""The user's model under each sample and channel/filter layout `hybridpar profile --model M --splits k`
is asked for, run as `hybridpar train` runs it, on a fake world of k ranks: the CPU time of rank 0's step, less
the time inside its collectives and DTensor's redistributions (each priced apart: the gloo fits time
the runtime's collective functions, copies included; the dry run counts the redistributions). What is
left (`rest_s`) is what the op table and the runtime-overhead terms price: the ops at the rank's local
shapes and the runtime's own work around them.

Why on the model itself: those terms come from synthetic chains (conv + batch norm + ReLU), and a
model's DTensor layouts do work no chain has: HF ConvNeXt under channel=2 left 36 ms of such work per
step against 24.6 ms priced, HF MobileNetV2 97 ms against 56 (its padding ops, the permutes and layer
norms around its depthwise convolutions), while HF ResNet was within 1 ms and a U-Net 7-15% under the
op table (2026-12-04). The plan adds the difference for a layout measured here (hybridpar.api).

Timed as the runtime_overhead chains are: thread CPU time (other jobs' time does not count), PyTorch's
fake process group (`torch.testing._internal.distributed.fake_pg`: collectives are no-ops), one thread.
The step's loss is the sum of the model's floating-point outputs (the dry run's; the loss is priced
apart). The subprocess is a fresh process, one draw of this VM's per-process speed as each rank is
(hybridpar.profile.rank_skew): its figures are filed as measured. Each layout takes at least `repeats`
steps and at least MIN_SECONDS of them: seven steps of a 3 ms model are too few to take a median of.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Sequence

MIN_SECONDS = 0.5  # of timed steps per layout (at most MAX_REPEATS steps)
MAX_REPEATS = 200


def layouts_for(splits: Sequence[int]) -> list[tuple[str, int]]:
    """(layout, world size) per sample and channel/filter layout a profile with these splits times."""
    return [(f"{kind}={k}", k) for k in sorted(set(splits)) if k > 1 for kind in ("sample", "channel", "filter")]


def _step_of(model, batch):
    import torch

    from hybridpar.parallel.check import output_tensors

    def step() -> None:
        model.zero_grad(set_to_none=True)
        outs = [o for o in output_tensors(model(*batch)) if o.is_floating_point() and o.requires_grad]
        torch.stack([o.float().sum() for o in outs]).sum().backward()
    return step


def measure_layout(spec: str, batch: int, input_shape: tuple[int, ...] | None, layout: str, world: int,
                   warmup: int = 2, repeats: int = 7) -> dict:
    """In this process (which must not hold a process group): rank 0's step of `spec` under `layout` on
    a fake world of `world`, medians over `repeats` steps, in seconds of CPU time."""
    import time

    import torch

    from hybridpar.graph.models import load_model
    from hybridpar.parallel.apply import apply_layout, state_of
    from hybridpar.parallel.check import fake_world
    from hybridpar.parallel.comm.collectives import CLOCK
    from hybridpar.parallel.dtensor.log import counting_redistributions
    from hybridpar.parallel.sample_io import split_samples

    torch.manual_seed(0)
    loaded = load_model(spec, batch=batch, input_shape=input_shape)
    with fake_world(world):
        model = apply_layout(loaded.module, layout, inputs="sample_shard")
        model.train()
        grid = state_of(model).grid
        inputs = split_samples(tuple(loaded.example_inputs), grid)
        step = _step_of(model, inputs)
        for _ in range(warmup):
            step()
        t0 = time.thread_time()
        step()
        once = max(time.thread_time() - t0, 1e-6)
        rows = []
        for _ in range(max(repeats, min(MAX_REPEATS, math.ceil(MIN_SECONDS / once)))):
            c0 = CLOCK.seconds
            with counting_redistributions() as moves:
                t0 = time.thread_time()
                step()
                total = time.thread_time() - t0
            rows.append((total, CLOCK.seconds - c0, moves.seconds, moves.calls))
    step_s = statistics.median(r[0] for r in rows)
    coll_s = statistics.median(r[1] for r in rows)
    moves_s = statistics.median(r[2] for r in rows)
    rest_s = statistics.median(r[0] - r[1] - r[2] for r in rows)
    shape = list(loaded.input_shape) if loaded.input_shape else None  # the model's own when not given
    return {"layout": layout, "world_size": world, "input_shape": shape, "step_s": step_s, "collectives_s": coll_s,
            "redistributions_s": moves_s, "redistributions": rows[-1][3], "rest_s": max(0.0, rest_s)}


def measure(spec: str, batch: int, input_shape: tuple[int, ...] | None, layouts: Sequence[tuple[str, int]],
            warmup: int = 2, repeats: int = 7) -> dict:
    """Every layout in turn. A layout the runtime cannot run on this model (the dry run refuses it, so no
    plan uses it) is left out, with why."""
    import torch

    torch.set_num_threads(1)
    steps, skipped = [], {}
    for lay, world in layouts:
        try:
            steps.append(measure_layout(spec, batch, input_shape, lay, world, warmup, repeats))
        except Exception as err:  # noqa: BLE001 - a layout the runtime cannot run on this model: not timed
            skipped[lay] = " ".join(f"{type(err).__name__}: {err}".split())[:200]
    return {"steps": steps, "skipped": skipped}


def layout_steps(spec: str, batch: int, input_shape: tuple[int, ...] | None, splits: Sequence[int], *,
                 repeats: int = 7, timeout_s: float = 600.0) -> dict:
    """`measure` in a fresh subprocess (the fake process group is process-global state)."""
    layouts = layouts_for(splits)
    args = {"spec": spec, "batch": batch, "input_shape": list(input_shape) if input_shape else None,
            "layouts": layouts, "repeats": repeats}
    from hybridpar.profile.one_thread import run_module

    what = f"timing {spec} under {', '.join(lay for lay, _ in layouts)} on a fake world"
    out = run_module("hybridpar.profile.layout_steps", [json.dumps(args)], what, timeout_s)
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    shape = tuple(a["input_shape"]) if a["input_shape"] else None
    result = measure(a["spec"], a["batch"], shape, [tuple(x) for x in a["layouts"]], repeats=a["repeats"])
    print(json.dumps(result), flush=True)
    os._exit(0)  # the fake process group's teardown is not needed
