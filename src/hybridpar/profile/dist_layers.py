"""The runtime's own channel/filter-split convolution and linear layers, timed outside their collectives.

A conv/linear split over channel/filter does more than the plain op at its local shape: the layer
wrapper (DTensor in and out), the autograd Function, the separate backward-data and backward-weight
calls, buffers allocated each step. On small models on this CPU that was ~2x the op table's time
(small_cnn `channel=2`: 31 ms of work outside collectives against 17 ms of ops; issue 13). So
`hybridpar profile --splits k` also times the layer itself: each conv/linear of the model, at each
layout with channel x filter > 1 among the factorisations of k (sample s: its local batch B/s), run
through `hybridpar.parallel.parallelize` on PyTorch's fake process group
(`torch.testing._internal.distributed.fake_pg`, the backend torchtitan's memory estimator uses;
collectives are no-ops) of channel x filter ranks. The time spent inside the collective functions
(hybridpar.parallel.comm.collectives: packing copies, buffers, Python) is taken out, because the gloo fits
time those functions already. CPU time of the thread, as every op record (profile.timing).

Records are keyed like the op table's, with the op named `conv2d@c{C}f{F}` (`/nodx`: the model's first
layer, whose input gradient the runtime skips); the forward in `fwd`, the whole backward in
`bwd_weight` (bwd_data 0), so the cost model's first-layer rule has nothing to drop.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from functools import partial

from hybridpar.cluster.calibration import OpRecord
from hybridpar.cost.compute import variant_name

DIST_OPS = ("conv2d", "linear")


def dist_jobs(specs, splits) -> dict[int, list[dict]]:
    """What to time, by fake world size (channel x filter): for each conv/linear spec (full shapes)
    and each (sample, channel, filter) of every k in `splits` with channel x filter > 1, the spec at
    batch / sample and the layout, both with and without the input gradient."""
    from hybridpar.cost.compute import local_shapes
    from hybridpar.profile.ops import _factorisations

    jobs: dict[int, list[dict]] = {}
    seen = set()
    for s in specs:
        if s.op not in DIST_OPS or s.groups != 1:
            continue
        for k in splits:
            for sa, c, f in _factorisations(k) if k > 1 else ():
                if c * f == 1 or s.x[0] % sa:
                    continue
                loc = local_shapes(s.node(), 1 / sa, 1 / c, 1 / f)
                for grad in (True, False):
                    key = loc.key(variant_name(s.op, c, f, grad))
                    if key in seen:
                        continue
                    seen.add(key)
                    jobs.setdefault(c * f, []).append({"spec": asdict(s), "sample": sa, "channel": c, "filter": f,
                                                       "input_grad": grad, "key": key})
    return jobs


def measure_dist_layers(specs, splits, *, warmup: int = 2, repeats: int = 5,
                        timeout_s: float = 600.0) -> dict[str, OpRecord]:
    """Time every job of `dist_jobs` (one subprocess per fake world size); records by key."""
    import tempfile

    out: dict[str, OpRecord] = {}
    from hybridpar.profile.one_thread import run_module

    for world, jobs in sorted(dist_jobs(specs, splits).items()):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "jobs.json")
            with open(path, "w") as fh:
                json.dump({"world": world, "jobs": jobs, "warmup": warmup, "repeats": repeats}, fh)
            run_module("hybridpar.profile.dist_layers", [path], f"timing the distributed layers on {world} fake ranks",
                       timeout_s)
            with open(path) as fh:
                for rec in json.load(fh)["records"]:
                    out[rec["key"]] = OpRecord.model_validate(rec)
    return out


def _run(path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hybridpar.parallel.styles.conv as conv_mod
    from hybridpar.parallel.api import parallelize
    from hybridpar.parallel.dtensor.boundary import boundary_placements
    from hybridpar.profile.ops import OpSpec
    from hybridpar.profile.timing import summarize

    with open(path) as fh:
        task = json.load(fh)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=task["world"])

    inside = [0.0]  # thread CPU seconds spent in the collective functions (the gloo fits hold them)

    def timed(fn):
        def run(*args, **kwargs):
            t0 = time.thread_time()
            got = fn(*args, **kwargs)
            inside[0] += time.thread_time() - t0
            if kwargs.get("async_op"):
                wait = got.wait

                def timed_wait():
                    t1 = time.thread_time()
                    r = wait()
                    inside[0] += time.thread_time() - t1
                    return r
                got.wait = timed_wait
            return got
        return run

    conv_mod.all_gather_dim = timed(conv_mod.all_gather_dim)
    conv_mod.reduce_scatter_dim = timed(conv_mod.reduce_scatter_dim)

    records = []
    for job in task["jobs"]:
        s = OpSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["spec"].items()})
        torch.manual_seed(0)
        if s.op == "conv2d":
            layer = nn.Conv2d(s.x[1], s.w[0], s.w[2:], stride=s.stride, padding=s.padding, dilation=s.dilation,
                              bias=s.bias)
        else:
            layer = nn.Linear(s.x[-1], s.w[0], bias=s.bias)
        model = parallelize(nn.Sequential(layer), f"channel={job['channel']},filter={job['filter']}",
                            inputs="sample_shard")
        dl = model[0]
        meshes = dl.meshes
        n = s.x[0] // job["sample"]
        shape = (n, *s.x[1:])
        cdim = 1 if s.op == "conv2d" else len(shape) - 1
        places = boundary_placements(meshes, cdim)
        g = meshes.act.get_local_rank("channel_filter")
        from hybridpar.layout import piece_sizes

        local = list(shape)
        local[cdim] = piece_sizes(shape[cdim], meshes.g_size)[g]
        base = torch.randn(local)

        make = partial(_input, base, job["input_grad"], meshes, places, shape)
        fwd, bwd = _time_layer(dl, make, inside, task["warmup"], task["repeats"])
        zero = summarize([0.0])
        records.append(OpRecord(key=job["key"], op=job["key"].split("|", 1)[0], fwd=fwd, bwd_data=zero,
                                bwd_weight=bwd).model_dump())
    with open(path, "w") as fh:
        json.dump({"records": records}, fh)


def _input(base, grad: bool, meshes, places, shape):
    from hybridpar.parallel.dtensor.boundary import from_local

    return from_local(base.detach().requires_grad_(grad), meshes, places, shape)


def _time_layer(layer, make_input, inside: list[float], warmup: int, repeats: int):
    """Medians of the layer's forward and backward CPU time outside its collective functions."""
    import torch

    from hybridpar.profile.timing import grad_call_s, summarize

    got = []
    for i in range(warmup + repeats):
        xd = make_input()
        inside[0] = 0.0
        t0 = time.thread_time()
        y = layer(xd)
        t1 = time.thread_time()
        fwd_in = inside[0]
        yl = y.to_local()
        dy = torch.ones_like(yl)
        inside[0] = 0.0
        t2 = time.thread_time()
        yl.backward(dy)
        t3 = time.thread_time()
        if i >= warmup:  # backward without the engine start-up a step pays once (timing.grad_call_s)
            got.append((t1 - t0 - fwd_in, t3 - t2 - inside[0] - grad_call_s()))
    return summarize([max(1e-7, a) for a, _ in got]), summarize([max(1e-7, b) for _, b in got])


if __name__ == "__main__":
    _run(sys.argv[1])
    os._exit(0)  # the fake process group's teardown is not needed
