"""LayerLayout: how one layer is split over the ranks of its data-parallel worker."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LayerLayout(BaseModel):
    """Degrees over the named mesh dimensions.

    sample: sample (batch) parallel degree; channel: input channels / in_features split (stationary-x,
    row-parallel FC); filter: output filters / out_features split (stationary-y, column-parallel FC).
    channel and filter together are stationary-w. sample*channel*filter == ranks of one DP worker group.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    sample: int = Field(1, ge=1)
    channel: int = Field(1, ge=1)
    filter: int = Field(1, ge=1)

    @property
    def size(self) -> int:
        return self.sample * self.channel * self.filter

    @property
    def g_size(self) -> int:
        """Ranks sharing one sample group's activations: the channel pieces at a layer boundary."""
        return self.channel * self.filter

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {"sample": self.sample, "channel": self.channel, "filter": self.filter}

    @property
    def algorithm(self) -> str:
        if self.channel > 1 and self.filter > 1:
            return "stationary-w"
        if self.channel > 1:
            return "stationary-x"
        if self.filter > 1:
            return "stationary-y"
        return "sample"

    def to_strategy(self) -> str:
        parts = [f"{k}={v}" for k, v in (("sample", self.sample), ("channel", self.channel),
                                          ("filter", self.filter)) if v > 1]
        return ",".join(parts) or "sample=1"
