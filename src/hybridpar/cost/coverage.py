"""Which of a plan's op times on localhost were measured, and which came from the roofline (issue 35).

On this machine the roofline was 7x off for Conv3d and a channel split 3-5x too cheap, so a localhost
figure that rests on it is an uncalibrated estimate and must say so: `coverage` prices each node at
its layout's local shape as `op_time` does and lists those that found no measured record, with the
reason `hybridpar profile` gave when it could not time them (`Calibration.untimed`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from hybridpar.cluster.calibration import Calibration, resolve_calibration
from hybridpar.cluster.model import DeviceSpec
from hybridpar.cost.compute import FREE_OPS, local_shapes, op_time
from hybridpar.graph.types import Graph, Node

Layout = tuple[int, int, int]  # (sample, channel, filter) degrees

LABEL = "UNCALIBRATED ESTIMATE"  # the note's first words: the CLI's table title and the report look for it


@dataclass(frozen=True)
class Coverage:
    """Nodes priced by the roofline, by op kind (node names), and their share of the compute."""

    roofline: dict[str, list[str]] = field(default_factory=dict)
    roofline_s: float = 0.0
    total_s: float = 0.0
    untimed: dict[str, str] = field(default_factory=dict)  # op kind -> why the profile could not time it
    why: str = ""  # set when nothing could be measured (no file, another dtype)
    # whether `hybridpar profile` would measure some of those op times (decided per op-table key: a
    # key the profile tried and could not time, one it never times, or another dtype would not change)
    fixable: bool = True
    unprofiled: dict[str, str] = field(default_factory=dict)  # op kind -> why the profile never times it here

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
            tail = f" ({fix})" if self.fixable else ""
            return f"{LABEL}: {self.why}; every compute figure is the roofline's{tail}"
        kinds = ", ".join(f"{op} x{len(names)}" + _why(op, self.untimed, self.unprofiled)
                          for op, names in sorted(self.roofline.items()))
        if self.unprofiled:  # one reason (a spatial plan's pieces) for many kinds: said once
            kinds += f" (*: not timed by `hybridpar profile`: {'; '.join(sorted(set(self.unprofiled.values())))})"
        share = self.roofline_s / self.total_s if self.total_s > 0 else 1.0
        tail = f"; {fix}" if self.fixable else ""
        return (f"{LABEL}: {sum(map(len, self.roofline.values()))} op(s) priced by the roofline (FLOPs and "
                f"bytes at the device's rates) instead of a time measured on this machine, {share:.0%} of the "
                f"predicted compute: {kinds}{tail}")

    def as_dict(self) -> dict:
        return {"roofline_ops": self.roofline, "roofline_compute_s": self.roofline_s,
                "compute_s": self.total_s, "untimed": self.untimed, "unprofiled": self.unprofiled, "why": self.why,
                "profiling_helps": self.fixable}


def _why(op: str, untimed: dict[str, str], unprofiled: dict[str, str]) -> str:
    if op in untimed:
        return f" (could not be timed: {untimed[op][:80]})"
    return "*" if op in unprofiled else ""


def coverage(graph: Graph, device: DeviceSpec, fractions: Callable[[Node], tuple[float, float, float]], *,
             dtype: str = "fp32", calibration: Calibration | str | os.PathLike | None = None,
             profiled: tuple[Collection[str], str] | None = None) -> Coverage | None:
    """What `op_time` would price by the roofline for each node of `graph` at its layout's
    (sample, channel, filter) fractions; None on a GPU preset (priced by its published rates).
    `profiled`: (the op-table keys `hybridpar profile` measures for this plan, why it measures no
    other), None when it measures every key the plan looks up."""
    if device.kind != "cpu":
        return None
    cal = resolve_calibration(calibration, default=True)
    if cal is None or cal.device_name != device.name:
        return Coverage(why="no calibration file of this machine (`hybridpar profile` writes it)")
    if dtype != "fp32":  # the profile times fp32 only: running it again would not help
        return Coverage(why=f"the calibration's op times are fp32; a {dtype} plan is priced by the roofline",
                        fixable=False)
    roof: dict[str, list[str]] = {}
    untimed: dict[str, str] = {}
    unprofiled: dict[str, str] = {}
    fixable = False
    roof_s = total = 0.0
    for n in graph.nodes:
        if n.op in FREE_OPS:
            continue
        s, c, f = fractions(n)
        t = op_time(n, device, dtype=dtype, sample_frac=s, channel_frac=c, filter_frac=f, calibration=cal)
        total += t.total_s
        if t.source == "roofline" and t.total_s > 0:
            roof.setdefault(n.op, []).append(n.name)
            roof_s += t.total_s
            key = local_shapes(n, s, c, f).key(n.op)
            # per key: an op kind can be untimed at one shape and simply unmeasured at another
            if key in cal.untimed:
                untimed.setdefault(n.op, cal.untimed[key])
            elif profiled is not None and key not in profiled[0]:
                unprofiled.setdefault(n.op, profiled[1])
            else:
                fixable = True
    return Coverage(roof, roof_s, total, untimed, fixable=fixable, unprofiled=unprofiled)


def whole_nodes(graph: Graph) -> frozenset[str]:
    """Names of the nodes the runtime runs with every channel under any channel/filter layout: a
    conv/linear it does not replace (cost.layout_comm.splits_by_layout: a grouped or depthwise conv,
    a subclass, a functional call), and the nodes that follow it in its layer, which the planner prices
    on that layer's distribution (search.layers.layer_cost.weight_layer_cost: sample split only)."""
    from hybridpar.cost.layout_comm import splits_by_layout
    from hybridpar.cost.memory import WEIGHT_OPS, layer_groups

    heads, _ = layer_groups(graph)
    return frozenset(n.name for head, followers, _ in heads if head.op in WEIGHT_OPS and not splits_by_layout(head)
                     for n in (head, *followers))


def as_run(node: Node, layout: Layout, whole: Collection[str]) -> Layout:
    """The (sample, channel, filter) degrees `node` runs at under `layout`: its samples only when the
    runtime runs it whole (`whole`: `whole_nodes`), so the op times looked up and profiled are the
    shapes the runtime runs (a depthwise conv cut to half its channels cannot run at all)."""
    return (layout[0], 1, 1) if node.name in whole else layout


def split_layouts(k: int) -> list[Layout]:
    """Every (sample, channel, filter) with sample x channel x filter = k: the layouts of k ranks."""
    return [(k // (c * f), c, f) for c in range(1, k + 1) if k % c == 0
            for f in range(1, k // c + 1) if (k // c) % f == 0]


def profile_keys(graph: Graph, splits: Collection[int]) -> dict[str, tuple[Node, Layout]]:
    """The op-table keys `hybridpar profile --model M --splits ...` times for `graph` (at its batch),
    each with its first node and degrees: each working node whole and at every layout of every k in
    `splits`, as the runtime runs it there (`as_run`), so the key is what `op_time` looks up."""
    whole = whole_nodes(graph)
    layouts = [(1, 1, 1)] + [lay for k in splits if k > 1 for lay in split_layouts(k)]
    out: dict[str, tuple[Node, Layout]] = {}
    for n in graph.nodes:
        if n.op in FREE_OPS or not n.out_shape:
            continue
        for lay in dict.fromkeys(as_run(n, lay, whole) for lay in layouts):
            out.setdefault(local_shapes(n, 1 / lay[0], 1 / lay[1], 1 / lay[2]).key(n.op), (n, lay))
    return out
