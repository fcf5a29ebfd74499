"""`parallelize(module, layout)`: the model runs with the semantics of one process on any layout;
`full_state_dict(module)` and `no_sync(module)` go with it.

Parallel layers are swapped in place by module name (as torchtitan's parallelize_* functions apply
their parallel styles): Conv2d (stationary-x/y/w), Linear (row/column), BatchNorm1d/2d/3d (global
statistics). Between them, activations are DTensors over the layout's mesh (samples on `sample`,
channels on `channel_filter`), so the user's own code sees global shapes and every op it calls
computes what it computes in one process (hybridpar.parallel.apply; our DTensor rules are on only
inside the module's forward: hybridpar.parallel.dtensor.rules). The root module takes the global
batch as ordinary tensors and returns ordinary tensors, the same on every rank; gradients are
synchronised during backward (hybridpar.parallel.comm.grad_sync), so any loss and any torch.optim
optimizer over `module.parameters()` train as in one process.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.errors import UserError
from hybridpar.parallel.apply import (
    INPUT_MODES,
    Layouts,
    ParallelState,
    apply_layout,
    as_layouts,
    check_parallelizable,
    grid_keys,
    grid_shape,
)
from hybridpar.parallel.check import check
from hybridpar.parallel.state import gather_full_state
from hybridpar.plans import LayerLayout, Plan

__all__ = ["INPUT_MODES", "Layouts", "ParallelState", "as_layouts", "check_parallelizable", "full_state_dict",
           "grid_keys", "grid_shape", "no_sync", "parallelize"]

if TYPE_CHECKING:
    from hybridpar.parallel.pipeline.module import MPState


def parallelize(module: nn.Module, spec: Plan | LayerLayout | str, *, check_inputs: Any = None,
                **options: Any) -> nn.Module:
    """Make `module` run `spec` (a Plan, a LayerLayout or a strategy string such as "sample=2,channel=2")
    on the current torch.distributed world, in place; returns the module, with `.hybridpar` set to a
    ParallelState. Collective: every rank calls it with the same arguments. Options: those of
    hybridpar.parallel.apply.apply_layout (inputs, bn_stats, materialize, ...).

    check_inputs: an example of what this rank will pass to model(...) (only shapes and dtypes
    count): first run the layout on meta tensors over a fake world on this rank alone
    (hybridpar.parallel.check.check) and raise a UserError naming the op and module it cannot
    serve, before any collective of this call."""
    from hybridpar.parallel import fsdp  # zero=2|3 and recompute: refused here before any collective

    recompute, mixed = fsdp.take_options(spec, options, dist.get_world_size())
    mp_plan = _mp_plan(module, spec, options)
    if mp_plan is not None:
        return _parallelize_mp(module, mp_plan, check_inputs, options)
    options.pop("example_inputs", None)  # for the placer and torch.export of model parallelism only
    if options.pop("time_chunks", None) not in (None, 1):  # the wavefront runs across an MP group's devices
        raise UserError("time_chunks needs a model-parallel plan (mp > 1): recurrent layers run whole here")
    if options.pop("schedule", None) is not None or options.pop("loss_fn", None) is not None:
        raise UserError("schedule/loss_fn (pipelined micro-batches, model.hybridpar.step) need a model-parallel "
                        "plan (mp > 1)")
    if check_inputs is not None:  # before the first collective (group creation)
        check(module, spec, check_inputs, world_size=dist.get_world_size(), inputs=options.get("inputs", "global"))
    return fsdp.finish(apply_layout(module, spec, **options), recompute, mixed)


def _mp_plan(module: nn.Module, spec: Plan | LayerLayout | str, options: dict[str, Any]) -> Plan | None:
    """The model-parallel Plan `spec` names (mp > 1), its placement resolved; None for other layouts.
    A strategy string ("mp=2,sample=2") takes its placement from options: `placement` (module or fx
    node name -> device), or `place(plan, module) -> Plan` (the caller's placer: hybridpar.parallelize
    passes DLPlacer's); parallel never searches."""
    placement = options.pop("placement", None)
    place = options.pop("place", None)
    if isinstance(spec, str):
        from hybridpar.plans import parse_strategy

        strat = parse_strategy(spec, dist.get_world_size())
        if strat.mp == 1:
            return None
        if strat.layout.g_size > 1 or strat.layout.spatial > 1:
            raise UserError(f"strategy {spec!r}: model parallelism runs with sample (data) parallelism only")
        spec = Plan(model=type(module).__name__, world_size=strat.world_size, batch=max(1, strat.layout.sample),
                    dp=strat.layout.sample, mp=strat.mp, default_layout=strat.layout, strategy=spec,
                    placement=placement)
    if not isinstance(spec, Plan) or spec.mp == 1:
        return None
    plan: Plan = spec
    if plan.placement is None and place is not None:
        plan = place(plan, module)
    if plan.placement is None:
        raise UserError(f"mp={plan.mp}: parallelize needs the placement (which layers run on which of the {plan.mp} "
                        "devices): pass a placement Plan (`hybridpar place --out`), placement={...}, or call "
                        "hybridpar.parallelize(module, strategy, example_inputs=...) to run the placer")
    return plan


def _parallelize_mp(module: nn.Module, plan: Plan, check_inputs: Any, options: dict[str, Any]) -> nn.Module:
    from hybridpar.parallel.pipeline.engine import batch_rows, check_mp_plan
    from hybridpar.parallel.pipeline.module import parallelize_mp

    if options.pop("inputs", "global") != "global":
        raise UserError("parallelize with mp > 1: inputs='global' only (every rank passes the global batch)")
    for ignored in ("comm_log", "grid", "extra_ops", "materialize"):
        if options.get(ignored) is not None:
            raise UserError(f"parallelize with mp > 1 takes no {ignored}")
        options.pop(ignored, None)
    if check_inputs is not None:  # before the first collective
        ex = tuple(check_inputs) if isinstance(check_inputs, (tuple, list)) else (check_inputs,)
        check_mp_plan(module, plan, batch_rows(ex), example_inputs=options.get("example_inputs"),
                      bn_stats=options.get("bn_stats", "global"))
    return parallelize_mp(module, plan, **options)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The undistributed model's state_dict (names and shapes of the module before parallelize), on
    every rank. Collective."""
    state = getattr(module, "hybridpar", None)
    if _is_mp(state):
        full = state.full_state_dict(everywhere=True)
        assert full is not None  # everywhere=True
        return full
    if not isinstance(state, ParallelState):
        raise UserError("full_state_dict: the module was not parallelized with hybridpar.parallelize")
    full = gather_full_state(module.state_dict(), state.shards(), state.grid.comm_log, everywhere=True)
    assert full is not None  # everywhere=True
    return full


def no_sync(module: nn.Module) -> AbstractContextManager[None]:
    """Context manager: backward passes inside accumulate gradients without synchronising them."""
    state = getattr(module, "hybridpar", None)
    if _is_mp(state):
        return state.no_sync()
    if not isinstance(state, ParallelState) or state.grad_sync is None:
        raise UserError("no_sync: the module was not parallelized with hybridpar.parallelize")
    return state.grad_sync.no_sync()


def _is_mp(state: Any) -> TypeGuard[MPState]:
    """Whether parallelize ran a model-parallel plan on the module (pipeline.module.MPState)."""
    import sys

    mod = sys.modules.get("hybridpar.parallel.pipeline.module")  # loaded whenever such a state exists
    return mod is not None and isinstance(state, mod.MPState)
