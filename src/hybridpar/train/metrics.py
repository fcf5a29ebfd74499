"""Per-step metrics of a training run: a JSON-lines file written as the run goes, and plain progress lines.

`StepMetrics(flops_per_step, peak_flops, world_size)` turns each StepInfo dict of rank 0 into the
record `--metrics FILE.jsonl` streams: step, loss, lr, samples_per_s, flops_per_s (achieved: the
model's forward+backward FLOPs of the global batch over the step's wall time), mfu (flops_per_s over
the peak of every rank together for the run's dtype), peak_memory_bytes (rank 0's), grad_norm (when
clipping), comm_s and comm_bytes by kind. `MetricsFile` appends one line per record and flushes it,
so `tail -f` shows the run live; the file gets the umask's mode. `TensorBoardLog` writes the same
records as TensorBoard scalars (`--tensorboard DIR`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from hybridpar.errors import UserError


def step_flops(module, example_inputs, batch: int) -> int:
    """Forward + backward FLOPs of one global batch, from the model's graph (traced at one sample)."""
    from hybridpar.graph import trace

    graph = trace(module, example_inputs)
    per_sample = (graph.fwd_flops + graph.bwd_flops) / max(1, _batch_of(example_inputs))
    return int(per_sample * batch)


def _batch_of(inputs) -> int:
    first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
    return int(first.shape[0]) if hasattr(first, "shape") and len(first.shape) else 1


def peak_flops(cluster: str, precision: str) -> float | None:
    """FLOP/s of one device of `cluster` for the run's dtype (None when unknown).

    A CPU with no figure for a reduced precision has an unknown one (bf16 ran 12x the fp32 matmul
    rate on this machine's AMX units; without the measurement mfu exceeded 1): None, so mfu is left
    out until `hybridpar profile` measures it. So is a CPU's built-in approximate figure (localhost
    without a calibration file: 10 GFLOP/s per core, deliberately low for planning; small_cnn on 2
    ranks achieved 1.18x it once a step stopped page-faulting). A GPU preset without one runs it at the
    fp32 rate."""
    from hybridpar.cluster import load_cluster

    try:
        cl = load_cluster(cluster)
    except Exception:  # noqa: BLE001 - metrics must never stop a run; mfu is then left out
        return None
    device = cl.device
    if device.kind == "cpu" and (precision not in device.peak_flops or
                                 cl.sources.get(f"device.peak_flops.{precision}", "").startswith("[approximation]")):
        return None
    if device.kind == "cpu" and precision in ("bf16", "fp16") and "fp32" in device.peak_flops:
        # A CPU without native bf16 (AVX2 only: measured 1.3 GFLOP/s against 46 for fp32 on an EPYC)
        # runs autocast steps above its bf16 matmul rate; the dtype's peak is the better of the two rates.
        return float(max(device.peak(precision), device.peak("fp32")))
    return float(device.peak(precision))


class StepMetrics:
    def __init__(self, flops_per_step: int | None, peak_per_rank: float | None, world_size: int):
        self.flops, self.peak, self.world = flops_per_step, peak_per_rank, world_size

    def record(self, info: dict) -> dict:
        dt = info.get("step_time_s") or 0.0
        achieved = self.flops / dt if self.flops and dt > 0 else None
        mfu = achieved / (self.peak * self.world) if achieved is not None and self.peak else None
        rec = {"step": info["step"], "loss": info["loss"], "lr": info.get("lr"), "step_time_s": dt,
               "samples_per_s": info.get("samples_per_s"), "flops_per_s": achieved, "mfu": mfu,
               "peak_memory_bytes": info.get("peak_memory_bytes"), "grad_norm": info.get("grad_norm"),
               "comm_s": info.get("comm_s", {}), "comm_bytes": info.get("comm_bytes", {})}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


class MetricsFile:
    """One JSON object per line, flushed as written."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = self.path.open("w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record, allow_nan=False) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class TensorBoardLog:
    """The same records as TensorBoard scalars (torch.utils.tensorboard; the optional `tensorboard`
    package): loss, lr, samples_per_s, flops_per_s, mfu, peak_memory_bytes and grad_norm where known,
    comm_bytes/KIND and comm_s/KIND, each at its step; flushed every step so TensorBoard shows the run live."""

    SCALARS = ("loss", "lr", "samples_per_s", "step_time_s", "flops_per_s", "mfu", "peak_memory_bytes", "grad_norm")

    def __init__(self, logdir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def write(self, record: dict) -> None:
        step = record["step"]
        for key in self.SCALARS:
            if isinstance(record.get(key), (int, float)):
                self.writer.add_scalar(key, record[key], step)
        for group in ("comm_bytes", "comm_s"):
            for kind, value in (record.get(group) or {}).items():
                self.writer.add_scalar(f"{group}/{kind}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tensorboard_missing() -> str | None:
    """Why `--tensorboard` cannot run here (the package is not installed), else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return "needs the tensorboard package (pip install 'hybridpar[tensorboard]')"
    return None


def progress_line(info: dict, total: int) -> str:
    parts = [f"step {info['step'] + 1}/{total}", f"loss {info['loss']:.4f}"]
    if info.get("lr") is not None:
        parts.append(f"lr {info['lr']:.4g}")
    parts.append(f"{info.get('samples_per_s', 0.0):.1f} samples/s")
    return "hybridpar: " + ", ".join(parts)


def peak_memory_bytes(device) -> int:
    """This process's peak memory since the last reset_peak_memory: CUDA allocations on a GPU, else the
    resident set's high-water mark (VmHWM; the process's maximum RSS where /proc is missing)."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


_STATUS: tuple[int, int] | None = None  # (pid, fd of its /proc/self/status): read every step on rank 0


def _vm_hwm() -> int | None:
    """VmHWM in bytes from /proc/self/status, through a descriptor kept open (one pread per step, not an
    open, a text decode and a line loop: ~40 us of rank 0's step); None where /proc is missing."""
    global _STATUS
    pid = os.getpid()
    if _STATUS is None or _STATUS[0] != pid:  # /proc/self is resolved at open: a forked child opens its own
        try:
            _STATUS = (pid, os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return None
    try:
        data = os.pread(_STATUS[1], 65536, 0)
    except OSError:
        return None
    at = data.find(b"VmHWM:")
    return None if at < 0 else int(data[at + 6:data.index(b"\n", at)].split()[0]) * 1024


def reset_peak_memory(device) -> None:
    """Start measuring the peak afresh (after the first step: the steady state, without one-time
    start-up costs such as imports and first-touch allocator growth)."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM to the current RSS
    except OSError:
        pass


@dataclass(frozen=True)
class MetricsConfig:
    """The `[metrics]` section of a run: what it records as it goes. `jsonl`: one JSON record per step
    (`--metrics FILE.jsonl`); `tensorboard`: the same as TensorBoard scalars in a directory (rank 0);
    `profile_steps` (A, B or "A:B"): a torch.profiler trace of steps A..B-1 on rank 0 into
    `profile_dir`; `log_every`: a progress line every N steps where stderr is not a terminal (0: none).
    `flops_per_step` and `peak_flops` are filled in by run_config (for mfu)."""

    jsonl: str | None = None
    tensorboard: str | None = None
    profile_steps: tuple[int, int] | str | None = None
    profile_dir: str | None = None
    log_every: int = 10
    flops_per_step: int | None = None  # forward + backward FLOPs of one global batch (for mfu)
    peak_flops: float | None = None  # one rank's peak FLOP/s for the run's precision (for mfu)

    def checked(self, checkpoint_dir: str | None) -> MetricsConfig:
        """This section with `profile_steps` parsed and `profile_dir` resolved (the checkpoint
        directory's `profile`, else ./hybridpar-profile); UserError (with `param`) for a bad setting."""
        from hybridpar.train.checks import check_output_dir, check_output_path, parse_profile_steps

        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) or self.log_every < 0:
            raise UserError(f"log_every must be >= 0, got {self.log_every}", param="log_every")
        check_output_path(self.jsonl, "metrics")
        check_output_dir(self.tensorboard, "tensorboard")
        if self.tensorboard is not None and (why := tensorboard_missing()):
            raise UserError(f"tensorboard {self.tensorboard}: {why}", param="tensorboard")
        window = parse_profile_steps(self.profile_steps)
        if self.profile_dir is not None and window is None:
            raise UserError("profile_dir needs `profile_steps`", param="profile_dir")
        if window is None:
            return replace(self, profile_steps=None, profile_dir=None)
        profile_dir = self.profile_dir or (os.path.join(checkpoint_dir, "profile") if checkpoint_dir
                                           else "hybridpar-profile")
        check_output_dir(profile_dir, "profile_dir")
        return replace(self, profile_steps=window, profile_dir=profile_dir)
