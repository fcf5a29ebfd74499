"""`load_cluster`: a preset name or a YAML/JSON cluster file -> a validated `Cluster` of G devices."""

from __future__ import annotations

import json
import math
import os
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hybridpar.cluster.localhost import localhost_cluster, physical_cores
from hybridpar.cluster.model import Cluster, DeviceSpec, InterNode, IntraNode
from hybridpar.cluster.spec import ClusterFile, Figure, Sourced, source_of, value_of
from hybridpar.errors import UserError
from hybridpar.jsonfile import read_input_text

PRESET_DIR = Path(__file__).with_name("presets")
PRESETS: tuple[str, ...] = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
LOCALHOST = "localhost"


@cache
def _read_preset(name: str) -> ClusterFile:
    return _validate(_parse(PRESET_DIR / f"{name}.yaml"), f"preset {name!r}")


def read_cluster_file(name_or_path: str | os.PathLike) -> ClusterFile:
    """The validated file behind a preset name or a path (UserError on anything wrong)."""
    text = str(name_or_path)
    if text in PRESETS:
        return _read_preset(text)
    path = Path(text).expanduser()
    if not path.exists():
        raise UserError(f"unknown cluster {text!r}: not a preset ({', '.join(PRESETS)}) nor a file")
    return _validate(_parse(path), f"cluster file {text!r}")


def _parse(path: Path) -> Any:
    try:
        raw = read_input_text(path, "cluster file")  # bounded: never /dev/zero or a FIFO
        if path.suffix.lower() == ".json":
            return json.loads(raw)
        return yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cluster file {str(path)!r} is unreadable: {err}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
        raise UserError(f"cluster file {str(path)!r} is not valid {kind}: {' '.join(str(err).split())}") from None


def _validate(data: Any, what: str) -> ClusterFile:
    if not isinstance(data, dict):
        raise UserError(f"{what}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ClusterFile.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(x) for x in first["loc"]]
        # Drop pydantic's union-branch names ("float", "Sourced") so the field path reads cleanly.
        loc = [x for x in loc if not x.startswith(("function-", "constrained-")) and x not in
               ("float", "int", "Sourced")]
        msg = first["msg"].removeprefix("Value error, ")
        if not loc:  # a whole-file check: its message names the fields itself
            raise UserError(f"{what}: {msg}") from None
        raise UserError(f"{what}: field {'.'.join(loc)}: {msg}") from None


def load_cluster(name_or_path: str | os.PathLike, gpus: int | None = None, *,
                 calibration: str | os.PathLike | None = None) -> Cluster:
    """A cluster of `gpus` devices: ceil(gpus / gpus_per_node) nodes of the preset (the last node may
    be partly used). gpus=None: one full node (localhost: one rank per core). `calibration` is the
    calibration file for localhost (default `$HYBRIDPAR_CALIBRATION` or ~/.cache/hybridpar/...)."""
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int)):
        raise UserError(f"gpus must be an integer, got {gpus!r}")
    if gpus is not None and gpus < 1:
        raise UserError(f"gpus must be >= 1, got {gpus}")
    spec = read_cluster_file(name_or_path)
    if spec.name == LOCALHOST or str(name_or_path) == LOCALHOST:
        ranks = physical_cores() if gpus is None else gpus
        base = build_cluster(spec.model_copy(update={"gpus_per_node": ranks}), ranks)
        return localhost_cluster(base, ranks, calibration)
    return build_cluster(spec, gpus)


def build_cluster(spec: ClusterFile, gpus: int | None) -> Cluster:
    per_node = int(value_of(spec.gpus_per_node))
    total = per_node if gpus is None else gpus
    nodes = math.ceil(total / per_node)
    max_nodes = int(value_of(spec.max_nodes)) if spec.max_nodes is not None else None
    if max_nodes is not None and nodes > max_nodes:
        raise UserError(f"cluster {spec.name!r} has at most {max_nodes} nodes ({max_nodes * per_node} "
                        f"devices); asked for {total}")
    if nodes > 1 and spec.inter is None:
        raise UserError(f"cluster {spec.name!r} has no inter-node network (field inter) but {total} "
                        f"devices need {nodes} nodes")
    dev = spec.device
    device = DeviceSpec(name=dev.name, kind=dev.kind,
                        peak_flops={k: value_of(v) for k, v in dev.peak_flops.items()},
                        mem_bw_Bps=value_of(dev.mem_bw_Bps), memory_bytes=value_of(dev.memory_bytes))
    return Cluster(
        name=spec.name, description=spec.description, device=device, gpus_per_node=per_node,
        num_nodes=nodes, num_devices=total, intra=_intra(spec), inter=_inter(spec),
        gamma_s_per_byte=(value_of(spec.gamma_s_per_byte) if spec.gamma_s_per_byte is not None
                          else 1.0 / device.mem_bw_Bps),  # approximation: one extra read per byte
        collective_base_latency_s=(value_of(spec.collective_base_latency_s)
                                   if spec.collective_base_latency_s is not None else 0.0),
        max_nodes=max_nodes, sources=figure_sources(spec), notes=tuple(spec.notes),
    )


def _intra(spec: ClusterFile) -> IntraNode:
    i = spec.intra
    eff = value_of(i.link_efficiency) if i.link_efficiency is not None else 1.0
    return IntraNode(
        kind=i.kind, link_name=i.link_name, link_bw_Bps=value_of(i.link_bw_Bps) * eff,
        link_latency_s=value_of(i.link_latency_s),
        links=tuple(sorted((min(x.a, x.b), max(x.a, x.b), x.count) for x in i.links)),
        links_per_device=i.links_per_device or 0, fallback_name=i.fallback_name or "",
        fallback_bw_Bps=value_of(i.fallback_bw_Bps) if i.fallback_bw_Bps is not None else 0.0,
        fallback_latency_s=value_of(i.fallback_latency_s) if i.fallback_latency_s is not None else 0.0,
    )


def _inter(spec: ClusterFile) -> InterNode | None:
    n = spec.inter
    if n is None:
        return None
    return InterNode(name=n.name, nics_per_node=int(value_of(n.nics_per_node)),
                     nic_bw_Bps=value_of(n.nic_bw_Bps), latency_s=value_of(n.latency_s))


def figure_sources(spec: ClusterFile) -> dict[str, str]:
    """Dotted field path -> source, for every sourced figure in the file (approximations marked)."""
    out: dict[str, str] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, Sourced):
            out[prefix] = (("[approximation] " if obj.approx else "") + obj.source
                           + (f" (note: {obj.note})" if obj.note else ""))
        elif hasattr(obj, "model_fields"):
            for name in type(obj).model_fields:
                walk(getattr(obj, name), f"{prefix}.{name}" if prefix else name)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}")

    walk(spec, "")
    return out


def unsourced_figures(spec: ClusterFile) -> list[str]:
    """Numeric figures given without a source (presets must have none)."""
    missing: list[str] = []

    def walk(obj: Any, prefix: str) -> None:
        if hasattr(obj, "model_fields"):
            for name in type(obj).model_fields:
                value = getattr(obj, name)
                path = f"{prefix}.{name}" if prefix else name
                if isinstance(value, (int, float)) and not isinstance(value, bool) and _is_figure(obj, name):
                    missing.append(path)
                else:
                    walk(value, path)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if isinstance(v, (int, float)):
                    missing.append(f"{prefix}.{k}")
                else:
                    walk(v, f"{prefix}.{k}")

    walk(spec, "")
    return missing


def _is_figure(obj: Any, name: str) -> bool:
    # Structural integers (link counts, device indices, links_per_device) are not published figures
    # on their own; a field typed as a Figure (number-or-Sourced) is.
    ann = str(type(obj).model_fields[name].annotation)
    return "Sourced" in ann


__all__ = [
    "PRESETS",
    "Figure",
    "build_cluster",
    "figure_sources",
    "load_cluster",
    "read_cluster_file",
    "source_of",
    "unsourced_figures",
]
