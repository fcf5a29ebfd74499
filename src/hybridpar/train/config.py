"""A run's configuration, and from it (plus a Plan or a strategy) a validated run, before any rank starts.

`TrainConfig` is the run's options, composed of one section per component that reads them:
`parallel` (ParallelConfig: the plan or strategy, rank count, micro-batches, batch-norm statistics),
`data` (hybridpar.train.data.config.DataConfig), `optim` (hybridpar.train.optim.OptimConfig),
`checkpoint` (CheckpointConfig: checkpoints, resume, the weights read and written) and `metrics`
(hybridpar.train.metrics.MetricsConfig). A TOML file's sections `[parallel]`, `[data]`, `[optim]`,
`[checkpoint]` and `[metrics]` map onto them; `TrainConfig.from_options(**flat)` takes the flat names
of `hybridpar train`'s flags instead (`lr`, `checkpoint_dir`, `metrics`, ...; FLAT_OPTIONS).

`run_config(config)` is what `hybridpar train` calls: it checks every option (each section checks its
own) and refuses bad ones with a UserError worded in the library's terms (`param` names the option),
loads the plan and the model, fills what the caller left out from the plan (batch, rank count, input
shape, model), dry-runs the model on one sample, estimates the run's memory against this machine's,
checks that every output path can be written and resolves the checkpoint directory (whose run it is,
where a resume starts). It returns a RunSetup: the TrainConfig every rank runs, the rank count to
start, and the notes worth telling the user.

Batch and rank count: a plan fixes both. Left out, they are the plan's; given and different, the run
is refused. Without a rank count and without a launcher, the plan's ranks are started as local
processes only when this machine has a core for each (more only when asked for explicitly).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hybridpar import startup
from hybridpar.errors import UserError
from hybridpar.plans import Plan
from hybridpar.train.checks import check_counts, check_output_path, parse_profile_steps  # noqa: F401 - API
from hybridpar.train.data.config import DataConfig
from hybridpar.train.metrics import MetricsConfig
from hybridpar.train.optim import OptimConfig

PROCESS_BYTES = 300 * 2**20  # what one rank costs before any tensor: interpreter, torch, gloo buffers
MAX_SEED = 2**63 - 1
DEFAULT_STEPS = 10  # a run given neither steps nor epochs
DEFAULT_BATCH = 32  # a strategy's run given no batch


@dataclass(frozen=True)
class ParallelConfig:
    """The `[parallel]` section: how the run is split. Exactly one of `plan` (a Plan or the path of a
    plan.json) and `strategy` (a uniform layout, e.g. "sample=2,channel=2"). `gpus`: ranks to start
    (None: the plan's or the strategy's; ignored under a launcher). `micro_batches`: GPipe
    micro-batches per replica (model-parallel plans only; None: the plan's, i.e. the placer's choice,
    else 1; run_config resolves it). `bn_stats`: batch-norm statistics over the
    global batch ("global", as one process) or each rank's samples ("local"). `recompute`: "all"
    recomputes every block's activations in backward (torch.utils.checkpoint), "none" keeps them."""

    plan: Plan | str | os.PathLike | None = None
    strategy: str | None = None
    gpus: int | None = None
    micro_batches: int | None = None
    # recurrent layers in K time chunks (the wavefront; model-parallel plans only; None: the plan's, else 1)
    time_chunks: int | None = None
    # the micro-batch schedule, "gpipe" | "1f1b" (model-parallel plans only; None: the plan's, the placer's)
    schedule: str | None = None
    bn_stats: str = "global"
    recompute: str = "none"

    def check(self) -> None:
        check_counts(gpus=self.gpus, micro_batches=self.micro_batches, time_chunks=self.time_chunks)
        if (self.strategy is None) == (self.plan is None):
            raise UserError("give exactly one of `strategy` or `plan`", param="strategy")
        if self.bn_stats not in ("global", "local"):
            raise UserError(f"bn_stats must be global or local, got {self.bn_stats!r}", param="bn_stats")
        if self.recompute not in ("none", "all"):
            raise UserError(f"recompute must be none or all, got {self.recompute!r}", param="recompute")
        if self.schedule not in (None, "gpipe", "1f1b"):
            raise UserError(f"schedule must be gpipe or 1f1b, got {self.schedule!r}", param="schedule")


@dataclass(frozen=True)
class CheckpointConfig:
    """The `[checkpoint]` section: sharded checkpoints in `dir` every `every` steps (0: only at the
    end), the newest `keep` kept; `resume`: "no", "yes" (continue from this run's newest good
    checkpoint; refuse when every one is damaged) or "if-any" (start at step 0 then); `overwrite`:
    other runs' checkpoints in `dir` may be removed. `init_from`: a state_dict of the undistributed
    model to start from; `save`: where the final weights go (undistributed). `resume_from` is the
    checkpoint run_config chose to continue from."""

    dir: str | None = None
    every: int = 0
    keep: int = 2
    resume: str = "no"
    overwrite: bool = False
    init_from: str | None = None
    save: str | None = None
    resume_from: str | None = None

    def check(self) -> None:
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise UserError(f"checkpoint_every must be >= 0, got {every!r}", param="checkpoint_every")
        if self.resume not in ("no", "yes", "if-any"):
            raise UserError(f"resume must be no, yes or if-any, got {self.resume!r}", param="resume")
        if (every or self.resume != "no" or self.overwrite) and not self.dir:
            raise UserError("checkpoint_every, `resume` and `overwrite` need `checkpoint_dir`",
                            param="checkpoint_every")


SECTIONS = {"parallel": ParallelConfig, "data": DataConfig, "optim": OptimConfig, "checkpoint": CheckpointConfig,
            "metrics": MetricsConfig}
# The flat names (`hybridpar train`'s flags, the keys of a TOML file without sections, run_config's
# keywords) -> (section or None for the run's own fields, field).
FLAT_OPTIONS: dict[str, tuple[str | None, str]] = {
    **{name: (None, name) for name in ("model", "input_shape", "batch", "steps", "epochs", "seed", "gns",
                                       "deterministic", "callbacks", "max_loss_ratio", "loss",
                                       "channels_last")},
    **{name: ("parallel", name) for name in ("plan", "strategy", "gpus", "micro_batches", "time_chunks", "schedule",
                                                       "bn_stats", "recompute")},
    "nproc": ("parallel", "gpus"), "devices": ("parallel", "gpus"),  # the device count's old names
    "data": ("data", "source"), "synthetic_size": ("data", "synthetic_size"), "shuffle": ("data", "shuffle"),
    "workers": ("data", "workers"), "local_ranks": ("data", "local_ranks"),
    **{name: ("optim", name) for name in ("optimizer", "lr", "momentum", "weight_decay", "lr_schedule",
                                          "warmup_steps", "grad_clip", "precision")},
    "checkpoint_dir": ("checkpoint", "dir"), "checkpoint_every": ("checkpoint", "every"),
    "keep_checkpoints": ("checkpoint", "keep"), "resume": ("checkpoint", "resume"),
    "overwrite": ("checkpoint", "overwrite"), "init_from": ("checkpoint", "init_from"),
    "save": ("checkpoint", "save"), "resume_from": ("checkpoint", "resume_from"),
    "metrics": ("metrics", "jsonl"), "tensorboard": ("metrics", "tensorboard"),
    "profile_steps": ("metrics", "profile_steps"), "profile_dir": ("metrics", "profile_dir"),
    "log_every": ("metrics", "log_every"),
}


def flat_name(section: str, key: str) -> str | None:
    """The flat name of `key` in a TOML section (its field name or its flat name), None if unknown."""
    key = key.replace("-", "_")
    for flat, (sec, name) in FLAT_OPTIONS.items():
        if sec == section and key in (name, flat) and flat not in ("nproc", "devices"):
            return flat
    if section == "parallel" and key in ("nproc", "devices"):
        return "gpus"
    if (section, key) == ("optim", "loss"):  # a run-level option that TOML files may also give in [optim]
        return "loss"
    return "no_shuffle" if (section, key) == ("data", "no_shuffle") else None


@dataclass(frozen=True)
class TrainConfig:
    """A training run's options: the model, its input, the batch and length of the run, its seed and
    the sections (run_config fills the plan, batch, input shape and steps it resolves)."""

    model: str | None = None
    input_shape: tuple[int, ...] | str | None = None  # per sample; default: the model's or the plan's
    batch: int | None = None  # global batch per step; default: the plan's, else 32
    steps: int | None = None  # default 10 (when epochs is not given)
    epochs: int | None = None
    seed: int = 0
    gns: bool = False  # online gradient noise scale (hybridpar.train.grad_noise), one tiny allreduce/step
    deterministic: bool = False  # deterministic kernels and seeding (hybridpar.train.determinism)
    callbacks: tuple[str, ...] = ()  # "module:function" step callbacks, imported in every rank
    max_loss_ratio: float | None = None  # stop (exit 3) when the loss exceeds this times its first value (guard)
    loss: str | None = None  # cross_entropy | mse | path.py:fn (hybridpar.train.loss); None: the task loss
    channels_last: bool = False  # 4-D weights and inputs in NHWC (hybridpar.train.memory_format)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    identity: dict = field(default_factory=dict)  # what makes a run this run (run_identity), set by run_config

    @property
    def plan(self) -> Plan:
        """The run's Plan (after run_config; before it, what the caller gave: a Plan, a path or None)."""
        return self.parallel.plan  # type: ignore[return-value]

    @classmethod
    def from_options(cls, **options: Any) -> TrainConfig:
        """A TrainConfig from flat names (FLAT_OPTIONS: `hybridpar train`'s flags with underscores)."""
        return cls().with_options(**options)

    def with_options(self, **options: Any) -> TrainConfig:
        """This config with flat-named options (FLAT_OPTIONS) over it; TypeError for an unknown name,
        as a misspelt keyword argument would raise. `no_shuffle` is `shuffle`'s negation; `resume`
        True/False/None mean "yes"/"no"/"no"."""
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for flat, value in options.items():
            if flat == "no_shuffle":
                flat, value = "shuffle", not value
            if flat == "resume":
                value = {True: "yes", False: "no", None: "no"}.get(value, value)
            if flat not in FLAT_OPTIONS:
                raise TypeError(f"unexpected keyword argument {flat!r} (a run's options: "
                                f"{', '.join(sorted(FLAT_OPTIONS))})")
            section, name = FLAT_OPTIONS[flat]
            (top if section is None else sections.setdefault(section, {}))[name] = value
        if top.get("callbacks") is not None:
            top["callbacks"] = tuple(top["callbacks"])
        for section, values in sections.items():
            top[section] = replace(getattr(self, section), **values)
        return replace(self, **top)

    def check(self) -> TrainConfig:
        """Every option checked, each section its own (UserError with `param`); returns this config
        with the profiler's window parsed and its directory resolved."""
        check_counts(batch=self.batch, steps=self.steps, epochs=self.epochs)
        self.parallel.check()
        self.data.check()
        self.optim.check()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"seed must be an integer from 0 to 2**63-1, got {self.seed!r}", param="seed")
        self.checkpoint.check()
        if not isinstance(self.channels_last, bool):
            raise UserError(f"channels_last must be true or false, got {self.channels_last!r}", param="channels_last")
        if self.steps is not None and self.epochs is not None:
            raise UserError("steps and `epochs`: give one, not both", param="steps")
        self.optim.check_options()
        from hybridpar.train.guard import check_max_loss_ratio

        ratio = check_max_loss_ratio(self.max_loss_ratio)
        from hybridpar.train.loss import check_loss, check_loss_data

        check_loss(self.loss)
        check_loss_data(self.loss, self.data.source)
        check_output_path(self.checkpoint.save, "save")
        return replace(self, max_loss_ratio=ratio, metrics=self.metrics.checked(self.checkpoint.dir))

    def total_steps(self, n_samples: int) -> int:
        """Steps of the run over a data set of `n_samples`."""
        if self.epochs is not None:
            return self.epochs * (n_samples // self.batch)
        return int(DEFAULT_STEPS if self.steps is None else self.steps)


@dataclass(frozen=True)
class RunSetup:
    config: TrainConfig
    world_size: int  # ranks to start (or that the launcher started)
    start_step: int = 0  # > 0 when resuming
    total_steps: int = 0
    notes: list[str] = field(default_factory=list)  # one line each: a schedule fallback, resume decisions, ...
    memory_per_rank: int = 0  # estimated bytes of one rank's process

    @property
    def nothing_to_do(self) -> bool:
        """Resuming a run that already reached its last step."""
        return self.start_step >= self.total_steps


@dataclass(frozen=True)
class _Loaded:
    """The model as run_config checks it: on meta (`loaded`), with real example inputs (`with_inputs`,
    the same object when it had to be built whole), its data spec and the activation bytes per sample."""

    loaded: Any
    with_inputs: Any
    shape: tuple[int, ...]
    spec: Any
    act_bytes: int


def run_config(config: TrainConfig | None = None, *, launcher_world: int | None = None,
               local_ranks: int | None = None, place: Callable[..., Plan] | None = None,
               **options: Any) -> RunSetup:
    """Validate a training run and return its RunSetup (UserError, with `param` set, on bad input).

    `config`: the run's TrainConfig; keyword `options` are flat names over it (FLAT_OPTIONS:
    `model=`, `strategy=`, `plan=`, `lr=`, `checkpoint_dir=`, ...). The plan: a Plan or the path of a
    plan.json; exactly one of plan and strategy. `launcher_world`: the world a launcher (torchrun)
    already started (None: this call's ranks are spawned locally); `local_ranks`: how many of those
    share this machine (default: all of them). `place(plan, module, optimizer=..., momentum=...,
    example_inputs=...)`: returns a model-parallel plan with its placement filled in (the caller's
    search, e.g. hybridpar.api.with_placement; the runtime never searches); without it such a plan
    must come with its placement."""
    cfg = (config or TrainConfig()).with_options(**options)
    if local_ranks is not None:
        cfg = replace(cfg, data=replace(cfg.data, local_ranks=local_ranks))
    cfg = cfg.check()
    the_plan, world, batch, model, input_shape = _plan_and_world(cfg, launcher_world)
    cfg = replace(cfg, model=model, batch=batch, parallel=replace(cfg.parallel, plan=the_plan, gpus=world))
    with startup.phase("loading and tracing the model"):
        m = _load_checked(model, input_shape, batch, cfg.loss)
    with startup.phase("placement") if the_plan.mp > 1 else contextlib.nullcontext():  # only MP plans search
        the_plan = _placed(cfg, m, place)
    from hybridpar.parallel.fsdp import plan_recompute

    # a plan's "all" (`plan --recompute all`) runs without --recompute all (the plan's per-block choice is
    # kept on the plan: parallelize runs it); parallel.fsdp.plan_recompute is the one rule
    recompute = "all" if plan_recompute(the_plan, cfg.parallel.recompute) == "all" else "none"
    micro = cfg.parallel.micro_batches  # absent: the placer's choice (the plan's), else one
    if micro is None:
        micro = (the_plan.micro_batches or 1) if the_plan.mp > 1 else 1
    the_plan = _with_time_chunks(the_plan, cfg.parallel.time_chunks)
    from hybridpar.parallel.pipeline.schedule import settle_schedule

    # --schedule (refused before start if it cannot run), else the placer's (gpipe where 1f1b cannot)
    settled = settle_schedule(m.loaded.module, the_plan, cfg.parallel.schedule, batch, micro,
                              tuple(m.loaded.example_inputs))
    # its fallback from the placer's 1f1b (GPipe holds more activations): told at start-up and in --json
    schedule_notes = [f"note: {n}" for n in settled.notes[len(the_plan.notes):]]
    format_note = channels_last_note(the_plan, cfg.channels_last)
    if format_note:
        schedule_notes.append(format_note)
    the_plan = settled
    cfg = replace(cfg, parallel=replace(cfg.parallel, plan=the_plan, recompute=recompute, micro_batches=micro))
    with startup.phase("dry run of the layout"):
        _check_layout(m.loaded.module, the_plan, batch, cfg.parallel.micro_batches, cfg.optim.precision,
                      tuple(m.loaded.example_inputs), cfg.parallel.bn_stats)
    _check_sharding(cfg, the_plan)
    n, data_bytes = _data_size(cfg.data.source, m.shape, m.spec, cfg.data.synthetic_size, cfg.seed, m.with_inputs)
    if n < batch:
        raise UserError(f"data {cfg.data.source} has {n} samples, fewer than batch {batch}", param="data")
    if cfg.checkpoint.init_from is not None:
        _check_init(m.loaded.module, cfg.checkpoint.init_from)
    cfg = replace(cfg, input_shape=m.shape, steps=cfg.steps if cfg.epochs is not None or cfg.steps is not None
                  else DEFAULT_STEPS)
    cfg = replace(cfg, identity=run_identity(cfg))
    if cfg.metrics.jsonl or cfg.metrics.tensorboard:
        cfg = replace(cfg, metrics=replace(cfg.metrics, flops_per_step=_step_flops(m.loaded, batch),
                                           peak_flops=_peak(the_plan, cfg.optim.precision)))
    last = _checked_length(cfg, n)
    per_rank = _rank_memory(cfg, m, data_bytes)
    _check_memory(per_rank, local_ranks or world, launched=launcher_world is not None)
    cfg, start, notes = _resume(cfg)
    return RunSetup(cfg, world, start, last, [*schedule_notes, *notes], per_rank)


def _load_checked(model: str, input_shape, batch: int, loss: str | None = None) -> _Loaded:
    """The model loaded on meta and dry-run on one example sample (its input shape checked against
    this machine's memory before and after loading)."""
    shape = _parse_shape(input_shape)
    if shape is not None:
        _check_sample_size(shape, batch)
    loaded, with_inputs = _load(model, shape)
    shape = tuple(loaded.input_shape or loaded.example_inputs[0].shape[1:])
    _check_sample_size(shape, batch)
    try:
        spec, act_bytes = _dry_run(loaded, loss)
    except UserError:
        if with_inputs.module is loaded.module:
            raise
        loaded = with_inputs = _load_whole(model, shape)  # a forward that reads values: check it for real
        spec, act_bytes = _dry_run(loaded, loss)
    return _Loaded(loaded, with_inputs, shape, spec, act_bytes)


def _placed(cfg: TrainConfig, m: _Loaded, place: Callable[..., Plan] | None) -> Plan:
    """The run's plan; a model-parallel one traced as the MP runtime runs it (an untraceable model is
    one line here) and given its placement by `place` when it has none."""
    the_plan = cfg.plan
    if the_plan.mp == 1:
        return the_plan
    from hybridpar.parallel.pipeline.engine import micro_batch_inputs
    from hybridpar.parallel.pipeline.partition import trace

    examples = micro_batch_inputs(m.loaded.example_inputs, the_plan.model_copy(update={"batch": cfg.batch}),
                                  cfg.parallel.micro_batches or the_plan.micro_batches or 1)
    trace(m.loaded.module, examples)
    if the_plan.placement is not None:
        return the_plan
    if place is None:
        raise UserError("plan: a model-parallel plan needs its placement before launch (write one with "
                        "`hybridpar place --out` or `hybridpar plan --out`)", param="plan")
    if the_plan.input_shape is None and m.shape:  # the shape this run takes (--input-shape), for the placer
        the_plan = the_plan.model_copy(update={"input_shape": list(m.shape)})
    # priced with the update this run makes (its state in memory, its time in the step)
    return place(the_plan, m.loaded.module, optimizer=cfg.optim.optimizer, momentum=cfg.optim.momentum,
                 example_inputs=examples, micro_batches=cfg.parallel.micro_batches,
                 time_chunks=cfg.parallel.time_chunks,
                 **({"schedule": cfg.parallel.schedule} if cfg.parallel.schedule is not None else {}))


def _with_time_chunks(plan: Plan, chunks: int | None) -> Plan:
    """The plan with the run's recurrent time chunks: --time-chunks, else the plan's (the placer's), else 1."""
    if plan.mp == 1:
        if chunks not in (None, 1):
            raise UserError(f"time_chunks {chunks} needs a model-parallel plan (mp > 1)", param="time_chunks")
        return plan
    return plan.model_copy(update={"time_chunks": chunks if chunks is not None else plan.time_chunks or 1})


def _checked_length(cfg: TrainConfig, n: int) -> int:
    """The run's last step + 1; UserError for a run of no steps or a profiler window past its end."""
    last = cfg.total_steps(n)
    if last < 1:
        raise UserError("nothing to train: 0 steps", param="steps")
    window = cfg.metrics.profile_steps
    if window is not None and window[0] >= last:
        raise UserError(f"profile_steps {window[0]}:{window[1]}: the run has steps 0..{last - 1}",
                        param="profile_steps")
    return last


def _rank_memory(cfg: TrainConfig, m: _Loaded, data_bytes: int) -> int:
    """Bytes one rank's process needs: the cost model's figure for this layout plus the data set held
    whole, else the coarser estimate from the model."""
    batch, optim = cfg.batch, cfg.optim
    predicted = _predicted_memory(m.loaded, cfg.plan, batch, optim.optimizer, optim.momentum, optim.weight_decay,
                                  cfg.parallel.recompute)
    if predicted is not None:
        per_rank = int(predicted) + data_bytes
    else:
        sample_bytes = math.prod(m.shape) * (8 if m.spec.vocab is not None else 4)
        per_rank = estimate_rank_memory(m.loaded.module, cfg.plan, batch, data_bytes, m.act_bytes,
                                        optimizer_slots=optim.state_slots, input_bytes=batch * sample_bytes)
    if optim.precision == "fp64":  # both figures count fp32 bytes; weights, grads, optimizer state, activations double
        per_rank = 2 * (per_rank - data_bytes) + data_bytes
    return per_rank


def _resume(cfg: TrainConfig) -> tuple[TrainConfig, int, list[str]]:
    """(config with the checkpoint to resume from, first step, notes): the checkpoint directory's
    verdict on whose run it holds and where a resume starts."""
    ck = cfg.checkpoint
    if not ck.dir:
        return cfg, 0, []
    from hybridpar.train.checkpoint import check_checkpoint_dir

    found = check_checkpoint_dir(ck.dir, cfg.identity, ck.resume, overwrite=ck.overwrite)
    if found.resume_from is None:
        return cfg, 0, list(found.notes)
    cfg = replace(cfg, checkpoint=replace(ck, resume_from=str(found.resume_from.path)))
    return cfg, found.resume_from.step, list(found.notes)


def run_identity(cfg: TrainConfig) -> dict:
    """What makes two runs the same run, whatever their layout or rank count: the model, its input,
    the data and its order, the optimizer's settings and the starting weights. The step count is not
    part of it (a longer run of the same settings continues the shorter one)."""
    d, o = cfg.data, cfg.optim
    return {"model": cfg.model, "input_shape": list(cfg.input_shape or ()), "data": d.source,
            "synthetic_size": d.synthetic_size if d.source == "synthetic" else None, "seed": cfg.seed,
            "batch": cfg.batch, "shuffle": d.shuffle, "lr": o.lr, "momentum": o.momentum,
            "weight_decay": o.weight_decay, "bn_stats": cfg.parallel.bn_stats, "init_from": cfg.checkpoint.init_from,
            "optimizer": o.optimizer, "lr_schedule": o.lr_schedule, "warmup_steps": o.warmup_steps,
            "grad_clip": o.grad_clip, "precision": o.precision}


def claim_checkpoint_dir(setup: RunSetup) -> None:
    """Take the checkpoint directory's advisory lock for this process's lifetime (UserError when
    another run holds it). Call it in the process that outlives the ranks (the launcher's parent, or
    rank 0 under torchrun), after run_config and before starting work."""
    if setup.config.checkpoint.dir:
        from hybridpar.train.checkpoint import lock_directory

        lock_directory(setup.config.checkpoint.dir)


# -- the pieces ----------------------------------------------------------------------------------

def channels_last_note(plan: Plan, channels_last: bool) -> str | None:
    """The start-up note on whether the plan priced the run's memory format (Plan.channels_last: set by
    `plan --channels-last`); None when both are NCHW."""
    how = plan.channels_last
    if not channels_last:
        return None if how is None else ("note: the plan was priced for channels-last memory (plan "
                                         "--channels-last); this run is NCHW, so its step time may differ")
    head = "note: --channels-last runs 4-D weights and inputs in NHWC; "
    if plan.predicted is None:
        return head + "no plan priced this run (a --strategy is not priced)"
    if how == "measured":
        return head + f"the plan priced it from channels-last op times measured on {plan.cluster}"
    if how == "partly-measured":
        return head + "the plan priced it, some 4-D ops as NCHW (uncalibrated for the format: its notes list them)"
    if how == "nchw-priced":
        return head + (f"the plan priced its 4-D ops as NCHW (no channels-last measurements for {plan.cluster}: "
                       "its notes say so)")
    return head + ("the plan's step-time figures are NCHW's (planned without --channels-last; `hybridpar plan "
                   "--channels-last` prices the format)")


def _plan_and_world(cfg: TrainConfig, launcher_world: int | None):
    """(plan, ranks, batch, model, input shape): the caller's, else the plan's; UserError where they
    disagree."""
    from hybridpar.plans import load_plan, parse_strategy

    model, input_shape, batch = cfg.model, cfg.input_shape, cfg.batch
    plan, strategy, gpus = cfg.parallel.plan, cfg.parallel.strategy, cfg.parallel.gpus
    if plan is not None:
        the_plan = plan if isinstance(plan, Plan) else load_plan(plan)
        where = "" if isinstance(plan, Plan) else f" ({plan})"
        if batch is None:
            batch = the_plan.batch
        elif batch != the_plan.batch:
            raise UserError(f"batch {batch} disagrees with the plan's batch {the_plan.batch}{where}; leave it "
                            "out to use the plan's, or make a plan for this batch", param="batch")
        if gpus is not None and gpus != the_plan.world_size:
            raise UserError(f"gpus {gpus} disagrees with the plan: plan is for {the_plan.world_size} ranks{where}",
                            param="gpus")
        if launcher_world is not None and launcher_world != the_plan.world_size:
            raise UserError(f"the launcher started {launcher_world} ranks but the plan is for "
                            f"{the_plan.world_size}{where}", param="plan")
        world = the_plan.world_size
        if launcher_world is None and gpus is None:
            _check_cores(world, "the plan is")
        if model is None and where and (":" in the_plan.model or the_plan.model.endswith(".py")):
            # a plan file is data: the model file it names is code, run only when the user names it too
            raise UserError(f"the plan{where} names the model file {the_plan.model!r}, which is code; plans "
                            "never run code on their own: pass the same `model` to run it", param="model")
        model = model or the_plan.model
        if input_shape is None and the_plan.input_shape:
            input_shape = tuple(the_plan.input_shape)
    else:
        if model is None:
            raise UserError("model is required with strategy", param="model")
        batch = DEFAULT_BATCH if batch is None else batch
        world = launcher_world or gpus
        strat = parse_strategy(strategy, world)
        if world is None:
            world = strat.world_size
            _check_cores(world, f"strategy {strategy!r} is")
        the_plan = Plan(model=model, world_size=world, batch=batch, dp=world // strat.mp, mp=strat.mp,
                        default_layout=strat.layout, strategy=strategy)
    if model is None:
        raise UserError("model is required", param="model")
    return the_plan, world, batch, model, input_shape


def _check_cores(world: int, what: str) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if world > cores:
        raise UserError(f"{what} for {world} ranks but this machine has {cores} CPU cores: start the ranks with "
                        f"torchrun on the cluster the plan is for, or ask for gpus {world} local processes "
                        "explicitly", param="gpus")


def _parse_shape(shape) -> tuple[int, ...] | None:
    if shape is None or isinstance(shape, tuple):
        return shape
    from hybridpar.graph.models import parse_shape

    return parse_shape(shape)


def _check_sample_size(shape: tuple[int, ...], batch: int) -> None:
    """Refuse input shapes (or batches) whose one batch cannot be held, before anything allocates one."""
    sample = math.prod(shape) * 4
    avail = available_memory()
    text = ",".join(map(str, shape))
    if sample > avail // 4:
        raise UserError(f"input_shape {text}: one sample is {_gib(sample)} and this machine has "
                        f"{_gib(avail)} available", param="input_shape")
    if sample * batch > avail // 4:
        raise UserError(f"batch {batch}: one batch of {text} samples is {_gib(sample * batch)} and this machine "
                        f"has {_gib(avail)} available", param="batch")


def _load(model: str, shape):
    """(the model on meta, the model's real example inputs): the launcher never holds the weights.
    The factory runs on meta (hybridpar.parallel.materialize records it), then for real with every
    weight freed after its last use (about one layer held at a time), for its example inputs (the
    data checks use their values). A factory that cannot run on meta, or runs other ops there, is
    built for real whole (both entries are that one model)."""
    import functools

    from hybridpar.graph.models import load_model
    from hybridpar.graph.zoo import ZOO
    from hybridpar.parallel.materialize import Materializer, ReplayDiverged, record_build

    if model in ZOO:  # the zoo builds on meta and makes its example inputs without the model
        meta = _load_whole(model, shape, device="meta")
        return meta, replace(meta, example_inputs=ZOO[model].example_inputs(1, meta.input_shape))
    meta, record, _why = record_build(functools.partial(load_model, model, batch=1, input_shape=shape))
    if meta is None:
        whole = _load_whole(model, shape)
        return whole, whole
    try:
        with torch.random.fork_rng(devices=[]):
            inputs = Materializer(functools.partial(load_model, model, batch=1, input_shape=shape), record,
                                  seed=0).build_freed()
    except (ReplayDiverged, UserError, SystemExit):
        whole = _load_whole(model, shape)
        return whole, whole
    return meta, inputs


def _load_whole(model: str, shape, device=None):
    from hybridpar.graph.models import load_model

    try:
        return load_model(model, batch=1, input_shape=shape, device=device)
    except SystemExit as err:  # a user's file or factory that exits must not end `train` with success
        raise UserError(f"model {model}: loading it called sys.exit({err.code})", param="model") from None


def _layout_dry_run(module, plan: Plan, batch: int, examples) -> None:
    """The channel/filter layout run on meta tensors over a fake world of the plan's ranks
    (hybridpar.parallel.check): an op the layout cannot serve is one line naming op and module, here,
    before any rank starts. Skipped inside an initialised world (under torchrun each rank has one)."""
    import torch.distributed as dist

    from hybridpar.parallel.check import dry_run

    if not examples or (dist.is_available() and dist.is_initialized()):
        return
    tensors = [t for t in examples if isinstance(t, torch.Tensor)]
    inputs = tuple(torch.zeros((batch, *t.shape[1:]), dtype=t.dtype, device="meta") for t in tensors)

    def values():  # a forward that reads values (HF GPT-2's masks): the examples' rows, repeated to the batch
        return module, tuple(t[torch.arange(batch) % t.shape[0]] for t in tensors), None
    dry_run(module, plan, inputs, world_size=plan.world_size, values=values)


def _dry_run(loaded, loss: str | None = None) -> tuple:
    """One eval-mode forward of one example sample (data_spec's): a model that raises or returns
    something that is not logits is refused here, not in every rank. Also measures the bytes of every
    leaf module's output for that sample (the activations a training step keeps per sample)."""
    from hybridpar.train.loss import loss_data_spec

    total = [0]
    out_seen: list = []

    def count(_m, _i, out):
        if torch.is_tensor(out):
            total[0] += out.numel() * out.element_size()

    leaves = [m for m in loaded.module.modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(count) for m in leaves]
    handles.append(loaded.module.register_forward_hook(lambda _m, _i, out: out_seen.append(out)))
    try:
        spec = loss_data_spec(loaded, loss)
    except UserError:
        raise
    except SystemExit as err:
        raise UserError(f"model {loaded.name}: its forward called sys.exit({err.code})", param="model") from None
    except Exception as err:  # noqa: BLE001 - a user's forward can raise anything
        out = out_seen[0] if out_seen else None
        if out is not None and not (torch.is_tensor(out) and out.dim() >= 2):
            what = f"a tensor of shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
            raise UserError(f"model {loaded.name}: forward returned {what}; training needs logits "
                            "[N, classes] or [N, T, vocab]", param="model") from None
        first = " ".join(str(err).split())[:200]
        raise UserError(f"model {loaded.name}: forward on one example sample (input shape "
                        f"{_shape_text(loaded)}) failed: {type(err).__name__}: {first}", param="model") from None
    finally:
        for h in handles:
            h.remove()
    return spec, total[0]


def _shape_text(loaded) -> str:
    first = loaded.example_inputs[0] if loaded.example_inputs else None
    return ",".join(map(str, first.shape[1:])) if torch.is_tensor(first) else "?"


def _check_sharding(cfg: TrainConfig, plan: Plan) -> None:
    """zero=2|3 and recompute: what does not run yet, one line before any rank starts."""
    from hybridpar.parallel.fsdp import plan_recompute, sharding_refusal

    layouts = [plan.default_layout, *plan.layers.values()]
    recompute = plan_recompute(plan, cfg.parallel.recompute)  # --recompute all, else the plan's choice
    why = sharding_refusal(layouts, plan.mp, recompute, dict(plan.layers))
    if why is not None:
        raise UserError(why, param="recompute" if "recompute" in why.split(":")[0] else "strategy")
    # zero=2|3 checkpoints: each rank its FSDP shard, as DCP chunks (train.checkpoint_sharded, checkpoint_dcp)


def _check_layout(module, plan: Plan, batch: int, micro_batches: int, precision: str = "fp32", examples=(),
                  bn_stats: str = "global") -> None:
    if plan.mp == 1:
        from hybridpar.parallel.api import as_layouts, check_parallelizable

        if micro_batches != 1:
            raise UserError(f"micro_batches {micro_batches} needs a model-parallel plan (mp > 1)",
                            param="micro_batches")
        check_parallelizable(module, as_layouts(plan), batch)
        # activations are DTensors (channel/filter or spatial splits): what the layout cannot serve
        # (an op, a module reading a conv's attributes the spatial wrapper lacks) refused before start
        if plan.default_layout.g_size > 1 or plan.default_layout.spatial > 1:
            _layout_dry_run(module, plan, batch, examples)
        return
    from hybridpar.parallel.pipeline import check_mp_plan

    # bad placement, an untraceable model: one line here, not a rank traceback
    check_mp_plan(module, plan, batch, examples or None, micro_batches, bn_stats)
    from hybridpar.parallel.pipeline.module import check_micro_batches

    check_micro_batches(module, micro_batches, bn_stats)
    if micro_batches > batch // plan.dp:
        raise UserError(f"micro_batches {micro_batches} exceeds the {batch // plan.dp} samples per replica",
                        param="micro_batches")


def _data_size(data: str, shape, spec, synthetic_size: int, seed: int, loaded) -> tuple[int, int]:
    """(samples, bytes of them that every rank holds in memory), without building large data sets here.
    synthetic, digits and .pt files are held whole; image folders, .npy arrays (memory-mapped) and
    factories' data sets are read batch by batch (their cost is in the batch, counted elsewhere)."""
    labels = 1 if spec.label_shape is None else math.prod(spec.label_shape)  # a loss's own targets: counted as read
    sample = math.prod(shape) * (8 if spec.vocab is not None else 4) + 8 * max(1, labels)
    if data == "synthetic":
        return synthetic_size, synthetic_size * sample
    from hybridpar.train.data import loader as data_mod

    if data == "digits":
        from sklearn.datasets import load_digits

        n = len(load_digits().target)
        _check_data_memory(data, n * sample)  # before the images are resized to the model's input
    elif Path(data).is_file():
        _check_data_memory(data, Path(data).stat().st_size)
    ds = data_mod.open_dataset(data, shape, num_classes=spec.num_classes, size=synthetic_size, seed=seed,
                               vocab=spec.vocab, label_shape=spec.label_shape, example_inputs=loaded.example_inputs)
    n = len(ds)
    _check_finite_data(data, ds)
    return n, n * sample if isinstance(ds, data_mod.Dataset) else 0


def _check_data_memory(data: str, nbytes: int) -> None:
    avail = available_memory()
    if nbytes > avail // 2:
        raise UserError(f"data {data}: about {_gib(nbytes)} in memory, more than half of this machine's "
                        f"{_gib(avail)} available", param="data")


def _check_finite_data(data: str, ds) -> None:
    from hybridpar.train.data.files import held_inputs

    for t in held_inputs(ds):  # data held in memory; files read on demand are checked as read
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UserError(f"data {data}: the inputs hold NaN or Inf values", param="data")


def _check_init(module, path: str) -> None:
    """The file is a state_dict of finite tensors matching `module` (on meta here: shapes and names
    checked, nothing copied); memory-mapped, so a large file is read, not held."""
    from hybridpar.train.checkpoint import mmap_load

    try:
        state = mmap_load(path, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"init_from {path}: file not found", param="init_from") from None
    except Exception as err:  # noqa: BLE001 - torch.load fails in many ways on a bad file
        raise UserError(f"init_from {path}: not a torch.save'd state_dict ({type(err).__name__})",
                        param="init_from") from None
    _check_init_state(module, path, state)


def _check_init_state(module, path: str, state) -> None:
    if not isinstance(state, dict):
        raise UserError(f"init_from {path}: expected a state_dict", param="init_from")
    bad = [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()
           and not bool(torch.isfinite(v).all())]
    if bad:
        raise UserError(f"init_from {path}: {bad[0]} holds NaN or Inf values", param="init_from")
    import warnings

    try:
        with warnings.catch_warnings():  # meta parameters: names and shapes checked, the copy a no-op
            warnings.filterwarnings("ignore", message=".*to a meta parameter.*")
            module.load_state_dict(state)
    except RuntimeError as err:
        lines = str(err).splitlines()
        first = lines[1].strip() if len(lines) > 1 else str(err)
        raise UserError(f"init_from {path} does not match the model: {first}", param="init_from") from None


def _predicted_memory(loaded, plan: Plan, batch: int, optimizer: str, momentum: float,
                      weight_decay: float, recompute: str = "none") -> float | None:
    """One rank's peak in a step as the cost model predicts it (hybridpar.cost.memory, the planner's
    own sum) from the model's graph, or None where it does not apply (model-parallel plans, a model
    the tracer cannot read)."""
    if plan.mp > 1:
        return None
    from hybridpar.cost.memory import predict_rank_memory
    from hybridpar.graph import trace
    from hybridpar.parallel.fsdp import plan_recompute

    try:
        graph = trace(loaded.module, loaded.example_inputs)
        # what recomputes: --recompute all (or a plan's "all"), else the plan's per-block choice
        blocks = plan_recompute(plan, recompute)
        return predict_rank_memory(graph, plan.default_layout, layers=plan.layers, batch=batch, optimizer=optimizer,
                                   momentum=momentum, weight_decay=weight_decay, recompute=blocks).total_bytes
    except Exception:  # noqa: BLE001 - then the coarser estimate below
        return None


def _step_flops(loaded, batch: int) -> int | None:
    from hybridpar.train.metrics import step_flops

    try:
        return step_flops(loaded.module, loaded.example_inputs, batch)
    except Exception:  # noqa: BLE001 - a model the graph tracer cannot read still trains; no mfu then
        return None


def _peak(plan: Plan, precision: str) -> float | None:
    from hybridpar.train.metrics import peak_flops

    if precision == "fp64":  # only a stated fp64 rate (a GPU's is far below its fp32 one): else no mfu
        from hybridpar.cluster import load_cluster

        try:
            stated = "fp64" in load_cluster(plan.cluster).device.peak_flops
        except Exception:  # noqa: BLE001 - metrics must never stop a run
            stated = False
        if not stated:
            return None
    return peak_flops(plan.cluster, precision)


# -- memory --------------------------------------------------------------------------------------

def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable; all physical memory where that is unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def estimate_rank_memory(module, plan: Plan, batch: int, data_bytes: int, act_bytes_per_sample: int, *,
                         optimizer_slots: int = 0, input_bytes: int = 0) -> int:
    """Bytes one rank's process needs, from the model: the data set (every rank holds it), the
    weights, gradients and optimizer slots (counted whole: an upper bound for split layers), the
    global batch (every rank takes it in) and the activations a step keeps (forward outputs and their
    gradients for this rank's samples: batch / sample degree)."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    samples = plan.dp if plan.mp > 1 else plan.default_layout.sample
    acts = 2 * act_bytes_per_sample * math.ceil(batch / max(1, samples))
    return PROCESS_BYTES + data_bytes + params * (2 + optimizer_slots) + 2 * input_bytes + acts


def _check_memory(per_rank: int, ranks_here: int, *, launched: bool) -> None:
    avail = available_memory()
    need = per_rank * ranks_here
    if need > avail:
        who = f"{ranks_here} ranks on this machine" if ranks_here > 1 else "one rank"
        raise UserError(f"this run needs about {_gib(per_rank)} per rank, {_gib(need)} for {who}, and this "
                        f"machine has {_gib(avail)} available; use fewer samples (synthetic_size), a smaller "
                        "input_shape or batch" + ("" if launched else ", or more machines under torchrun"))


def _gib(n: int) -> str:
    if n >= 2**50:
        return f"{n / 2**50:.3g} PiB"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
