"""The Plan: everything the runtime needs, nothing about how it was found. JSON, versioned."""

from __future__ import annotations

import os
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from hybridpar.errors import UserError
from hybridpar.files import atomic_write
from hybridpar.jsonfile import read_json
from hybridpar.layout import LayerLayout  # the one layout vocabulary; re-exported here

SCHEMA_VERSION: Final = 1


class _Frozen(BaseModel):
    # No inf/NaN: JSON cannot carry them, so such a plan would not survive its own save/load.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Prediction(_Frozen):
    """Predicted per-step figures (seconds, bytes)."""

    step_time_s: float = Field(ge=0)
    compute_s: float = Field(0.0, ge=0)
    comm_s: float = Field(0.0, ge=0)
    exposed_comm_s: float = Field(0.0, ge=0)
    idle_s: float = Field(0.0, ge=0)
    memory_bytes: list[int] = Field(default_factory=list)
    comm_bytes: dict[str, int] = Field(default_factory=dict)
    per_layer: dict[str, dict[str, float]] = Field(default_factory=dict)


def _boolean_at(data: Any, path: str) -> str | None:
    """The path of the first boolean in plain JSON data, or None."""
    if isinstance(data, bool):
        return path
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _boolean_at(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class Plan(_Frozen):
    schema_version: Literal[1] = SCHEMA_VERSION
    model: str = Field(min_length=1)
    input_shape: list[int] | None = None
    cluster: str = "localhost"
    world_size: int = Field(ge=1)
    batch: int = Field(ge=1, description="global batch per step")
    dp: int = Field(1, ge=1, description="data-parallel replicas of one MP group")
    mp: int = Field(1, ge=1, description="devices per data-parallel worker (model parallel)")
    default_layout: LayerLayout = LayerLayout()
    layers: dict[str, LayerLayout] = Field(default_factory=dict, description="module name -> layout")
    placement: dict[str, int] | None = Field(None, description="module/node name -> device in MP group")
    strategy: str | None = None
    predicted: Prediction | None = None
    notes: list[str] = Field(default_factory=list)
    # "all": every block recomputes its activations in backward (`train --recompute all`); None: not
    # set (the run's --recompute decides). Serialised only when set: older plans stay byte-identical.
    recompute: Literal["none", "all"] | None = None
    # The blocks (hybridpar.layout.blocks.block_of names) that recompute: the planner's per-block choice
    # (`plan --recompute auto`); None: `recompute` decides for every block. Serialised only when set.
    recompute_blocks: list[str] | None = None
    # GPipe micro-batches per replica of a model-parallel plan, as the placer chose them (its bubble
    # priced); None: not chosen (one, unless the run says). Serialised only when set, as recompute.
    micro_batches: int | None = Field(None, ge=1)
    # The micro-batch schedule of a model-parallel plan: "gpipe" (all forwards, then all backwards) or
    # "1f1b" (torch.distributed.pipelining's one-forward-one-backward, for a chain of stages), as the
    # placer chose it with the count; None: not chosen (gpipe). Serialised only when set, as recompute.
    schedule: Literal["gpipe", "1f1b"] | None = None
    # Time chunks per recurrent layer of a model-parallel plan (the time-step wavefront, as the placer
    # chose and priced it; 1: whole layers); None: not chosen (whole). Serialised only when set.
    time_chunks: int | None = Field(None, ge=1)
    # Priced for channels-last (NHWC) memory (`plan --channels-last`, as `train --channels-last` runs):
    # "measured" every 4-D op from this machine's channels-last records, "partly-measured" some of them
    # as NCHW, "nchw-priced" all of them as NCHW (no channels-last records: a GPU preset, or not
    # profiled); None: planned for NCHW. Serialised only when set, as recompute.
    channels_last: Literal["measured", "partly-measured", "nchw-priced"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_booleans(cls, data: Any) -> Any:
        """`true` is not 1: a plan holds no booleans, and pydantic's lax ints would take them."""
        where = _boolean_at(data, "")
        if where is not None:
            raise ValueError(f"{where or 'plan'}: true/false where a number or text is expected")
        return data

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> Any:
        out = handler(self)
        if isinstance(out, dict):
            for key in ("recompute", "micro_batches", "recompute_blocks", "schedule", "time_chunks",
                        "channels_last"):
                if getattr(self, key) is None:
                    out.pop(key, None)
        return out

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if self.dp * self.mp != self.world_size:
            raise ValueError(f"dp*mp = {self.dp}*{self.mp} != world_size {self.world_size}")
        per_worker = self.world_size // self.mp
        for name, lay in [("default_layout", self.default_layout), *self.layers.items()]:
            if lay.size != per_worker:
                raise ValueError(f"layout of {name} uses {lay.size} ranks, expected {per_worker}")
        if self.recompute_blocks is not None and self.recompute == "all":
            raise ValueError("recompute_blocks: names some blocks, but recompute is 'all' (every block)")
        if self.placement is not None:
            bad = {k: v for k, v in self.placement.items() if not 0 <= v < self.mp}
            if bad:
                k, v = next(iter(bad.items()))
                raise ValueError(f"placement[{k}] = {v} outside 0..{self.mp - 1}")
        # No batch % dp check: with mp == 1, dp is the rank count, and the batch is cut by the sample degree
        # only (unevenly where it does not divide; a channel/filter layout gives every rank all of it). The
        # planner refuses a sample degree above the batch, the MP runtime checks its own split.
        return self

    def layout_of(self, module_name: str) -> LayerLayout:
        return self.layers.get(module_name, self.default_layout)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def save(self, path: str | os.PathLike) -> None:
        """Atomic write: a kill never leaves a half-written plan."""
        atomic_write(path, self.to_json())


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "plan"
    return f"{loc}: {e['msg']}"


def plan_from_dict(data: object) -> Plan:
    if not isinstance(data, dict):
        raise UserError("plan: expected a JSON object")
    if data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise UserError(f"plan: schema_version {data.get('schema_version')!r} unsupported "
                        f"(this hybridpar reads {SCHEMA_VERSION})")
    try:
        return Plan.model_validate(data)
    except ValidationError as err:
        raise UserError(f"invalid plan: {_first_error(err)}") from None


def load_plan(path: str | os.PathLike) -> Plan:
    return plan_from_dict(read_json(path, "plan"))
