"""The per-rank training loop shared by `hybridpar train` and the Python API.

`run_rank(cfg, queue)` builds the model (seeded, or from --init-from), the engine from make_engine,
SGD, and trains; rank 0 sends one StepInfo per step on `queue` (when given) and runs the callbacks,
the hook point for checkpointing or other per-step work (the online gradient noise scale is built in:
TrainConfig.gns, hybridpar.train.grad_noise):
    callback(info: StepInfo, engine, optimizer) -> None
listed in TrainConfig.callbacks ("module:function", imported in every rank, so they survive spawn).

Never train on NaN: every step checks the loss, this rank's gradients and, after the update, the
weights, buffers and optimizer state for NaN/Inf (hybridpar.train.guard: one fused reduction, at most
one tiny allreduce, so every rank agrees); the first bad step stops the run with TrainResult.error
naming the step (and the tensor) and TrainResult.exit_code NONFINITE_EXIT (3). Nothing of that step is
kept: no checkpoint, no callback, no `save`, and the weights are checked finite again before `save`,
so the last good checkpoint is never replaced by a bad state."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from hybridpar.parallel.finite import finite_here as _finite_here
from hybridpar.train.config import TrainConfig

NONFINITE_EXIT = 3  # exit status of `hybridpar train` when a step's loss or gradients are NaN/Inf


@dataclass(frozen=True)
class StepInfo:
    step: int
    loss: float
    step_time_s: float
    samples_per_s: float
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_s: dict[str, float] = field(default_factory=dict)  # rank 0's wall time in collectives, per kind
    gns_b_noise: float | None = None  # smoothed B_noise after this step (None: off, n/a or not yet)
    lr: float | None = None  # the learning rate this step used
    peak_memory_bytes: int | None = None  # rank 0's peak so far (CUDA allocations, else resident set)
    grad_norm: float | None = None  # global gradient norm before clipping (with grad_clip)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TrainResult:
    steps: list[StepInfo]
    param_bytes_per_rank: list[int]
    param_bytes_by_type_per_rank: list[dict[str, int]]
    final_loss: float
    saved: str | None
    world_size: int
    gns_per_epoch: list[float | None] = field(default_factory=list)  # smoothed B_noise at each epoch's end
    gns_note: str | None = None  # why there is no estimate ("n/a: needs >1 sample group"), else None
    start_step: int = 0  # the first step this run took (> 0 when resumed)
    error: str | None = None  # why the run stopped early (every rank agrees), else None
    exit_code: int = 0  # NONFINITE_EXIT for a non-finite step, 1 for other stops, else 0
    peak_memory_bytes_per_rank: list[int] = field(default_factory=list)  # each rank's peak (see metrics)


def total_steps(cfg: TrainConfig, n_samples: int) -> int:
    """Steps of the run over a data set of `n_samples` (TrainConfig.total_steps)."""
    return cfg.total_steps(n_samples)


def build_module(cfg: TrainConfig):
    """The undistributed model, same on every rank: seeded init, then --init-from if given."""
    from hybridpar.graph.models import load_model

    torch.manual_seed(cfg.seed)
    loaded = load_model(cfg.model, batch=1, input_shape=cfg.input_shape)
    if cfg.checkpoint.init_from:
        state = torch.load(cfg.checkpoint.init_from, map_location="cpu", weights_only=True)
        loaded.module.load_state_dict(state)
    return loaded


def build_engine(cfg: TrainConfig, device, resume_from=None):
    """(loaded model, its DataSpec, engine, resume state or None), this rank holding only its pieces.

    Channel/filter/sample plans: the model is built on meta, cut by parallelize, and this rank's
    pieces get the values of the model built whole with cfg.seed (hybridpar.parallel.materialize);
    --init-from and a resume then read only this rank's pieces from their files. Model-parallel
    plans (the MP engine takes whole layers) and models that cannot be built on meta are built whole
    first, as before (said on stderr)."""
    import functools

    from hybridpar.graph.models import load_model, rebatch
    from hybridpar.parallel.materialize import Materializer, record_build
    from hybridpar.train import checkpoint as ckpt
    from hybridpar.train.engine import make_engine
    from hybridpar.train.loss import loss_data_spec, make_loss
    from hybridpar.train.optim import to_precision

    loss_fn = make_loss(cfg.loss)

    meta = record = None
    if cfg.plan.mp == 1:
        build = functools.partial(load_model, cfg.model, batch=1, input_shape=cfg.input_shape)
        meta, record, why = record_build(build)
        if meta is not None:
            try:
                spec = loss_data_spec(meta, cfg.loss)  # one forward on meta: shapes only
            except Exception as err:  # noqa: BLE001 - a forward reading values (.item(): HF Perceiver): whole
                meta, why = None, f"its forward on meta: {type(err).__name__}: {' '.join(str(err).split())[:120]}"
        if meta is None and dist.get_rank() == 0:
            import sys

            print(f"hybridpar: model {cfg.model} cannot be built on the meta device ({why}); every rank "
                  "builds it whole before cutting its pieces", file=sys.stderr, flush=True)
    if meta is None:  # whole model first (MP plans; factories that fail on meta)
        loaded = build_module(cfg)
        resumed = ckpt.load_checkpoint(info, loaded.module) if (info := resume_from) else None
        spec = loss_data_spec(loaded, cfg.loss)
        extra = {}
        if cfg.plan.mp > 1:  # a global batch's inputs, for a model that runs on torch.export's graph
            extra["example_inputs"] = rebatch(tuple(loaded.example_inputs), cfg.batch)
        elif cfg.optim.precision == "bf16":  # zero=2|3: FSDP2 gathers bf16 copies of the fp32 weights
            extra["mixed_precision"] = "bf16"
        engine = _recomputing(make_engine(to_precision(loaded.module.to(device), cfg.optim.precision), cfg.plan,
                                          bn_stats=cfg.parallel.bn_stats, micro_batches=cfg.parallel.micro_batches,
                                          loss_fn=loss_fn, **extra), cfg)
        return loaded, spec, engine, resumed
    mat = Materializer(build, record, cfg.seed, torch.device(device))
    # fp64: the meta model's dtypes first; the pieces are then made in float64 and get the build's
    # values converted (the materializer, --init-from and resume copy_ into them)
    engine = _recomputing(make_engine(to_precision(meta.module, cfg.optim.precision), cfg.plan,
                                      bn_stats=cfg.parallel.bn_stats, micro_batches=cfg.parallel.micro_batches,
                                      materialize=mat, loss_fn=loss_fn,
                                      mixed_precision="bf16" if cfg.optim.precision == "bf16" else "none"), cfg)
    loaded = replace(mat.last_build, module=engine.module)  # the real example inputs; weights: the engine's
    if cfg.checkpoint.init_from:
        ckpt.load_init_pieces(cfg.checkpoint.init_from, engine)
    resumed = ckpt.load_pieces(resume_from, engine) if resume_from else None
    return loaded, spec, engine, resumed


def _recomputing(engine, cfg: TrainConfig):
    """--recompute all: every block's forward recomputed in backward (hybridpar.parallel.fsdp; run_config
    refused the layouts it does not run with)."""
    if cfg.parallel.recompute != "none":
        from hybridpar.parallel.fsdp import recompute_blocks

        recompute_blocks(engine.module)
    return engine


def _import(spec: str) -> Callable:
    import importlib

    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)


def run_rank(cfg: TrainConfig, queue=None) -> TrainResult:
    """Train on this rank (torch.distributed already initialised). Returns the result on every rank
    (param bytes gathered from all ranks)."""
    # What the user's code prints in a rank (a model's forward) goes to stderr: the command's stdout
    # is its report, and with --json a parser reads it.
    with contextlib.redirect_stdout(sys.stderr):
        run = _RankRun(cfg, queue)
        feed = run.feed()  # the same global batches on every rank, read by loader workers
        for step, x, y in feed:
            if not run.step(step, x, y):
                break
        feed.close()  # stops the loader's workers when the loop ended early
        return run.finish()


class _RankRun:
    """One rank's run: the engine, optimizer and guards built from `cfg`, then one `step` per batch
    (False: the run stops, `error` and `code` say why) and `finish` (the final weights and the result)."""

    def __init__(self, cfg: TrainConfig, queue):
        from hybridpar.train import checkpoint as ckpt
        from hybridpar.train.data.loader import open_dataset
        from hybridpar.train.guard import StateGuard
        from hybridpar.train.launch import current_device
        from hybridpar.train.optim import WholeNorms, make_optimizer

        if cfg.deterministic:
            from hybridpar.train.determinism import enable_determinism

            enable_determinism(cfg.seed, dist.get_rank())
        self.cfg, self.queue = cfg, queue
        self.device = device = current_device()  # CUDA under torchrun+NCCL; batches move there step by step
        loaded, spec, engine, resumed = build_engine(cfg, device, _resume_point(cfg))
        self.engine = engine
        shape = tuple(loaded.input_shape or loaded.example_inputs[0].shape[1:])
        self.ds = open_dataset(cfg.data.source, shape, num_classes=spec.num_classes, size=cfg.data.synthetic_size,
                               seed=cfg.seed, vocab=spec.vocab, label_shape=spec.label_shape,
                               example_inputs=loaded.example_inputs)
        if hasattr(engine, "warm_up"):  # final shard shapes before the optimizer and checkpoints see them
            engine.warm_up(shape)
        if cfg.channels_last:  # after the final shard shapes, before the optimizer (the same Parameters)
            from hybridpar.train.memory_format import module_to_channels_last

            module_to_channels_last(engine.module)
        self.probe = None
        if cfg.gns:
            from hybridpar.train.grad_noise import GradNoiseProbe

            self.probe = GradNoiseProbe(engine, cfg.batch)
        self.per_epoch = len(self.ds) // cfg.batch
        self.gns_epochs: list[float | None] = []
        optim = cfg.optim
        self.norms = WholeNorms(engine) if optim.optimizer == "lars" or optim.grad_clip else None
        self.opt = make_optimizer(optim.optimizer, engine.parameters(), lr=optim.lr, momentum=optim.momentum,
                                  weight_decay=optim.weight_decay, norms=self.norms)
        self.start = ckpt.restore_training_state(resumed, engine, self.opt) if resumed else 0
        self.guard = StateGuard.for_run(engine, self.opt, device, bn_stats=cfg.parallel.bn_stats,
                                        max_loss_ratio=cfg.max_loss_ratio)
        self.callbacks = [_import(c) for c in cfg.callbacks]
        self.rank = dist.get_rank()
        self.infos: list[StepInfo] = []
        self.held: list[StepInfo] = []  # steps done whose guard verdict is not in yet (reported after it)
        self.last = total_steps(cfg, len(self.ds))
        self.error: str | None = None
        self.code = 0
        self.last_saved = self.start or None  # the newest good checkpoint: the one resumed from, then each one written
        self.tracer = _StepProfiler(cfg, device) if self.rank == 0 and cfg.metrics.profile_steps else None

    def feed(self):
        from hybridpar.train.data.loader import batches, default_workers

        cfg = self.cfg
        workers = cfg.data.workers
        if workers is None:
            workers = default_workers(self.ds, cfg.data.local_ranks or dist.get_world_size())
        return batches(self.ds, cfg.batch, start=self.start, stop=self.last, seed=cfg.seed, shuffle=cfg.data.shuffle,
                       workers=workers, device=self.device)

    def _stop(self, step: int, what: str, loss: float) -> bool:
        earlier = self.guard.settle()  # a verdict still in flight may name an earlier step: that one stops it
        if earlier and earlier[0] < step:
            step, what, loss = earlier
        self.held = [i for i in self.held if i.step < step]  # a bad step's report is dropped
        self._release()
        self.error, self.code = _stop_message(self.cfg, step, what, loss, self.last_saved), NONFINITE_EXIT
        return False

    def step(self, step: int, x, y) -> bool:
        """One training step; False when the run stops here."""
        from hybridpar.host_allocator import give_back_free_memory
        from hybridpar.train import faults
        from hybridpar.train.metrics import reset_peak_memory
        from hybridpar.train.optim import autocast, cast_inputs, clip_grad_norm, lr_at, set_lr

        cfg, engine, device = self.cfg, self.engine, self.device
        faults.maybe_inject_failure(step)
        faults.maybe_pause(step)
        if self.tracer is not None:
            self.tracer.before(step)
        x = cast_inputs(x, cfg.optim.precision)
        if cfg.channels_last:
            from hybridpar.train.memory_format import inputs_to_channels_last

            x = inputs_to_channels_last(x)
        x_loc, y_loc = engine.local_batch(x, y)
        lr = lr_at(step, cfg.optim.lr, cfg.optim.lr_schedule, cfg.optim.warmup_steps, self.last)
        set_lr(self.opt, lr)
        t0 = time.perf_counter()
        with faults.peer_loss_at(step), autocast(cfg.optim.precision, device):
            loss = engine.train_step(x_loc, y_loc)
        bad = self.guard.loss_exploded(loss)
        if bad:
            return self._stop(step, bad, loss)
        # the loss and this rank's gradients, judged with the state after the update: one verdict per step
        pending = self.guard.before_update(loss)
        b_noise = self.probe.after_step() if self.probe is not None else None  # synced grads, before the update
        gnorm = clip_grad_norm(engine.parameters(), cfg.optim.grad_clip, self.norms) if cfg.optim.grad_clip else None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # + weights, buffers, optimizer state: never continue from NaN/Inf. Where the ranks must agree on
        # it, the verdict comes with the next step (guard.submit): nothing is kept or reported before it
        with faults.peer_loss_at(step):
            self.guard.submit(pending, step, loss)
        if self.guard.bad:
            return self._stop(*self.guard.bad)
        dt = time.perf_counter() - t0
        self.held.append(StepInfo(step, loss, dt, cfg.batch / dt if dt > 0 else 0.0,
                                  engine.comm_log.step_bytes_by_kind(), engine.comm_log.step_seconds_by_kind(),
                                  b_noise, lr, _peak_memory(device) if self.rank == 0 else None, gnorm))
        if step == self.start:
            # what start-up and the first step freed goes back to the OS (a heap that keeps freed memory
            # would hold it all run: hybridpar.host_allocator); from now on the steady state's peak
            give_back_free_memory()
            reset_peak_memory(device)
        if self.tracer is not None:
            self.tracer.after(step)
        # a callback sees the state of the step it is told of: with callbacks every step is settled
        if self._due(step) or step + 1 == self.last or self.callbacks:
            return self._settled(step) and self._checkpoint(step)
        self._release()
        return True

    def _due(self, step: int) -> bool:
        ck = self.cfg.checkpoint
        return bool(ck.dir and ((ck.every and (step + 1) % ck.every == 0) or step + 1 == self.last))

    def _settled(self, step: int) -> bool:
        """Every step's verdict in and reported; False (the run stops) when one was bad."""
        from hybridpar.train import faults

        with faults.peer_loss_at(step):
            bad = self.guard.settle()
        if bad:
            return self._stop(*bad)
        self._release()
        return True

    def _release(self) -> None:
        """Report the held steps whose verdict is in (callbacks, progress, the noise scale: only what
        is good)."""
        while self.held and self.held[0].step <= self.guard.judged:
            info = self.held.pop(0)
            if self.probe is not None and ((info.step + 1) % self.per_epoch == 0 or info.step + 1 == self.last):
                self.gns_epochs.append(info.gns_b_noise)  # a partial last epoch reports where it stopped
            self._report(info)

    def _checkpoint(self, step: int) -> bool:
        """A checkpoint after `step` when one is due; False when writing it failed (on every rank)."""
        from hybridpar.train import checkpoint as ckpt

        ck = self.cfg.checkpoint
        if not self._due(step):
            return True
        try:
            ckpt.save_checkpoint(ck.dir, step + 1, self.engine, self.opt, meta=checkpoint_meta(self.cfg),
                                 keep=ck.keep, overwrite=ck.overwrite)
            self.last_saved = step + 1
        except ckpt.CheckpointWriteError as err:  # every rank raises it together: stop cleanly
            self.error, self.code = str(err), 1
            return False
        return True

    def _report(self, info: StepInfo) -> None:
        self.infos.append(info)
        if self.rank == 0:
            if self.queue is not None:
                self.queue.put(info.to_dict())
            for cb in self.callbacks:
                cb(info, self.engine, self.opt)

    def finish(self) -> TrainResult:
        """After the last step: the profiler's trace, the queue drained, the final weights (`save`) and
        the result with every rank's parameter and peak memory bytes."""
        cfg, engine, device, infos, queue = self.cfg, self.engine, self.device, self.infos, self.queue
        if self.error is None:  # the loop's last step settles; a feed that ended early may leave one in flight
            self._settled(self.held[-1].step if self.held else self.last - 1)
        if self.tracer is not None:
            self.tracer.close()  # a run that stopped inside the window still writes what it traced
        if self.rank == 0 and hasattr(queue, "join_thread"):  # a multiprocessing queue (spawn): every StepInfo
            queue.close()                                       # reaches the parent before this rank exits
            queue.join_thread()
        saved = None
        if self.error is None and cfg.checkpoint.save:
            if not _all_finite(engine.parameters(), device):
                self._stop(self.last - 1, "weights", infos[-1].loss if infos else math.nan)
            else:
                state = engine.full_state_dict()
                if self.rank == 0 and state is not None:
                    _save_weights(state, cfg.checkpoint.save)
                saved = cfg.checkpoint.save
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (engine.param_bytes(), engine.param_bytes_by_type(), _peak_memory(device)))
        note = self.probe.reason if self.probe is not None else None
        if self.probe is not None:
            self.probe.close()
        return TrainResult(infos, [p[0] for p in per_rank], [p[1] for p in per_rank],
                           infos[-1].loss if infos else float("nan"), saved, dist.get_world_size(),
                           self.gns_epochs, note, self.start, self.error, self.code, [p[2] for p in per_rank])


def _peak_memory(device) -> int:
    from hybridpar.train.metrics import peak_memory_bytes

    return peak_memory_bytes(device)


def profile_trace_path(cfg: TrainConfig) -> str | None:
    """The chrome trace `profile_steps` writes (None without profile_steps)."""
    if not cfg.metrics.profile_steps:
        return None
    a, b = cfg.metrics.profile_steps
    return os.path.join(cfg.metrics.profile_dir or "hybridpar-profile", f"trace-rank0-steps-{a}-{b}.json")


class _StepProfiler:
    """`profile_steps` (A, B) on rank 0: torch.profiler records steps A..B-1 (CPU, and CUDA on a GPU)
    and writes one chrome trace, profile_dir/trace-rank0-steps-A-B.json, when step B-1 ends (or the
    loop stops earlier)."""

    def __init__(self, cfg: TrainConfig, device):
        self.first, self.stop = cfg.metrics.profile_steps
        self.path = profile_trace_path(cfg)
        self.device, self.prof, self.step_ctx = device, None, None

    def before(self, step: int) -> None:
        if self.prof is None and self.first <= step < self.stop:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if getattr(self.device, "type", "cpu") == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=acts, record_shapes=True)
            self.prof.__enter__()
        if self.prof is not None:
            self.step_ctx = torch.profiler.record_function(f"hybridpar step {step}")
            self.step_ctx.__enter__()

    def after(self, step: int) -> None:
        if self.step_ctx is not None:
            self.step_ctx.__exit__(None, None, None)
            self.step_ctx = None
        if self.prof is not None and step + 1 >= self.stop:
            self.close()

    def close(self) -> None:
        if self.step_ctx is not None:
            self.step_ctx.__exit__(None, None, None)
            self.step_ctx = None
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        prof.export_chrome_trace(self.path)


def _resume_point(cfg: TrainConfig):
    """The checkpoint this run continues from: the one run_config chose, or (Python API callers that
    set only `resume`) this run's newest complete one."""
    from hybridpar.train import checkpoint as ckpt

    if cfg.checkpoint.resume_from:
        return ckpt.checkpoint_info(cfg.checkpoint.resume_from)
    if cfg.checkpoint.resume != "no" and cfg.checkpoint.dir:
        return ckpt.latest_checkpoint(cfg.checkpoint.dir, owner=checkpoint_meta(cfg).get("run_id"))
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _agree_any(flags: list[float], device) -> list[float]:
    """Each flag summed over every rank (one small allreduce; one all-to-all round on gloo)."""
    from hybridpar.parallel.comm.collectives import all_reduce_
    from hybridpar.parallel.comm.log import CommLog
    from hybridpar.parallel.mesh import Group

    t = torch.tensor(flags, dtype=torch.float64, device=device)
    world = Group(tuple(range(dist.get_world_size())), dist.group.WORLD, dist.get_rank())
    all_reduce_(t, world, CommLog(), "finite")  # not the step's traffic: the check of `hybridpar train`
    return t.tolist()


def _all_finite(params, device) -> bool:
    ok = _finite_here([_local(p.detach()) for p in params])
    return _agree_any([0.0 if ok else 1.0], device)[0] == 0


def _stop_message(cfg: TrainConfig, step: int, what: str, loss: float, last_saved: int | None) -> str:
    where = {"loss": f"the loss is {loss}", "gradients": f"the gradients are not finite (loss {loss:.4g})",
             "weights": "the weights are not finite"}.get(what, what)
    if what.startswith("state:"):  # hybridpar.train.guard: a tensor after the update
        where = f"{what.removeprefix('state:')} is not finite after the update (loss {loss:.4g})"
    keep = "nothing was saved"
    if cfg.checkpoint.dir:
        keep += (f"; the last good checkpoint, step {last_saved}, is intact in {cfg.checkpoint.dir}"
                 if last_saved else f"; no checkpoint was written to {cfg.checkpoint.dir}")
    return f"step {step}: {where}; training stopped ({keep}); lower lr or check the data"


def checkpoint_meta(cfg: TrainConfig) -> dict:
    """What a resume checks: data order is a function of (seed, step, batch, data); the run's identity
    (run_config.run_identity) and its digest decide whose checkpoints a directory holds."""
    from hybridpar.train.checkpoint import run_id

    meta = {"model": cfg.model, "seed": cfg.seed, "batch": cfg.batch, "data": cfg.data.source,
            "shuffle": cfg.data.shuffle, "plan": cfg.plan.model_dump(mode="json")}
    if cfg.identity:
        meta.update(identity=cfg.identity, run_id=run_id(cfg.identity))
    return meta


def _save_weights(state: dict, path: str) -> None:
    """`--save`: the undistributed state_dict, written atomically with the umask's mode."""
    from hybridpar.files import atomic_write

    atomic_write(path, lambda f: torch.save(state, f))


class TrainingFailed(RuntimeError):
    """A rank died or raised; the message is one line (the rank's last words)."""


def train(cfg: TrainConfig, on_step: Callable[[dict], None] | None = None) -> TrainResult | None:
    """Run `cfg` on its ranks: spawned local gloo processes, or, under a launcher (torchrun), this
    process as one rank of the launcher's world. `on_step(step_info_dict)` is called on rank 0 (here)
    after every step. Returns rank 0's TrainResult (each rank's own in a launched world: they agree
    on `error`); TrainingFailed when a spawned rank dies or raises."""
    from hybridpar.train import launch

    sinks = cfg.metrics.jsonl or cfg.metrics.tensorboard
    if sinks and (not launch.under_launcher() or os.environ.get("RANK") == "0"):
        on_step = _with_metrics(cfg, on_step)
    try:
        return _train(cfg, on_step)
    finally:
        if on_step is not None and hasattr(on_step, "close"):
            on_step.close()


def _with_metrics(cfg: TrainConfig, on_step):
    """on_step that also streams the `--metrics` record of every step (to the JSON-lines file and/or
    as TensorBoard scalars)."""
    from hybridpar.train.metrics import MetricsFile, StepMetrics, TensorBoardLog

    sinks = ([MetricsFile(cfg.metrics.jsonl)] if cfg.metrics.jsonl else []) + \
        ([TensorBoardLog(cfg.metrics.tensorboard)] if cfg.metrics.tensorboard else [])
    metrics = StepMetrics(cfg.metrics.flops_per_step, cfg.metrics.peak_flops, cfg.plan.world_size)

    class _Both:
        def __call__(self, info: dict) -> None:
            record = metrics.record(info)
            for sink in sinks:
                sink.write(record)
            if on_step is not None:
                on_step(info)

        def close(self) -> None:
            for sink in sinks:
                sink.close()

    return _Both()


def _train(cfg: TrainConfig, on_step):
    from hybridpar.train import launch

    if launch.under_launcher():
        launch.init()
        rank = dist.get_rank()

        class _Forward:
            def put(self, info):
                on_step(info)

        result = run_rank(cfg, _Forward() if rank == 0 and on_step is not None else None)
        dist.destroy_process_group()
        return result

    from torch.multiprocessing.spawn import ProcessException

    queue = launch.context().Queue()

    def poll():
        while not queue.empty():
            info = queue.get()
            if on_step is not None:
                on_step(info)

    try:
        return launch.spawn(run_rank, cfg.plan.world_size, cfg, queue, poll=poll)
    except ProcessException as err:  # a rank died or raised: one line, no hang
        lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
        refused = "hybridpar.errors.UserError: "
        if lines and lines[-1].startswith(refused):  # a check inside the ranks refused the input: exit 2
            from hybridpar.errors import UserError

            raise UserError(lines[-1][len(refused):]) from None
        hint = f" (continue with resume from {cfg.checkpoint.dir})" if cfg.checkpoint.dir else ""
        raise TrainingFailed(f"training failed: {lines[-1] if lines else err}{hint}") from None
