"""The optimizer step, `zero_grad`, the train loop's finiteness check and the loss, measured on this machine.

A training step is more than the graph's ops: after backward the optimizer updates every parameter
tensor and `zero_grad` drops the gradients, and before backward the loss (cross-entropy) runs on the
model's output. On a CPU, torch's optimizers loop over parameter tensors in Python (foreach kernels
are the default on GPUs only), so the update costs a few microseconds per tensor plus its bytes:
measured on this VM, 0.33 ms of lstm2's 4.75 ms step at batch 32 and 0.61 of small_cnn's 36.0 ms
(issue 13), unpriced before.

`hybridpar train` also checks every step's gradients and, after the update, every weight, buffer and
optimizer slot for NaN/Inf (hybridpar.train.guard): two passes over what the update touches, which cost
more than the update itself with SGD (a small BEiT's 24 tensors of 595k elements: 0.6-1.2 ms of guard
against 0.43 ms of update, one thread, 2026-12-04), unpriced before.

All are fitted as CPU time of this thread (time.thread_time, as the op table):
  update(tensors, elements) = call_s + per_tensor_s * tensors + per_element_s * elements
    (optimizer.step() + zero_grad(), per optimizer kind, over parameter sets of several counts and sizes)
  guard(tensors, elements)  = the same form, the train loop's StateGuard around that update (its
    gradient screen before, its state screen and verdict after), per optimizer kind (its state is screened)
  loss(elements)            = call_s + per_element_s * elements
    (cross-entropy forward and backward from the logits, over several output sizes; the backward
    call's own start-up rides here, as a step pays it once)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hybridpar.profile.timing import clock
from hybridpar.train.guard import StateGuard

UPDATE_KINDS = ("sgd", "momentum", "adamw")  # train's default (SGD, momentum 0), SGD with momentum, AdamW
# (tensors, elements per tensor): few and many tensors, small and large, so both slopes are seen
UPDATE_SETS = ((4, 256), (48, 256), (4, 131072), (24, 32768), (48, 16384), (8, 262144))
LOSS_SHAPES = ((32, 10), (32, 1000), (256, 1000), (1024, 1000))


def _optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    raise ValueError(f"unknown optimizer kind {kind!r}")


def _fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares of times against rows (a column of ones first), coefficients clipped at 0 (a
    negative slope is noise: work never takes time away)."""
    coef, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(times, dtype=float), rcond=None)
    return [max(0.0, float(c)) for c in coef]


def _median_interleaved(fns: list, warmup: int, repeats: int) -> list[float]:
    """Median CPU time of each function, the functions taken in turn so every median spans the same
    stretch of time (this VM's speed drifts)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            samples[i].append(fn())
    return [float(np.median(s)) for s in samples]


def _guard(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> StateGuard:
    """The train loop's guard over `params` as one rank of a sample-only layout holds them (every rank's
    verdict the same: no collective), on an engine that is just those parameters."""
    from types import SimpleNamespace

    holder = torch.nn.ParameterList(params)
    engine = SimpleNamespace(module=holder, grads_agree=True, parameters=holder.parameters,
                             _local_state={str(i): p for i, p in enumerate(params)})
    return StateGuard.for_run(engine, opt, torch.device("cpu"))


def measure_update(warmup: int = 3, repeats: int = 15) -> dict:
    """{"update": {kind: fit}, "guard": {kind: fit}, "loss": {call_s, per_element_s}}; an update or guard fit
    is {call_s, per_tensor_s, per_element_s}."""
    torch.manual_seed(0)
    out: dict = {"update": {}, "guard": {}}
    for kind in UPDATE_KINDS:
        fns = []
        for count, size in UPDATE_SETS:
            params = [torch.nn.Parameter(torch.zeros(size)) for _ in range(count)]
            grads = [torch.randn(size) * 1e-3 for _ in range(count)]
            opt = _optimizer(kind, params)
            guard = _guard(params, opt)

            def step(params=params, grads=grads, opt=opt) -> float:
                for p, g in zip(params, grads):  # what backward leaves (untimed)
                    p.grad = g
                t0 = clock()
                opt.step()
                opt.zero_grad()
                return clock() - t0

            def check(params=params, grads=grads, opt=opt, guard=guard) -> float:
                for p, g in zip(params, grads):  # untimed: backward's gradients, then the update
                    p.grad = g
                t0 = clock()
                pending = guard.before_update(1.0)
                before = clock() - t0
                opt.step()
                opt.zero_grad()
                t0 = clock()
                guard.submit(pending, 0, 1.0)
                return before + clock() - t0

            fns += [step, check]
        times = _median_interleaved(fns, warmup, repeats)
        rows = [[1.0, c, c * s] for c, s in UPDATE_SETS]
        for name, ts in (("update", times[0::2]), ("guard", times[1::2])):
            call, per_tensor, per_element = _fit(rows, ts)
            out[name][kind] = {"call_s": call, "per_tensor_s": per_tensor, "per_element_s": per_element}
    fns = []
    for n, k in LOSS_SHAPES:
        z = torch.randn(n, k, requires_grad=True)
        y = torch.randint(0, k, (n,))

        def loss(z=z, y=y) -> float:
            z.grad = None
            t0 = clock()
            F.cross_entropy(z, y).backward()
            return clock() - t0

        fns.append(loss)
    times = _median_interleaved(fns, warmup, repeats)
    call, per_element = _fit([[1.0, n * k] for n, k in LOSS_SHAPES], times)
    out["loss"] = {"call_s": call, "per_element_s": per_element}
    return out
