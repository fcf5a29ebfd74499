"""Gantt chart (PNG/SVG via matplotlib) of a placement's per-step schedule: one row per device and per
link that carries a transfer; forward, backward and transfers in distinct colours."""

from __future__ import annotations

import os
from pathlib import Path

from hybridpar.search.placer.result import PlacementResult

COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "send": "#55A868", "grad": "#C44E52", "post": "#8172B3",
          "gpost": "#937860"}
LABELS = {"fwd": "forward", "bwd": "backward (+ update)", "send": "activation transfer",
          "grad": "gradient transfer", "post": "posting a transfer", "gpost": "posting a gradient"}


def gantt_rows(result: PlacementResult) -> dict[str, list[tuple[float, float, str, str]]]:
    """row label -> [(start_s, duration_s, kind, op name)], devices first, then links."""
    rows: dict[str, list[tuple[float, float, str, str]]] = {}
    for d in range(result.problem.num_devices):
        dev = result.problem.device_ids[d] if result.problem.device_ids else d
        rows[f"device {d} (gpu {dev})"] = []
    labels = list(rows)
    for op, s, e in zip(result.schedule.ops, result.schedule.start, result.schedule.end):
        if op.kind in ("fwd", "bwd", "post", "gpost"):  # on a device
            rows[labels[op.device]].append((s, e - s, op.kind, op.name))
        else:
            for link in op.resources:
                rows.setdefault(f"link {link}", []).append((s, e - s, op.kind, op.name))
    return rows


def save_gantt(result: PlacementResult, path: str | os.PathLike, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = gantt_rows(result)
    scale, unit = (1e3, "ms") if result.step_time_s >= 1e-3 else (1e6, "us")
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(rows)))
    for y, bars in enumerate(rows.values()):
        for kind, color in COLORS.items():
            spans = [(s * scale, max(d * scale, 1e-9)) for s, d, k, _ in bars if k == kind]
            if spans:
                ax.broken_barh(spans, (y - 0.38, 0.76), facecolors=color, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel(f"time in one training step ({unit})")
    ax.set_xlim(0, result.step_time_s * scale * 1.01 or 1)
    gap = f", gap {result.gap:.1%}" if result.gap is not None else ""
    ax.set_title(title or f"{result.problem.name}: {result.solver} placement on {result.problem.num_devices} "
                          f"device(s), step {result.step_time_s * scale:.3g} {unit}{gap}")
    ax.legend(handles=[Patch(color=c, label=LABELS[k]) for k, c in COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.18 - 0.02 * len(rows)), ncol=4, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
