"""From a Plan (or a strategy) plus training options to a validated run, before any rank starts.

`run_config(**options)` is what `hybridpar train` calls with its flags (and what a Python caller may
call with the same names): it loads the plan and the model, fills what the caller left out from the
plan (batch, rank count, input shape, model), checks every option and refuses bad ones with a
UserError worded in the library's terms (`param` names the option), dry-runs the model on one sample,
estimates the run's memory against this machine's, checks that every output path can be written and
resolves the checkpoint directory (whose run it is, where a resume starts). It returns a RunSetup:
the TrainConfig every rank runs, the rank count to start, and the notes worth telling the user.

Batch and rank count: a plan fixes both. Left out, they are the plan's; given and different, the run
is refused. Without a rank count and without a launcher, the plan's ranks are started as local
processes only when this machine has a core for each (more only when asked for explicitly).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hybridpar.errors import UserError
from hybridpar.plans import Plan
from hybridpar.train.trainer import TrainConfig, total_steps

PROCESS_BYTES = 300 * 2**20  # what one rank costs before any tensor: interpreter, torch, gloo buffers
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class RunSetup:
    config: TrainConfig
    world_size: int  # ranks to start (or that the launcher started)
    start_step: int = 0  # > 0 when resuming
    total_steps: int = 0
    notes: list[str] = field(default_factory=list)  # one line each: resume decisions, skipped checkpoints
    memory_per_rank: int = 0  # estimated bytes of one rank's process

    @property
    def nothing_to_do(self) -> bool:
        """Resuming a run that already reached its last step."""
        return self.start_step >= self.total_steps


def run_config(*, model: str | None = None, input_shape: str | tuple[int, ...] | None = None,
               strategy: str | None = None, plan: str | os.PathLike | Plan | None = None,
               nproc: int | None = None, data: str = "synthetic", batch: int | None = None,
               steps: int | None = None, epochs: int | None = None, lr: float = 0.1, momentum: float = 0.0,
               weight_decay: float = 0.0, seed: int = 0, shuffle: bool = True, init_from: str | None = None,
               save: str | None = None, bn_stats: str = "global", synthetic_size: int = 1024,
               micro_batches: int = 1, gns: bool = False, checkpoint_dir: str | None = None,
               checkpoint_every: int = 0, resume: str | bool = "no", overwrite: bool = False,
               deterministic: bool = False, optimizer: str = "sgd", lr_schedule: str = "constant",
               warmup_steps: int = 0, grad_clip: float | None = None, precision: str = "fp32",
               metrics: str | None = None, tensorboard: str | None = None,
               profile_steps: str | tuple[int, int] | None = None, profile_dir: str | None = None,
               workers: int | None = None, launcher_world: int | None = None,
               local_ranks: int | None = None, place: Callable[..., Plan] | None = None) -> RunSetup:
    """Validate a training run and return its RunSetup (UserError, with `param` set, on bad input).

    `plan`: a Plan or the path of a plan.json; exactly one of `plan` and `strategy`. `launcher_world`:
    the world a launcher (torchrun) already started (None: this call's ranks are spawned locally);
    `local_ranks`: how many of those share this machine (default: all of them). `resume`: "no",
    "yes" (continue from this run's newest good checkpoint; refuse when every checkpoint is damaged)
    or "if-any" (start at step 0 then); True/False mean "yes"/"no". `place(plan, module, optimizer=...)`: returns a
    model-parallel plan with its placement filled in (the caller's search, e.g.
    hybridpar.api.with_placement; the runtime never searches); without it such a plan
    must come with its placement."""
    resume = {True: "yes", False: "no", None: "no"}.get(resume, resume)  # type: ignore[arg-type]
    _check_counts(batch=batch, steps=steps, epochs=epochs, nproc=nproc, synthetic_size=synthetic_size,
                  micro_batches=micro_batches)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise UserError(f"workers must be an integer >= 0, got {workers!r}", param="workers")
    _check_numbers(lr=lr, momentum=momentum, weight_decay=weight_decay, seed=seed,
                   checkpoint_every=checkpoint_every)
    if (strategy is None) == (plan is None):
        raise UserError("give exactly one of strategy or plan", param="strategy")
    if steps is not None and epochs is not None:
        raise UserError("steps and epochs: give one, not both", param="steps")
    if (checkpoint_every or resume != "no" or overwrite) and not checkpoint_dir:
        raise UserError("checkpoint_every, resume and overwrite need checkpoint_dir", param="checkpoint_dir")
    if bn_stats not in ("global", "local"):
        raise UserError(f"bn_stats must be global or local, got {bn_stats!r}", param="bn_stats")
    from hybridpar.train.optim import check_options

    check_options(optimizer=optimizer, lr_schedule=lr_schedule, warmup_steps=warmup_steps, grad_clip=grad_clip,
                  precision=precision)
    _check_output_path(save, "save")
    _check_output_path(metrics, "metrics")
    _check_output_dir(tensorboard, "tensorboard")
    if tensorboard is not None:
        from hybridpar.train.metrics import tensorboard_missing

        if why := tensorboard_missing():
            raise UserError(f"tensorboard {tensorboard}: {why}", param="tensorboard")
    window = parse_profile_steps(profile_steps)
    if profile_dir is not None and window is None:
        raise UserError("profile_dir needs profile_steps", param="profile_dir")
    if window is not None:
        profile_dir = profile_dir or (os.path.join(checkpoint_dir, "profile") if checkpoint_dir
                                      else "hybridpar-profile")
        _check_output_dir(profile_dir, "profile_dir")

    the_plan, world, batch, model, input_shape = _plan_and_world(
        model=model, input_shape=input_shape, strategy=strategy, plan=plan, nproc=nproc, batch=batch,
        launcher_world=launcher_world)
    shape = _parse_shape(input_shape)
    if shape is not None:
        _check_sample_size(shape, batch)
    loaded, with_inputs = _load(model, shape)
    shape = tuple(loaded.input_shape or loaded.example_inputs[0].shape[1:])
    _check_sample_size(shape, batch)
    try:
        spec, act_bytes = _dry_run(loaded)
    except UserError:
        if with_inputs.module is loaded.module:
            raise
        loaded = with_inputs = _load_whole(model, shape)  # a forward that reads values: check it for real
        spec, act_bytes = _dry_run(loaded)
    if the_plan.mp > 1:  # the graph the MP runtime runs (fx, else export): an untraceable model is one line here
        from hybridpar.parallel.pipeline.engine import micro_batch_inputs
        from hybridpar.parallel.pipeline.partition import trace

        trace(loaded.module, micro_batch_inputs(loaded.example_inputs, the_plan.model_copy(update={"batch": batch}),
                                                micro_batches))
    if the_plan.mp > 1 and the_plan.placement is None:
        if place is None:
            raise UserError("plan: a model-parallel plan needs its placement before launch (write one with "
                            "`hybridpar place --out` or `hybridpar plan --out`)", param="plan")
        from hybridpar.cost.update import optimizer_kind

        # priced with the update this run makes (its state in memory, its time in the step)
        the_plan = place(the_plan, loaded.module, optimizer=optimizer_kind(optimizer, momentum),
                         example_inputs=micro_batch_inputs(loaded.example_inputs,
                                                           the_plan.model_copy(update={"batch": batch}), micro_batches))
    _check_layout(loaded.module, the_plan, batch, micro_batches, precision, tuple(loaded.example_inputs), bn_stats)
    n, data_bytes = _data_size(data, shape, spec, synthetic_size, seed, with_inputs)
    sample_bytes = math.prod(shape) * (8 if spec.vocab is not None else 4)
    if n < batch:
        raise UserError(f"data {data} has {n} samples, fewer than batch {batch}", param="data")
    if init_from is not None:
        _check_init(loaded.module, init_from)

    cfg = TrainConfig(model=model, plan=the_plan, data=data, batch=batch,
                      steps=(10 if steps is None and epochs is None else steps) if epochs is None else None,
                      epochs=epochs, lr=lr, momentum=momentum, weight_decay=weight_decay, seed=seed,
                      shuffle=shuffle, init_from=init_from, save=save, input_shape=shape, bn_stats=bn_stats,
                      synthetic_size=synthetic_size, micro_batches=micro_batches, gns=gns,
                      checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume != "no",
                      overwrite=overwrite, deterministic=deterministic, optimizer=optimizer,
                      lr_schedule=lr_schedule, warmup_steps=warmup_steps, grad_clip=grad_clip, precision=precision,
                      metrics=metrics, workers=workers, local_ranks=local_ranks, tensorboard=tensorboard,
                      profile_steps=window, profile_dir=profile_dir if window else None)
    cfg = replace(cfg, identity=run_identity(cfg))
    if metrics or tensorboard:
        cfg = replace(cfg, flops_per_step=_step_flops(loaded, batch), peak_flops=_peak(the_plan, precision))
    last = total_steps(cfg, n)
    if last < 1:
        raise UserError("nothing to train: 0 steps", param="steps")
    if window is not None and window[0] >= last:
        raise UserError(f"profile_steps {window[0]}:{window[1]}: the run has steps 0..{last - 1}",
                        param="profile_steps")

    predicted = _predicted_memory(loaded, the_plan, batch, optimizer, momentum, weight_decay)
    if predicted is not None:  # the cost model's figure for this layout, plus the data set held whole
        per_rank = int(predicted) + data_bytes
    else:
        per_rank = estimate_rank_memory(loaded.module, the_plan, batch, data_bytes, act_bytes,
                                        optimizer_slots=2 if optimizer == "adamw" else 1 if momentum else 0,
                                        input_bytes=batch * sample_bytes)
    if precision == "fp64":  # both figures count fp32 bytes; weights, grads, optimizer state, activations double
        per_rank = 2 * (per_rank - data_bytes) + data_bytes
    _check_memory(per_rank, local_ranks or world, launched=launcher_world is not None)

    notes: list[str] = []
    start = 0
    if checkpoint_dir:
        from hybridpar.train.checkpoint import check_checkpoint_dir

        found = check_checkpoint_dir(checkpoint_dir, cfg.identity, resume, overwrite=overwrite)
        notes = list(found.notes)
        if found.resume_from is not None:
            cfg = replace(cfg, resume_from=str(found.resume_from.path))
            start = found.resume_from.step
    return RunSetup(cfg, world, start, last, notes, per_rank)


def run_identity(cfg: TrainConfig) -> dict:
    """What makes two runs the same run, whatever their layout or rank count: the model, its input,
    the data and its order, the optimizer's settings and the starting weights. The step count is not
    part of it (a longer run of the same settings continues the shorter one)."""
    return {"model": cfg.model, "input_shape": list(cfg.input_shape or ()), "data": cfg.data,
            "synthetic_size": cfg.synthetic_size if cfg.data == "synthetic" else None, "seed": cfg.seed,
            "batch": cfg.batch, "shuffle": cfg.shuffle, "lr": cfg.lr, "momentum": cfg.momentum,
            "weight_decay": cfg.weight_decay, "bn_stats": cfg.bn_stats, "init_from": cfg.init_from,
            "optimizer": cfg.optimizer, "lr_schedule": cfg.lr_schedule, "warmup_steps": cfg.warmup_steps,
            "grad_clip": cfg.grad_clip, "precision": cfg.precision}


def claim_checkpoint_dir(setup: RunSetup) -> None:
    """Take the checkpoint directory's advisory lock for this process's lifetime (UserError when
    another run holds it). Call it in the process that outlives the ranks (the launcher's parent, or
    rank 0 under torchrun), after run_config and before starting work."""
    if setup.config.checkpoint_dir:
        from hybridpar.train.checkpoint import lock_directory

        lock_directory(setup.config.checkpoint_dir)


# -- the pieces ----------------------------------------------------------------------------------

def _check_counts(**counts: int | None) -> None:
    for name, v in counts.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise UserError(f"{name} must be an integer, got {v!r}", param=name)
        if v is not None and v < 1:
            raise UserError(f"{name} must be >= 1, got {v}", param=name)


def _check_numbers(*, lr, momentum, weight_decay, seed, checkpoint_every) -> None:
    for name, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"{name} must be a finite number, got {v!r}", param=name)
    if lr <= 0:
        raise UserError(f"lr must be > 0, got {lr}", param="lr")
    if momentum < 0 or weight_decay < 0:
        name = "momentum" if momentum < 0 else "weight_decay"
        raise UserError(f"{name} must be >= 0, got {momentum if momentum < 0 else weight_decay}", param=name)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed must be an integer from 0 to 2**63-1, got {seed!r}", param="seed")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise UserError(f"checkpoint_every must be >= 0, got {checkpoint_every!r}", param="checkpoint_every")


def parse_profile_steps(spec: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """`A:B` (steps A..B-1, 0 <= A < B) as (A, B); UserError naming profile_steps otherwise."""
    if spec is None:
        return None
    parts = list(spec) if isinstance(spec, (tuple, list)) else str(spec).split(":")
    try:
        if len(parts) != 2 or any(isinstance(p, (bool, float)) for p in parts):
            raise ValueError
        a, b = (int(str(p).strip()) for p in parts)
    except ValueError:
        raise UserError(f"profile_steps must be A:B with integers 0 <= A < B, got {spec!r}",
                        param="profile_steps") from None
    if a < 0 or b <= a:
        raise UserError(f"profile_steps must be A:B with integers 0 <= A < B, got {spec!r}", param="profile_steps")
    return a, b


def _check_output_dir(path: str | None, param: str) -> None:
    """A directory this run will write into: not an existing file, and it exists or can be made."""
    if path is None:
        return
    p = Path(path)
    if str(path) == "" or (p.exists() and not p.is_dir()):
        raise UserError(f"{param} {path}: is not a directory", param=param)
    existing = next((q for q in (p, *p.parents) if q.exists()), Path("."))
    if not existing.is_dir():
        raise UserError(f"{param} {path}: {existing} is not a directory", param=param)
    from hybridpar.train.checkpoint import can_create_in

    if not can_create_in(existing):
        raise UserError(f"{param} {path}: not writable", param=param)


def _check_output_path(path: str | None, param: str) -> None:
    """A file this run will write: not a directory, and its folder exists (or can be made) and is
    writable. Checked now, not after the training it would hold."""
    if path is None:
        return
    p = Path(path)
    if str(path) == "" or p.is_dir() or str(path).endswith(os.sep):
        raise UserError(f"{param} {path}: is a directory, expected a file path", param=param)
    parent = p.parent
    existing = next((q for q in (parent, *parent.parents) if q.exists()), Path("."))
    if not existing.is_dir():
        raise UserError(f"{param} {path}: {existing} is not a directory", param=param)
    from hybridpar.train.checkpoint import can_create_in

    if not can_create_in(existing):
        raise UserError(f"{param} {path}: not writable", param=param)


def _plan_and_world(*, model, input_shape, strategy, plan, nproc, batch, launcher_world):
    from hybridpar.plans import load_plan, parse_strategy

    if plan is not None:
        the_plan = plan if isinstance(plan, Plan) else load_plan(plan)
        where = "" if isinstance(plan, Plan) else f" ({plan})"
        if batch is None:
            batch = the_plan.batch
        elif batch != the_plan.batch:
            raise UserError(f"batch {batch} disagrees with the plan's batch {the_plan.batch}{where}; leave it "
                            "out to use the plan's, or make a plan for this batch", param="batch")
        if nproc is not None and nproc != the_plan.world_size:
            raise UserError(f"nproc {nproc} disagrees with the plan: plan is for {the_plan.world_size} ranks{where}",
                            param="nproc")
        if launcher_world is not None and launcher_world != the_plan.world_size:
            raise UserError(f"the launcher started {launcher_world} ranks but the plan is for "
                            f"{the_plan.world_size}{where}", param="plan")
        world = the_plan.world_size
        if launcher_world is None and nproc is None:
            _check_cores(world, "the plan is")
        model = model or the_plan.model
        if input_shape is None and the_plan.input_shape:
            input_shape = tuple(the_plan.input_shape)
    else:
        if model is None:
            raise UserError("model is required with strategy", param="model")
        batch = 32 if batch is None else batch
        world = launcher_world or nproc
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
                        f"torchrun on the cluster the plan is for, or ask for nproc {world} local processes "
                        "explicitly", param="nproc")


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


def _dry_run(loaded) -> tuple:
    """One eval-mode forward of one example sample (data_spec's): a model that raises or returns
    something that is not logits is refused here, not in every rank. Also measures the bytes of every
    leaf module's output for that sample (the activations a training step keeps per sample)."""
    from hybridpar.train.data.loader import data_spec

    total = [0]
    out_seen: list = []

    def count(_m, _i, out):
        if torch.is_tensor(out):
            total[0] += out.numel() * out.element_size()

    leaves = [m for m in loaded.module.modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(count) for m in leaves]
    handles.append(loaded.module.register_forward_hook(lambda _m, _i, out: out_seen.append(out)))
    try:
        spec = data_spec(loaded)
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


def _check_layout(module, plan: Plan, batch: int, micro_batches: int, precision: str = "fp32", examples=(),
                  bn_stats: str = "global") -> None:
    if plan.mp == 1:
        from hybridpar.parallel.api import as_layouts, check_parallelizable

        if micro_batches != 1:
            raise UserError(f"micro_batches {micro_batches} needs a model-parallel plan (mp > 1)",
                            param="micro_batches")
        check_parallelizable(module, as_layouts(plan), batch)
        if plan.default_layout.g_size > 1:
            _layout_dry_run(module, plan, batch, examples)
        return
    from hybridpar.parallel.pipeline import check_mp_plan

    # bad placement, an untraceable model: one line here, not a rank traceback
    check_mp_plan(module, plan, batch, examples or None, micro_batches, bn_stats)
    if micro_batches > batch // plan.dp:
        raise UserError(f"micro_batches {micro_batches} exceeds the {batch // plan.dp} samples per replica",
                        param="micro_batches")


def _data_size(data: str, shape, spec, synthetic_size: int, seed: int, loaded) -> tuple[int, int]:
    """(samples, bytes of them that every rank holds in memory), without building large data sets here.
    synthetic, digits and .pt files are held whole; image folders, .npy arrays (memory-mapped) and
    factories' data sets are read batch by batch (their cost is in the batch, counted elsewhere)."""
    sample = math.prod(shape) * (8 if spec.vocab is not None else 4) + 8 * max(1, math.prod(spec.label_shape))
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
    x = getattr(ds, "x", None)
    tensors = [x] if torch.is_tensor(x) else list(x.values()) if isinstance(x, dict) else list(x or ())
    for t in tensors:
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
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
                      weight_decay: float) -> float | None:
    """One rank's peak in a step as the cost model predicts it (hybridpar.cost.memory, the planner's
    own sum) from the model's graph, or None where it does not apply (model-parallel plans, a model
    the tracer cannot read)."""
    if plan.mp > 1:
        return None
    from hybridpar.cost.memory import predict_rank_memory
    from hybridpar.graph import trace

    try:
        graph = trace(loaded.module, loaded.example_inputs)
        return predict_rank_memory(graph, plan.default_layout, layers=plan.layers, batch=batch, optimizer=optimizer,
                                   momentum=momentum, weight_decay=weight_decay).total_bytes
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
