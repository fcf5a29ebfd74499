"""The calibration file of the `localhost` cluster: what `hybridpar profile` measured on this machine.

It describes the cluster, so it lives here; `hybridpar.profile` is the tool that writes it, and
`hybridpar.cost` reads it through the cluster. Kept free of torch so that loading a cluster stays
fast. JSON, validated by pydantic, written atomically (temporary file + rename) so a reader never sees
half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridpar.errors import UserError
from hybridpar.files import atomic_write
from hybridpar.jsonfile import read_input

# 2: a recurrent module other than one LSTM layer is recorded under its own op name ('gru', 'lstm*4':
# graph.recurrent.record_op); a version-1 file may hold a stack's time under one layer's key
# 3: a recurrent module's backward timed as one call (profile.graph_ops.time_job): its kernel computes the
# input and weight gradients together, so timing them apart counted it twice (a 4-layer LSTM's backward
# 103 ms against 52); and each LSTM layer also at its time chunks' steps (cost.compute.chunk_time)
# 4: the train loop's finiteness check (hybridpar.train.guard) fitted beside the optimizer step (`guard`);
# a version-3 file would price every step without it; the spatial runtime's work per halo-exchanging op
# (RuntimeOverhead.spatial_op_*); and every op's backward timed without the autograd engine's start-up per
# timed call (profile.timing.timed_grad: ~23 us a call here, which a step pays once, not per op)
CALIBRATION_VERSION = 4
ENV_VAR = "HYBRIDPAR_CALIBRATION"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Measurement(_Model):
    """Summary of repeated timings of one thing (after warm-up)."""

    median_s: float = Field(ge=0)
    p10_s: float = Field(ge=0)
    p90_s: float = Field(ge=0)
    repeats: int = Field(ge=1)

    @property
    def rel_spread(self) -> float:
        """(p90 - p10) / median: the noise of this measurement."""
        return (self.p90_s - self.p10_s) / self.median_s if self.median_s > 0 else 0.0

    def scaled(self, k: float) -> Measurement:
        return self.model_copy(update={"median_s": self.median_s * k, "p10_s": self.p10_s * k,
                                       "p90_s": self.p90_s * k})


class _AffineFit(_Model):
    """T(n) = intercept + slope * n fitted to timings at several sizes (bytes), at one world size."""

    world_size: int = Field(ge=2)
    intercept_s: float = Field(ge=0)
    slope_s_per_byte: float = Field(ge=0)
    sizes_bytes: list[int]
    times: list[Measurement]
    max_rel_residual: float = Field(ge=0)  # worst |fit - median| / median over the sizes

    def predict_s(self, bytes_: float) -> float:
        return self.intercept_s + self.slope_s_per_byte * bytes_


class GlooFit(_AffineFit):
    """The fit of gloo allreduce over the whole world, and the ring-model alpha/beta it implies:
    T = 2(p-1) alpha + 2(p-1)/p n beta (reduction folded into beta)."""

    alpha_s: float = Field(ge=0)
    beta_s_per_byte: float = Field(ge=0)


class CollectiveFit(_AffineFit):
    """The fit of one collective kind in groups of `group_size` ranks (all world_size / group_size
    groups at once). n in the runtime's byte convention (hybridpar.parallel.comm.log)."""

    kind: str
    group_size: int = Field(ge=2)


class OpRecord(_Model):
    """Measured times of one op at one local shape (see `op_key`)."""

    key: str
    op: str
    fwd: Measurement
    bwd_data: Measurement
    bwd_weight: Measurement | None = None

    def scaled(self, k: float) -> OpRecord:
        return self.model_copy(update={"fwd": self.fwd.scaled(k), "bwd_data": self.bwd_data.scaled(k),
                                       "bwd_weight": None if self.bwd_weight is None else self.bwd_weight.scaled(k)})


class ProcessDraw(_Model):
    """How fast the process that timed the op table ran against a fresh process on this machine
    (hybridpar.profile.rank_skew.SkewSampler): the same reference iteration (a convolution and an LSTM,
    forward and backward, one thread), its CPU time in the profiling process at each of the profile's
    sampling points and in the fresh lockstep workers' one-process phases, medians of both. On this VM
    a process's speed is drawn at its start and holds for tens of seconds: ten fresh processes timing
    an LSTM, a convolution and a linear layer ran each from -14% to +16% of the median process, three
    of them slow in all three (benchmarks/probe_process_draw.py, 2026-12-04); the op table was one
    such draw, the ranks it prices are others. `hybridpar profile` multiplies the records it times by
    `scale` (fresh / here), so they price a typical fresh process."""

    here_s: float = Field(gt=0)
    fresh_s: float = Field(gt=0)

    @property
    def scale(self) -> float:
        return self.fresh_s / self.here_s


class RuntimeOverhead(_Model):
    """CPU seconds per training step that the channel/filter/sample runtime adds over eager PyTorch at
    the same local shapes (hybridpar.profile.runtime_overhead), forward and backward: per graph node
    of a sample-only layout (plain tensors), per node of a layout with a channel/filter split (DTensor's
    dispatch or our layer wrapper), per conv/linear split over channel/filter beyond that, and per
    convolution or pooling that exchanges a halo under a spatial split (the spatial runtime's _HaloOp),
    and per redistribution DTensor runs (the dry run counts them)."""

    sample_node_fwd_s: float = Field(ge=0)
    sample_node_bwd_s: float = Field(ge=0)
    dtensor_node_fwd_s: float = Field(ge=0)
    dtensor_node_bwd_s: float = Field(ge=0)
    layer_fwd_s: float = Field(ge=0)
    layer_bwd_s: float = Field(ge=0)
    spatial_op_fwd_s: float = Field(ge=0)
    spatial_op_bwd_s: float = Field(ge=0)
    # per DTensor redistribution (forward or backward, with a message or without); None in older files
    redistribute_s: float | None = Field(default=None, ge=0)


def model_key(spec: str) -> str:
    """`spec` with its file part resolved, so that `a/b.py:f`, `./a/b.py:f` and its absolute path are one
    model (a fake-world step filed under one spelling and looked up under another would silently fall
    back to the generic terms); a zoo name as given."""
    path, sep, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    return os.path.realpath(path) + sep + name if path.endswith(".py") else spec


class LayoutStep(_Model):
    """A model's step under one sample or channel/filter layout on a fake world, as `hybridpar train`
    runs it (hybridpar.profile.layout_steps): CPU seconds of rank 0's thread in a fresh process, as
    measured; `rest_s` is the step less the time inside its collectives and DTensor's
    redistributions (each priced apart), the work the op table and the runtime-overhead terms price."""

    model: str  # the model spec as `hybridpar profile --model` took it (a file's path resolved: model_key)
    batch: int = Field(ge=1)
    input_shape: list[int] | None = None
    world_size: int = Field(ge=2)
    layout: str
    step_s: float = Field(ge=0)
    collectives_s: float = Field(ge=0)
    redistributions_s: float = Field(ge=0)
    rest_s: float = Field(ge=0)

    def key(self) -> tuple:
        return (model_key(self.model), self.batch, tuple(self.input_shape) if self.input_shape else None,
                self.world_size, self.layout)


class StepFit(_Model):
    """Per-step work outside the graph's ops (hybridpar.profile.update), CPU seconds of one thread:
    call_s + per_tensor_s * tensors + per_element_s * elements."""

    call_s: float = Field(ge=0)
    per_tensor_s: float = Field(default=0.0, ge=0)
    per_element_s: float = Field(ge=0)


class Calibration(_Model):
    version: int = CALIBRATION_VERSION
    device_name: str = "localhost-cpu"
    created: str = ""
    hostname: str = ""
    cpu_count: int = Field(ge=1)
    torch_version: str = ""
    threads_per_rank: int = 1
    peak_flops_fp32: float = Field(gt=0)  # measured single-thread matmul FLOP/s
    matmul: Measurement | None = None
    # measured single-thread bf16 matmul FLOP/s (matrix units where the CPU has them); None in files
    # written before it: a bf16 run's mfu is then left out rather than held to the fp32 peak
    peak_flops_bf16: float | None = Field(default=None, gt=0)
    matmul_bf16: Measurement | None = None
    # (FLOPs, FLOP/s) of single-thread fp32 matmuls from small to large: the size factor of op pieces
    # with no measured record (hybridpar.cost.compute.cpu_curve); empty in older files
    matmul_curve: list[tuple[float, float]] = []
    mem_bw_Bps: float = Field(gt=0)  # measured copy bandwidth (read + write bytes / time)
    gloo: dict[int, GlooFit] = {}
    collectives: list[CollectiveFit] = []  # per kind and group size, per world size
    ops: dict[str, OpRecord] = {}  # by op_key; channels-last and bf16 records under format_op's names
    # resident bytes of one initialised gloo rank holding no model: interpreter, torch, process groups,
    # hybridpar's runtime (hybridpar.profile.framework_memory); the memory model adds it per rank
    framework_bytes: int | None = Field(default=None, ge=0)
    # CPU seconds the model-parallel executor (fx interpreter, token chain) adds per graph node to a
    # training step over eager PyTorch (hybridpar.profile.executor); the placer adds it per node
    mp_node_overhead_s: float | None = Field(default=None, ge=0)
    # what the channel/filter/sample runtime adds per node and per split layer (RuntimeOverhead); None
    # in files written before it: those layouts are then priced without it
    runtime_overhead: RuntimeOverhead | None = None
    # optimizer.step() + zero_grad() per optimizer kind ("sgd", "momentum", "adamw") over the parameter
    # tensors a rank holds, and the loss (cross-entropy forward + backward) over its output's elements;
    # empty/None in files written before them: priced by the roofline then (hybridpar.cost.update)
    update: dict[str, StepFit] = {}
    # the train loop's NaN/Inf check around that update (hybridpar.train.guard), per optimizer kind
    guard: dict[str, StepFit] = {}
    loss: StepFit | None = None
    # P -> how much longer a synchronous step of P ranks computes than one process alone (the slowest
    # rank's CPU time per lockstep iteration over one process's; hybridpar.profile.rank_skew); empty in
    # older files: no such stretch then
    rank_skew: dict[int, Annotated[float, Field(ge=1)]] = {}  # >= 1: more ranks never compute faster
    # the profiling process's speed against a fresh process's (ProcessDraw): the op records timed by the
    # last `hybridpar profile` were scaled by it; None in older files and without a rank count > 1
    process_draw: ProcessDraw | None = None
    # op-table key -> why `hybridpar profile --model` could not time the op at that local shape
    # (hybridpar.profile.graph_ops): priced by the roofline, and the plan's notes say so
    untimed: dict[str, str] = {}
    # models' steps under their sample and channel/filter layouts on a fake world (LayoutStep); empty in
    # older files
    layout_steps: list[LayoutStep] = []
    # "model | layout" -> why the runtime could not run that layout on the model (not timed; the dry run
    # refuses it, so no plan uses it)
    layout_steps_skipped: dict[str, str] = {}

    def skew(self, ranks: int) -> float:
        """rank_skew at `ranks` (1.0 for one rank), else at the measured rank count nearest to it."""
        if ranks <= 1 or not self.rank_skew:
            return 1.0
        if ranks in self.rank_skew:
            return self.rank_skew[ranks]
        return self.rank_skew[min(self.rank_skew, key=lambda p: (abs(p - ranks), p))]

    def layout_step(self, model: str, batch: int, input_shape: Sequence[int] | None, world_size: int,
                    layout: str) -> LayoutStep | None:
        want = (model_key(model), batch, tuple(input_shape) if input_shape else None, world_size, layout)
        return next((s for s in self.layout_steps if s.key() == want), None)

    def gloo_fit(self, world_size: int) -> GlooFit | None:
        """The fit at `world_size`, else the measured world size nearest to it."""
        if not self.gloo:
            return None
        if world_size in self.gloo:
            return self.gloo[world_size]
        return self.gloo[min(self.gloo, key=lambda p: (abs(p - world_size), p))]

    def collective_fits(self, world_size: int) -> list[CollectiveFit]:
        """The per-kind fits measured at `world_size`, else at the measured world size nearest to it."""
        worlds = {f.world_size for f in self.collectives}
        if not worlds:
            return []
        w = world_size if world_size in worlds else min(worlds, key=lambda p: (abs(p - world_size), p))
        return [f for f in self.collectives if f.world_size == w]


def op_key(op: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...] | None,
           y_shape: tuple[int, ...]) -> str:
    """Profile-table key of an op at a local shape: op kind, input, weight and output shapes."""
    w = "x".join(map(str, w_shape)) if w_shape else "-"
    return f"{op}|x={'x'.join(map(str, x_shape))}|w={w}|y={'x'.join(map(str, y_shape))}"


MEMORY_FORMATS = ("nchw", "channels_last")
PRECISIONS = ("fp32", "bf16")  # bf16: the op as a bf16 autocast step runs it (`train --precision bf16`)
CHANNELS_LAST_TAG = "#cl"  # an op record timed in channels-last memory: "conv2d#cl|x=...", no NCHW key changes
BF16_TAG = "#bf16"  # ... and under bf16 autocast: "conv2d#bf16|x=...", "conv2d#cl#bf16|x=..."


def format_op(op: str, memory_format: str = "nchw", precision: str = "fp32") -> str:
    """The op-table name of `op` timed in `memory_format` at `precision`: the NCHW fp32 name as it always
    was (older files keep their keys), the others under their own names (`hybridpar profile
    --channels-last`, `--precision bf16`)."""
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory format {memory_format!r}: expected one of {', '.join(MEMORY_FORMATS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    return (op + (CHANNELS_LAST_TAG if memory_format == "channels_last" else "")
            + (BF16_TAG if precision == "bf16" else ""))


def format_key(key: str, memory_format: str = "nchw", precision: str = "fp32") -> str:
    """An op-table key (`op_key`) with its op renamed for `memory_format` and `precision` (`format_op`)."""
    op, _, rest = key.partition("|")
    return f"{format_op(op, memory_format, precision)}|{rest}"


def default_calibration_path() -> Path:
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/hybridpar/calibration.json").expanduser()


_CACHE: dict[tuple[str, float], Calibration] = {}


def load_calibration(path: str | os.PathLike | None = None, *, required: bool = False) -> Calibration | None:
    """Read a calibration file (default path when None). Missing -> None (or UserError if required);
    malformed -> UserError naming the field."""
    p = Path(path).expanduser() if path is not None else default_calibration_path()
    try:
        mtime = p.stat().st_mtime
    except OSError:
        if required:
            raise UserError(f"calibration file {str(p)!r} not found (run `hybridpar profile`)") from None
        return None
    cached = _CACHE.get((str(p), mtime))
    if cached is not None:
        return cached
    try:
        data = json.loads(read_input(p, "calibration file"))  # bounded: never /dev/zero or a FIFO
        cal = Calibration.model_validate(data)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise UserError(f"calibration file {str(p)!r} is unreadable: {err}") from None
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise UserError(f"calibration file {str(p)!r}: field {where}: {first['msg']}") from None
    if cal.version != CALIBRATION_VERSION:
        raise UserError(f"calibration file {str(p)!r}: version {cal.version}, expected "
                        f"{CALIBRATION_VERSION} (run `hybridpar profile` again)")
    _CACHE[(str(p), mtime)] = cal
    return cal


def save_calibration(cal: Calibration, path: str | os.PathLike | None = None) -> Path:
    """Write atomically (hybridpar.files.atomic_write); returns the path written."""
    p = Path(path).expanduser() if path is not None else default_calibration_path()
    return atomic_write(p, cal.model_dump_json(indent=2))


def resolve_calibration(calibration: Calibration | str | os.PathLike | None, *,
                        default: bool) -> Calibration | None:
    """`calibration` itself when it is one, else the file it names (None: the default file, read only
    when `default`, e.g. for CPU devices, whose times the default file measured)."""
    if isinstance(calibration, Calibration):
        return calibration
    if calibration is not None or default:
        return load_calibration(calibration)
    return None
