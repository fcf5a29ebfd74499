"""hybridpar.profile: measure this machine (op times, matmul peak, gloo collectives) and write the
calibration file that the `localhost` cluster and `hybridpar.cost.compute.op_time` read.

Importing this package does not import torch; the measuring modules (ops, gloo, run) do.
"""

from hybridpar.profile.calibration import (
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
