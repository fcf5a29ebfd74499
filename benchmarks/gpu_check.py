"""The GPU check: one prepared command that measures what the planner predicts, sized to a short GPU window.

    python benchmarks/gpu_check.py                  # on one GPU: <= 8 minutes (its estimate printed first)
    python benchmarks/gpu_check.py --cpu-smoke      # the same code path on CPU, tiny models, < 1 minute
    python benchmarks/gpu_check.py --budget-s 300   # stop starting cells after 300 s (the rest: "skipped")

What it does, in order (JSON to --out, a markdown table beside it):
1. the environment: GPU, driver, torch, CUDA, cuDNN (CPU and cores on --cpu-smoke);
2. the device profile: every op kind and shape of each model's graph timed forward and backward on
   the device (hybridpar.profile.graph_ops, the op profiler of `hybridpar profile --model`, on a GPU
   its kernels' time by CUDA events) in every dtype and memory format the cells run, matmul peaks
   (fp32, TF32, bf16) and copy bandwidth, into a calibration file for the preset's device, and the
   preset's cluster file with the measured peaks and bandwidth (`hybridpar plan --cluster that.yaml`
   reads the calibration's op times);
3. for each model x {fp32, bf16} x {NCHW, channels-last}: the plan's predicted step (one device,
   `sample=1`, `--channels-last` where the cell is) with the preset and with the measured calibration,
   `hybridpar train`'s measured step
   (in this process under torchrun's environment: a world of one rank, NCCL on a GPU, as a torchrun
   launch runs it), a plain PyTorch loop of the same model, loss, optimizer and autocast, and the
   predicted memory against the measured peak (`torch.cuda.max_memory_allocated`);
4. a torch.profiler table of ResNet-50's plain step by op kind, measured against predicted.

What is not priced is said in the cell, never filled in: the preset prices a channels-last run from
the roofline as NCHW (the plan's notes say so; the table marks it), the calibrated plan from the
device profile's channels-last and bf16 records.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench-results" / "gpu_check.json"
TRANSFORMER = f"{Path(__file__).resolve()}:transformer"  # no transformer-block model in the zoo: defined here
TINY_TRANSFORMER = f"{Path(__file__).resolve()}:tiny_transformer"


@dataclass(frozen=True)
class Config:
    models: tuple[tuple[str, str, int], ...]  # (label, model spec, batch)
    profiled: str  # the model of the per-op-kind table
    steps: int  # timed steps per run (after `warmup`)
    warmup: int
    op_repeats: int  # repeats per op of the device profile
    matmul_n: int
    budget_s: float  # cells not started past it are "skipped"
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    formats: tuple[str, ...] = ("nchw", "channels_last")
    # seconds a cell costs beyond its steps (plans, start-up, first steps) and a model's profile, for
    # the estimate printed before the run
    cell_overhead_s: float = 8.0
    profile_s: float = 45.0


FULL = Config(models=(("ResNet-50", "resnet50", 64), ("ResNet-50 x8 wide", "resnet50_w8", 16),
                      ("Inception-V3", "inception_v3_noaux", 32), ("GNMT", "gnmt", 32),
                      ("Transformer blocks", TRANSFORMER, 16)),
              profiled="resnet50", steps=15, warmup=5, op_repeats=5, matmul_n=4096, budget_s=480.0)
SMOKE = Config(models=(("small CNN", "small_cnn", 4), ("Transformer blocks (tiny)", TINY_TRANSFORMER, 2)),
               profiled="small_cnn", steps=2, warmup=1, op_repeats=1, matmul_n=128, budget_s=600.0,
               cell_overhead_s=0.6, profile_s=2.0)


# -- the transformer-block model (a file model: `path.py:factory`) -----------------------------------

def _blocks(width: int, heads: int, depth: int, seq: int, vocab: int, batch: int):
    import torch
    from torch import nn

    class Blocks(nn.Module):
        """Token embedding, `depth` pre-norm encoder blocks (SDPA attention, GELU MLP), a vocabulary head."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, width)
            self.blocks = nn.Sequential(*(nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                                     activation="gelu", batch_first=True,
                                                                     norm_first=True) for _ in range(depth)))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)

        def forward(self, ids):
            return self.head(self.norm(self.blocks(self.emb(ids))))

    torch.manual_seed(0)
    return Blocks(), (torch.randint(0, vocab, (batch, seq)),)


def transformer():
    """GPT-2-small-like blocks: width 768, 12 heads, 6 blocks, 512 tokens, vocabulary 32,000."""
    return _blocks(768, 12, 6, 512, 32000, 16)


def tiny_transformer():
    return _blocks(16, 2, 1, 8, 32, 2)


# -- environment ----------------------------------------------------------------------------------

def environment(device: str) -> dict:
    import torch

    env = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
           "host": platform.node(), "cpu_cores": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), driver=_driver(),
                   tf32_conv=torch.backends.cudnn.allow_tf32, tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


def _driver() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def preset_for(env: dict) -> str:
    """The cluster preset whose device is this one, or the closest: H100's tensor-core rates for an H200."""
    if env["device"] != "cuda":
        return "localhost"
    name = (env.get("gpu") or "").upper()
    if "A100" in name:
        return "dgx-a100"
    if "V100" in name:
        return "dgx1-v100"
    return "dgx-h100"


# -- timing helpers -------------------------------------------------------------------------------

def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _median_s(fn, device: str, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_peaks(device: str, n: int, repeats: int) -> dict:
    """Matmul FLOP/s in fp32, TF32 (GPU) and bf16 at n x n, and copy bandwidth (read + write bytes / s)."""
    import torch

    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    out = {}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype, allow in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                   ("bf16", torch.bfloat16, False)):
            if name == "tf32" and device != "cuda":
                continue
            torch.backends.cuda.matmul.allow_tf32 = allow
            x, y = a.to(dtype), b.to(dtype)
            out[name] = 2.0 * n**3 / _median_s(lambda x=x, y=y: torch.mm(x, y), device, 2, max(3, repeats))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    src = torch.ones((256 << 20) // 4 if device == "cuda" else (16 << 20) // 4, device=device)
    dst = torch.empty_like(src)
    out["copy_Bps"] = 2.0 * src.numel() * 4 / _median_s(lambda: dst.copy_(src), device, 2, max(3, repeats))
    return out


# -- step 2: the device profile ---------------------------------------------------------------------

def device_profile(cfg: Config, device: str, device_name: str, path: Path, log) -> dict:
    """Every op kind and shape of every model at its batch, timed on the device; written as a
    Calibration for `device_name` (the preset's device), so plans on the preset read these op times."""
    import torch

    from hybridpar.cluster.calibration import Calibration, save_calibration
    from hybridpar.graph import trace
    from hybridpar.graph.models import load_model
    from hybridpar.profile.graph_ops import profile_graph_ops

    peaks = device_peaks(device, cfg.matmul_n, cfg.op_repeats)
    ops, untimed, per_model = {}, {}, {}
    for label, spec, batch in cfg.models:
        t0 = time.perf_counter()
        loaded = load_model(spec, batch=batch)
        graph = trace(loaded.module, loaded.example_inputs, train=True)
        module = loaded.module.to(device)
        inputs = tuple(x.to(device) for x in loaded.example_inputs)
        # every (memory format, dtype) a cell of this model runs: the calibrated plans price each from its own
        formats = tuple((fmt, dtype) for fmt in cfg.formats for dtype in cfg.dtypes
                        if fmt == "nchw" or _images(spec))
        got, bad = profile_graph_ops(module, inputs, graph, (1,), set(ops), device=device, warmup=1,
                                     repeats=cfg.op_repeats, formats=formats)
        ops.update(got)
        untimed.update(bad)
        per_model[label] = {"ops_timed": len(got), "untimed": len(bad), "seconds": time.perf_counter() - t0}
        log(f"profiled {label}: {len(got)} op shapes timed, {len(bad)} not ({time.perf_counter() - t0:.1f} s)")
        del module, inputs
        if device == "cuda":
            torch.cuda.empty_cache()
    cal = Calibration(device_name=device_name, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      hostname=platform.node(), cpu_count=os.cpu_count() or 1, torch_version=torch.__version__,
                      peak_flops_fp32=peaks["fp32"], peak_flops_bf16=peaks.get("bf16"), mem_bw_Bps=peaks["copy_Bps"],
                      ops=ops, untimed=untimed)
    save_calibration(cal, path)
    return {"path": str(path), "peaks": peaks, "models": per_model, "op_shapes": len(ops), "untimed": untimed}


def measured_cluster(preset: str, peaks: dict, path: Path) -> Path:
    """The preset's cluster file with the device's measured matmul peaks and copy bandwidth in place of
    the published ones (same device name, so the calibration's op times apply): what "calibrated"
    predictions are priced on."""
    import yaml

    from hybridpar.cluster.loader import PRESET_DIR

    data = yaml.safe_load((PRESET_DIR / f"{preset}.yaml").read_text())
    dev = data["device"]
    src = f"measured by benchmarks/gpu_check.py, {time.strftime('%Y-%m-%d', time.gmtime())}"
    for name in ("fp32", "tf32", "bf16"):
        if name in peaks:
            dev["peak_flops"][name] = {"value": float(peaks[name]), "source": src}
    dev["mem_bw_Bps"] = {"value": float(peaks["copy_Bps"]), "source": src}
    data["name"] = f"{preset}-measured"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# -- step 3: the cells ------------------------------------------------------------------------------

@dataclass
class Cell:
    model: str
    spec: str
    batch: int
    dtype: str
    fmt: str
    predicted_preset_s: float | None = None
    predicted_calibrated_s: float | None = None
    predicted_memory_bytes: int | None = None
    train_s: float | None = None
    train_memory_bytes: int | None = None
    plain_s: float | None = None
    plain_memory_bytes: int | None = None
    # host seconds to enqueue one plain step (the GPU left to run it): near `plain_s`, the step is bound by
    # the host's launches, which the op table (the kernels' time) does not price
    plain_host_s: float | None = None
    # bytes already allocated on the GPU when the runs started (this process's other work): taken out
    # of both runs' peaks
    allocated_before_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


@functools.cache  # the estimate plans the preset's cells first: once each
def predicted(spec: str, cluster: str, batch: int, dtype: str, calibration: str | None,
              channels_last: bool = False) -> tuple[float, int, tuple]:
    """(step seconds, memory bytes per device, notes) of the plan on one device (`sample=1`)."""
    from hybridpar.api import plan

    res = plan(spec, cluster, 1, batch, strategy="sample=1", dtype=dtype, calibration=calibration,
               channels_last=channels_last)
    p = res.prediction
    return p.step_time_s, (p.memory_bytes[0] if p.memory_bytes else 0), tuple(res.plan.notes)


def train_step(spec: str, batch: int, dtype: str, fmt: str, cfg: Config) -> tuple[float, int | None]:
    """`hybridpar train`'s median step and peak memory, run in this process under torchrun's
    environment (one rank: it joins that world, NCCL on a GPU), as a torchrun launch runs it."""
    from hybridpar.cli.main import main

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    buf, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = main(["train", "--model", spec, "--strategy", "sample=1", "--batch", str(batch), "--steps",
                       str(cfg.warmup + cfg.steps), "--precision", dtype, "--log-every", "1000", "--json",
                       *(["--channels-last"] if fmt == "channels_last" else [])])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if rc != 0:
        last = (err.getvalue().strip().splitlines() or [f"exit {rc}"])[-1]
        raise RuntimeError(f"hybridpar train failed: {last}")
    out = json.loads(buf.getvalue())
    steps = out["steps"][cfg.warmup:]
    # after the warm-up only: train resets the peak after its first step, which held this process's
    # earlier cells' peak (the previous plain loop's)
    peaks = [s["peak_memory_bytes"] for s in steps if s.get("peak_memory_bytes")]
    return statistics.median(s["step_time_s"] for s in steps), (max(peaks) if peaks else None)


def _batch(spec: str, batch: int, device: str, fmt: str, dtype: str):
    import torch

    from hybridpar.graph.models import load_model
    from hybridpar.train.optim import cast_inputs, to_precision

    loaded = load_model(spec, batch=batch)
    module = to_precision(loaded.module.to(device), dtype)
    inputs = tuple(x.to(device) for x in cast_inputs(loaded.example_inputs, dtype))
    if fmt == "channels_last":
        module = module.to(memory_format=torch.channels_last)
        inputs = tuple(x.to(memory_format=torch.channels_last) if x.dim() == 4 else x for x in inputs)
    return module, inputs


def _allocated(device: str) -> int:
    import torch

    return int(torch.cuda.memory_allocated()) if device == "cuda" else 0


def plain_step(spec: str, batch: int, dtype: str, fmt: str, device: str, cfg: Config,
               profile_out: dict | None = None) -> tuple[float, int | None, float]:
    """A plain PyTorch loop of the model: the same loss (train.engine.task_loss), SGD (lr 0.1, as
    `train`'s default) and autocast as `hybridpar train`; median step and peak memory (GPU)."""
    import torch

    from hybridpar.train.engine import task_loss
    from hybridpar.train.optim import autocast

    base = _allocated(device)
    module, inputs = _batch(spec, batch, device, fmt, dtype)
    module.train()
    with torch.no_grad(), autocast(dtype, torch.device(device)):
        out = module(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    g = torch.Generator().manual_seed(0)
    if out.dim() == 2:
        labels = torch.randint(0, out.shape[1], (out.shape[0],), generator=g)
    else:
        labels = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)
    labels = labels.to(device)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast(dtype, torch.device(device)):
            y = module(*inputs)
        loss = task_loss(y[0] if isinstance(y, (tuple, list)) else y, labels)
        loss.backward()
        opt.step()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    median = _median_s(step, device, cfg.warmup, cfg.steps)
    peak = int(torch.cuda.max_memory_allocated()) - base if device == "cuda" else None
    host = []
    for _ in range(cfg.steps):
        _sync(device)
        t0 = time.perf_counter()
        step()  # returns once its kernels are enqueued (nothing in it waits for the GPU)
        host.append(time.perf_counter() - t0)
    _sync(device)
    if profile_out is not None:
        profile_out.update(op_kind_profile(step, device))
    return median, peak, statistics.median(host)


# -- step 4: per op kind ----------------------------------------------------------------------------

# ATen kernel names -> the cost model's op kinds (hybridpar.graph.ops), by substring, first match
_KIND_RULES = (("conv", "conv2d"), ("batch_norm", "batchnorm"), ("threshold_backward", "relu"), ("relu", "relu"),
               ("max_pool", "maxpool"), ("adaptive_avg", "adaptive_avgpool"), ("avg_pool", "avgpool"),
               ("addmm", "linear"), ("aten::mm", "linear"), ("linear", "linear"), ("aten::add", "add"),
               ("softmax", "softmax"), ("nll_loss", "loss"), ("cross_entropy", "loss"))


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for pat, kind in _KIND_RULES if pat in low), "other")


def op_kind_profile(step, device: str, steps: int = 3) -> dict:
    """Self time per op kind per step of `step()` under torch.profiler (device time on a GPU, CPU
    time on CPU): ATen ops named by `_KIND_RULES`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    by_kind: dict[str, float] = {}
    for ev in prof.key_averages():
        if not ev.key.startswith("aten::"):
            continue
        us = ev.self_device_time_total if device == "cuda" else ev.self_cpu_time_total
        by_kind[_kind(ev.key)] = by_kind.get(_kind(ev.key), 0.0) + us * 1e-6 / steps
    return {"measured_s": by_kind}


def predicted_by_kind(spec: str, cluster: str, calibration: str | None, batch: int) -> dict[str, float]:
    """The cost model's compute per op kind of one device's step (fp32, whole batch)."""
    from hybridpar.cluster import load_cluster
    from hybridpar.cost.compute import op_time
    from hybridpar.cost.scaling import graph_at_batch
    from hybridpar.search.graph_cache import traced_graph

    graph = graph_at_batch(traced_graph(spec, None)[0], batch)
    dev = load_cluster(cluster, gpus=1).device
    out: dict[str, float] = {}
    for n in graph.nodes:
        t = op_time(n, dev, calibration=calibration)
        kind = n.op if n.op in {k for _, k in _KIND_RULES} else "other"
        out[kind] = out.get(kind, 0.0) + t.total_s
    return out


# -- the run ----------------------------------------------------------------------------------------

def estimate_s(cfg: Config, preset: str) -> float:
    """Seconds the run is expected to take: per model its profile, per cell its plans and start-up,
    and per run of steps (train and plain) the preset's predicted step, doubled (the check found
    measured steps up to 2x the preset's figure)."""
    total = 0.0
    for _, spec, batch in cfg.models:
        total += cfg.profile_s
        for dtype in cfg.dtypes:
            try:
                step, _, _ = predicted(spec, preset, batch, dtype, None)
            except Exception:  # noqa: BLE001 - an estimate: a model the preset cannot price gets a second
                step = 1.0
            # train and the plain loop in each format (channels-last only for image models)
            runs = 2 * (1 + (1 if "channels_last" in cfg.formats and _images(spec) else 0))
            total += len(cfg.formats) * cfg.cell_overhead_s + runs * (cfg.warmup + cfg.steps) * 2 * step
    return total


@functools.cache
def _images(spec: str) -> bool:
    """Whether the model takes 4-D image batches (where channels-last is a layout): its cached graph's
    first input."""
    from hybridpar.search.graph_cache import traced_graph

    graph, _ = traced_graph(spec, None)
    return len(next(n for n in graph.nodes if n.op == "input").out_shape) == 4


def run_cell(cell: Cell, device: str, preset: str, measured: tuple[str, str], cfg: Config,
             profile_out: dict | None) -> None:
    """One cell: the predictions with the preset and with (measured cluster file, calibration file),
    `hybridpar train`'s step (NCHW) and the plain loop's."""
    if cell.fmt == "channels_last" and not _images(cell.spec):
        cell.notes.append("not applicable: no 4-D activations")  # channels_last changes nothing here
        return
    cl = cell.fmt == "channels_last"
    cell.predicted_preset_s, cell.predicted_memory_bytes, notes = predicted(cell.spec, preset, cell.batch,
                                                                            cell.dtype, None, cl)
    cell.notes += [n for n in notes if n.startswith("UNCALIBRATED")]
    if cl:  # the preset has no channels-last op times: its plan prices the format as NCHW (its notes say)
        cell.notes.append("preset: channels-last priced as NCHW")
    cell.predicted_calibrated_s, _, _ = predicted(cell.spec, measured[0], cell.batch, cell.dtype, measured[1], cl)
    cell.allocated_before_bytes = before = _allocated(device)
    cell.train_s, peak = train_step(cell.spec, cell.batch, cell.dtype, cell.fmt, cfg)
    cell.train_memory_bytes = None if peak is None else peak - before  # the run's own, as the plain loop's
    cell.plain_s, cell.plain_memory_bytes, cell.plain_host_s = plain_step(cell.spec, cell.batch, cell.dtype,
                                                                          cell.fmt, device, cfg, profile_out)
    if device == "cuda":  # the plain loop's model and batch are gone: their cached blocks too
        import torch

        torch.cuda.empty_cache()


# a cell whose plain step spends less than this share of its time enqueueing kernels on the host is
# GPU-bound: its step is its kernels' time, which the op table measures; above it the host's launches
# set the step, which nothing in the cost model prices yet
HOST_BOUND = 0.8


def summary(cells: list[Cell]) -> dict:
    """Medians of |predicted - measured| / measured over the cells (measured: `hybridpar train`'s step,
    else the plain loop's), again over the GPU-bound cells alone (`HOST_BOUND`), memory against train's
    peak, and train's step over the plain loop's."""
    def err(pred, meas):
        return abs(pred - meas) / meas if pred is not None and meas else None

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    done = [c for c in cells if c.plain_s is not None]
    meas = [c.train_s or c.plain_s for c in done]
    gpu = [(c, m) for c, m in zip(done, meas) if c.plain_host_s is not None and c.plain_host_s < HOST_BOUND * c.plain_s]
    return {"cells": len(cells), "measured": len(done),
            "median_abs_err_calibrated": med(err(c.predicted_calibrated_s, m) for c, m in zip(done, meas)),
            "median_abs_err_preset": med(err(c.predicted_preset_s, m) for c, m in zip(done, meas)),
            "gpu_bound": len(gpu),
            "median_abs_err_calibrated_gpu_bound": med(err(c.predicted_calibrated_s, m) for c, m in gpu),
            "median_abs_err_preset_gpu_bound": med(err(c.predicted_preset_s, m) for c, m in gpu),
            "median_abs_err_memory": med(err(c.predicted_memory_bytes, c.train_memory_bytes) for c in done),
            "train_over_plain": {d: med(c.train_s / c.plain_s for c in done if c.dtype == d and c.train_s)
                                 for d in ("fp32", "bf16")}}


def run(cfg: Config, device: str, out: Path, log=print, command: str = "") -> dict:
    """The whole check; the JSON (and its table) rewritten after every cell, so a run cut short by
    the GPU window keeps what it measured."""
    import torch

    torch.manual_seed(0)
    t_start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    preset = preset_for(env)
    log(f"estimated run time: {estimate_s(cfg, preset) / 60:.1f} min (budget {cfg.budget_s / 60:.1f} min); "
        f"device {env.get('gpu') or env.get('cpu')}, preset {preset}")
    from hybridpar.cluster import load_cluster

    cal_path = out.with_suffix(".calibration.json")
    prof = device_profile(cfg, device, load_cluster(preset, gpus=1).device.name, cal_path, log)
    measured = (str(measured_cluster(preset, prof["peaks"], out.with_suffix(".cluster.yaml"))), str(cal_path))
    batch = next(b for _, s, b in cfg.models if s == cfg.profiled)
    cells: list[Cell] = []
    by_kind: dict = {}
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "mode": "cpu-smoke" if device == "cpu" else "gpu", "command": command,
              "environment": env, "preset": preset, "profile": prof, "config": asdict(cfg)}

    def write() -> None:
        result.update(cells=[asdict(c) for c in cells], op_kinds={"model": cfg.profiled, "batch": batch, **by_kind},
                      summary=summary(cells), wall_s=time.perf_counter() - t_start)
        out.write_text(json.dumps(result, indent=1, default=str))
        out.with_suffix(".md").write_text(render_markdown(result, dated=True))

    for label, spec, b in cfg.models:
        for dtype in cfg.dtypes:
            for fmt in cfg.formats:
                cell = Cell(label, spec, b, dtype, fmt)
                cells.append(cell)
                if time.perf_counter() - t_start > cfg.budget_s:
                    cell.notes.append("skipped: over the time budget")
                    continue
                want_profile = spec == cfg.profiled and dtype == "fp32" and fmt == "nchw"
                try:
                    run_cell(cell, device, preset, measured, cfg, by_kind if want_profile else None)
                except Exception as e:  # noqa: BLE001 - one failing cell is reported, the rest still run
                    cell.notes.append(f"failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
                    if device == "cuda":
                        torch.cuda.empty_cache()  # an out-of-memory cell leaves its blocks cached
                log(f"{label} {dtype} {fmt}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in (
                    ("preset", cell.predicted_preset_s), ("calibrated", cell.predicted_calibrated_s),
                    ("train", cell.train_s), ("plain", cell.plain_s)) if v is not None))
                write()
    if by_kind:
        by_kind["predicted_preset_s"] = predicted_by_kind(cfg.profiled, preset, None, batch)
        by_kind["predicted_calibrated_s"] = predicted_by_kind(cfg.profiled, *measured, batch)
    write()
    log(f"wrote {out} and {out.with_suffix('.md')} in {result['wall_s']:.0f} s")
    return result


# -- the table ----------------------------------------------------------------------------------------

def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _mib(v) -> str:
    return "-" if not v else f"{v / 2**20:,.0f} MiB"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def render_markdown(result: dict, *, dated: bool = False) -> str:
    """The check's table (the README's "Checked on a GPU" region is this, undated)."""
    env, s = result["environment"], result["summary"]
    dev = env.get("gpu") or f"CPU ({env.get('cpu')}, smoke run: tiny models)"
    head = (f"One {dev}, torch {env['torch']}" + (f", CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, driver "
                                                   f"{env.get('driver')}" if env.get("gpu") else "")
            + f"; preset `{result['preset']}`" + (f"; {result['when']}" if dated else "") + ".\n\n")
    rows = ["| model | batch | dtype | format | predicted (preset) | predicted (calibrated) | `hybridpar train` "
            "| plain PyTorch | its host time | predicted memory | measured memory | notes |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in result["cells"]:
        mem = c["train_memory_bytes"] or c["plain_memory_bytes"]
        na = any(n.startswith("not applicable") for n in c["notes"])
        train = "n/a" if na else _ms(c["train_s"])
        pred = [_ms(c["predicted_preset_s"]), _ms(c["predicted_calibrated_s"])]
        if "preset: channels-last priced as NCHW" in c["notes"] and pred[0] != "-":
            pred[0] += " (as NCHW)"
        notes = "; ".join(n for n in c["notes"] if not n.startswith(("preset:", "UNCALIBRATED")))
        rows.append(f"| {c['model']} | {c['batch']} | {c['dtype']} | {c['fmt']} | {pred[0]} | {pred[1]} | {train} "
                    f"| {_ms(c['plain_s'])} | {_ms(c.get('plain_host_s'))} | {_mib(c['predicted_memory_bytes'])} "
                    f"| {_mib(mem)} | {notes} |")
    tail = (f"\nMedian |predicted - measured| / measured over {s['measured']} of {s['cells']} cells: "
            f"{_pct(s['median_abs_err_calibrated'])} calibrated, {_pct(s['median_abs_err_preset'])} preset; "
            f"memory {_pct(s['median_abs_err_memory'])}; `hybridpar train` / plain step: "
            + ", ".join(f"{d} {v:.2f}x" for d, v in s["train_over_plain"].items() if v is not None) + ".\n"
            f"On the {s.get('gpu_bound', 0)} GPU-bound cells (the plain step's host time under "
            f"{HOST_BOUND:.0%} of the step): {_pct(s.get('median_abs_err_calibrated_gpu_bound'))} calibrated, "
            f"{_pct(s.get('median_abs_err_preset_gpu_bound'))} preset. The others are bound by the host's "
            "kernel launches, which the op table (the kernels' time) does not price.\n")
    kinds = result.get("op_kinds") or {}
    if kinds.get("measured_s"):
        names = sorted(set(kinds["measured_s"]) | set(kinds.get("predicted_preset_s", {})))
        tail += (f"\nPer op kind, {kinds['model']} fp32 NCHW batch {kinds['batch']}, one step (torch.profiler "
                 "self time; predicted: the cost model's compute):\n\n| op kind | measured | predicted (preset) "
                 "| predicted (calibrated) |\n|---|---:|---:|---:|\n")
        tail += "".join(f"| {k} | {_ms(kinds['measured_s'].get(k))} | {_ms(kinds.get('predicted_preset_s', {}).get(k))}"
                        f" | {_ms(kinds.get('predicted_calibrated_s', {}).get(k))} |\n" for k in names)
    return head + "\n".join(rows) + "\n" + tail


def readme_region(path: Path = DEFAULT_OUT) -> str:
    """The README's "Checked on a GPU" region: the committed full run's table, or that none has run."""
    if not path.exists():
        return ("Not yet run: `python benchmarks/gpu_check.py` on one GPU (its own time estimate is printed "
                "first; `--cpu-smoke` runs the same code on CPU in `make test`) writes "
                "`bench-results/gpu_check.json`, and `make figures` puts its table here. An earlier manual "
                "check of ResNet-50 on an H200 is in [docs/results.md](docs/results.md#on-a-gpu).\n")
    result = json.loads(path.read_text())
    if result.get("mode") != "gpu":
        return "The committed `bench-results/gpu_check.json` is not a GPU run: nothing to show.\n"
    fields = set(Cell.__dataclass_fields__)  # the summary from the cells, by this script's rules
    result["summary"] = summary([Cell(**{k: v for k, v in c.items() if k in fields}) for c in result["cells"]])
    return render_markdown(result) + f"\nCommand: `{result['command']}`.\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on CPU: the same code path in < 1 minute")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"JSON (and .md, .calibration.json beside it); default {DEFAULT_OUT.relative_to(ROOT)} "
                         "(a temporary folder for --cpu-smoke)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no cell after this many seconds")
    ap.add_argument("--estimate-only", action="store_true", help="print the time estimate and stop")
    args = ap.parse_args(argv)
    import torch

    cfg = SMOKE if args.cpu_smoke else FULL
    if args.budget_s is not None:
        from dataclasses import replace

        cfg = replace(cfg, budget_s=args.budget_s)
    device = "cpu" if args.cpu_smoke else "cuda"
    if args.estimate_only:  # without a GPU at hand: the H100 preset's figures
        gpu = torch.cuda.is_available() and not args.cpu_smoke
        preset = preset_for(environment(device)) if gpu or args.cpu_smoke else "dgx-h100"
        print(f"estimated run time: {estimate_s(cfg, preset) / 60:.1f} min")
        return 0
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-smoke on CPU)", file=sys.stderr)
        return 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu-check-")) / "gpu_check.json" if args.cpu_smoke
                       else DEFAULT_OUT)
    run(cfg, device, out, command=" ".join(["python benchmarks/gpu_check.py", *(argv if argv is not None
                                                                                 else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
