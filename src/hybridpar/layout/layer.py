"""LayerLayout: how one layer is split over the ranks of its data-parallel worker."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

# Named degrees, outermost first: rank order is row-major over them (a layout without spatial splits
# keeps the sample, channel, filter order it always had).
ORDER = ("sample", "depth", "height", "width", "channel", "filter")
ZERO_LEVELS = (0, 2, 3)  # LayerLayout.zero: 0 replicated, 2 sharded (kept whole from forward to backward), 3 resharded


class LayerLayout(BaseModel):
    """Degrees over the named mesh dimensions.

    sample: sample (batch) parallel degree; channel: input channels / in_features split (stationary-x,
    row-parallel FC); filter: output filters / out_features split (stationary-y, column-parallel FC).
    channel and filter together are stationary-w. depth/height/width: one sample's spatial dimensions
    split with halo exchange (Dryden et al. IPDPS'19; dims 2.. of N C [D] H W activations: a 2-D
    layer's height is dim 2, width dim 3; a 3-D layer's depth is dim 2). The product of all degrees
    == ranks of one DP worker group; rank order is row-major over SPATIAL_ORDER.

    zero: how the sample dimension holds the parameters (not a degree: it multiplies no rank count).
    0: replicated on every sample rank (DDP-like); 2: sharded over the sample ranks (parameters,
    gradients and optimizer state), gathered whole for forward and kept whole until backward ends
    (FSDP2 reshard_after_forward=False); 3: sharded, gathered for forward, freed, gathered again in
    backward (ZeRO-3, FSDP2 `fully_shard`). Strategy key `zero=2|3`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    sample: int = Field(1, ge=1)
    channel: int = Field(1, ge=1)
    filter: int = Field(1, ge=1)
    depth: int = Field(1, ge=1)
    height: int = Field(1, ge=1)
    width: int = Field(1, ge=1)
    zero: int = 0

    @field_validator("zero")
    @classmethod
    def _zero_level(cls, v: int) -> int:
        if v not in ZERO_LEVELS:
            raise ValueError(f"zero must be 0, 2 or 3, got {v}")
        return v

    @model_serializer(mode="wrap")
    def _omit_zero(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Plans without sharding serialise as they always did (no `zero` key)."""
        out = handler(self)
        if isinstance(out, dict) and not self.zero:
            out.pop("zero", None)
        return out

    @property
    def size(self) -> int:
        return self.sample * self.spatial * self.channel * self.filter

    @property
    def spatial(self) -> int:
        """Ranks splitting one sample's spatial dimensions (depth x height x width)."""
        return self.depth * self.height * self.width

    @property
    def g_size(self) -> int:
        """Ranks sharing one sample group's activations: the channel pieces at a layer boundary."""
        return self.channel * self.filter

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ORDER}

    @property
    def algorithm(self) -> str:
        if self.channel > 1 and self.filter > 1:
            return "stationary-w"
        if self.channel > 1:
            return "stationary-x"
        if self.filter > 1:
            return "stationary-y"
        if self.spatial > 1:
            return "spatial"
        return "sample"

    def to_strategy(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ORDER if getattr(self, k) > 1] or ["sample=1"]
        if self.zero:
            parts.append(f"zero={self.zero}")
        return ",".join(parts)

    def zero_refusal(self) -> str | None:
        """Why this layout's sharded sample dimension cannot run yet (None: it can, or zero=0)."""
        if self.zero and self.spatial > 1:
            return (f"layout {self.to_strategy()}: zero={self.zero} (parameters sharded over the sample ranks) "
                    "runs with sample and channel/filter layouts for now, not with spatial splits; use "
                    f"sample={self.size},zero={self.zero}, or drop zero")
        return None
