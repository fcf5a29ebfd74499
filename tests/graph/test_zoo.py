"""Zoo: parameter counts against the published figures; FLOPs against torch.utils.flop_counter."""

import pytest
import torch

from hybridpar.graph.flops import matmul_flops
from hybridpar.graph.models import load_model
from hybridpar.graph.tracing import trace
from hybridpar.graph.zoo import ZOO

PUBLISHED_EXACT = {
    "resnet50": 25_557_032, "resnet101": 44_549_160, "resnet152": 60_192_808,
    "wide_resnet50_2": 68_883_240, "inception_v3": 27_161_264, "vgg16": 138_357_544,
    "gnmt": 160_671_297,
}
OURS = ["small_cnn", "small_resnet", "resnet50", "resnet101", "resnet152", "wide_resnet50_2", "resnet50_w2",
        "resnet50_w4", "resnet50_w8", "vgg16", "inception_v3", "inception_v3_noaux", "gnmt", "gnmt8", "biglstm"]


def _meta_params(name: str) -> int:
    with torch.device("meta"):
        m = ZOO[name].build()
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED_EXACT))
def test_published_parameter_counts_exact(name):
    assert ZOO[name].published_params == PUBLISHED_EXACT[name]
    assert _meta_params(name) == PUBLISHED_EXACT[name]


def test_biglstm_matches_rounded_published_size():
    # Jozefowicz et al. give 1.8 B (two significant digits).
    assert round(_meta_params("biglstm") / 1e8) == 18


def test_wide_variants_widen_only_the_bottleneck():
    # x2 is Wide-ResNet-50-2; each widening multiplies the 3x3 conv weights by k^2.
    assert _meta_params("resnet50_w2") == 68_883_240
    with torch.device("meta"):
        w4 = ZOO["resnet50_w4"].build()
    conv2 = w4.layer1[0].conv2
    assert (conv2.in_channels, conv2.out_channels) == (256, 256)
    assert w4.layer1[0].conv3.out_channels == 256 and w4.fc.in_features == 2048


def test_inception_noaux_is_inception_minus_aux_head():
    assert _meta_params("inception_v3_noaux") == ZOO["inception_v3_noaux"].published_params


@pytest.mark.parametrize("name", OURS)
def test_graph_flops_match_flop_counter(name, flop_counter):
    # Like with like: FlopCounterMode counts matmuls/convs (incl. nn.LSTM's decomposed gate
    # matmuls); we compare the matmul-class nodes' FLOPs. Big models run on the meta device.
    batch = 2  # Inception's aux-head BN needs >1 sample in training mode
    # GNMT at full width but 10 tokens: FLOPs are linear in T, and nn.LSTM on meta costs Python time per step.
    shape = (10,) if name.startswith("gnmt") else None
    lm = load_model(name, batch=batch, device="meta", input_shape=shape)
    g = trace(lm.module, lm.example_inputs, name)
    assert g.params == _meta_params(name)
    fwd, bwd = flop_counter(lm.module, lm.example_inputs)
    ours = matmul_flops(g)
    # Exact: both count 2*M*N*K per matmul/conv on the same shapes (the README says "equal").
    assert ours.fwd == fwd
    assert ours.bwd_data + ours.bwd_weight == bwd
    # Non-matmul ops are counted on top, but stay a small share of the total.
    assert ours.fwd <= g.fwd_flops <= 1.1 * ours.fwd
