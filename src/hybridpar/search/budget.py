"""Bounded work: `plan`, `place` and `project` estimate their problem's time and memory up front and
refuse one past the limit (UserError: one line, exit 2) before doing the work.

The estimates are deliberately simple and pessimistic, from the sizes the work grows with:

- pricing one collective over n ranks walks every rank (ring phases, per-link bottlenecks):
  about `SECONDS_PER_RANK` and `BYTES_PER_RANK` per rank (measured: one allreduce over 10^6 ranks of
  `dgx1-v100` took 10 s and 1.1 GB);
- the per-layer planner prices, for every weight layer (the model's graph nodes) and every candidate
  layout, the collectives of its sample, channel and filter groups, and solves an ILP with one term per
  (layer, layout) and one per (edge, layout pair) of each sample degree's space;
- the placer holds three M x M device tables and a CP-SAT model with a few variables per (task, device).

Limits: `MAX_SECONDS` (600 s) and `MAX_BYTES` (8 GiB), overridable with the environment variables
`HYBRIDPAR_PLAN_MAX_S` and `HYBRIDPAR_PLAN_MAX_BYTES` for a bigger machine or more patience.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hybridpar.errors import UserError

SECONDS_PER_RANK = 1e-5
BYTES_PER_RANK = 1.2e3
SECONDS_PER_ILP_TERM = 2e-5
BYTES_PER_ILP_TERM = 400.0
BYTES_PER_TABLE_ENTRY = 100.0  # a Python float in a tuple of tuples, three tables, with slack

MAX_SECONDS = 600.0
MAX_BYTES = 8 * 2**30


@dataclass(frozen=True)
class Estimate:
    seconds: float
    bytes: float


def _limit(var: str, default: float) -> float:
    text = os.environ.get(var)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{var}={text!r}: expected a number") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{var}={text!r}: expected a finite number > 0")
    return value


def limits() -> tuple[float, float]:
    """(seconds, bytes) a planning command may be estimated to take."""
    return _limit("HYBRIDPAR_PLAN_MAX_S", MAX_SECONDS), _limit("HYBRIDPAR_PLAN_MAX_BYTES", MAX_BYTES)


def _size(b: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b / 2**10:.3g} KiB"


def check(what: str, est: Estimate, hint: str) -> Estimate:
    """UserError (one line) when `est` is past the limits; else `est`."""
    max_s, max_b = limits()
    if est.seconds > max_s or est.bytes > max_b:
        raise UserError(f"{what} is too large to plan: estimated ~{est.seconds:,.0f} s and ~{_size(est.bytes)} "
                        f"(limits {max_s:,.0f} s, {_size(max_b)}; HYBRIDPAR_PLAN_MAX_S / HYBRIDPAR_PLAN_MAX_BYTES "
                        f"raise them); {hint}")
    return est


def collective_estimate(ranks: int, collectives: float = 1.0) -> Estimate:
    """Pricing `collectives` collectives over `ranks` ranks (memory: the largest one at a time)."""
    return Estimate(collectives * ranks * SECONDS_PER_RANK, ranks * BYTES_PER_RANK)


def layer_plan_estimate(nodes: int, gpus: int, spaces: dict[object, list]) -> Estimate:
    """The per-layer planner over `nodes` weight layers, `gpus` ranks and the candidate layouts of each
    sample degree (`spaces`: key -> layouts with .sample/.channel/.filter), plus the data-parallel baseline."""
    seen: set = set()
    rank_work = gpus  # the baseline's allreduce
    ilp = 0.0
    for layouts in spaces.values():
        for lay in layouts:
            if lay not in seen:
                seen.add(lay)
                rank_work += lay.sample + lay.channel + lay.filter
        ilp = max(ilp, nodes * len(layouts) + nodes * len(layouts) ** 2)
    seconds = nodes * rank_work * SECONDS_PER_RANK + ilp * len(spaces) * SECONDS_PER_ILP_TERM
    return Estimate(seconds, gpus * BYTES_PER_RANK + ilp * BYTES_PER_ILP_TERM)


# `hybridpar project` prices, for each GPU count, data parallelism and each model-parallel degree with
# bucketed gradient allreduces and hierarchical variants: measured ~300-400 collectives per count
# (resnet50 on dgx1-v100 at 10,000 GPUs: 36 s, 0.55 GB).
PROJECT_COLLECTIVES_PER_STRATEGY = 100


def projection_estimate(gpus: list[int] | tuple[int, ...], strategies: int) -> Estimate:
    """`hybridpar project` over the GPU counts `gpus` with `strategies` strategies per count."""
    work = sum(gpus) * strategies * PROJECT_COLLECTIVES_PER_STRATEGY
    return Estimate(work * SECONDS_PER_RANK, max(gpus) * BYTES_PER_RANK * 4)


def check_projection(gpus, mp_degrees) -> Estimate:
    """UserError when `hybridpar project` over `gpus` (with data parallelism and `mp_degrees`) is past the limits."""
    return check(f"projection over {', '.join(f'{g:,}' for g in gpus)} GPUs",
                 projection_estimate(tuple(gpus), 1 + len(mp_degrees)), "project fewer or smaller GPU counts")


def placer_tables_estimate(devices: int) -> Estimate:
    """The placer's M x M device tables (bandwidth, latency, links)."""
    return Estimate(3 * devices**2 * 1e-6, 3 * devices**2 * BYTES_PER_TABLE_ENTRY)


def placer_ilp_estimate(tasks: int, devices: int) -> Estimate:
    """Building the placer's CP-SAT model: a few variables per (task, device) (the solve itself stops at
    the user's --time-limit, which is not counted)."""
    terms = 4.0 * tasks * devices
    return Estimate(terms * SECONDS_PER_ILP_TERM, terms * BYTES_PER_ILP_TERM)
