"""PlacerConfig: how `place_model` searches and what it prices, one object instead of a dozen keywords.

The optimizer is named in `hybridpar train`'s words (`sgd` with `momentum`, `adamw`, `lars`), so that
`plan`, `place`, `project` and `train` share one vocabulary; the cost model's older names stay
accepted as aliases: `momentum` (= `sgd` with momentum > 0) and `adam` (Adam: AdamW's two moments,
its update timed as AdamW's loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridpar.errors import UserError
from hybridpar.search.options import with_options

RUN_OPTIMIZERS = ("sgd", "adamw", "lars")  # `hybridpar train --optimizer`
OPTIMIZER_ALIASES = ("momentum", "adam")  # the cost model's older names, still accepted
# The projection's models (Pal et al. 2019) train with momentum SGD: its placements are priced so.
PROJECTION_OPTIMIZER = {"optimizer": "sgd", "momentum": 0.9}


def optimizer_cost_name(optimizer: str, momentum: float = 0.0) -> str:
    """The cost model's name (hybridpar.cost.memory.OPTIMIZERS) of a run's optimizer; UserError
    naming `optimizer` for one neither vocabulary knows."""
    if optimizer not in RUN_OPTIMIZERS + OPTIMIZER_ALIASES:
        raise UserError(f"optimizer must be one of {', '.join(RUN_OPTIMIZERS)} (or the old names "
                        f"{', '.join(OPTIMIZER_ALIASES)}), got {optimizer!r}", param="optimizer")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not momentum >= 0:  # NaN too
        raise UserError(f"momentum must be >= 0, got {momentum!r}", param="momentum")
    from hybridpar.cost.update import optimizer_kind

    return optimizer_kind(optimizer, momentum)


@dataclass(frozen=True)
class PlacerConfig:
    """Everything `place_model` takes besides the model, the cluster and the device count.

    `time_limit_s`, `workers`, `seed` and `gap` fix the ILP's answer (its time limit is deterministic
    time; it stops within `gap` of its proven bound, None: ilp.DEFAULT_GAP). `time_chunks` K >= 2
    prices each recurrent layer as K time chunks, as the MP runtime runs them (`train --time-chunks K`:
    parallel/pipeline/wavefront.py; a what-if only on a torch.export graph; 0 or 1: whole layers; None:
    the placer's choice between whole layers and 4 chunks, api._choose_time_chunks).
    `free_order` prices DLPlacer's free schedule instead of the MP runtime's program order (a what-if).
    `optimizer`/`momentum`: what training steps with (its state in memory, its update in the step), in
    `train`'s words. `micro_batches`: GPipe micro-batches per replica (placer.micro); None: the placer
    chooses the count with the shortest predicted step (1 for a model with batch norm, whose statistics
    would be each micro-batch's); 1: no pipelining. `schedule`: "gpipe" or "1f1b" (a chain placement,
    K >= its stages; less activation memory); None: chosen with the count under the memory limit."""

    solver: str = "ilp"
    time_limit_s: float = 30.0
    batch: int | None = None  # per data-parallel worker (one MP group); None: DEFAULT_BATCH
    coarsen: int | None = None  # max nodes of the coarsened graph; None: DEFAULT_COARSEN
    input_shape: tuple[int, ...] | None = None
    dtype: str = "fp32"
    workers: int = 2
    mem_capacity_bytes: float | None = None
    time_chunks: int | None = None
    seed: int = 0
    free_order: bool = False
    gap: float | None = None
    # momentum SGD unless told: the optimizer the placer's models (Pal et al. 2019) and the projection
    # train with; `optimizer` given alone (keywords, `--optimizer`) is that optimizer with momentum 0
    optimizer: str = "sgd"
    momentum: float = 0.9
    micro_batches: int | None = None
    # "gpipe" | "1f1b" (placer.micro.choose_pipeline); None: the placer chooses it with the count
    schedule: str | None = None

    @property
    def optimizer_kind(self) -> str:
        """The optimizer in the cost model's names (UserError for an unknown one)."""
        return optimizer_cost_name(self.optimizer, self.momentum)

    @classmethod
    def of(cls, config: PlacerConfig | None = None, options: Mapping[str, Any] | None = None) -> PlacerConfig:
        """`config` (default: the defaults) with `options` (keyword arguments of place_model) over it;
        TypeError for a keyword that is not a field, as a misspelt keyword argument would raise. An
        `optimizer` given without `momentum` is that optimizer as `train` takes it (momentum 0)."""
        opts = dict(options or {})
        if "optimizer" in opts:
            opts.setdefault("momentum", 0.0)
        return with_options(cls, config, opts)
