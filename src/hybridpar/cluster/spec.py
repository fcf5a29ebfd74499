"""The cluster *file* schema: what a preset or a user's YAML/JSON cluster file may contain.

Every figure may be written as a plain number or as `{value, source[, note]}`; presets always use the
second form so that the source of each published figure sits beside it. `to_cluster` (in loader.py)
turns a validated file into the runtime `Cluster`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Finite positive numbers only (YAML happily parses .inf and .nan).
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(gt=0, le=1_000_000)]
DevicesPerNode = Annotated[int, Field(gt=0, le=4096)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Sourced(_Strict):
    """A figure with where it comes from. `approx: true` marks our own approximations."""

    value: PositiveFloat
    source: str = Field(min_length=1)
    note: str | None = None
    approx: bool = False


Figure = PositiveFloat | Sourced


def value_of(fig: Figure) -> float:
    return float(fig.value) if isinstance(fig, Sourced) else float(fig)


def source_of(fig: Figure) -> str | None:
    return fig.source if isinstance(fig, Sourced) else None


class DeviceFile(_Strict):
    name: str
    kind: Literal["gpu", "cpu"] = "gpu"
    # FLOP/s per dtype; matmul-class ops use the dtype's entry (tensor-core rate where there is one).
    peak_flops: dict[Literal["fp64", "fp32", "tf32", "fp16", "bf16"], Figure]
    mem_bw_Bps: Figure
    memory_bytes: Figure

    @model_validator(mode="after")
    def _has_fp32(self) -> DeviceFile:
        if "fp32" not in self.peak_flops:
            raise ValueError("peak_flops needs an fp32 entry")
        return self


class MeshLink(_Strict):
    """`count` parallel links between local devices `a` and `b` (e.g. 2 NVLinks on DGX-1 0-3)."""

    a: int = Field(ge=0)
    b: int = Field(ge=0)
    count: PositiveInt


class IntraFile(_Strict):
    """Links inside a node. mesh: point-to-point links listed pair by pair (pairs not listed go over
    the host path `fallback_*`); switch: every device has `links_per_device` links into a
    full-bisection switch (NVSwitch); shared: ranks on one host exchanging through memory (gloo)."""

    kind: Literal["mesh", "switch", "shared"]
    link_name: str
    link_bw_Bps: Figure  # one link, one direction
    link_efficiency: Figure | None = None  # achievable fraction of link_bw_Bps (e.g. NCCL's model)
    link_latency_s: Figure
    links: list[MeshLink] = []
    links_per_device: PositiveInt | None = None
    fallback_name: str | None = None
    fallback_bw_Bps: Figure | None = None
    fallback_latency_s: Figure | None = None

    @model_validator(mode="after")
    def _consistent(self) -> IntraFile:
        if self.kind == "switch" and self.links_per_device is None:
            raise ValueError("links_per_device is required for kind: switch")
        if self.kind == "mesh" and (self.fallback_bw_Bps is None or self.fallback_latency_s is None):
            raise ValueError("fallback_bw_Bps and fallback_latency_s are required for kind: mesh")
        if self.kind == "mesh" and not self.links:
            raise ValueError("links: a mesh needs at least one link")
        if self.link_efficiency is not None and value_of(self.link_efficiency) > 1:
            raise ValueError("link_efficiency must be <= 1")
        return self


class InterFile(_Strict):
    name: str
    nics_per_node: PositiveInt | Sourced
    nic_bw_Bps: Figure  # one NIC, one direction
    latency_s: Figure


# Physical bounds of each figure (inclusive), wide enough for any real machine from a laptop core to an
# exascale node, narrow enough that a typo or an absurd value (peak_flops: 1e-300, a 1e30 B/s link) is
# refused with the field's name instead of producing infinite or zero times downstream.
BOUNDS: dict[str, tuple[float, float, str]] = {
    "device.peak_flops": (1e6, 1e19, "FLOP/s"),
    "device.mem_bw_Bps": (1e6, 1e16, "B/s"),
    "device.memory_bytes": (1e3, 1e16, "bytes"),
    "intra.link_bw_Bps": (1e3, 1e15, "B/s"),
    "intra.link_efficiency": (1e-3, 1.0, ""),
    "intra.link_latency_s": (1e-10, 10.0, "s"),
    "intra.fallback_bw_Bps": (1e3, 1e15, "B/s"),
    "intra.fallback_latency_s": (1e-10, 10.0, "s"),
    "inter.nic_bw_Bps": (1e3, 1e15, "B/s"),
    "inter.latency_s": (1e-10, 10.0, "s"),
    "gamma_s_per_byte": (1e-17, 1e-3, "s/B"),
    "collective_base_latency_s": (1e-10, 10.0, "s"),
}


def _figures(f: ClusterFile) -> Iterator[tuple[str, str, float]]:
    """(field path, bounds key, value) of every physical figure in the file."""
    d = f.device
    for dtype, fig in d.peak_flops.items():
        yield f"device.peak_flops.{dtype}", "device.peak_flops", value_of(fig)
    yield "device.mem_bw_Bps", "device.mem_bw_Bps", value_of(d.mem_bw_Bps)
    yield "device.memory_bytes", "device.memory_bytes", value_of(d.memory_bytes)
    for name in ("link_bw_Bps", "link_efficiency", "link_latency_s", "fallback_bw_Bps", "fallback_latency_s"):
        fig = getattr(f.intra, name)
        if fig is not None:
            yield f"intra.{name}", f"intra.{name}", value_of(fig)
    if f.inter is not None:
        yield "inter.nic_bw_Bps", "inter.nic_bw_Bps", value_of(f.inter.nic_bw_Bps)
        yield "inter.latency_s", "inter.latency_s", value_of(f.inter.latency_s)
    for name in ("gamma_s_per_byte", "collective_base_latency_s"):
        fig = getattr(f, name)
        if fig is not None:
            yield name, name, value_of(fig)


class ClusterFile(_Strict):
    name: str
    description: str = ""
    gpus_per_node: DevicesPerNode | Sourced
    max_nodes: PositiveInt | Sourced | None = None
    device: DeviceFile
    intra: IntraFile
    inter: InterFile | None = None
    # Reduction cost per byte (the gamma of alpha-beta-gamma); default: one extra read per byte.
    gamma_s_per_byte: Figure | None = None
    # Fixed cost added once per collective call (library launch/sync), as NCCL's baseLatencies.
    collective_base_latency_s: Figure | None = None
    notes: list[str] = []

    @model_validator(mode="after")
    def _links_in_node(self) -> ClusterFile:
        g = value_of(self.gpus_per_node)
        if g != int(g) or not 1 <= g <= 4096:
            raise ValueError(f"gpus_per_node must be a whole number in 1..4096, got {g}")
        g = int(g)
        for name, fig in (("max_nodes", self.max_nodes),
                          ("inter.nics_per_node", self.inter.nics_per_node if self.inter else None)):
            if fig is not None and (value_of(fig) != int(value_of(fig)) or value_of(fig) > 1_000_000):
                raise ValueError(f"{name} must be a whole number, got {value_of(fig)}")
        for path, key, v in _figures(self):
            lo, hi, unit = BOUNDS[key]
            if not lo <= v <= hi:
                raise ValueError(f"field {path}: {v:g} is outside the physical bounds {lo:g}..{hi:g}"
                                 f"{' ' + unit if unit else ''}")
        seen: set[tuple[int, int]] = set()
        for link in self.intra.links:
            if link.a >= g or link.b >= g or link.a == link.b:
                raise ValueError(f"intra.links: pair {link.a}-{link.b} is not two devices of a {g}-device node")
            pair = (min(link.a, link.b), max(link.a, link.b))
            if pair in seen:
                raise ValueError(f"intra.links: pair {pair[0]}-{pair[1]} listed twice")
            seen.add(pair)
        return self
