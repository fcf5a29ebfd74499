"""Report figures: matplotlib (Agg) rendered to PNG bytes, so the page can inline them."""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: no display on clusters or in CI
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from hybridpar.plans import Prediction
from hybridpar.report.measured import Measured

_DPI = 96


def to_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def time_breakdown(pred: Prediction) -> bytes:
    """One bar per component of the predicted step time."""
    parts = {"compute": pred.compute_s, "communication": pred.comm_s,
             "exposed comm": pred.exposed_comm_s, "idle": pred.idle_s, "step": pred.step_time_s}
    fig, ax = plt.subplots(figsize=(6, 2.8))
    names, values = list(parts), [v * 1e3 for v in parts.values()]
    ax.barh(names, values, color=["#4c72b0", "#dd8452", "#c44e52", "#8c8c8c", "#55a868"])
    ax.invert_yaxis()
    ax.set_xlabel("predicted time per step (ms)")
    ax.set_title("Predicted step time breakdown")
    return to_png(fig)


def memory_per_device(memory_bytes: Sequence[int]) -> bytes:
    fig, ax = plt.subplots(figsize=(6, 2.8))
    scale, unit = (2**30, "GiB") if max(memory_bytes, default=0) >= 2**30 else (2**20, "MiB")
    ax.bar(range(len(memory_bytes)), [b / scale for b in memory_bytes], color="#4c72b0")
    if len(memory_bytes) <= 32:
        ax.set_xticks(range(len(memory_bytes)))
    ax.set_xlabel("device (rank in plan)")
    ax.set_ylabel(unit)
    ax.set_title("Predicted memory per device")
    return to_png(fig)


def per_layer_times(per_layer: dict[str, dict[str, float]], max_layers: int = 60) -> bytes | None:
    """Stacked bars of each layer's predicted times (the keys ending in `_s`)."""
    keys = sorted({k for v in per_layer.values() for k in v if k.endswith("_s")})
    if not keys:
        return None
    names = list(per_layer)[:max_layers]
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.22 * len(names)))
    left = [0.0] * len(names)
    for k in keys:
        vals = [per_layer[n].get(k, 0.0) * 1e3 for n in names]
        ax.barh(names, vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("predicted ms per step")
    ax.set_title("Predicted time per layer" + (f" (first {max_layers})" if len(per_layer) > max_layers else ""))
    ax.legend(fontsize=7, loc="lower right")
    return to_png(fig)


def predicted_vs_measured(pred: Prediction | None, meas: Measured) -> bytes:
    """Step time and bytes per collective kind, predicted beside measured; loss curve when present."""
    panels = 1 + bool(meas.comm_bytes or (pred and pred.comm_bytes)) + bool(meas.losses)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.0), squeeze=False)
    ax_iter = iter(axes[0])
    ax = next(ax_iter)
    bars = {"predicted": pred.step_time_s if pred else 0.0, "measured": meas.step_time_s or 0.0}
    ax.bar(list(bars), [v * 1e3 for v in bars.values()], color=["#4c72b0", "#dd8452"])
    ax.set_ylabel("ms per step")
    ax.set_title("Step time")
    if panels > 1 and (meas.comm_bytes or (pred and pred.comm_bytes)):
        ax = next(ax_iter)
        kinds = sorted(set(meas.comm_bytes) | set(pred.comm_bytes if pred else {}))
        xs = range(len(kinds))
        ax.bar([x - 0.2 for x in xs], [(pred.comm_bytes.get(k, 0) if pred else 0) / 2**20 for k in kinds],
               width=0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], [meas.comm_bytes.get(k, 0) / 2**20 for k in kinds],
               width=0.4, label="measured")
        ax.set_xticks(list(xs), kinds, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("MiB per step")
        ax.set_title("Communication by kind")
        ax.legend(fontsize=7)
    if meas.losses:
        ax = next(ax_iter)
        ax.plot(range(1, len(meas.losses) + 1), meas.losses, marker=".")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("Measured loss")
    fig.tight_layout()
    return to_png(fig)


def speedup_plot(projection: dict) -> bytes:
    """Speedup over one GPU vs GPUs, one line per strategy (from `hybridpar project --json`)."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    points = projection["points"]
    for strat in dict.fromkeys(p["strategy"] for p in points):
        pts = sorted((p for p in points if p["strategy"] == strat), key=lambda p: p["gpus"])
        ax.plot([p["gpus"] for p in pts], [p["speedup"] for p in pts], marker="o", ms=3, label=strat,
                lw=2.2 if strat == "DP" else 1.3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup over 1 GPU (time to target)")
    cross = projection.get("crossover_gpus")
    ax.set_title(f"{projection.get('model', '')} on {projection.get('cluster', '')}"
                 + (f": hybrid overtakes DP at {cross} GPUs" if cross else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return to_png(fig)
