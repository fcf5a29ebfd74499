"""Model parallelism (and hybrid DP x MP) in the user's own loop, with one process's semantics.

`parallelize_mp(module, plan)` runs the MP engine's set-up on `module` in place (the placement's
partition, this rank's weights kept and the others freed to the meta device, batch norms with
global-batch statistics, the gradient sync across replicas) and replaces its forward:

- every rank calls `model(*inputs, **kw_inputs)` with the same global batch; each replica takes its
  contiguous slice of the samples (tensors whose leading size is the batch's) and runs its stages,
  activations crossing between the replica's ranks as in `MPEngine.train_step`;
- the outputs (a tensor, or tuples/lists/dicts of them) come back whole on every rank: each output
  tensor is broadcast by the rank that computed it to the other stages of its replica, then
  gathered along the samples across the replicas;
- backward: every rank computes the same loss of the same outputs, so the rank that produced an
  output takes the gradient rows of its own replica's samples from its own loss (nothing is sent
  for the outputs, nothing is counted twice); the gradients then flow back through the stages as
  the engine's do (the p2p token chain reaches every stage, including those that hold no output),
  and each stage's parameter gradients are summed over the replicas during backward (GradSync);
- `model.parameters()` are the module's: this rank's stage holds real tensors, the others are
  meta tensors that never get a gradient, so torch.optim optimizers skip them;
- `hybridpar.full_state_dict(model)` gathers the whole state from the owners (`MPState`);
- `micro_batches` K > 1 pipelines each replica's samples GPipe-style: K forwards in a row, each
  stage's sends non-blocking, so stage d runs micro-batch k while stage d+1 runs k-1; one backward
  (the outputs' micro-batches concatenated) runs theirs in reverse order. The gradients are those of
  the whole batch (sums of the micro-batches' own); batch norm would normalise per micro-batch, so
  it is refused unless bn_stats="local" says so (`check_micro_batches`).

Root-level Python that torch.fx traced with the module in training mode stays so (F.dropout(x,
training=self.training) in the root's forward); modules (nn.Dropout, batch norm) follow
model.train()/eval(). Move the model to its device before parallelize: freed weights cannot move.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from hybridpar.errors import UserError
from hybridpar.parallel.comm.collectives import all_gather_dim
from hybridpar.parallel.mesh import STAGE_DIM, Group, new_groups
from hybridpar.parallel.pipeline.engine import MPEngine, batch_rows, check_time_chunks, split_rows
from hybridpar.parallel.pipeline.executor import run_forward
from hybridpar.parallel.pipeline.norm import has_batch_norm
from hybridpar.plans import Plan

_TAG_WRAP = 1 << 24  # message numbers of successive forwards wrap here (tags stay in int32)


@dataclass(frozen=True)
class _Leaf:
    """One output tensor: the device of its replica that computes it, its shape and dtype there."""

    device: int
    shape: torch.Size
    dtype: torch.dtype


class MPState:
    """What parallelize did for a model-parallel plan (`module.hybridpar`): the engine that runs the
    stages, this replica's stage group, and the forward's message numbering."""

    def __init__(self, engine: MPEngine, micro_batches: int = 1, schedule: str | None = None, loss_fn=None):
        self.engine = engine
        self.micro_batches = micro_batches
        self.schedule = schedule  # step()'s (pipeline.schedule); None: gpipe
        self.loss_fn = loss_fn  # step()'s; model(...) + the caller's loss needs none
        self._pipeline: Any = None  # pipeline.schedule.ChainPipeline, made at the first step()
        self.plan: Plan = engine.plan
        self.layout = engine.layout
        self.comm_log = engine.comm_log
        # every rank creates every replica's stage group, in one order (collective)
        groups = new_groups(self.layout.dims.groups(STAGE_DIM))
        self.stage_group: Group = groups.get(tuple(self.layout.stage_ranks())) or Group(
            (dist.get_rank(),), None, 0)
        self._msg_base = 0

    @property
    def grad_sync(self):
        return self.engine._grad_sync  # noqa: SLF001 - the engine's sync is the module's

    def no_sync(self) -> AbstractContextManager[None]:
        return nullcontext() if self.grad_sync is None else self.grad_sync.no_sync()

    def full_state_dict(self, everywhere: bool = True) -> dict[str, torch.Tensor] | None:
        """The undistributed state_dict; on every rank with `everywhere`, else on rank 0. Collective."""
        from hybridpar.parallel.state import ShardInfo, gather_full_state

        eng = self.engine
        mine = self.layout.replica == 0
        empty = torch.empty(0)
        local = {k: eng.local_state_dict().get(k, empty) for k in eng._schema}  # noqa: SLF001
        shards = {k: ShardInfo(tuple(shape), ()) if mine and owner == self.layout.device else None
                  for k, (owner, shape, _dtype) in eng._schema.items()}  # noqa: SLF001
        return gather_full_state(local, shards, self.comm_log, everywhere=everywhere)

    def step(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> torch.Tensor:
        """One training step of `model(*args, **kwargs)` and `loss_fn(outputs, target)` through
        torch.distributed.pipelining's schedule (1f1b or gpipe; pipeline.schedule's doc): forwards and
        backwards of the micro-batches, the gradients accumulated (and summed over replicas). Returns the
        global batch's loss on every rank; `losses` gets this replica's micro-batch losses. Collective."""
        from hybridpar.parallel.pipeline.schedule import ChainPipeline

        if self.loss_fn is None:
            raise UserError("step: parallelize the model with loss_fn=... (the schedule computes the loss of each "
                            "micro-batch itself)")
        if self._pipeline is None:
            self._pipeline = ChainPipeline(self, self.schedule or "gpipe", self.loss_fn)
        return self._pipeline.step(args, kwargs, target, losses)

    # -- the forward -------------------------------------------------------------------------
    def forward(self, args: tuple, kwargs: dict) -> Any:
        eng, lay = self.engine, self.layout
        eng.link.wait_all()  # the previous forward's and backward's sends
        inputs = eng.bind(args, kwargs)
        n = batch_rows(inputs)
        eng.check_batch(n)
        sizes = [len(r) for r in torch.tensor_split(torch.arange(n), lay.dp)]
        mine_n = sizes[lay.replica]
        local = tuple(split_rows(list(inputs), n, lay.dp)[lay.replica]) if lay.dp > 1 else inputs
        mbs = min(self.micro_batches, mine_n)
        pieces = [tuple(p) for p in split_rows(list(local), mine_n, mbs)] if mbs > 1 else [local]
        piece_rows = [len(r) for r in torch.tensor_split(torch.arange(mine_n), mbs)]
        shapes = [eng._shapes(p) for p in pieces]  # noqa: SLF001
        n_msgs = sum(sh[1] for sh in shapes)
        if self._msg_base + n_msgs > _TAG_WRAP:
            self._msg_base = 0
        base, self._msg_base = self._msg_base, self._msg_base + n_msgs
        runs = []
        for piece, (cross, count, _outs) in zip(pieces, shapes):  # GPipe: every micro-batch's forward in a row
            runs.append(run_forward(eng.partition, lay.device, eng.link, piece, cross, base, eng.device,
                                    all_outputs=True))
            base += count
        token = runs[0][1] if mbs == 1 else torch.stack([t for _v, t in runs]).sum()
        values: list[dict] = []
        for v, _t in runs:
            assert isinstance(v, dict)  # all_outputs: every output node's value on its device
            values.append(v)
        leaves, tensors, specs = [], [], []
        for name in eng.partition.output_nodes:
            dev = eng.partition.device_of.get(name)
            dev = 0 if dev is None else dev
            metas = [tree_flatten(sh[2][name]) for sh in shapes]
            meta_leaves, spec = metas[0]
            mine = [tree_flatten(v[name])[0] for v in values] if dev == lay.device else None
            for k, m in enumerate(meta_leaves):
                if isinstance(m, torch.Tensor):
                    for (piece_leaves, _spec), rows_j in zip(metas, piece_rows):
                        _check_rows(piece_leaves[k], rows_j, lay.dp, mbs, name)
                    shape = torch.Size((mine_n, *m.shape[1:])) if mbs > 1 else m.shape
                    leaves.append(_Leaf(dev, shape, m.dtype))
                    if mine is None:
                        tensors.append(token.new_empty(0))
                    else:
                        tensors.append(mine[0][k] if mbs == 1 else torch.cat([leaf[k] for leaf in mine]))
            specs.append((name, spec, meta_leaves))
        rows = (sum(sizes[:lay.replica]), mine_n) if lay.dp > 1 else None
        whole = _Publish.apply(self, tuple(leaves), sizes, rows, token, *tensors)
        it = iter(whole)
        node_values = {}
        for name, spec, meta_leaves in specs:
            node_values[name] = tree_unflatten([next(it) if isinstance(m, torch.Tensor) else m
                                                for m in meta_leaves], spec)
        return _output(eng.partition.gm, node_values)


class _Publish(torch.autograd.Function):
    """forward: every output tensor, whole, on every rank (a broadcast from its producer over the
    replica's stages, then a gather of the replicas' rows); backward: its producer takes its own
    replica's rows of the gradient (every rank computed the same loss), and the token's gradient
    starts this rank's p2p chain in backward."""

    @staticmethod
    def forward(ctx, state: MPState, leaves: tuple[_Leaf, ...], sizes: list[int], rows, token, *tensors):
        lay, eng = state.layout, state.engine
        outs = []
        for leaf, t in zip(leaves, tensors):
            if leaf.device == lay.device:
                buf = t.detach().contiguous().clone()
            else:
                buf = torch.empty(leaf.shape, dtype=leaf.dtype, device=eng.device)
            group = state.stage_group
            if group.size > 1:
                src = lay.rank_of(lay.replica, leaf.device)
                with state.comm_log.timed("broadcast", group.size, buf.numel() * buf.element_size(), "output:fwd"):
                    dist.broadcast(buf, src=src, group=group.pg)
            if rows is not None:
                assert eng._group is not None  # rows: more than one replica  # noqa: SLF001
                buf = all_gather_dim(buf, 0, eng._group, sizes, state.comm_log, "output:fwd")  # noqa: SLF001
            outs.append(buf)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        ctx.mine = [leaf.device == lay.device for leaf in leaves]
        ctx.rows = rows
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        out: list[torch.Tensor | None] = [None, None, None, None, torch.zeros((), device=grads[0].device)
                                          if grads else None]
        for k, (g, mine) in enumerate(zip(grads, ctx.mine)):
            if not mine or g is None or not ctx.needs_input_grad[5 + k]:
                out.append(None)
            elif ctx.rows is not None:
                out.append(g.narrow(0, ctx.rows[0], ctx.rows[1]).contiguous())
            else:
                out.append(g)
        return tuple(out)


def _check_rows(meta: torch.Tensor, rows: int, dp: int, mbs: int, name: str) -> None:
    if dp == 1 and mbs == 1:
        return
    if meta.dim() == 0 or meta.shape[0] != rows:
        how = " x ".join(w for w in (f"sample={dp}" if dp > 1 else "", f"{mbs} micro-batches" if mbs > 1 else "") if w)
        raise UserError(f"output {name} has shape {tuple(meta.shape)}; under mp x {how} every output tensor must "
                        f"lead with the samples ({rows} per piece), as each piece computes its own samples' "
                        "outputs: return per-sample outputs and compute the loss outside the model")


def _output(gm: fx.GraphModule, node_values: dict[str, Any]) -> Any:
    """The model's output with every fx node replaced by its value (plain tuples, lists and dicts)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")

    def build(a):
        if isinstance(a, fx.Node):
            return node_values[a.name]
        if isinstance(a, tuple):
            return type(a)(*(build(x) for x in a)) if hasattr(a, "_fields") else tuple(build(x) for x in a)
        if isinstance(a, list):
            return [build(x) for x in a]
        if isinstance(a, dict):
            return {k: build(v) for k, v in a.items()}
        return a

    result = build(out_node.args[0])
    spec = getattr(gm, "_out_spec", None)  # torch.export's module: flat outputs, unflattened by its spec
    if spec is not None:
        result = tree_unflatten(list(result), spec)
    return result


def check_micro_batches(module: nn.Module, micro_batches: int, bn_stats: str) -> None:
    """UserError for micro-batches whose batch norm could not stay one process's: its statistics
    would be each micro-batch's (and the running statistics updated once per micro-batch), which
    only bn_stats="local" accepts."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise UserError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    if micro_batches > 1 and bn_stats == "global" and has_batch_norm(module):
        raise UserError(f"{micro_batches} micro-batches: the model's batch norm would normalise each micro-batch "
                        "separately, not the global batch; use --micro-batches 1, or --bn-stats local to "
                        "train with per-micro-batch statistics")


def parallelize_mp(module: nn.Module, plan: Plan, *, bn_stats: str = "global", example_inputs: tuple | None = None,
                   micro_batches: int | None = None, schedule: str | None = None, loss_fn=None,
                   time_chunks: int | None = None, **engine_options: Any) -> nn.Module:
    """Make `module` run the model-parallel `plan` (its placement resolved: hybridpar.api.with_placement)
    in the user's own loop, in place (see this module's doc); returns it with `.hybridpar` an MPState.
    Collective. `example_inputs`: a global batch's inputs (a tuple), for a model torch.fx cannot trace
    (it then runs on torch.export's graph at one replica's slice of their shapes). Other options go to
    MPEngine (ordered_p2p, overlap_grad_sync, grad_bucket_bytes, device). `micro_batches`: GPipe
    micro-batches per replica (see this module's doc); None: the plan's (the placer's choice), else 1.
    `schedule` ("gpipe" | "1f1b"; None: the plan's) and `loss_fn(outputs, target)` (a mean over samples):
    for `module.hybridpar.step(...)`, torch.distributed.pipelining's schedule over a chain of stages
    (pipeline.schedule); 1f1b asked here is refused here, on every rank, for a placement that is not a
    chain (the plan's, the placer's choice, at the first step: `model(...)` runs any placement).
    `time_chunks` K: recurrent layers in K time chunks, the wavefront (pipeline.wavefront); None: the
    plan's (the placer's choice), else 1 (whole layers)."""
    from hybridpar.parallel.pipeline.schedule import check_schedule

    if plan.mp < 2:
        raise UserError(f"parallelize_mp: the plan has mp={plan.mp}")
    if micro_batches is None:
        micro_batches = plan.micro_batches or 1
    if time_chunks is not None:
        plan = plan.model_copy(update={"time_chunks": check_time_chunks(time_chunks)})
    check_micro_batches(module, micro_batches, bn_stats)
    asked = schedule is not None
    schedule = schedule if asked else plan.schedule
    check_schedule(schedule if asked else None, micro_batches, plan.mp)  # the plan's: at step()
    examples = None
    if example_inputs is not None:
        ex = tuple(example_inputs)
        examples = tuple(split_rows(list(ex), batch_rows(ex), plan.dp)[0]) if plan.dp > 1 else ex
        if micro_batches > 1:  # an exported graph is specialised to one micro-batch's shapes
            examples = tuple(split_rows(list(examples), batch_rows(examples), micro_batches)[0])
    engine = MPEngine(module, plan, bn_stats=bn_stats, example_inputs=examples, **engine_options)
    state = MPState(engine, micro_batches, schedule, loss_fn)
    if asked and schedule == "1f1b":  # refused now, on every rank alike, if the placement is not a chain
        from hybridpar.parallel.pipeline.schedule import ChainPipeline

        state._pipeline = ChainPipeline(state, schedule, loss_fn)  # noqa: SLF001

    def forward(*args, **kwargs):
        return state.forward(args, kwargs)

    module.forward = forward  # the instance's own: the class keeps its own
    setattr(module, "hybridpar", state)  # noqa: B010 - an attribute nn.Module's typing does not know
    return module
