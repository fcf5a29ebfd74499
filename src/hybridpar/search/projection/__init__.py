"""End-to-end projection (Pal et al.): time to a target accuracy for DP, hybrid DP x MP and
channel/filter layouts over GPU counts, with statistical efficiency.

`model` holds the projection itself over abstract step costs (`StepCosts`), `joint` the joint choice
of batch and MP degree under a GPU budget, and `costs` the step costs of a zoo model on a cluster from
the cost model, the placer and the per-layer planner (imports torch: import it explicitly).
"""

from hybridpar.search.projection.joint import BATCH_OPTIONS, JointChoice, Terms, choose, explain, terms_of
from hybridpar.search.projection.model import (
    MP_DEGREES,
    CFStep,
    MPStep,
    Point,
    Profile,
    Projection,
    StepCosts,
    band_sensitivity,
    default_batch_per_gpu,
    overlapped_end,
    paper_margin,
    project,
    projection_data,
    shared_links_end,
)

__all__ = [
    "BATCH_OPTIONS",
    "MP_DEGREES",
    "CFStep",
    "JointChoice",
    "MPStep",
    "Point",
    "Profile",
    "Projection",
    "StepCosts",
    "Terms",
    "band_sensitivity",
    "choose",
    "default_batch_per_gpu",
    "explain",
    "overlapped_end",
    "paper_margin",
    "project",
    "projection_data",
    "shared_links_end",
    "terms_of",
]
