"""Never save or continue from non-finite state: the check `hybridpar train` runs after every update.

The loss and the gradients are checked before the optimizer step (hybridpar.train.trainer). That is
not enough: a step can leave finite weights and still put Inf into a batch norm's running variance
(lr 1e7 on small_cnn does, from step 2 on), or overflow the weights or the optimizer's state in the
update itself. `StateGuard.after_update` checks, after every optimizer step, every floating tensor a
checkpoint would hold: the weights, the buffers (batch-norm running statistics) and the optimizer's
state (momentum, Adam moments). Cost: one fused reduction per step (`torch._foreach_norm(.., inf)`
over all of them, NaN propagates, no overflow), one stacked isfinite and one device sync; no
collective where every rank holds the same state (sample-only layouts with global batch-norm
statistics: every rank's verdict is the same), else one 8-byte allreduce.

`--max-loss-ratio R` (off by default): `loss_exploded` stops a run whose loss exceeds R times the
first loss this run computed (the same value on every rank: no collective)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


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
    if not named:
        return None
    peaks = torch._foreach_norm([t for _, t in named], float("inf"))
    kinds = {(p.dtype, p.device) for p in peaks}
    if len(kinds) == 1:  # the common case: one stack, one isfinite, one sync
        ok = torch.isfinite(torch.stack(peaks))
        if bool(ok.all()):
            return None
        return named[int((~ok).nonzero()[0, 0])][0]
    # stacked per dtype: a float64 peak above float32's range is finite, not Inf
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(peaks):
        groups.setdefault((p.dtype, p.device), []).append(i)
    bad_at = None
    flags = [(idx, torch.isfinite(torch.stack([peaks[i] for i in idx]))) for idx in groups.values()]
    if all(bool(ok.all()) for _, ok in flags):
        return None
    for idx, ok in flags:
        for j, good in zip(idx, ok.tolist()):
            if not good and (bad_at is None or j < bad_at):
                bad_at = j
    return named[bad_at][0]


class StateGuard:
    """After every optimizer step: is the state every rank holds finite? See the module docstring.

    `agreed`: every rank holds the same state (its own verdict is every rank's), so no collective."""

    def __init__(self, engine, optimizer, device, *, agreed: bool, max_loss_ratio: float | None = None):
        self.engine, self.optimizer, self.device = engine, optimizer, device
        self.agreed = agreed
        self.max_loss_ratio = max_loss_ratio
        self.first_loss: float | None = None

    @classmethod
    def for_run(cls, engine, optimizer, device, *, bn_stats: str = "global",
                max_loss_ratio: float | None = None) -> StateGuard:
        agreed = bool(getattr(engine, "grads_agree", False)) and bn_stats == "global"
        return cls(engine, optimizer, device, agreed=agreed, max_loss_ratio=max_loss_ratio)

    def after_update(self) -> str | None:
        """The name of a non-finite tensor (the same answer on every rank), else None. Collective
        unless `agreed`."""
        bad = first_nonfinite(named_state(self.engine, self.optimizer))
        if self.agreed or not dist.is_initialized() or dist.get_world_size() == 1:
            return bad
        flag = torch.tensor([0.0 if bad is None else 1.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(flag)
        if flag.item() == 0:
            return None
        names: list[str | None] = [None] * dist.get_world_size()  # only when stopping: who saw what
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
