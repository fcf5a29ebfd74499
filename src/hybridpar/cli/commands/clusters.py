"""`hybridpar clusters`: the cluster presets, and one cluster's devices, links and sources."""

from __future__ import annotations

import click
from rich.markup import escape

from hybridpar.cli.output import console, human_bytes, print_json, table


def _tflops(x: float) -> str:
    return f"{x / 1e12:.3g}"


def _gbps(x: float) -> str:
    return f"{x / 1e9:.4g}"


def short_source(text: str) -> str:
    """'https://host/path (...)' -> 'host'; 'github:owner/repo path' -> 'github:owner/repo'."""
    if text.startswith("[approximation] ") and "://" not in text and "github:" not in text:
        return "approximation"
    text = text.removeprefix("[approximation] ")
    head = text.split()[0] if text else ""
    if head.startswith(("http://", "https://")):
        return head.split("/")[2]
    if head.startswith("github:"):
        return head
    return (text[:28] + "...") if len(text) > 30 else text


def _per_device_intra_Bps(c) -> float:
    """A device's total intra-node link bandwidth, one direction."""
    intra = c.intra
    if intra.kind == "mesh":
        return max(sum(c.nvlinks(a, b) for b in range(c.gpus_per_node)) for a in range(c.gpus_per_node)) \
            * intra.link_bw_Bps
    if intra.kind == "switch":
        return intra.links_per_device * intra.link_bw_Bps
    return intra.link_bw_Bps


def summary(c) -> dict:
    d = c.device
    return {
        "name": c.name, "description": c.description, "devices_per_node": c.gpus_per_node,
        "max_nodes": c.max_nodes, "device": d.name, "peak_flops": d.peak_flops, "mem_bw_Bps": d.mem_bw_Bps,
        "memory_bytes": d.memory_bytes, "intra": c.intra.kind, "intra_link": c.intra.link_name,
        "intra_link_bw_Bps": c.intra.link_bw_Bps, "intra_per_device_bw_Bps": _per_device_intra_Bps(c),
        "inter": c.inter.name if c.inter else None,
        "inter_bw_per_node_Bps": c.inter.nic_bw_Bps * c.inter.nics_per_node if c.inter else None,
        "source": c.sources.get("device.peak_flops.fp32", ""),
    }


def detail(c) -> dict:
    return {**summary(c), "num_nodes": c.num_nodes, "num_devices": c.num_devices,
            "ranks_share_cores": c.ranks_share_cores, "cores": c.cores,
            "link_matrix": c.link_matrix(), "intra_node": c.intra.model_dump(),
            "inter_node": c.inter.model_dump() if c.inter else None,
            "gamma_s_per_byte": c.gamma_s_per_byte, "collective_base_latency_s": c.collective_base_latency_s,
            "sources": c.sources, "notes": list(c.notes)}


def register(app: click.Group) -> None:
    @app.command("clusters")
    @click.option("--show", "show", metavar="NAME|FILE", help="one preset or cluster file in detail")
    @click.option("--gpus", type=int, default=None, help="devices for --show (default: one node)")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def clusters_cmd(show: str | None, gpus: int | None, json_: bool) -> None:
        """List the cluster presets, or show one cluster's link matrix and sources."""
        from hybridpar.cluster import PRESETS, load_cluster

        if show is not None:
            c = load_cluster(show, gpus=gpus)
            if json_:
                print_json(detail(c))
            else:
                _print_detail(c)
            return
        rows = [summary(load_cluster(name)) for name in PRESETS]
        if json_:
            print_json(rows)
            return
        cols = ["name", "devices/node", "device", "fp32 TFLOP/s", "fp16 TFLOP/s", "memory", "mem GB/s",
                "intra GB/s/dev", "inter GB/s/node", "source (fp32 peak)"]
        console.print(table("hybridpar cluster presets (bandwidths one direction, effective)", cols, [
            [r["name"], r["devices_per_node"], r["device"], _tflops(r["peak_flops"]["fp32"]),
             _tflops(r["peak_flops"].get("fp16", r["peak_flops"]["fp32"])), f"{r['memory_bytes'] / 1e9:.3g} GB",
             _gbps(r["mem_bw_Bps"]), _gbps(r["intra_per_device_bw_Bps"]),
             _gbps(r["inter_bw_per_node_Bps"]) if r["inter_bw_per_node_Bps"] else "-", short_source(r["source"])]
            for r in rows], justify_right=lambda col: col not in ("name", "device", "source (fp32 peak)")))
        console.print("sources of every figure: hybridpar clusters --show NAME")


def _print_detail(c) -> None:
    d = c.device
    console.print(f"[bold]{c.name}[/bold]: {c.description}")
    console.print(f"{c.num_devices} x {d.name} on {c.num_nodes} node(s) of {c.gpus_per_node}; peak "
                  + ", ".join(f"{k} {_tflops(v)} TFLOP/s" for k, v in d.peak_flops.items())
                  + f"; {human_bytes(d.memory_bytes)} at {_gbps(d.mem_bw_Bps)} GB/s")
    g = len(c.link_matrix())
    console.print(table(f"links inside a node ({c.intra.link_name}: {_gbps(c.intra.link_bw_Bps)} GB/s per link "
                        f"per direction; SYS = {c.intra.fallback_name or 'host'} path)",
                        ["", *[f"{i}" for i in range(g)]],
                        [[f"{a}", *row] for a, row in enumerate(c.link_matrix())]))
    if c.inter:
        console.print(f"between nodes: {c.inter.name}, {c.inter.nics_per_node} NIC(s) x "
                      f"{_gbps(c.inter.nic_bw_Bps)} GB/s per direction, latency {c.inter.latency_s * 1e6:.3g} us")
    if c.ranks_share_cores:
        console.print(f"{c.num_devices} ranks on {c.cores} core(s): compute stretches by "
                      f"{d.time_share:.3g}x (ranks time-share the cores; a step moves at its slowest rank's pace)")
    # Sources contain brackets ("[approximation]"): escape them from rich markup.
    console.print(table("sources", ["figure", "source"], [(k, escape(v)) for k, v in sorted(c.sources.items())],
                        justify_right=lambda col: False))
    for note in c.notes:
        console.print(f"note: {escape(note)}")
