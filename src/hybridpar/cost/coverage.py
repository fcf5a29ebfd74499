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

from hybridpar.cluster.calibration import BF16_TAG, PRECISIONS, Calibration, format_key, resolve_calibration
from hybridpar.cluster.model import DeviceSpec
from hybridpar.cost.compute import FREE_OPS, channels_last_layout, format_copy_time, local_shapes, op_time
from hybridpar.graph.recurrent import record_op
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
    if dtype not in PRECISIONS:  # the profile times fp32 and bf16 autocast only: running it again would not help
        return Coverage(why=f"the calibration's op times are fp32; a {dtype} plan is priced by the roofline",
                        fixable=False)
    if dtype == "bf16" and not any(r.op.endswith(BF16_TAG) for r in cal.ops.values()):
        return Coverage(why="the calibration's op times are fp32 (none timed under bf16 autocast); a bf16 plan is "
                            "priced by the roofline")
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
            key = format_key(local_shapes(n, s, c, f).key(record_op(n)), "nchw", dtype)
            # per key: an op kind can be untimed at one shape and simply unmeasured at another
            if key in cal.untimed:
                untimed.setdefault(n.op, cal.untimed[key])
            elif profiled is not None and local_shapes(n, s, c, f).key(record_op(n)) not in profiled[0]:
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
            out.setdefault(local_shapes(n, 1 / lay[0], 1 / lay[1], 1 / lay[2]).key(record_op(n)), (n, lay))
    return out


@dataclass(frozen=True)
class FormatCoverage:
    """How a channels-last plan priced its NHWC ops: from channels-last records (`measured` nodes) or as
    NCHW (`as_nchw`, by op kind), and the conversion copies where the model leaves the format
    (`copies`: the nodes that read a channels-last activation in NCHW order; `copy_s`: seconds per step)."""

    measured: tuple[str, ...] = ()
    as_nchw: dict[str, list[str]] = field(default_factory=dict)
    copies: tuple[str, ...] = ()
    copy_s: float = 0.0
    has_file: bool = True  # a calibration file of this machine was found (CPU devices)

    @property
    def status(self) -> str:
        """The Plan's `channels_last` field."""
        if not self.as_nchw:
            return "measured"
        return "partly-measured" if self.measured else "nchw-priced"

    def note(self, device: DeviceSpec, profile_args: str) -> str:
        """The plan's note, starting "channels-last:"; `profile_args`: the profile options that time the
        model's ops (localhost only)."""
        n_nchw = sum(map(len, self.as_nchw.values()))
        total = n_nchw + len(self.measured)
        copies = (f"; {len(self.copies)} layout conversion cop{'y' if len(self.copies) == 1 else 'ies'} "
                  f"(a channels-last activation read in NCHW order: {', '.join(self.copies[:3])}"
                  f"{' ...' if len(self.copies) > 3 else ''}) priced at the memory bandwidth, "
                  f"{self.copy_s * 1e3:.3g} ms per step") if self.copies else ""
        if not self.as_nchw:
            # each op timed alone with NHWC tensors; a run also converts formats where autograd hands an
            # op NCHW gradients, which is not priced: small_cnn's run gained less than its plan
            # (docs/cluster-cost.md, "Channels-last")
            return f"channels-last: all {total} 4-D op(s) priced from channels-last op times measured on this " \
                   f"machine{copies}; an approximation: conversions inside backward are not priced, so the " \
                   f"gain over NCHW is overstated (docs/cluster-cost.md)"
        kinds = ", ".join(f"{op} x{len(names)}" for op, names in sorted(self.as_nchw.items()))
        if device.kind != "cpu":
            why = f"there are no channels-last measurements for {device.name}; the step time is NCHW's"
        else:
            where = "in the calibration file" if self.has_file else "(no calibration file of this machine)"
            why = f"no channels-last record of them {where} (run `hybridpar profile {profile_args} --channels-last`)"
        return (f"channels-last: {n_nchw} of {total} 4-D op(s) priced as NCHW, uncalibrated for that format "
                f"({kinds}): {why}{copies}")


def format_coverage(graph: Graph, device: DeviceSpec, fractions: Callable[[Node], tuple[float, float, float]], *,
                    dtype: str = "fp32", calibration: Calibration | str | os.PathLike | None = None) -> FormatCoverage:
    """Each node of `graph` a channels-last run computes on NHWC memory (cost.compute.channels_last_layout)
    priced at its layout's fractions as the planner does: measured in that format, or as NCHW; and the
    conversion copies."""
    measured: list[str] = []
    as_nchw: dict[str, list[str]] = {}
    copy_s = 0.0
    cal = resolve_calibration(calibration, default=device.kind == "cpu")
    layout = channels_last_layout(graph)
    for n in graph.nodes:
        s, c, f = fractions(n)
        if n.name in layout.copies:
            copy_s += format_copy_time(n, layout.copies[n.name], device, dtype, s, c, f).total_s
        if n.name not in layout.image:
            continue
        t = op_time(n, device, dtype=dtype, sample_frac=s, channel_frac=c, filter_frac=f, calibration=cal,
                    memory_format="channels_last")
        if t.as_nchw:
            as_nchw.setdefault(n.op, []).append(n.name)
        else:
            measured.append(n.name)
    copies = tuple(layout.copies)
    return FormatCoverage(tuple(measured), as_nchw, copies, copy_s,
                          has_file=cal is not None and cal.device_name == device.name)
