"""Joint choice for a GPU budget: per-worker batch, DP degree and MP degree (or channel/filter groups)
that minimise time to target under the device memory limit, with the reason in one paragraph.

Time to target splits into three terms (they sum to it exactly):
    compute     = E_min      x steps/epoch x (step - exposed comm)   what the work costs at best
    allreduce   = E(B)       x steps/epoch x exposed comm            gradient sync not hidden by backward
    extra epochs= (E(B)-E_min) x steps/epoch x (step - exposed comm) statistical-efficiency loss at batch B
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridpar.convergence.builtin import WorkloadCurve
from hybridpar.errors import InfeasibleError, UserError
from hybridpar.search.projection.model import MP_DEGREES, Point, StepCosts, project

BATCH_OPTIONS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Terms:
    compute_s: float
    allreduce_s: float
    extra_epochs_s: float

    @property
    def dominant(self) -> str:
        named = {"compute": self.compute_s, "allreduce": self.allreduce_s, "extra epochs": self.extra_epochs_s}
        return max(named, key=named.__getitem__)


@dataclass(frozen=True)
class JointChoice:
    budget: int
    best: Point
    terms: Terms
    dp_only: Point | None  # best fitting DP-only option at the same budget, for comparison
    candidates: tuple[Point, ...]
    rejected_memory: int
    explanation: str

    def to_dict(self) -> dict:
        return {"budget_gpus": self.budget, "choice": {**self.best.__dict__, "family": self.best.family},
                "terms_s": {"compute": self.terms.compute_s, "allreduce": self.terms.allreduce_s,
                            "extra_epochs": self.terms.extra_epochs_s},
                "dominant": self.terms.dominant,
                "dp_only": self.dp_only.__dict__ if self.dp_only else None,
                "candidates_considered": len(self.candidates), "rejected_for_memory": self.rejected_memory,
                "explanation": self.explanation}


def terms_of(p: Point, curve: WorkloadCurve) -> Terms:
    per_epoch_steps = p.steps / p.epochs
    e_min = getattr(curve.curve, "e_min", None) or curve.curve.epochs(1)
    work = p.step_s - p.exposed_comm_s
    return Terms(e_min * per_epoch_steps * work, p.epochs * per_epoch_steps * p.exposed_comm_s,
                 (p.epochs - e_min) * per_epoch_steps * work)


def choose(costs: StepCosts, curve: WorkloadCurve, budget: int, *, batch_options: Sequence[int] = BATCH_OPTIONS,
           mp_degrees: Sequence[int] = MP_DEGREES, progress: Callable[[str], None] | None = None) -> JointChoice:
    """Search per-worker batch x strategy on exactly `budget` GPUs; only options that fit in memory."""
    if budget < 1:
        raise UserError(f"budget must be >= 1 GPU, got {budget}", param="budget")
    if not batch_options or any(b < 1 for b in batch_options):
        raise UserError("batch_options must list positive batch sizes", param="batch_options")
    cands: list[Point] = []
    for b in sorted(set(batch_options)):
        if progress:
            progress(f"batch {b}/GPU")
        cands += [p for p in project(costs, curve, [budget], b, mp_degrees=mp_degrees).points if p.gpus == budget]
    fitting = [p for p in cands if p.fits]
    if not fitting:
        need = min(cands, key=lambda p: p.memory_bytes)
        raise InfeasibleError(f"no option fits in {costs.capacity_bytes / 2**30:.1f} GiB per GPU on {budget} GPUs; "
                              f"the smallest ({need.strategy}, batch {need.global_batch // need.dp}/worker) needs "
                              f"{need.memory_bytes / 2**30:.1f} GiB")
    best = min(fitting, key=lambda p: p.time_s)
    dp = min((p for p in fitting if p.family == "DP"), key=lambda p: p.time_s, default=None)
    terms = terms_of(best, curve)
    # the runner-up from another family than the choice and DP, so the paragraph says why it lost
    other = min((p for p in fitting if p.family not in (best.family, "DP")), key=lambda p: p.time_s, default=None)
    text = explain(best, terms, dp, curve, budget, len(cands) - len(fitting), other)
    return JointChoice(budget, best, terms, dp, tuple(cands), len(cands) - len(fitting), text)


def explain(best: Point, t: Terms, dp: Point | None, curve: WorkloadCurve, budget: int, rejected: int,
            other: Point | None = None) -> str:
    total = t.compute_s + t.allreduce_s + t.extra_epochs_s
    pct = {k: 100 * v / total for k, v in
           (("compute", t.compute_s), ("allreduce", t.allreduce_s), ("extra epochs", t.extra_epochs_s))}
    how = (f"{best.dp} data-parallel workers with the parameters sharded (FSDP, zero=3) and every block "
           "recomputed" if best.family == "FSDP" else f"{best.dp} data-parallel workers" if best.mp == 1 else
           f"{best.dp} data-parallel workers x {best.mp}-way "
           f"{'model parallelism' if best.family == 'hybrid' else 'channel/filter parallelism'}")
    s = (f"On {budget} GPUs the fastest option is {best.strategy}: {how} at {best.global_batch // best.dp} "
         f"samples per worker (global batch {best.global_batch:,}), {best.epochs:.3g} epochs to target. "
         f"Its time splits into compute {pct['compute']:.0f}%, exposed allreduce {pct['allreduce']:.0f}% and "
         f"extra epochs from the large batch {pct['extra epochs']:.0f}%, so {t.dominant} dominates.")
    if dp is not None and dp is not best:
        s += _versus(dp, best, curve, "The best data-parallel-only option")
    elif dp is None:
        s += " No data-parallel-only option fits in memory at this budget."
    if other is not None:
        s += _versus(other, best, curve, f"The best {other.family} option ({other.strategy})")
    if rejected:
        s += f" {rejected} option(s) were rejected because they exceed device memory."
    if curve.borrowed:
        s += " The convergence curve is borrowed from another workload (see notes), so the epochs term is uncertain."
    return s


def _versus(loser: Point, best: Point, curve: WorkloadCurve, what: str) -> str:
    lt, bt = terms_of(loser, curve), terms_of(best, curve)
    # the term by which the loser falls furthest behind the choice
    gaps = {k: getattr(lt, _attr(k)) - getattr(bt, _attr(k)) for k in ("compute", "allreduce", "extra epochs")}
    worst = max(gaps, key=gaps.__getitem__)
    return (f" {what} (global batch {loser.global_batch:,}) is {loser.time_s / best.time_s:.2f}x slower, "
            f"mostly from its {worst} term ({gaps[worst] / best.time_s:+.0%} of the chosen option's time).")


def _attr(term: str) -> str:
    return {"compute": "compute_s", "allreduce": "allreduce_s", "extra epochs": "extra_epochs_s"}[term]
