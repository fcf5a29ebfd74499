"""The per-rank training loop shared by `hybridpar train` and the Python API.

`run_rank(cfg, queue)` builds the model (seeded, or from --init-from), the engine from make_engine,
SGD, and trains; rank 0 sends one StepInfo per step on `queue` (when given) and runs the callbacks,
the hook point for checkpointing or other per-step work (the online gradient noise scale is built in:
TrainConfig.gns, hybridpar.runtime.grad_noise):
    callback(info: StepInfo, engine, optimizer) -> None
registered with `register_step_callback` (importable callables, so they survive process spawn)."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.plans import Plan


@dataclass(frozen=True)
class TrainConfig:
    model: str
    plan: Plan
    data: str = "synthetic"
    batch: int = 32
    steps: int | None = 10
    epochs: int | None = None
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    shuffle: bool = True
    init_from: str | None = None
    save: str | None = None
    input_shape: tuple[int, ...] | None = None
    bn_stats: str = "global"
    synthetic_size: int = 1024
    callbacks: tuple[str, ...] = ()  # "module:function" step callbacks, imported in every rank
    # Hardening (hybridpar.runtime.checkpoint / faults / determinism):
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end when checkpoint_dir is set)
    keep_checkpoints: int = 2
    resume: bool = False  # continue from the newest complete checkpoint in checkpoint_dir, if any
    deterministic: bool = False
    micro_batches: int = 1  # GPipe micro-batches per replica (MP plans only)
    gns: bool = False  # online gradient noise scale (hybridpar.runtime.grad_noise), one tiny allreduce/step


@dataclass(frozen=True)
class StepInfo:
    step: int
    loss: float
    step_time_s: float
    samples_per_s: float
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_s: dict[str, float] = field(default_factory=dict)  # rank 0's wall time in collectives, per kind
    gns_b_noise: float | None = None  # smoothed B_noise after this step (None: off, n/a or not yet)

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


def total_steps(cfg: TrainConfig, n_samples: int) -> int:
    if cfg.epochs is not None:
        return cfg.epochs * (n_samples // cfg.batch)
    return int(cfg.steps or 0)


def build_module(cfg: TrainConfig):
    """The undistributed model, same on every rank: seeded init, then --init-from if given."""
    from hybridpar.graph.models import load_model

    torch.manual_seed(cfg.seed)
    loaded = load_model(cfg.model, batch=1, input_shape=cfg.input_shape)
    if cfg.init_from:
        state = torch.load(cfg.init_from, map_location="cpu", weights_only=True)
        loaded.module.load_state_dict(state)
    return loaded


def _import(spec: str) -> Callable:
    import importlib

    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)


def run_rank(cfg: TrainConfig, queue=None) -> TrainResult:
    """Train on this rank (torch.distributed already initialised). Returns the result on every rank
    (param bytes gathered from all ranks)."""
    from hybridpar.runtime import checkpoint as ckpt
    from hybridpar.runtime import faults
    from hybridpar.runtime.data import batch_indices, data_spec, load_dataset
    from hybridpar.runtime.engine import make_engine
    from hybridpar.runtime.launch import current_device

    if cfg.deterministic:
        from hybridpar.runtime.determinism import enable_determinism

        enable_determinism(cfg.seed, dist.get_rank())
    loaded = build_module(cfg)
    info = ckpt.latest_checkpoint(cfg.checkpoint_dir) if cfg.resume and cfg.checkpoint_dir else None
    resumed = ckpt.load_checkpoint(info, loaded.module) if info else None  # weights, before sharding
    shape = tuple(loaded.input_shape or loaded.example_inputs[0].shape[1:])
    spec = data_spec(loaded)
    ds = load_dataset(cfg.data, shape, num_classes=spec.num_classes, size=cfg.synthetic_size, seed=cfg.seed,
                      vocab=spec.vocab, label_shape=spec.label_shape)
    device = current_device()  # CUDA under torchrun+NCCL; batches move there step by step
    engine = make_engine(loaded.module.to(device), cfg.plan, bn_stats=cfg.bn_stats,
                         micro_batches=cfg.micro_batches)
    if hasattr(engine, "warm_up"):  # final shard shapes before the optimizer and checkpoints see them
        engine.warm_up(shape)
    probe = None
    if cfg.gns:
        from hybridpar.runtime.grad_noise import GradNoiseProbe

        probe = GradNoiseProbe(engine, cfg.batch)
    per_epoch = len(ds) // cfg.batch
    gns_epochs: list[float | None] = []
    opt = torch.optim.SGD(engine.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    start = ckpt.restore_training_state(resumed, engine, opt) if resumed else 0
    callbacks = [_import(c) for c in cfg.callbacks]
    rank = dist.get_rank()
    infos: list[StepInfo] = []
    last = total_steps(cfg, len(ds))
    for step in range(start, last):
        faults.maybe_inject_failure(step)
        idx = batch_indices(len(ds), cfg.batch, step, shuffle=cfg.shuffle, seed=cfg.seed)
        x_loc, y_loc = engine.local_batch(ds.x[idx].to(device), ds.y[idx].to(device))
        t0 = time.perf_counter()
        try:
            loss = engine.train_step(x_loc, y_loc)
        except RuntimeError as err:  # a dead or unreachable peer: say so, never hang (timeouts in launch)
            raise (faults.peer_loss_error(err, step) if faults.is_peer_loss(err) else err) from err
        b_noise = probe.after_step() if probe is not None else None  # synced grads, before the update
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if probe is not None and ((step + 1) % per_epoch == 0 or step + 1 == last):
            gns_epochs.append(b_noise)  # a partial last epoch reports where it stopped
        if cfg.checkpoint_dir and ((cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)
                                   or step + 1 == last):
            ckpt.save_checkpoint(cfg.checkpoint_dir, step + 1, engine, opt, meta=checkpoint_meta(cfg),
                                 keep=cfg.keep_checkpoints)
        info = StepInfo(step, loss, dt, cfg.batch / dt if dt > 0 else 0.0, engine.comm_log.step_bytes_by_kind(),
                        engine.comm_log.step_seconds_by_kind(), b_noise)
        infos.append(info)
        if rank == 0:
            if queue is not None:
                queue.put(info.to_dict())
            for cb in callbacks:
                cb(info, engine, opt)
    if rank == 0 and hasattr(queue, "join_thread"):  # a multiprocessing queue (spawn): every StepInfo
        queue.close()                                  # reaches the parent before this rank exits
        queue.join_thread()
    state = engine.full_state_dict()
    if rank == 0 and cfg.save and state is not None:
        _atomic_save(state, cfg.save)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (engine.param_bytes(), engine.param_bytes_by_type()))
    note = probe.reason if probe is not None else None
    if probe is not None:
        probe.close()
    return TrainResult(infos, [p[0] for p in per_rank], [p[1] for p in per_rank],
                       infos[-1].loss if infos else float("nan"), cfg.save, dist.get_world_size(),
                       gns_epochs, note)


def checkpoint_meta(cfg: TrainConfig) -> dict:
    """What a resume checks: data order is a function of (seed, step, batch, data)."""
    return {"model": cfg.model, "seed": cfg.seed, "batch": cfg.batch, "data": cfg.data, "shuffle": cfg.shuffle,
            "plan": cfg.plan.model_dump(mode="json")}


def _atomic_save(obj, path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
