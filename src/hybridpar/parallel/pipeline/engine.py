"""MPEngine: model-parallel and hybrid DP x MP training of one Plan on torch.distributed.

Implements the runtime Engine contract (docs/INTERFACES.md): local_batch, train_step,
parameters, full_state_dict, comm_log.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map_only

from hybridpar.errors import UserError
from hybridpar.graph.models import rebatch
from hybridpar.graph.runnable import is_exported
from hybridpar.parallel.comm.grad_sync import BUCKET_BYTES, GradSync
from hybridpar.parallel.comm.log import CommLog
from hybridpar.parallel.finite import finite_here
from hybridpar.parallel.pipeline.executor import crossings, message_count, meta_copy, meta_values, run_forward
from hybridpar.parallel.pipeline.layout import HybridLayout, direction_groups, dp_group
from hybridpar.parallel.pipeline.norm import has_batch_norm, sync_batch_norms, unreachable_batch_norms
from hybridpar.parallel.pipeline.p2p import Link
from hybridpar.parallel.pipeline.partition import Partition, partition_module
from hybridpar.parallel.pipeline.placement import resolve_placement
from hybridpar.parallel.state import ShardInfo, gather_full_state
from hybridpar.plans import Plan


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MPEngine:
    """Runs `plan` (mp devices per replica, dp replicas) on the initialised default process group.

    The engine takes over `module`: weights placed on other devices are moved to the meta device
    (freed), so each rank holds only its own share. `micro_batches` > 1 splits each replica's
    batch GPipe-style: all forwards, then all backwards, one gradient sync per step (equal to
    serial training for models without batch statistics). `ordered_p2p` (default: unless the
    backend is gloo) issues every pair's sends and receives in one global order, without
    pre-posted receives, as NCCL needs; gloo gets non-blocking, pre-posted, lazy receives.
    bn_stats="global" (default) computes batch-norm statistics over the global batch (all replicas),
    "local" over each replica's samples. overlap_grad_sync: allreduce gradient buckets across
    replicas during backward (else after it), in buckets of about grad_bucket_bytes
    (hybridpar.parallel.comm.grad_sync.GradSync, the package's one gradient sync and bucket rule).
    example_inputs: one forward's inputs (a micro-batch of a replica: `micro_batch_inputs`), for a
    model torch.fx cannot trace, which then runs on torch.export's graph at their shapes.
    loss_fn(outputs, targets): the caller's loss of one micro-batch, summed over its samples (the engine
    divides by the global batch's target count); `outputs` is the model's output (its first tensor
    when it returns a tuple or dict); the engine owns no loss (benchmarks/bench_mp.py gives its own).
    Inputs (`local_batch`, `train_step`): a tensor, a tuple of the model's positional inputs, or a
    dict of its keyword inputs; every tensor with the batch's leading size is split by samples.
    The user's own loop, and `hybridpar train`, run on the same engine's set-up through
    hybridpar.parallelize (pipeline.module), not through train_step."""

    def __init__(self, module: nn.Module, plan: Plan, *, micro_batches: int = 1,
                 device: torch.device | None = None, ordered_p2p: bool | None = None,
                 bn_stats: str = "global", overlap_grad_sync: bool = True,
                 grad_bucket_bytes: int = BUCKET_BYTES, example_inputs: tuple | None = None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None):
        if not dist.is_initialized():
            raise RuntimeError("MPEngine needs torch.distributed initialised (launch.init())")
        if dist.get_world_size() != plan.world_size:
            raise UserError(f"plan needs {plan.world_size} ranks (dp={plan.dp} x mp={plan.mp}), "
                            f"running on {dist.get_world_size()}")
        _check_layouts(plan)
        if bn_stats not in ("global", "local"):
            raise UserError(f"bn_stats must be 'global' or 'local', got {bn_stats!r}")
        if micro_batches < 1:
            raise UserError(f"micro_batches must be >= 1, got {micro_batches}")
        self.plan = plan
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.layout = HybridLayout(plan.dp, plan.mp, dist.get_rank())
        self.device = device or _default_device()
        self.comm_log = CommLog()
        self.step_grads_finite: bool | None = None  # every rank's gradients finite, agreed in the last step
        ordered = dist.get_backend() != "gloo" if ordered_p2p is None else ordered_p2p
        module.train()  # trace the training graph (a forward may branch on self.training)
        self.signature = _signature(module)
        # the loss in the weights' precision (the same on every rank: the whole module decides): an fp64
        # run reports, and is checked on, float64 losses
        wide = any(p.dtype == torch.float64 for p in module.parameters())
        self._loss_dtype = torch.float64 if wide else torch.float32
        self.placement = resolve_placement(plan, module)
        # recurrent layers as the time-chunk wavefront (pipeline.wavefront): the plan's (the placer's)
        self.time_chunks = check_time_chunks(plan.time_chunks or 1)
        self.partition: Partition = partition_module(
            module, self.placement, plan.mp, lazy_recv=not ordered, time_chunks=self.time_chunks,
            example_inputs=None if example_inputs is None else _like_weights(tuple(example_inputs), module))
        self.exported = is_exported(self.partition.gm)
        if self.exported:
            _check_exported(module, plan, bn_stats)
        # an exported graph reads its lifted constants from itself: copy it, not the module
        self._meta = meta_copy(self.partition.gm if self.exported else module).train()
        self._kinds_root = module if self.exported else self.partition.gm
        self._group = dp_group(self.layout)
        # same decision on every rank (it gates a check in local_batch)
        self._sync_bn = self._group is not None and bn_stats == "global" and has_batch_norm(module)
        if self._group is not None and bn_stats == "global":
            _refuse_unreachable_norms(self.partition.gm, plan)
        if self._sync_bn and self._group is not None:
            sync_batch_norms(module, self.partition, self.layout, self._group, self.comm_log)
        full = module.state_dict(keep_vars=True)
        owner = self.partition.owner_of_key
        self._schema = {k: (owner[k], t.shape, t.dtype) for k, t in full.items()}
        self._local_state = {k: t for k, t in full.items() if owner[k] == self.layout.device}
        self._take_over(module)
        self._params = [p for k, p in module.named_parameters() if owner[k] == self.layout.device]
        self._placeholder = nn.Parameter(torch.empty(0, device=self.device))
        group = self._group
        self._grad_sync = None if group is None else GradSync(
            self._params, lambda _p: group, {}, self.comm_log, overlap=overlap_grad_sync,
            bucket_bytes=grad_bucket_bytes)
        lay = self.layout
        # gloo's pre-posted path: one group per direction (Link says why); NCCL's ordered path keeps
        # the default group (each communicator costs device memory and its kernels have no such lock)
        self.link = Link(rank_of_device=lambda d: lay.rank_of(lay.replica, d), log=self.comm_log,
                         prepost=not ordered, device=lay.device,
                         directions=None if ordered else direction_groups(lay))
        self._cross_cache: dict[tuple, tuple[dict, int, dict[str, object]]] = {}
        self._global_count: int | None = None

    # -- set-up -----------------------------------------------------------------------------
    def _take_over(self, module: nn.Module) -> None:
        """Free the weights other devices own; move ours to this rank's device."""
        owned = {id(t) for t in self._local_state.values()}
        for mod in module.modules():
            stores: tuple[dict[str, Any], ...] = (mod._parameters, mod._buffers)
            for store in stores:
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) in owned:
                        t.data = t.data.to(self.device)
                    elif t.device.type != "meta":
                        store[name] = (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                                       if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
        # The graph's get_attr targets are its own references (copied from `module` when traced):
        # point them at what `module` holds now, or the freed weights would stay alive through them.
        gm = self.partition.gm
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                prefix, _, field = str(node.target).rpartition(".")
                try:
                    now = module.get_submodule(prefix) if prefix else module
                    value = getattr(now, field)
                    holder = gm.get_submodule(prefix) if prefix else gm
                except AttributeError:
                    continue  # a constant torch.export lifted: the graph's own
                if isinstance(value, torch.Tensor) and getattr(holder, field, None) is not value:
                    if field in holder._parameters or field in holder._buffers:
                        table: dict[str, Any] = holder._parameters if field in holder._parameters else holder._buffers
                        table[field] = value
                    else:
                        setattr(holder, field, value)

    def _crossings(self, inputs: tuple) -> tuple[dict, int]:
        cross, n, _outs = self._shapes(inputs)
        return cross, n

    def _shapes(self, inputs: tuple) -> tuple[dict, int, dict[str, object]]:
        """(crossings, their message count, every output node's value on meta) for inputs shaped so."""
        key = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in inputs)
        if key not in self._cross_cache:
            values = meta_values(self.partition, self._meta, inputs)
            cross = crossings(self.partition, values)
            outs = {n: values[n] for n in self.partition.output_nodes if n in values}
            self._cross_cache[key] = (cross, message_count(cross), outs)
        return self._cross_cache[key]

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """The graph's inputs (one per placeholder, in order) for `model(*args, **kwargs)`."""
        return bind_inputs(self.partition.gm, self.signature, args, kwargs)

    # -- the Engine contract -----------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this rank owns (its device's share of the model). A device the placement
        left without weights yields one empty placeholder (never given a gradient, so optimizers
        skip it), because torch.optim rejects an empty parameter list."""
        return iter(self._params or [self._placeholder])

    def local_batch(self, x_global, y_global: torch.Tensor):
        """This replica's contiguous slice of the global batch (every device of a replica gets it).
        x_global: a tensor, a tuple or a dict of inputs (every tensor with the batch's leading size is split)."""
        n = batch_rows(x_global)
        self.check_batch(n)
        self._global_count = y_global.numel()
        k = self.layout.replica
        return split_rows(x_global, n, self.layout.dp)[k], torch.tensor_split(y_global, self.layout.dp)[k]

    def check_batch(self, n: int) -> None:
        """UserError (the same on every rank) for a global batch of `n` samples this plan cannot split."""
        if n < self.layout.dp:
            raise UserError(f"global batch {n} smaller than dp={self.layout.dp}")
        if self._sync_bn and n % self.layout.dp:
            raise UserError(f"global batch {n} must divide evenly over dp={self.layout.dp} "
                            "replicas for global batch-norm statistics")

    def train_step(self, x, y: torch.Tensor) -> float:
        """Forward, loss (`loss_fn`, summed / global target count), backward, gradient allreduce across
        replicas. Returns the global-batch mean loss on every rank. x: a tensor, tuple or dict of inputs."""
        self.comm_log.mark_step()
        # nn.Module's own train(): torch.export's module refuses train(); its graph is the training one
        nn.Module.train(self.partition.gm)
        count = self._global_count or y.numel() * self.layout.dp
        n = batch_rows(x)
        mbs = min(self.micro_batches, n)
        xs, ys = split_rows(x, n, mbs), torch.tensor_split(y, mbs)
        loss_local = torch.zeros((), device=self.device, dtype=self._loss_dtype)
        roots = []
        msg_base = 0
        for xm, ym in zip(xs, ys):
            inputs = self.bind(*as_call(xm))
            cross, n_msgs = self._crossings(inputs)
            out, token = run_forward(self.partition, self.layout.device, self.link, inputs, cross,
                                     msg_base, self.device)
            msg_base += n_msgs
            if self.loss_fn is None:
                raise UserError("MPEngine.train_step needs the caller's loss_fn")
            loss = self.loss_fn(out, ym.to(self.device)) / count if out is not None else None
            if loss is not None:
                loss_local += loss.detach()
            roots.append((loss, token))
        for i, (loss, token) in reversed(list(enumerate(roots))):  # GPipe order: last micro-batch first
            # only the first micro-batch's backward (the last to run) leaves the final gradients: the
            # gradient sync runs in it, its buckets overlapping that backward, done when it returns
            sync = self._grad_sync
            quiet = sync.no_sync() if sync is not None and i > 0 else nullcontext()
            tensors = [token] if loss is None else [loss, token]
            with quiet:
                torch.autograd.backward(tensors, [torch.zeros_like(token) if t is token else None for t in tensors])
        self.link.wait_all()
        # only each replica's loss device contributes; this rank's gradients' finiteness goes with it,
        # so the train loop's check needs no collective of its own (step_grads_finite)
        bad = 0.0 if finite_here([p.grad for p in self._params if p.grad is not None]) else 1.0
        both = torch.stack([loss_local, loss_local.new_tensor(bad)])
        dist.all_reduce(both)
        self.comm_log.record("allreduce", dist.get_world_size(), loss_local.element_size(), "loss")
        self.step_grads_finite = bool(both[1] == 0)
        return float(both[0])

    def warm_up(self, sample_shape: tuple[int, ...]) -> None:
        """Nothing to exchange before training (the Engine protocol's hook)."""

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """The state this rank owns, keyed by the undistributed state_dict's names (whole tensors:
        MP never splits a weight), e.g. for sharded checkpoints."""
        return dict(self._local_state)

    def full_state_dict(self):
        """The undistributed model's state_dict (on CPU) on rank 0; None on other ranks. Collective:
        every rank calls it; replica 0's owner of each entry contributes it whole."""
        mine = self.layout.replica == 0
        empty = torch.empty(0)
        local = {k: self._local_state.get(k, empty) for k in self._schema}
        shards = {k: ShardInfo(tuple(shape), ()) if mine and owner == self.layout.device else None
                  for k, (owner, shape, _dtype) in self._schema.items()}
        return gather_full_state(local, shards, self.comm_log)

    # -- reporting ---------------------------------------------------------------------------
    def param_bytes(self) -> int:
        """Bytes of parameters held by this rank."""
        return sum(p.numel() * p.element_size() for p in self._params)

    def param_bytes_by_type(self) -> dict[str, int]:
        """This rank's parameter bytes per layer type (conv, linear, lstm, embedding, norm, other)."""
        kinds = ((nn.Conv2d, "conv"), (nn.Linear, "linear"), (nn.LSTM, "lstm"), (nn.Embedding, "embedding"),
                 (nn.modules.batchnorm._BatchNorm, "norm"))
        mine = {id(p) for p in self._params}
        out: dict[str, int] = {}
        for m in self._kinds_root.modules():
            kind = next((k for t, k in kinds if isinstance(m, t)), "other")
            b = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False) if id(p) in mine)
            if b:
                out[kind] = out.get(kind, 0) + b
        return out


def micro_batch_inputs(example_inputs: tuple, plan: Plan, micro_batches: int = 1) -> tuple:
    """The example inputs at the batch one forward of a replica takes (what torch.export specialises
    an exported graph to)."""
    return rebatch(tuple(example_inputs), max(1, plan.batch // plan.dp // max(1, micro_batches)))


def _like_weights(inputs: tuple, module: nn.Module) -> tuple:
    """Floating inputs in the weights' dtype (fp64 runs cast each batch so; export must trace it so)."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return inputs
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


def _check_exported(module: nn.Module, plan: Plan, bn_stats: str) -> None:
    """What an exported graph cannot run as the fx one does: its batch norm is ATen ops, which the
    global statistics' module swap does not reach, and its shapes are fixed to one micro-batch."""
    if plan.dp > 1 and bn_stats == "global" and has_batch_norm(module):
        raise UserError("model parallelism on torch.export's graph (the model is not torch.fx-traceable) cannot "
                        "compute batch-norm statistics over the global batch; use bn_stats='local' or dp=1")


def check_exported_batch(plan: Plan, batch: int, micro_batches: int) -> None:
    if batch % (plan.dp * micro_batches):
        raise UserError(f"global batch {batch} must divide evenly over dp={plan.dp} x {micro_batches} micro-batch(es): "
                        "the model runs on torch.export's graph (it is not torch.fx-traceable), whose shapes are "
                        "fixed to one micro-batch")


def _check_layouts(plan: Plan) -> None:
    for name, lay in [("default_layout", plan.default_layout), *plan.layers.items()]:
        if lay.channel > 1 or lay.filter > 1:
            raise UserError(f"plan: {name} splits channels/filters ({lay.to_strategy()}) inside an mp={plan.mp} "
                            "group; model parallelism runs with sample (data) parallelism only")


def check_time_chunks(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"time_chunks must be an integer >= 1 (1: whole recurrent layers), got {k!r}",
                        param="time_chunks")
    return k


def check_mp_plan(module: nn.Module, plan: Plan, batch: int, example_inputs: tuple | None = None,
                  micro_batches: int = 1, bn_stats: str = "global") -> None:
    """Validate an MP plan against the model before any rank starts (UserError on a problem): the
    model traces (torch.fx, else torch.export at `example_inputs`' shapes), the placement names its
    modules, weights sit on one device, the batch splits."""
    _check_layouts(plan)
    if batch < plan.dp:
        raise UserError(f"global batch {batch} smaller than dp={plan.dp}")
    if plan.dp > 1 and batch % plan.dp and has_batch_norm(module):
        raise UserError(f"global batch {batch} must divide evenly over dp={plan.dp} replicas for global "
                        "batch-norm statistics")
    examples = None if example_inputs is None else micro_batch_inputs(
        example_inputs, plan.model_copy(update={"batch": batch}), micro_batches)
    part = partition_module(module, plan.placement, plan.mp, example_inputs=examples,
                            time_chunks=check_time_chunks(plan.time_chunks or 1))
    if is_exported(part.gm):
        _check_exported(module, plan, bn_stats)
        check_exported_batch(plan, batch, micro_batches)
    if plan.dp > 1 and bn_stats == "global":
        _refuse_unreachable_norms(part.gm, plan)


def _refuse_unreachable_norms(gm: fx.GraphModule, plan: Plan) -> None:
    bad = unreachable_batch_norms(gm)
    if bad:
        raise UserError(f"mp={plan.mp} x sample={plan.dp}: the model computes batch-norm statistics with "
                        f"F.batch_norm in its own forward ({bad[0]}), which would see each replica's samples "
                        "only; use an nn.BatchNorm module, bn_stats='local', or dp=1")


def _signature(module: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def as_call(x) -> tuple[tuple, dict]:
    """(args, kwargs) of a model call from a batch's inputs: a tensor, a tuple/list of positional
    inputs, or a dict of keyword inputs."""
    if isinstance(x, dict):
        return (), dict(x)
    if isinstance(x, (tuple, list)):
        return tuple(x), {}
    return (x,), {}


def bind_inputs(gm: fx.GraphModule, signature: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple:
    """One value per placeholder of `gm`, in order, for a call `model(*args, **kwargs)`: by parameter
    name on torch.fx's graph (defaults filled in), as the flattened inputs on torch.export's."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if is_exported(gm) or signature is None:
        flat = tree_flatten((tuple(args), dict(kwargs)))[0]
        if len(flat) != len(holders):
            raise UserError(f"the model's graph takes {len(holders)} input(s), got {len(flat)}")
        return tuple(flat)
    bound = signature.bind(*args, **kwargs).arguments  # a TypeError as the model's own call would raise
    out = []
    for node in holders:
        name = str(node.target).lstrip("*")
        if name in bound:
            out.append(bound[name])
        elif node.args:
            out.append(node.args[0])
        else:
            raise TypeError(f"forward() missing required argument: {name!r}")
    return tuple(out)


def batch_rows(x) -> int:
    """The batch's sample count: the leading size of its first tensor with at least one dimension."""
    n = next((t.shape[0] for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor) and t.dim()), None)
    if n is None:
        raise UserError("the model's inputs hold no tensor with a batch dimension")
    return n


def split_rows(x, n: int, parts: int) -> list:
    """`x` (a tensor or a tuple/list/dict of inputs) cut into `parts` contiguous pieces of samples
    (torch.tensor_split's sizes): every tensor whose leading size is `n` is cut, the rest is kept whole."""
    def piece(k: int):
        return tree_map_only(torch.Tensor, lambda t: torch.tensor_split(t, parts)[k]
                             if t.dim() and t.shape[0] == n else t, x)
    return [piece(k) for k in range(parts)]
