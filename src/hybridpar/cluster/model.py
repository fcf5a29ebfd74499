"""The runtime view of a cluster: devices, links and routes between any two devices.

Devices are numbered globally 0..num_devices-1, node-major (device d sits on node d // gpus_per_node
at local index d % gpus_per_node). A transfer between two devices occupies a tuple of *directed*
link ids (full-duplex links: the two directions do not compete), each with a capacity in bytes/s;
the collective cost model shares a link's capacity among the transfers that use it at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DeviceSpec(_Frozen):
    """One accelerator (or one CPU core on localhost)."""

    name: str
    kind: Literal["gpu", "cpu"] = "gpu"
    peak_flops: dict[str, float]  # FLOP/s per dtype; tensor-core rate where the device has one
    mem_bw_Bps: float
    memory_bytes: float
    # > 1 when ranks time-share cores (localhost with more ranks than cores): compute stretches by it.
    time_share: float = 1.0
    # True where collectives run on the cores that compute (gloo between CPU ranks that fill every
    # core): an exchange issued during backward takes its time from backward instead of hiding behind it
    comm_takes_compute: bool = False

    def peak(self, dtype: str = "fp32") -> float:
        """Peak for `dtype`; a dtype the device has no special rate for runs at the fp32 rate."""
        return self.peak_flops.get(dtype, self.peak_flops["fp32"])


class IntraNode(_Frozen):
    kind: Literal["mesh", "switch", "shared"]
    link_name: str
    link_bw_Bps: float  # one link, one direction, effective (published rate x efficiency)
    link_latency_s: float
    links: tuple[tuple[int, int, int], ...] = ()  # mesh: (a, b, count), local indices, a < b
    links_per_device: int = 0  # switch
    fallback_name: str = ""
    fallback_bw_Bps: float = 0.0
    fallback_latency_s: float = 0.0


class InterNode(_Frozen):
    name: str
    nics_per_node: int
    nic_bw_Bps: float  # one NIC, one direction
    latency_s: float


class MeasuredCollective(_Frozen):
    """A measured collective time, T(n) = intercept + slope * n for n bytes (the runtime's byte
    convention), in groups of `group_size` ranks with every such group running at once. Where a
    cluster has one for a kind and group size, the cost model takes it over the link model."""

    kind: str
    group_size: int
    intercept_s: float
    slope_s_per_byte: float

    def time_s(self, bytes_: float) -> float:
        return self.intercept_s + self.slope_s_per_byte * bytes_


@dataclass(frozen=True)
class Route:
    links: tuple[str, ...]
    latency_s: float
    capacities_Bps: tuple[float, ...] = ()  # of each link, in the same order


class Cluster(_Frozen):
    name: str
    description: str = ""
    device: DeviceSpec
    gpus_per_node: int
    num_nodes: int
    num_devices: int
    intra: IntraNode
    inter: InterNode | None = None
    gamma_s_per_byte: float
    collective_base_latency_s: float = 0.0
    ranks_share_cores: bool = False
    cores: int | None = None
    max_nodes: int | None = None
    measured_collectives: tuple[MeasuredCollective, ...] = ()  # localhost: from `hybridpar profile`
    sources: dict[str, str] = {}
    notes: tuple[str, ...] = ()

    def measured_collective(self, kind: str, group_size: int) -> MeasuredCollective | None:
        return next((m for m in self.measured_collectives if m.kind == kind and m.group_size == group_size), None)

    # -- placement of devices ------------------------------------------------------------------
    def node_of(self, dev: int) -> int:
        self._check(dev)
        return dev // self.gpus_per_node

    def local_of(self, dev: int) -> int:
        self._check(dev)
        return dev % self.gpus_per_node

    def devices_of_node(self, node: int) -> tuple[int, ...]:
        lo = node * self.gpus_per_node
        return tuple(range(lo, min(lo + self.gpus_per_node, self.num_devices)))

    def _check(self, dev: int) -> None:
        if not 0 <= dev < self.num_devices:
            raise ValueError(f"device {dev} is not in cluster {self.name!r} of {self.num_devices} devices")

    # -- links ---------------------------------------------------------------------------------
    @cached_property
    def _mesh(self) -> dict[tuple[int, int], int]:
        return {(a, b): c for a, b, c in self.intra.links} | {(b, a): c for a, b, c in self.intra.links}

    def nvlinks(self, a: int, b: int) -> int:
        """Direct intra-node links between devices a and b (mesh count; 0 across nodes or none)."""
        if self.node_of(a) != self.node_of(b) or a == b:
            return 0
        la, lb = self.local_of(a), self.local_of(b)
        if self.intra.kind == "mesh":
            return self._mesh.get((la, lb), 0)
        return self.intra.links_per_device if self.intra.kind == "switch" else 1

    def nic_of(self, dev: int) -> int:
        """The NIC a device's inter-node traffic leaves by (NICs spread evenly over local devices)."""
        assert self.inter is not None
        return self.local_of(dev) * self.inter.nics_per_node // self.gpus_per_node

    @cached_property
    def capacities(self) -> dict[str, float]:
        """Capacity (bytes/s) of every link id that routes can use."""
        caps: dict[str, float] = {}
        for n in range(self.num_nodes):
            devs = self.devices_of_node(n)
            for a in devs:
                for b in devs:
                    if a != b:
                        for link, cap in self._intra_links(a, b):
                            caps[link] = cap
                if self.inter is not None and self.num_nodes > 1:
                    k = self.nic_of(a)
                    caps[f"n{n}:nic{k}:tx"] = self.inter.nic_bw_Bps
                    caps[f"n{n}:nic{k}:rx"] = self.inter.nic_bw_Bps
        return caps

    def _intra_links(self, a: int, b: int) -> list[tuple[str, float]]:
        n, la, lb = self.node_of(a), self.local_of(a), self.local_of(b)
        intra = self.intra
        if intra.kind == "mesh":
            count = self._mesh.get((la, lb), 0)
            if count:
                return [(f"n{n}:link{la}>{lb}", count * intra.link_bw_Bps)]
            # No direct link: the host path (PCIe + CPU interconnect), shared by all such pairs going
            # the same way (on DGX-1 and POWER9 nodes every such pair crosses the socket link).
            return [(f"n{n}:host:{'up' if la < lb else 'down'}", intra.fallback_bw_Bps)]
        if intra.kind == "switch":
            port = intra.links_per_device * intra.link_bw_Bps
            return [(f"n{n}:dev{la}:tx", port), (f"n{n}:dev{lb}:rx", port)]
        return [(f"n{n}:loop{la}>{lb}", intra.link_bw_Bps)]

    @cached_property
    def _routes(self) -> dict[tuple[int, int], Route]:
        return {}  # memo: collectives ask for the same pairs again and again

    def route(self, a: int, b: int) -> Route:
        """Link ids (with capacities) and latency of a transfer from device a to device b."""
        hit = self._routes.get((a, b))
        if hit is None:
            hit = self._routes[(a, b)] = self._route(a, b)
        return hit

    def _route(self, a: int, b: int) -> Route:
        self._check(a)
        self._check(b)
        if a == b:
            return Route((), 0.0)
        if self.node_of(a) == self.node_of(b):
            links = self._intra_links(a, b)
            direct = self.intra.kind != "mesh" or self.nvlinks(a, b) > 0
            return Route(tuple(link for link, _ in links),
                         self.intra.link_latency_s if direct else self.intra.fallback_latency_s,
                         tuple(cap for _, cap in links))
        assert self.inter is not None, "multi-node cluster without an inter-node network"
        na, nb = self.node_of(a), self.node_of(b)
        return Route((f"n{na}:nic{self.nic_of(a)}:tx", f"n{nb}:nic{self.nic_of(b)}:rx"), self.inter.latency_s,
                     (self.inter.nic_bw_Bps, self.inter.nic_bw_Bps))

    def links_between(self, a: int, b: int) -> tuple[str, ...]:
        return self.route(a, b).links

    def p2p_bw_Bps(self, a: int, b: int) -> float:
        """Bandwidth of one transfer a -> b alone on the cluster (its bottleneck link)."""
        caps = self.route(a, b).capacities_Bps
        return min(caps) if caps else self.device.mem_bw_Bps

    def p2p_latency_s(self, a: int, b: int) -> float:
        return self.route(a, b).latency_s

    # -- display -------------------------------------------------------------------------------
    def link_matrix(self) -> list[list[str]]:
        """Per-pair link description inside one node (e.g. 'NV2', 'SYS', 'NVS')."""
        g = min(self.gpus_per_node, self.num_devices)
        out = []
        for a in range(g):
            row = []
            for b in range(g):
                if a == b:
                    row.append("X")
                elif self.intra.kind == "mesh":
                    c = self._mesh.get((a, b), 0)
                    row.append(f"NV{c}" if c else "SYS")
                elif self.intra.kind == "switch":
                    row.append(f"NVS{self.intra.links_per_device}")
                else:
                    row.append("SHM")
            out.append(row)
        return out

    @cached_property
    def cache_key(self) -> int:
        """Stable hash of the whole cluster, for caches keyed by cluster (models hold dicts)."""
        return hash(self.model_dump_json())
