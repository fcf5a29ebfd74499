"""Which of a plan's op times on localhost were measured, and which came from the roofline (issue 35).

On this machine the roofline was 7x off for Conv3d and a channel split 3-5x too cheap, so a localhost
figure that rests on it is an uncalibrated estimate and must say so: `coverage` prices each node at
its layout's local shape as `op_time` does and lists those that found no measured record, with the
reason `hybridpar profile` gave when it could not time them (`Calibration.untimed`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridpar.cluster.calibration import Calibration, resolve_calibration
from hybridpar.cluster.model import DeviceSpec
from hybridpar.cost.compute import local_shapes, op_time
from hybridpar.graph.types import Graph, Node

LABEL = "UNCALIBRATED ESTIMATE"  # the note's first words: the CLI's table title and the report look for it


@dataclass(frozen=True)
class Coverage:
    """Nodes priced by the roofline, by op kind (node names), and their share of the compute."""

    roofline: dict[str, list[str]] = field(default_factory=dict)
    roofline_s: float = 0.0
    total_s: float = 0.0
    untimed: dict[str, str] = field(default_factory=dict)  # op kind -> why the profile could not time it
    why: str = ""  # set when nothing could be measured (no file, another dtype)

    @property
    def calibrated(self) -> bool:
        return not self.roofline and not self.why

    def note(self, profile_args: str) -> str:
        """The plan's note (starting with LABEL), or "" when every op time was measured;
        `profile_args`: the `hybridpar profile` options that measure them."""
        if self.calibrated:
            return ""
        fix = f"run `hybridpar profile {profile_args}` to measure them"
        if self.why:
            return f"{LABEL}: {self.why}; every compute figure is the roofline's ({fix})"
        kinds = ", ".join(f"{op} x{len(names)}" + (f" (could not be timed: {self.untimed[op][:80]})"
                                                   if op in self.untimed else "")
                          for op, names in sorted(self.roofline.items()))
        share = self.roofline_s / self.total_s if self.total_s > 0 else 1.0
        # an op the profile could not time stays on the roofline: re-profiling would not change it
        tail = "" if set(self.roofline) <= set(self.untimed) else f"; {fix}"
        return (f"{LABEL}: {sum(map(len, self.roofline.values()))} op(s) priced by the roofline (FLOPs and "
                f"bytes at the device's rates) instead of a time measured on this machine, {share:.0%} of the "
                f"predicted compute: {kinds}{tail}")

    def as_dict(self) -> dict:
        return {"roofline_ops": self.roofline, "roofline_compute_s": self.roofline_s,
                "compute_s": self.total_s, "untimed": self.untimed, "why": self.why}


_FREE = ("input", "output", "flatten", "reshape")


def coverage(graph: Graph, device: DeviceSpec, fractions: Callable[[Node], tuple[float, float, float]], *,
             dtype: str = "fp32", calibration: Calibration | str | os.PathLike | None = None) -> Coverage | None:
    """What `op_time` would price by the roofline for each node of `graph` at its layout's
    (sample, channel, filter) fractions; None on a GPU preset (priced by its published rates)."""
    if device.kind != "cpu":
        return None
    cal = resolve_calibration(calibration, default=True)
    if cal is None or cal.device_name != device.name:
        return Coverage(why="no calibration file of this machine (`hybridpar profile` writes it)")
    if dtype != "fp32":
        return Coverage(why=f"the calibration's op times are fp32; a {dtype} plan is priced by the roofline")
    roof: dict[str, list[str]] = {}
    untimed: dict[str, str] = {}
    roof_s = total = 0.0
    for n in graph.nodes:
        if n.op in _FREE:
            continue
        s, c, f = fractions(n)
        t = op_time(n, device, dtype=dtype, sample_frac=s, channel_frac=c, filter_frac=f, calibration=cal)
        total += t.total_s
        if t.source == "roofline" and t.total_s > 0:
            roof.setdefault(n.op, []).append(n.name)
            roof_s += t.total_s
            why = cal.untimed.get(local_shapes(n, s, c, f).key(n.op))
            if why:
                untimed.setdefault(n.op, why)
    return Coverage(roof, roof_s, total, untimed)
