"""Per-step work outside the graph's ops: the optimizer step with `zero_grad` and the train loop's
finiteness check around it, and the loss.

Every rank runs `optimizer.step(); optimizer.zero_grad()` over the parameter tensors it holds (a
shard of each under a channel/filter split, its devices' layers under model parallelism), and
`hybridpar train` screens the same tensors' gradients before it and the weights and optimizer state
after it for NaN/Inf (hybridpar.train.guard); the rank holding the model's output runs the loss
(cross-entropy) on its samples' outputs:

  update = (call_s + per_tensor_s * tensors + per_element_s * elements)   optimizer step + zero_grad
         + (the same form, fitted apart)                                   the guard's screens
  loss   = call_s + per_element_s * output elements

The guard is `hybridpar train`'s: a user's own loop over `hybridpar.parallelize` does not pay it, and
steps there run faster than `plan` says by that much (a small BEiT's: ~0.6 of ~5 ms).

localhost: fitted by `hybridpar profile` (hybridpar.profile.update; CPU time of one thread, stretched
by the device's time share as the op table is). torch's optimizers loop over tensors in Python on a
CPU, so per tensor is most of it in small models. Elsewhere (GPU presets, a CPU without a profile):
a roofline, labelled an approximation: the bytes each update reads and writes per parameter at the
device's memory bandwidth, and a few kernel launches per step (torch's foreach kernels, the GPU
default, update every tensor of a step in a handful of launches).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybridpar.cluster.calibration import Calibration, resolve_calibration
from hybridpar.cluster.model import Cluster, DeviceSpec

# bytes read + written per parameter element, in units of the element size: SGD reads the weight and
# its gradient and writes the weight; momentum adds its buffer's read and write; Adam(W) two moments
UPDATE_PASSES = {"sgd": 3, "momentum": 5, "lars": 5, "adam": 7, "adamw": 7}
# the guard reads the gradients, the weights and the optimizer's state once each (GPUs: max-|x| kernels)
GUARD_PASSES = {"sgd": 2, "momentum": 3, "lars": 3, "adam": 4, "adamw": 4}
LOSS_PASSES = 4  # log-softmax forward (read, write) and its gradient (read, write)
ROOFLINE_LAUNCHES = 4  # kernels per update or loss on a GPU (foreach groups, softmax + nll)
# the measured kind that stands for one the profile does not time (LARS: SGD with momentum plus per-
# tensor norms, an approximation; Adam: AdamW's loop without the decoupled decay)
_MEASURED_AS = {"lars": "momentum", "adam": "adamw"}


def optimizer_kind(name: str, momentum: float = 0.0) -> str:
    """The cost model's name (hybridpar.cost.memory.OPTIMIZERS) of `hybridpar train`'s optimizer:
    "sgd" with momentum is "momentum"."""
    return "momentum" if name == "sgd" and momentum else name


@dataclass(frozen=True)
class StepWork:
    """The fits of one device: seconds for `tensors` tensors of `elements` parameter elements. The
    update's terms hold the optimizer step's and the guard's together (see the module docstring)."""

    update_call_s: float
    update_per_tensor_s: float
    update_per_element_s: float
    loss_call_s: float
    loss_per_element_s: float
    source: str  # "measured" or "roofline"

    def update_s(self, tensors: int, elements: float) -> float:
        if tensors <= 0:
            return 0.0
        return self.update_call_s + self.update_per_tensor_s * tensors + self.update_per_element_s * elements

    def update_per_tensor(self, tensors: int, elements: float) -> float:
        """The part of `update_s` that grows with what a device holds (without the call)."""
        return self.update_per_tensor_s * tensors + self.update_per_element_s * elements

    def loss_s(self, elements: float) -> float:
        return self.loss_call_s + self.loss_per_element_s * elements if elements > 0 else 0.0


def step_work(device: DeviceSpec | Cluster, optimizer: str = "sgd", *, dtype: str = "fp32",
              calibration: Calibration | str | os.PathLike | None = None) -> StepWork:
    """The update and loss fits of `device` for `optimizer` ("sgd" = train's default, momentum 0)."""
    from hybridpar.cost.compute import efficiency_table
    from hybridpar.graph.types import DTYPE_BYTES

    dev = device.device if isinstance(device, Cluster) else device
    cal = resolve_calibration(calibration, default=dev.kind == "cpu")
    if cal is not None and cal.device_name == dev.name and cal.loss is not None:
        fit = cal.update.get(optimizer) or cal.update.get(_MEASURED_AS.get(optimizer, ""))
        guard = cal.guard.get(optimizer) or cal.guard.get(_MEASURED_AS.get(optimizer, ""))
        if fit is not None and guard is not None:
            k = dev.time_share
            return StepWork((fit.call_s + guard.call_s) * k, (fit.per_tensor_s + guard.per_tensor_s) * k,
                            (fit.per_element_s + guard.per_element_s) * k,
                            cal.loss.call_s * k, cal.loss.per_element_s * k, "measured")
    table = efficiency_table()[dev.kind]
    bw = dev.mem_bw_Bps * table["classes"]["elementwise"]["memory"]
    b = DTYPE_BYTES[dtype]
    launch = ROOFLINE_LAUNCHES * table["launch_s"] * dev.time_share  # the guard's kernels among them
    passes = UPDATE_PASSES.get(optimizer, UPDATE_PASSES["momentum"]) + \
        GUARD_PASSES.get(optimizer, GUARD_PASSES["momentum"])
    per_elem = passes * b / bw * dev.time_share
    return StepWork(launch, 0.0, per_elem, launch, LOSS_PASSES * b / bw * dev.time_share, "roofline")
