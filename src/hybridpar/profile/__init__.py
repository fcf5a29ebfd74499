"""hybridpar.profile: measure this machine (op times, matmul peak, gloo collectives) and write the
calibration file (`hybridpar.cluster.calibration`) that the `localhost` cluster and
`hybridpar.cost.compute.op_time` read. A tool on top: nothing below the command line imports it.

Importing this package does not import torch; the measuring modules (ops, gloo, run) do.
"""

from hybridpar.cluster.calibration import (
    Calibration,
    CollectiveFit,
    GlooFit,
    Measurement,
    OpRecord,
    default_calibration_path,
    load_calibration,
    op_key,
    save_calibration,
)

__all__ = ["Calibration", "CollectiveFit", "GlooFit", "Measurement", "OpRecord", "default_calibration_path",
           "load_calibration", "op_key", "save_calibration"]
