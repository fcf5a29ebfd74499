"""Never save or continue from non-finite state: the check `hybridpar train` runs around every update.

A step can leave finite weights and still put Inf into a batch norm's running variance (lr 1e7 on
small_cnn does, from step 2 on), or overflow the weights or the optimizer's state in the update itself;
the loss and the gradients alone do not show it. Every step, `StateGuard` checks the loss, this rank's
gradients (`before_update`, taken before clipping and the optimizer step) and, after the update, every
floating tensor a checkpoint would hold: the weights, the buffers (batch-norm running statistics) and the
optimizer's state (momentum, Adam moments) (`submit`). One verdict on all of them per step, and nothing
of a bad step is kept: the run stops and writes nothing. Its cost:
- one screen over the gradients and one over the state (hybridpar.parallel.finite.screens: on CPU a
  float64 sum of the concatenated small tensors, which cannot overflow and is NaN/Inf exactly when an
  entry is; elsewhere a multi-tensor max-|x|), one stacked isfinite and one device sync;
- the tensors found by walking the modules' parameters and persistent buffers and the optimizer's
  state, not through state_dict and DTensor.to_local (several times slower); the walk is checked once
  against the checkpoint's own list (`named_state`) and replaced by it where they differ; the gradients
  are the optimizer's parameters'. Names are looked up only on the failing path;
- no collective where every rank's verdict is the same (sample-only layouts: the loss, the summed
  gradients, the weights and the optimizer state agree on every rank; with per-rank batch-norm
  statistics the buffers' flag rides in the gradient allreduce, `use_buffer_rider`), else one 16-byte
  allreduce (MAX of two flags) that the step does not wait for: its verdict is taken with the next
  step's, or before a checkpoint, a callback or the end of the run (`settle`).
Measured side by side, guard on and off: benchmarks/bench_train_overhead.py (docs/hardening.md).

`--max-loss-ratio R` (off by default): `loss_exploded` stops a run whose loss exceeds R times the
first loss this run computed (the same value on every rank: no collective)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybridpar.parallel.finite import first_bad, nonfinite_flag, peaks, screens

_LOSS, _GRADS = 2.0, 1.0  # the first flag's values, MAX-reduced: a bad loss on any rank names the loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece without DTensor.to_local's autograd call (~20 us each): the same storage."""
    return t._local_tensor if isinstance(t, DTensor) else t


def named_state(engine, optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, this rank's tensor) of every non-empty floating tensor a checkpoint of `engine` and
    `optimizer` holds: weights and buffers by their state_dict names, optimizer slots as
    "NAME (optimizer SLOT)"."""
    from hybridpar.train.checkpoint import local_tensors

    tensors, _ = local_tensors(engine)
    out = []
    for name, t in tensors.items():
        t = _local(t).detach()
        if t.is_floating_point() and t.numel():
            out.append((name, t))
    by_id = {id(t): n for n, t in tensors.items()}
    for p, st in optimizer.state.items():
        for slot, v in st.items():
            if torch.is_tensor(v):
                v = _local(v).detach()
                if v.is_floating_point() and v.numel() and not v.is_sparse:
                    out.append((f"{by_id.get(id(p), '?')} (optimizer {slot})", v))
    return out


def first_nonfinite(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or Inf, else None: one multi-tensor max-|x| kernel
    per dtype and device, one isfinite over the stacked peaks, one device sync."""
    named = [(n, t) for n, t in named if t.numel()]
    i = first_bad(peaks([t for _, t in named]))
    return None if i is None else named[i][0]


def _modules(engine) -> list[nn.Module] | None:
    module = getattr(engine, "module", None)
    return None if module is None else list(module.modules())


def _walk(modules: list[nn.Module] | None, optimizer, buffers: bool = True,
          others: bool = True) -> list[torch.Tensor] | None:
    """The tensors named_state finds, found without state_dict: the modules' parameters and persistent
    buffers and the optimizer's state, as they are (DTensors not unwrapped), or only the buffers or
    only the others; None without modules. The modules are listed once per run (the engine built
    them); their tensors are read every step, so a buffer replaced by a new tensor is seen."""
    if modules is None:
        return None
    out: list[torch.Tensor] = []
    for m in modules:
        if others:
            out.extend(p for p in m._parameters.values() if p is not None)
        if buffers:
            skip = m._non_persistent_buffers_set
            out.extend(b for n, b in m._buffers.items() if b is not None and n not in skip)
    if others:
        for st in optimizer.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def _checkable(raw: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's pieces of the floating, dense tensors among `raw` (what named_state keeps)."""
    return [_piece(t) for t in raw if t.is_floating_point() and not t.is_sparse]


def _named_raw(engine, optimizer) -> list[torch.Tensor]:
    from hybridpar.train.checkpoint import local_tensors

    tensors, _ = local_tensors(engine)
    raw = list(tensors.values())
    for st in optimizer.state.values():
        raw.extend(v for v in st.values() if torch.is_tensor(v))
    return raw


class StateGuard:
    """Around every optimizer step: are the loss, the gradients and the state every rank holds finite?
    See the module docstring.

    `agreed`: every rank holds the same state (its own verdict is every rank's), so no collective; the
    loss and the gradients agree on every rank where the engine's `grads_agree` says so."""

    def __init__(self, engine, optimizer, device, *, agreed: bool, max_loss_ratio: float | None = None):
        self.engine, self.optimizer, self.device = engine, optimizer, device
        self.agreed = agreed
        self.step_agreed = bool(getattr(engine, "grads_agree", False))
        self.max_loss_ratio = max_loss_ratio
        self.first_loss: float | None = None
        self._walk_ok: bool | None = None  # the module walk finds exactly named_state's tensors (checked once)
        self._mods: list[nn.Module] | None = None  # the engine's modules, listed at that check
        self._params: list[torch.Tensor] | None = None  # the optimizer's parameters (fixed for a run)
        self.buffer_rider = False  # this rank's buffers' verdict goes with the loss (use_buffer_rider)
        self._inflight: tuple | None = None  # submit's allreduce not yet waited for
        self._judged_step = -1
        self.bad: tuple[int, str, float] | None = None  # (step, what, loss): the first bad step judged

    @classmethod
    def for_run(cls, engine, optimizer, device, *, bn_stats: str = "global",
                max_loss_ratio: float | None = None) -> StateGuard:
        agreed = bool(getattr(engine, "grads_agree", False)) and bn_stats == "global"
        guard = cls(engine, optimizer, device, agreed=agreed, max_loss_ratio=max_loss_ratio)
        if not agreed and bool(getattr(engine, "grads_agree", False)) and hasattr(engine, "rider"):
            guard.use_buffer_rider()
        return guard

    def use_buffer_rider(self) -> None:
        """Sample-only layouts with per-rank batch-norm statistics: the weights, gradients and optimizer
        state agree on every rank, only the buffers differ. Their verdict (taken after the forward
        that updated them; nothing else writes them) goes with the step's loss in the engine's own
        collective (`engine.rider`), so the check needs none of its own."""
        self.buffer_rider = True
        self.engine.rider = self._buffers_flag

    def _buffers_flag(self) -> torch.Tensor:
        if self._mods is None:
            self._mods = _modules(self.engine)
        return nonfinite_flag(screens(_checkable(_walk(self._mods, self.optimizer, others=False) or [])))

    def before_update(self, loss: float) -> tuple:
        """This step's loss and this rank's gradients, before clipping and the update: the gradients'
        screens (no device sync). For submit."""
        if self._params is None:  # the optimizer's: the engine's parameters, without walking the modules
            self._params = [p for g in self.optimizer.param_groups for p in g["params"]] \
                if self.optimizer is not None else list(self.engine.parameters())
        return not math.isfinite(loss), screens([_piece(p.grad) for p in self._params if p.grad is not None])

    def state_tensors(self) -> list[torch.Tensor]:
        """This rank's pieces of every floating tensor a checkpoint holds (see the module docstring)."""
        if self._walk_ok is None:
            self._mods = _modules(self.engine)
            walked, named = _walk(self._mods, self.optimizer), _named_raw(self.engine, self.optimizer)
            self._walk_ok = walked is not None and \
                {id(t) for t in _checkable(walked)} == {id(t) for t in _checkable(named)}
        if not self._walk_ok:
            return _checkable(_named_raw(self.engine, self.optimizer))
        return _checkable(_walk(self._mods, self.optimizer, buffers=not self._riding()) or [])

    def _riding(self) -> bool:
        """Whether this step's buffers were judged by every rank through the engine's rider."""
        return self.buffer_rider and bool(self._walk_ok) and getattr(self.engine, "rider_values", None) is not None

    # --- the verdict: submit each step, settle before anything is kept --------------------------------
    def submit(self, pending: tuple | None, step: int, loss: float) -> None:
        """Judge `step` after its update: the loss and gradients (`pending`, before_update's; None: the
        state only) and every weight, buffer and optimizer slot; the verdict is the same on every rank.
        Where every rank's verdict agrees it is in at once; else the flags' allreduce (MAX of two) starts
        without waiting and its verdict is taken with the next submit or at `settle`, so a step does
        not wait for the slowest rank. The next step then runs from state not yet judged: the train
        loop keeps and reports nothing of a step before its verdict is in (`settle`, `judged`)."""
        self._take_inflight()
        step_flag, state_bad, collective = self._local_flags(pending)
        name = self._local_name(state_bad)
        if not collective:
            self._judged(step, loss, self._what(step_flag, state_bad, name))
            return
        flags = torch.tensor([step_flag, float(state_bad)], dtype=torch.float64, device=self.device)
        self._inflight = (step, loss, name, flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True))

    def settle(self) -> tuple[int, str, float] | None:
        """Wait for the verdict in flight; (step, what, loss) of the first bad step judged, else None.
        what: "loss", "gradients" or "state:NAME" (a weight, buffer or optimizer slot)."""
        self._take_inflight()
        return self.bad

    @property
    def judged(self) -> int:
        """The last step whose verdict is in (-1: none yet)."""
        return self._judged_step

    def check_step(self, pending: tuple | None) -> str | None:
        """submit and settle for one verdict of its own: "loss", "gradients", "state:NAME" or None."""
        self.bad = None
        self.submit(pending, self._judged_step + 1, math.nan)
        bad, self.bad = self.settle(), None
        return bad[1] if bad else None

    def after_update(self) -> str | None:
        """The name of a non-finite weight, buffer or optimizer slot (the same answer on every rank),
        else None: check_step without the loss and gradients. Collective unless `agreed`."""
        bad = self.check_step(None)
        return bad.removeprefix("state:") if bad else None

    def _local_flags(self, pending: tuple | None) -> tuple[float, bool, bool]:
        """(step flag, state bad, needs a collective): this rank's verdict, before any agreement."""
        loss_bad, grad_screens = pending if pending is not None else (False, [])
        i = first_bad(grad_screens + screens(self.state_tensors()))
        step_flag = _LOSS if loss_bad else _GRADS if i is not None and i < len(grad_screens) else 0.0
        state_bad = i is not None and i >= len(grad_screens)
        riding = self._riding()
        if riding:  # the buffers' verdict, every rank's (engine.rider); the rest agrees on every rank
            state_bad = state_bad or any(v > 0 for v in self.engine.rider_values)
            self.engine.rider_values = None  # used once: a step without the rider falls back to the collective
        step_agreed = pending is None or self.step_agreed
        collective = not ((self.agreed or riding) and step_agreed) and dist.is_initialized() \
            and dist.get_world_size() > 1
        return step_flag, state_bad, collective

    def _take_inflight(self) -> None:
        if self._inflight is None:
            return
        step, loss, name, flags, work = self._inflight
        self._inflight = None
        work.wait()
        step_flag, state_bad = flags.tolist()
        self._judged(step, loss, self._what(step_flag, bool(state_bad), name))

    def _judged(self, step: int, loss: float, what: str | None) -> None:
        self._judged_step = step
        if what is not None and self.bad is None:
            self.bad = (step, what, loss)

    def _what(self, step_flag: float, state_bad: bool, bad_name: str | None) -> str | None:
        if step_flag:
            return "loss" if step_flag == _LOSS else "gradients"
        return f"state:{self._agreed_name(bad_name)}" if state_bad else None

    def _local_name(self, state_bad: bool) -> str | None:
        """This rank's first non-finite tensor's name, looked up only when its own state is bad (taken at
        once: the next step may change which tensors are bad before the verdict is in)."""
        return first_nonfinite(named_state(self.engine, self.optimizer)) if state_bad else None

    def _agreed_name(self, bad: str | None) -> str:
        """The first non-finite tensor's name (only when stopping): this rank's, or a rank's that saw one."""
        if self.agreed or not dist.is_initialized() or dist.get_world_size() == 1:
            return bad or "?"
        names: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(names, bad)
        return next((n for n in names if n), "?")

    def loss_exploded(self, loss: float) -> str | None:
        """A one-line reason when `loss` exceeds max_loss_ratio times the first loss, else None."""
        if self.first_loss is None and math.isfinite(loss):
            self.first_loss = loss
        r = self.max_loss_ratio
        if r is None or self.first_loss is None or not math.isfinite(loss):
            return None
        if loss > r * abs(self.first_loss):
            return (f"the loss {loss:.4g} exceeds {r:g} times its first value {self.first_loss:.4g} "
                    "(--max-loss-ratio)")
        return None


def check_max_loss_ratio(value) -> float | None:
    """`max_loss_ratio` as given: None (off) or a finite number > 1; UserError otherwise."""
    from hybridpar.errors import UserError

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 1:
        raise UserError(f"max_loss_ratio must be a finite number > 1, got {value!r}", param="max_loss_ratio")
    return float(value)
