"""DTensor's own collectives (the redistributions its op rules insert between our layers) in the
CommLog, beside our layers' collectives: a TorchDispatchMode sees every functional collective DTensor
issues, with its group, and ModuleTracker names the module it ran in. That includes the ones issued
inside DTensor's dispatch of an op (its inputs redistributed to what the op's rule needs: a bilinear
F.interpolate's spatially split input, a LayerNorm's split features, the inputs of an op run
replicated), which the mode sees by deferring DTensor's ops to DTensor (issue 30; gloo's own count
in tests/parallel/test_dtensor_log_bytes.py).

Kinds as in hybridpar.cost.collectives (allgather = the gathered result, reduce_scatter = the input,
allreduce = the buffer); tags start with "dtensor:" so they can be told from our layers' own."""

from __future__ import annotations

from math import prod

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_KINDS = {
    "all_gather_into_tensor": "allgather", "all_gather_into_tensor_coalesced": "allgather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "allreduce", "all_reduce_coalesced": "allreduce", "all_to_all_single": "alltoall",
    "broadcast": "broadcast",
}


def _group_size(name: str) -> int:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_world_size(_resolve_process_group(name))  # type: ignore[arg-type]  # a GroupName is a str


class DTensorCommLog(TorchDispatchMode):
    """Active around a forward and backward: each functional collective is recorded in `log` (and in
    `records`: module path, kind, group size, bytes)."""

    def __init__(self, log, tracker=None, priced: bool = False):
        super().__init__()
        self.log, self.tracker = log, tracker
        self.records: list[dict] = []
        self.priced = priced  # its records are moves the planner prices itself (hybridpar.parallel.check)

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # DTensor's own op: let DTensor run it. A mode is off the stack while it runs an op, so
            # the redistributions DTensor makes inside (an op's inputs gathered to what its rule
            # needs: F.interpolate's spatially split input) would go unseen; NotImplemented has
            # torch run DTensor's dispatch with this mode on the stack (as FakeTensorMode defers to
            # other subclasses), and its collectives on the local pieces come back here.
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional":
            kind = _KINDS.get(func._schema.name.split("::")[-1])
            if kind is not None:
                self._record(kind, func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, kind: str, func, args, kwargs) -> None:
        t = args[0]
        t = t[0] if isinstance(t, (list, tuple)) else t
        # the group's name is the last str argument (all_reduce's first is its reduce op: "sum")
        group = next((a for a in reversed((*args[1:], *kwargs.values())) if isinstance(a, str)), None)
        size = _group_size(group) if group is not None else 1
        nbytes = prod(t.shape) * t.element_size()
        if kind == "allgather":
            nbytes *= size
        module = ""
        if self.tracker is not None and self.tracker.parents:
            # the innermost: most dots ("Global", always among the parents, ties by length with a
            # root's child, e.g. "Ups.up", and is the innermost only when alone)
            named = [p for p in self.tracker.parents if p != "Global"]
            module = max(named, key=lambda p: p.count(".")) if named else "Global"
        self.records.append({"module": module, "kind": kind, "group_size": size, "bytes": nbytes,
                             **({"priced": True} if self.priced else {})})
        if self.log is not None and size > 1:
            self.log.record(kind, size, nbytes, f"dtensor:{module}")


_ACTIVE: list[DTensorCommLog] = []  # the recorders entered, innermost last


def watched(priced: bool = False):
    """Context manager for the collectives our DTensor rules issue (hybridpar.parallel.dtensor.rules),
    marked `priced` when the planner prices them itself. Where the active recorder is on the dispatch
    mode stack (our rules run from a torch-function mode or an autograd Function), it sees them: only
    the mark changes for the duration. Inside a dispatch (a custom op handler) it is off the stack and
    would not see them: a recorder of the same log and records watches them there. No-op if none."""
    from contextlib import contextmanager, nullcontext

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if not _ACTIVE:
        return nullcontext()
    outer = _ACTIVE[-1]
    if any(mode is outer for mode in _get_current_dispatch_mode_stack()):
        @contextmanager
        def marked():
            before, outer.priced = outer.priced, priced
            try:
                yield outer
            finally:
                outer.priced = before

        return marked()
    inner = DTensorCommLog(outer.log, outer.tracker, priced)
    inner.records = outer.records
    return inner


def recording(log):
    """Context manager: DTensor's collectives inside go to `log`, with module names."""
    from contextlib import ExitStack, contextmanager

    from torch.utils.module_tracker import ModuleTracker

    @contextmanager
    def ctx():
        with ExitStack() as stack:
            tracker = stack.enter_context(ModuleTracker())
            mode = stack.enter_context(DTensorCommLog(log, tracker))
            yield mode
    return ctx()


class RedistributionCount:
    """Calls of DTensor's `redistribute_local_tensor` that change a tensor's placements, forward and
    backward: every redistribution, a collective's or a local one (Replicate -> Shard takes a piece,
    with no message), each of which costs DTensor's Python machinery (~0.2 ms on this VM)."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0  # CPU time of this thread inside them (outermost calls), placements changed or not
        self.depth = 0


def counting_redistributions():
    """Context manager yielding a RedistributionCount of the redistributions run inside. DTensor's
    modules import the function by name, so each module's reference is wrapped (and restored)."""
    from contextlib import contextmanager

    import torch.distributed.tensor._api as api
    import torch.distributed.tensor._dispatch as dispatch
    import torch.distributed.tensor._redistribute as redist

    @contextmanager
    def ctx():
        count = RedistributionCount()
        original = redist.redistribute_local_tensor

        def counted(local, current, target, *args, **kwargs):
            import time

            if tuple(current.placements) != tuple(target.placements):
                count.calls += 1
            count.depth += 1
            t0 = time.thread_time()
            try:
                return original(local, current, target, *args, **kwargs)
            finally:
                count.depth -= 1
                if count.depth == 0:
                    count.seconds += time.thread_time() - t0

        mods = [m for m in (api, dispatch, redist) if getattr(m, "redistribute_local_tensor", None) is original]
        for m in mods:
            m.redistribute_local_tensor = counted  # type: ignore[attr-defined]
        try:
            yield count
        finally:
            for m in mods:
                m.redistribute_local_tensor = original  # type: ignore[attr-defined]
    return ctx()


def is_dtensor_tag(tag: str) -> bool:
    return tag.startswith("dtensor:")


__all__ = ["DTensorCommLog", "RedistributionCount", "counting_redistributions", "is_dtensor_tag", "recording",
           "torch", "watched"]
