"""The one layout vocabulary, shared by the planner, the cost model and the runtime (pure Python, no
torch): a layer's split as placements over named mesh dimensions (DTensor's words), how a dimension
is cut into pieces, and which ranks form each communication group.

- Mesh: ranks form a row-major grid over the named dimensions `MESH_DIMS` (sample, channel, filter;
  room for height/width). Rank = (i_s * P_C + i_c) * P_F + i_f. Inside a sample group the G = P_C*P_F
  ranks sit at position g = i_c * P_F + i_f.
- Placements: `Shard(dim)`, `Replicate()`, `Partial()` per mesh dimension, as in
  torch.distributed.tensor. An activation between layers is `Shard(0)` on `sample` and `Shard(1)` on
  the flattened channel x filter dimension (G channel pieces); the runtime maps these one to one onto
  DTensor placements.
- Pieces: DTensor's convention (torch.chunk): ceil(n/p)-sized pieces, the last ones smaller or empty,
  so that a rank's local piece is exactly the DTensor shard of the same placement.

A new split kind is a new mesh dimension name here, plus its cost rule (hybridpar.cost.layout_comm)
and its runtime rule (hybridpar.parallel.styles), side by side.
"""

from hybridpar.layout.groups import (
    Groups,
    channel_groups,
    filter_groups,
    rank_of,
    sample_groups,
    shard_groups,
)
from hybridpar.layout.layer import LayerLayout
from hybridpar.layout.pieces import (
    GridPos,
    Split,
    held,
    inter,
    moved_channels,
    moved_elements,
    needed,
    overlap,
    piece_offsets,
    piece_sizes,
    ranges,
    received_channels,
)
from hybridpar.layout.placements import (
    MESH_DIMS,
    Partial,
    Placement,
    Replicate,
    Shard,
    activation_placements,
)

__all__ = [
    "MESH_DIMS", "GridPos", "Groups", "LayerLayout", "Partial", "Placement", "Replicate", "Shard",
    "Split", "activation_placements", "channel_groups", "filter_groups", "held", "inter",
    "moved_channels", "moved_elements", "needed", "overlap", "piece_offsets", "piece_sizes", "rank_of",
    "ranges", "received_channels", "sample_groups", "shard_groups",
]
