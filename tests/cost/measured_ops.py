"""A calibration file of made-up measured records for every op of a graph (tests of cost.compute)."""

from __future__ import annotations

import math

from hybridpar.cluster.calibration import Calibration, Measurement, OpRecord
from hybridpar.cost.compute import FREE_OPS, local_shapes


def _m(s: float) -> Measurement:
    return Measurement(median_s=s, p10_s=s, p90_s=s, repeats=3)


def write_op_calibration(graph, path, weight_factor: float = 2.0) -> str:
    """Measured records of every op at the whole layer's shapes, at 1 and 1/2 of the samples (what
    `hybridpar profile --model M --splits 1,2` writes): forward t = 1 us per output element,
    backward-data 2t, backward-weight `weight_factor` t, on a device whose roofline is far slower (so an
    op left to it shows). Returns the path as a string."""
    ops = {}
    for n in graph.nodes:
        if n.op in FREE_OPS:
            continue
        for frac in (1.0, 0.5):
            loc = local_shapes(n, frac)
            t = math.prod(loc.y) * 1e-6
            key = loc.key(n.op)
            ops[key] = OpRecord(key=key, op=n.op, fwd=_m(t), bwd_data=_m(2 * t),
                                bwd_weight=_m(weight_factor * t) if n.params else None)
    path.write_text(Calibration(cpu_count=2, peak_flops_fp32=1e8, mem_bw_Bps=1e8, ops=ops).model_dump_json())
    return str(path)
