"""fp32 convolutions are priced at the TF32 tensor-core rate on GPUs that have one (PyTorch's default:
torch.backends.cudnn.allow_tf32 is True), fp32 matmuls at the fp32 rate (allow_tf32 is False for them);
a GPU without TF32 (V100) and other dtypes are unchanged."""

import torch

from hybridpar.cluster import load_cluster
from hybridpar.cost.compute import compute_dtype, roofline_time
from hybridpar.graph import trace


def _nodes():
    net = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(64 * 16, 256))
    g = trace(net, (torch.randn(32, 64, 4, 4),))
    return next(n for n in g.nodes if n.op == "conv2d"), next(n for n in g.nodes if n.op == "linear")


def test_fp32_conv_runs_at_tf32_where_the_gpu_has_it():
    h100, v100 = load_cluster("dgx-h100").device, load_cluster("dgx1-v100").device
    assert compute_dtype("conv2d", "fp32", h100) == "tf32"
    assert compute_dtype("linear", "fp32", h100) == "fp32"
    assert compute_dtype("conv2d", "fp32", v100) == "fp32"
    assert compute_dtype("conv2d", "bf16", h100) == "bf16"
    conv, fc = _nodes()
    # the fp32 conv is priced as the tf32 one; the fp32 linear stays slower than a tf32 one
    assert roofline_time(conv, h100, dtype="fp32").fwd_s == roofline_time(conv, h100, dtype="tf32").fwd_s
    assert roofline_time(fc, h100, dtype="fp32").fwd_s > roofline_time(fc, h100, dtype="tf32").fwd_s
    assert roofline_time(conv, v100, dtype="fp32").fwd_s == roofline_time(conv, v100, dtype="tf32").fwd_s
