"""The training engine contract (`Engine`), the channel/filter/sample engine and the model-parallel one.
Both build the module with `hybridpar.parallel.api.parallelize` and train it with the run's loss
(`loss_fn`, hybridpar.train.loss), as a user's own loop would; `make_engine(module, plan)` picks one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.errors import UserError
from hybridpar.parallel.api import parallelize
from hybridpar.parallel.comm.collectives import all_reduce_
from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.state import gather_full_state
from hybridpar.plans import LayerLayout, Plan


@runtime_checkable
class Engine(Protocol):
    """What `hybridpar train`'s loop drives (ChannelFilterEngine, MPModuleEngine)."""

    comm_log: CommLog

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def local_batch(self, x, y) -> tuple: ...

    def warm_up(self, sample_shape: tuple[int, ...]) -> None: ...

    def train_step(self, x, y) -> float: ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None: ...

    def param_bytes(self) -> int: ...

    def param_bytes_by_type(self) -> dict[str, int]: ...


def task_loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """`hybridpar train`'s loss: cross-entropy (mean over the batch, or its sum); sequence outputs
    [N, T, V] against [N, T] flattened."""
    if out.dim() > 2 and y.dim() == out.dim() - 1:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return F.cross_entropy(out, y, reduction=reduction)


def task_loss_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """task_loss summed over the samples (MPEngine's loss_fn contract: it divides by the global batch's
    target count, so micro-batches and replicas add up to the global mean)."""
    return task_loss(out, y, reduction="sum")


class ChannelFilterEngine:
    """`hybridpar train`'s loop body over the public API (hybridpar.parallel.api) in its
    cheaper input form, as DDP runs: each sample group takes its own samples (`local_batch`), computes
    the mean loss of its samples, and the gradients are averaged over sample groups during backward, so
    no rank gathers the whole batch's outputs; the reported loss is the global batch's mean."""

    pre_sync_scale = 1.0  # a rank's gradient before the sync is its sample group's mean (grad_noise)

    def __init__(self, module: nn.Module, plan: Plan | LayerLayout | str, *, bn_stats: str = "global",
                 comm_log: CommLog | None = None, grid=None, extra_ops=(), materialize=None, loss_fn=task_loss,
                 mixed_precision: str = "none"):
        self.loss_fn = loss_fn  # the mean over this sample group's samples (hybridpar.train.loss)
        self.module = parallelize(module, plan, bn_stats=bn_stats, comm_log=comm_log, grid=grid,
                                  extra_ops=extra_ops, inputs="sample_shard", materialize=materialize,
                                  mixed_precision=mixed_precision)  # zero=2|3 under bf16: FSDP2's policy
        self.state = module.hybridpar
        self.grid = self.state.grid
        self.comm_log: CommLog = self.grid.comm_log
        self._dtensor_records: list[dict] | None = None
        # rider(): a few float flags of this rank's, sent with the step's loss (no collective of their
        # own: hybridpar.train.guard's verdict on this rank's batch-norm buffers); rider_values: their
        # mean over the sample groups after train_step
        self.rider = None
        self.rider_values: list[float] | None = None

    def parameters(self):
        return self.module.parameters()

    @property
    def grads_agree(self) -> bool:
        """Whether every rank ends a step with the same loss and, for every gradient, the sum over all
        ranks (sample-only layouts), so a NaN or Inf anywhere shows on every rank and the train loop's
        finiteness check needs no collective of its own."""
        import torch.distributed as dist

        return (self.state.meshes is None and not self.state.param_grid and not getattr(self.state, "sharded", 0)
                and self.grid.replica_group.size == dist.get_world_size())  # FSDP: each rank its own shard

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (its shards; replicated DTensors count their local copy)."""
        return sum(_local(p).numel() * p.element_size() for p in self.module.parameters())

    def param_bytes_by_type(self) -> dict[str, int]:
        """This rank's parameter bytes per layer type (conv, linear, norm, other)."""
        from hybridpar.parallel.styles.conv import DistConv2d, DistLinear
        from hybridpar.parallel.styles.norm import DistBatchNorm

        kinds = ((nn.Conv2d, DistConv2d), "conv"), ((nn.Linear, DistLinear), "linear"), \
            ((nn.modules.batchnorm._BatchNorm, DistBatchNorm), "norm")
        out: dict[str, int] = {}
        for m in self.module.modules():
            kind = next((k for types, k in kinds if isinstance(m, types)), "other")
            b = sum(_local(p).numel() * p.element_size() for p in m.parameters(recurse=False))
            if b:
                out[kind] = out.get(kind, 0) + b
        return out

    def local_batch(self, x, y) -> tuple:
        """This rank's sample group's rows of the global batch (x may be a tuple or dict of inputs)."""
        from hybridpar.parallel.sample_io import split_samples

        return split_samples(x, self.grid), split_samples(y, self.grid)

    def warm_up(self, sample_shape: tuple[int, ...]) -> None:
        """Nothing to exchange any more: global shapes are known to every rank."""

    def forward(self, x) -> torch.Tensor:
        """x: a tensor, a tuple of inputs, or a dict of keyword inputs (multi-input models)."""
        if isinstance(x, dict):
            return self.module(**x)
        if isinstance(x, (tuple, list)):
            return self.module(*x)
        return self.module(x)

    def train_step(self, x, y) -> float:
        """Forward, cross-entropy (mean over this sample group's samples), backward (gradients averaged
        over sample groups: the global batch's mean). Returns the global-batch mean loss (every rank)."""
        self.comm_log.mark_step()
        self.module.train()
        gs, replicas = self.state.grad_sync, self.grid.replica_group
        # this sample group's mean loss, averaged over the groups for reporting: sent with the
        # gradients when a bucket goes over the same ranks (GradSync.carry), else on its own below
        value = None
        if self.state.meshes is None or self._dtensor_records is not None:
            loss = self.loss_fn(self.forward(x), y)
            value = self._with_rider(loss.detach().clone().reshape(1))
            if gs is not None and gs.enabled and replicas.size > 1:
                gs.carry(value, replicas, "loss")
            loss.backward()
            for r in self._dtensor_records or ():  # same shapes and placements each step: same collectives
                if r["group_size"] > 1:
                    self.comm_log.record(r["kind"], r["group_size"], r["bytes"], f"dtensor:{r['module']}")
        else:
            from hybridpar.parallel.dtensor.log import recording

            # DTensor's own redistributions, logged beside ours: watched on the first step only (a
            # dispatch mode on every op costs), then replayed into the log
            with recording(self.comm_log) as rec:
                loss = self.loss_fn(self.forward(x), y)
                loss.backward()
            self._dtensor_records = list(rec.records)
        if value is not None and gs is not None and gs.carried():
            return self._loss_of(value)  # summed over the replicas and divided by their number with the gradients
        value = self._with_rider(loss.detach().clone().reshape(1)) / self.grid.sample
        all_reduce_(value, replicas, self.comm_log, "loss")  # for reporting only
        return self._loss_of(value)

    def _with_rider(self, value: torch.Tensor) -> torch.Tensor:
        return value if self.rider is None else torch.cat([value, self.rider().to(value)])

    def _loss_of(self, value: torch.Tensor) -> float:
        values = value.tolist()  # one sync for the loss and the rider
        self.rider_values = values[1:] if self.rider is not None else None
        return float(values[0])

    def sync_gradients(self) -> None:
        """Gradients are synchronised during backward; kept for the engine protocol."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The undistributed model's state_dict on rank 0 (None elsewhere). Collective."""
        return gather_full_state(self.module.state_dict(), self.state.shards(), self.comm_log)


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


class MPModuleEngine:
    """`hybridpar train`'s loop body for model-parallel plans (mp > 1, with sample replicas): the module
    `hybridpar.parallelize` returns for the plan (hybridpar.parallel.pipeline.module), trained as a
    user's own loop trains it: every rank passes the global batch, gets the whole outputs, computes the
    run's loss (the same value on every rank) and calls backward, which sends the gradients back to the
    producing stages and sums the weights' gradients over the replicas. No loss belongs to the engine.
    Under the plan's schedule "1f1b" the step runs through torch.distributed.pipelining instead
    (`module.hybridpar.step`, pipeline.schedule), the run's loss given to the schedule."""

    def __init__(self, module: nn.Module, plan: Plan, *, bn_stats: str = "global", loss_fn=task_loss,
                 micro_batches: int | None = None, example_inputs: tuple | None = None):
        self.loss_fn = loss_fn
        self.module = parallelize(module, plan, bn_stats=bn_stats, example_inputs=example_inputs,
                                  micro_batches=micro_batches, schedule=plan.schedule, loss_fn=loss_fn)
        self.state = module.hybridpar  # pipeline.module.MPState
        self.mp_engine = self.state.engine  # the stages, the owned weights and the gradient sync
        self.layout = self.state.layout
        self.comm_log: CommLog = self.state.comm_log
        self.device = self.mp_engine.device
        self._local_state = self.mp_engine.local_state_dict()  # checkpoints: whole tensors of the owned layers

    def parameters(self):
        """This rank's weights (MPEngine.parameters: the module's others are freed meta tensors)."""
        return self.mp_engine.parameters()

    def local_batch(self, x, y) -> tuple:
        """The global batch itself: every rank calls the module with it (pipeline.module)."""
        from hybridpar.parallel.pipeline.engine import batch_rows

        self.mp_engine.check_batch(batch_rows(x))
        return x, y

    def warm_up(self, sample_shape: tuple[int, ...]) -> None:
        """Nothing to exchange before training."""

    def train_step(self, x, y) -> float:
        """Forward of the global batch, the run's loss of the whole outputs, backward. Returns the loss
        (every rank computed the same one)."""
        from hybridpar.parallel.pipeline.engine import as_call

        self.comm_log.mark_step()
        self.module.train()
        args, kwargs = as_call(x)
        if self.state.schedule == "1f1b":  # forwards and backwards interleaved: the schedule owns backward
            return float(self.state.step(*args, target=y, **kwargs))
        loss = self.loss_fn(self.module(*args, **kwargs), y.to(self.device) if torch.is_tensor(y) else y)
        loss.backward()
        return float(loss.detach())

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The undistributed model's state_dict on rank 0 (None elsewhere). Collective."""
        return self.state.full_state_dict(everywhere=False)

    def param_bytes(self) -> int:
        return self.mp_engine.param_bytes()

    def param_bytes_by_type(self) -> dict[str, int]:
        return self.mp_engine.param_bytes_by_type()


def make_engine(module: nn.Module, plan: Plan | LayerLayout | str, *, bn_stats: str = "global",
                micro_batches: int | None = 1, loss_fn=task_loss, **kwargs):
    """The engine for `plan`: model parallel (mp > 1; `micro_batches` > 1 pipelines each replica's
    batch GPipe-style; None: the plan's) or channel/filter/sample parallel (one micro-batch only), both training with
    `loss_fn(outputs, target)` (a batch mean). Other keyword arguments go to the chosen engine."""
    if isinstance(plan, Plan) and plan.mp > 1:
        return MPModuleEngine(module, plan, bn_stats=bn_stats, loss_fn=loss_fn, micro_batches=micro_batches,
                              **kwargs)
    if micro_batches not in (None, 1):
        raise UserError(f"micro_batches={micro_batches} needs a model-parallel plan (mp > 1)")
    return ChannelFilterEngine(module, plan, bn_stats=bn_stats, loss_fn=loss_fn, **kwargs)
