"""1F1B (and GPipe) micro-batch schedules through torch.distributed.pipelining, for a placement whose
partition is a chain of stages: the user's loss goes into the schedule (torchtitan's contract).

1F1B runs a micro-batch's backward as soon as its forward reached the last stage, so stage s holds at
most S - s micro-batches' activations (GPipe: all K); the backward must therefore start inside the
step, before the caller could see the outputs, and `model(x)` + `loss.backward()` cannot express it.
So `model.hybridpar.step(*inputs, target=y, losses=[])` (after `hybridpar.parallelize(model, plan,
schedule="1f1b", loss_fn=fn)`) runs one training step's forwards and backwards:

- every rank passes the same global batch and target (as to `model(...)`); each replica takes its
  contiguous samples and cuts them into K equal micro-batches (K: the plan's `micro_batches`);
- this rank runs its stage (the placement's nodes on its device, torch.fx's graph as MPEngine
  partitions it) as a `PipelineStage` of torch's `Schedule1F1B` (or `ScheduleGPipe`), the
  activations and their gradients crossing between neighbouring stages of the replica;
- the last stage computes `loss_fn(outputs, target)` of each micro-batch (outputs: the model's own
  output structure), a mean over the micro-batch's samples, as torch's pipelining assumes; each is
  weighted by its share of the global batch (1 / (K x replicas)), so the gradients are exactly those
  of one process's `loss_fn` over the whole batch when loss_fn is a mean over samples (a sum: scale
  it yourself);
- the weights' gradients are summed over the replicas in the last micro-batch's backward (the
  module's GradSync, quiet during the earlier ones); the optimizer steps as usual;
- it returns the global batch's loss (every rank), and appends this replica's K micro-batch losses
  to `losses` (every rank).

`model(x)` keeps running the placement's executor (any DAG, GPipe micro-batches), e.g. for evaluation.
A partition is a chain when its devices form a path d0 -> d1 -> ... (every activation crosses from a
stage to the next), the model's inputs are read on d0 only and its outputs computed on the last;
anything else is refused with one line (`chain_order`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.utils._pytree import tree_flatten, tree_unflatten

from hybridpar.errors import UserError
from hybridpar.parallel.pipeline.p2p import p2p_tag
from hybridpar.parallel.pipeline.partition import Partition

if TYPE_CHECKING:
    from hybridpar.parallel.pipeline.module import MPState

SCHEDULES = ("gpipe", "1f1b")


def _instead(kind: str) -> str:
    """What runs any placement instead of torch's `kind` schedule: the executor, which `--schedule gpipe`
    (hybridpar train) and `model(x)` + `loss.backward()` run; step() runs torch's schedule either way."""
    return "use --schedule gpipe" if kind == "1f1b" else "use model(...) and loss.backward()"


def check_even_micro_batches(kind: str, batch: int, dp: int, k: int) -> None:
    if batch % (dp * k):
        raise UserError(f"{kind}: global batch {batch} must divide evenly over sample={dp} x {k} micro-batches "
                        "(torch's pipeline stages need equal micro-batches)")


def check_crossings_have_gradients(kind: str, transfers, cross: dict) -> None:
    """torch's stages send a gradient back for every activation they receive: UserError for a crossing
    (`transfers`, their Crossing in `cross`) that holds a tensor without one."""
    for t in transfers:
        if not all(cross[t.index].diff):
            raise UserError(f"{kind}: the activation {t.node} crossing from device {t.src} to {t.dst} holds a tensor "
                            "without a gradient (integers, or computed without autograd); torch's pipeline stages "
                            f"send a gradient for every activation: {_instead(kind)}")


def chain_order(part: Partition, kind: str = "1f1b") -> tuple[int, ...]:
    """The partition's devices in stage order; UserError (one line, naming torch's schedule `kind`)
    when it is not a chain."""
    used = {d for d in part.device_of.values() if d is not None}
    idle = sorted(set(range(part.mp)) - used)
    if idle:
        raise UserError(f"{kind}: device {idle[0]} of mp={part.mp} runs no layer; a pipeline needs every device as "
                        f"a stage ({_instead(kind)})")
    nxt: dict[int, int] = {}
    prev: dict[int, int] = {}
    for t in part.transfers:
        if nxt.setdefault(t.src, t.dst) != t.dst or prev.setdefault(t.dst, t.src) != t.src:
            raise UserError(f"{kind}: the placement is not a chain of stages (node {t.node} goes from device {t.src} "
                            f"to {t.dst}, skipping or branching); {_instead(kind)}, which runs any placement")
    first = [d for d in range(part.mp) if d not in prev]
    order = [first[0]] if len(first) == 1 else []
    while order and order[-1] in nxt and len(order) <= part.mp:
        order.append(nxt[order[-1]])
    if len(order) != part.mp:
        raise UserError(f"{kind}: the placement's devices do not form one chain of stages (a cycle, or stages that "
                        f"do not feed each other); {_instead(kind)}")
    _check_ends(part, order[0], order[-1], kind)
    return tuple(order)


def _check_ends(part: Partition, first: int, last: int, kind: str) -> None:
    for node in part.nodes:
        if node.op != "placeholder":
            continue
        late = sorted({d for u in node.users if u.op != "output" and (d := part.device_of[u.name]) is not None}
                      - {first})
        if late:
            raise UserError(f"{kind}: the model's input {node.name} is read on device {late[0]}, not only by the "
                            f"first stage (device {first}); {_instead(kind)}")
    for name in part.output_nodes:
        if part.device_of.get(name) != last:
            raise UserError(f"{kind}: the model's output {name} is computed on device {part.device_of.get(name)}, "
                            f"not on the last stage (device {last}); {_instead(kind)}")


def check_schedule(schedule: str | None, micro_batches: int, stages: int, time_chunks: int | None = None) -> None:
    """UserError for a schedule name, or a 1F1B count below the stage count (torch's Schedule1F1B needs
    every stage busy before the first backward)."""
    if schedule is None:
        return
    if schedule not in SCHEDULES:
        raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule == "1f1b" and (time_chunks or 1) > 1:
        raise UserError(f"1f1b runs whole recurrent layers: {time_chunks} time chunks (the wavefront) run under "
                        "--schedule gpipe only (or give --time-chunks 1)")
    if schedule == "1f1b" and micro_batches < stages:
        raise UserError(f"1f1b needs at least as many micro-batches as stages: {micro_batches} < {stages} "
                        f"(use --micro-batches {stages} or more)")


class _StageModule(nn.Module):
    """This rank's stage as a module: the partition's nodes on its device, from the received
    activations (flat tensors, in the transfers' order) or, on the first stage, the model's inputs,
    to the activations for the next stage (flat tensors) or, on the last, the model's output."""

    def __init__(self, pipe: ChainPipeline):
        super().__init__()
        self._pipe = (pipe,)  # not a submodule: the stage owns no parameters here

    def forward(self, *flat: Any) -> Any:
        return self._pipe[0].run_stage(flat)


class ChainPipeline:
    """The torch.distributed.pipelining schedule of a chain partition on this rank (module doc)."""

    def __init__(self, state: MPState, schedule: str, loss_fn):
        eng = state.engine
        self.state, self.kind, self.loss_fn = state, schedule, loss_fn
        self.order = chain_order(eng.partition, schedule)
        self.stage = self.order.index(state.layout.device)
        self.S = len(self.order)
        check_schedule(schedule, state.micro_batches, self.S, getattr(state.plan, "time_chunks", None))
        part = eng.partition
        dev = state.layout.device
        self._in = [t for t in part.transfers if t.dst == dev]
        self._out = [t for t in part.transfers if t.src == dev]
        self._built: dict[tuple, Any] = {}
        self._cross: dict = {}
        self._weight = 1.0
        self._losses: list[torch.Tensor] = []
        self.trace: list[str] = []  # the last step's "F"/"B" per micro-batch on this stage, in running order
        self.module = _StageModule(self)

    # -- the stage's forward ------------------------------------------------------------------
    def run_stage(self, flat: tuple) -> Any:
        from hybridpar.parallel.pipeline.executor import _LocalInterpreter
        from hybridpar.parallel.pipeline.module import _output

        eng, dev = self.state.engine, self.state.layout.device
        part = eng.partition
        self.trace.append("F")
        interp = _LocalInterpreter(part.gm, eng.device, exported=eng.exported)
        env = interp.env
        by_name = {n.name: n for n in part.nodes}
        it = iter(flat)
        if self.stage == 0:
            for node in part.nodes:
                if node.op == "placeholder":
                    env[node] = next(it)
        else:
            for t in self._in:
                c = self._cross[t.index]
                leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in c.leaves]
                env[by_name[t.node]] = tree_unflatten(leaves, c.spec)
        drops = part.drops_of(dev)
        sent = {t.node for t in self._out}  # returned at the end, not sent where the executor would
        for i, node in enumerate(part.nodes):
            if node.op not in ("placeholder", "output") and part.device_of[node.name] == dev:
                env[node] = interp.run_node(node)
            for gone in drops.get(i, ()):
                if gone.name not in sent:
                    env.pop(gone, None)
        if self.stage == self.S - 1:
            return _output(part.gm, {n: env[by_name[n]] for n in part.output_nodes})
        out: list[torch.Tensor] = []
        for t in self._out:
            out += [x for x in tree_flatten(env[by_name[t.node]])[0] if isinstance(x, torch.Tensor)]
        return tuple(out)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        self._losses.append(loss.detach())
        return loss * self._weight  # the micro-batch's share of the global batch's mean

    # -- set-up per micro-batch shape -----------------------------------------------------------
    def _schedule_for(self, piece: tuple, k: int, cut: tuple[bool, ...]):
        """(torch's schedule, the crossings) for micro-batches shaped like `piece`; `cut`: which inputs
        are cut into micro-batches (those leading with the replica's samples), the rest go whole."""
        eng = self.state.engine
        key = (k, cut, *[(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else _hashable(x) for x in piece])
        if key in self._built:
            return self._built[key]
        cross, _n, outs = eng._shapes(piece)  # noqa: SLF001 - the engine's meta shapes of one micro-batch
        check_crossings_have_gradients(self.kind, [*self._in, *self._out], cross)
        ins = [x for x in piece if isinstance(x, torch.Tensor)] if self.stage == 0 else [
            x for t in self._in for x in cross[t.index].tensor_leaves]
        if self.stage == self.S - 1:
            outs_meta = [x for n in eng.partition.output_nodes for x in tree_flatten(outs[n])[0]
                         if isinstance(x, torch.Tensor)]
        else:
            outs_meta = [x for t in self._out for x in cross[t.index].tensor_leaves]
        built = self._build(tuple(m.to("meta") for m in ins), tuple(m.to("meta") for m in outs_meta), k, cut)
        self._built[key] = (built, cross)
        return built, cross

    def _build(self, ins: tuple, outs: tuple, k: int, cut: tuple[bool, ...]):
        state = self.state
        group = state.stage_group
        stage = _Stage(self, self.module, self.stage, self.S, state.engine.device, input_args=ins or None,
                       output_args=outs, group=group.pg)
        stage.stage_index_to_group_rank = {s: group.ranks.index(state.layout.rank_of(state.layout.replica, d))
                                           for s, d in enumerate(self.order)}
        spec: Any = tuple(TensorChunkSpec(0) if c else _Replicate() for c in cut)
        cls = Schedule1F1B if self.kind == "1f1b" else ScheduleGPipe
        return cls(stage, k, loss_fn=self._loss, args_chunk_spec=spec if self.stage == 0 else None,
                   scale_grads=False)

    # -- one step -------------------------------------------------------------------------------
    def step(self, args: tuple, kwargs: dict, target: Any, losses: list | None) -> torch.Tensor:
        from hybridpar.parallel.pipeline.engine import batch_rows, split_rows

        state = self.state
        eng, lay = state.engine, state.layout
        eng.link.wait_all()  # a previous model(...)'s sends
        inputs = eng.bind(args, kwargs)
        n = batch_rows(inputs)
        eng.check_batch(n)
        if not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] != n:
            raise UserError(f"step: target must be a tensor leading with the batch's {n} samples (torch's pipeline "
                            "schedules cut it into micro-batches)")
        k = state.micro_batches
        check_even_micro_batches(self.kind, n, lay.dp, k)
        local = tuple(split_rows(list(inputs), n, lay.dp)[lay.replica]) if lay.dp > 1 else inputs
        tgt = torch.tensor_split(target, lay.dp)[lay.replica].to(eng.device)
        piece = tuple(split_rows(list(local), n // lay.dp, k)[0])
        cut = tuple(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n // lay.dp for x in local)
        schedule, cross = self._schedule_for(piece, k, cut)
        self._cross, self._weight, self._losses, self.trace = cross, 1.0 / (k * lay.dp), [], []
        nn.Module.train(eng.partition.gm)
        first, last = self.stage == 0, self.stage == self.S - 1
        call = tuple(x.to(eng.device) if isinstance(x, torch.Tensor) else x for x in local) if first else ()
        schedule.step(*call, target=tgt if last else None)
        return self._publish(losses, k)

    def _publish(self, losses: list | None, k: int) -> torch.Tensor:
        """Every replica's micro-batch losses on every rank (one allreduce of dp x K numbers): the step's
        loss, and this replica's losses for `losses`."""
        lay, eng = self.state.layout, self.state.engine
        dtype = eng._loss_dtype  # noqa: SLF001 - the same on every rank (the weights' precision)
        every = torch.zeros(lay.dp * k, dtype=dtype, device=eng.device)
        if self.stage == self.S - 1:
            every[lay.replica * k:(lay.replica + 1) * k] = torch.stack(self._losses).to(dtype)
        dist.all_reduce(every)
        self.state.comm_log.record("allreduce", dist.get_world_size(), every.numel() * every.element_size(), "loss")
        if losses is not None:
            losses.extend(every[lay.replica * k:(lay.replica + 1) * k].unbind())
        self._losses = []
        return every.mean()


def _hashable(x: Any) -> Any:
    """A non-tensor input in a cache key: itself where hashable, else its repr."""
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


class _Stage(PipelineStage):
    """torch's PipelineStage whose weights' gradient sync over the replicas (the module's GradSync) runs
    in the last micro-batch's backward only: the earlier ones accumulate."""

    def __init__(self, pipe: ChainPipeline, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pipe = pipe

    # the schedule's transfers, logged as the executor's Link logs its own (both ends, per peer device)
    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return self._logged(super().get_fwd_send_ops(fwd_chunk_id), "send", "fwd")

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        return self._logged(super().get_fwd_recv_ops(fwd_chunk_id), "recv", "fwd")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return self._logged(super().get_bwd_send_ops(bwd_chunk_id), "send", "bwd")

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        return self._logged(super().get_bwd_recv_ops(bwd_chunk_id), "recv", "bwd")

    def _logged(self, ops: list, kind: str, phase: str) -> list:
        log, mp = self.pipe.state.comm_log, self.pipe.state.layout.mp
        for op in ops:
            log.record(kind, 2, op.tensor.numel() * op.tensor.element_size(), p2p_tag(phase, op.peer % mp))
        return ops

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward: bool = False):
        self.pipe.trace.append("B")
        sync = self.pipe.state.grad_sync
        if sync is None:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        sync.enabled = bool(last_backward)
        try:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        finally:
            sync.enabled = True


def with_schedule(plan, schedule: str | None):
    """The plan with the run's schedule: the one asked (`--schedule`), else the plan's (the placer's),
    else None (gpipe). UserError for a schedule on a plan without model parallelism."""
    if schedule is not None and schedule not in SCHEDULES:
        raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if plan.mp == 1:
        if schedule is not None:
            raise UserError(f"--schedule {schedule} needs a model-parallel plan (mp > 1)")
        return plan
    return plan.model_copy(update={"schedule": schedule if schedule is not None else plan.schedule})


def check_pipeline_plan(module: nn.Module, plan, batch: int, micro_batches: int,
                        example_inputs: tuple | None = None) -> None:
    """Before any rank starts: a 1f1b plan's placement is a chain of stages, K >= its stages, and the
    global batch cuts into equal micro-batches of every replica (UserError, one line). Others pass."""
    if plan.mp == 1 or plan.schedule != "1f1b":
        return
    from hybridpar.parallel.pipeline.engine import micro_batch_inputs
    from hybridpar.parallel.pipeline.partition import partition_module

    check_schedule("1f1b", micro_batches, plan.mp, getattr(plan, "time_chunks", None))
    check_even_micro_batches("1f1b", batch, plan.dp, micro_batches)
    examples = None if example_inputs is None else micro_batch_inputs(
        example_inputs, plan.model_copy(update={"batch": batch}), micro_batches)
    part = partition_module(module, plan.placement, plan.mp, example_inputs=examples)
    chain_order(part)
    if examples is not None:
        _check_crossings_differentiable(module, part, examples)


def _check_crossings_differentiable(module: nn.Module, part: Partition, examples: tuple) -> None:
    """torch's stages send a gradient back for every activation they receive: refuse (on meta tensors,
    before start) an activation crossing between stages that holds a tensor without one."""
    from hybridpar.graph.runnable import is_exported
    from hybridpar.parallel.pipeline.engine import _signature, bind_inputs
    from hybridpar.parallel.pipeline.executor import crossings, meta_copy, meta_values

    meta = meta_copy(part.gm if is_exported(part.gm) else module).train()
    inputs = bind_inputs(part.gm, _signature(module), tuple(examples), {})
    check_crossings_have_gradients("1f1b", part.transfers, crossings(part, meta_values(part, meta, inputs)))


def settle_schedule(module: nn.Module, plan, asked: str | None, batch: int, micro_batches: int,
                    example_inputs: tuple | None = None):
    """The run's plan with its schedule checked before start: `asked` (--schedule) is refused with one
    line when it cannot run; the placer's 1f1b that cannot (its coarse graph's chain is not the traced
    one's, or the run's micro-batches differ) falls back to gpipe, noted last in plan.notes for the run to
    tell at start-up (both are exact). The note says what changes: GPipe holds every micro-batch's
    activations where the placer priced 1F1B's S - s (the runtime does not price; `hybridpar place
    --schedule gpipe` does)."""
    plan = with_schedule(plan, asked)
    try:
        check_pipeline_plan(module, plan, batch, micro_batches, example_inputs)
    except UserError as err:
        if asked is not None:
            raise
        note = (f"schedule: gpipe (the placer's 1f1b cannot run: {err}); gpipe holds all {micro_batches} "
                "micro-batches' activations where the plan priced 1f1b's, so its memory figure is low: "
                "`hybridpar place --schedule gpipe` prices this run")
        return plan.model_copy(update={"schedule": "gpipe", "notes": [*plan.notes, note]})
    return plan
