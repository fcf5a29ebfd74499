"""hybridpar.report: one self-contained HTML page per plan (and measured run)."""

from hybridpar.report.build import Report, build_report
from hybridpar.report.measured import Measured, load_measured, measured_from_dict

__all__ = ["Measured", "Report", "build_report", "load_measured", "measured_from_dict"]
