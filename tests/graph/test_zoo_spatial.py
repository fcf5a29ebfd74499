"""The high-resolution models of spatial parallelism: U-Net (2-D segmentation) and CosmoFlow (3-D)."""

import pytest
import torch

from hybridpar.errors import UserError
from hybridpar.graph.models import load_model
from hybridpar.graph.tracing import trace
from hybridpar.graph.zoo import ZOO


def _double_conv(cin: int, cout: int) -> int:  # two 3x3 convs without bias, two batch norms (weight, bias)
    return 9 * cin * cout + 9 * cout * cout + 4 * cout


def test_unet_parameter_count():
    widths = [32, 64, 128, 256, 512]
    want = sum(_double_conv(a, b) for a, b in zip([3, *widths[:-1]], widths))
    for hi, lo in zip(reversed(widths[1:]), reversed(widths[:-1])):  # 2x2 transposed conv (bias), double conv
        want += 4 * hi * lo + lo + _double_conv(2 * lo, lo)
    want += 32 * 2 + 2  # the 1x1 head
    with torch.device("meta"):
        assert sum(p.numel() for p in ZOO["unet"].build().parameters()) == want == 7_763_074
    assert ZOO["unet"].input_shape == (3, 1024, 1024)


def test_cosmoflow_parameter_count():
    ch = [4, 32, 64, 128, 256, 256]
    want = sum(27 * a * b + b for a, b in zip(ch, ch[1:]))  # conv3d k=3 with bias
    want += 256 * 4**3 * 128 + 128 + 128 * 64 + 64 + 64 * 4 + 4  # the MLP on the 4^3 x 256 features
    with torch.device("meta"):
        assert sum(p.numel() for p in ZOO["cosmoflow"].build().parameters()) == want == 5_040_676
    assert ZOO["cosmoflow"].input_shape == (4, 128, 128, 128)


def test_unet_forward_at_odd_tiny_input_and_strided_down():
    torch.manual_seed(0)
    for down in ("pool", "conv"):
        m = ZOO["unet"].build(base=4, depth=2, down=down)
        y = m(torch.randn(2, 3, 20, 28))
        assert y.shape == (2, 2, 20, 28)
        y.sum().backward()
        assert all(p.grad is not None for p in m.parameters())


def test_cosmoflow_forward_tiny_and_input_shape():
    torch.manual_seed(0)
    m = ZOO["cosmoflow"].build(base=2)
    assert m(torch.randn(2, 4, 32, 32, 32)).shape == (2, 4)
    lm = load_model("cosmoflow", batch=1, device="meta", input_shape=(4, 32, 32, 32))
    g = trace(lm.module, lm.example_inputs, "cosmoflow")
    assert sum(n.op == "conv" for n in g.nodes) == 5 and g.nodes[0].out_shape == (1, 4, 32, 32, 32)
    with pytest.raises(UserError, match="--input-shape C,D,H,W"):
        load_model("cosmoflow", batch=1, device="meta", input_shape=(4, 32, 32))


def test_spatial_runtime_serves_every_module():
    from hybridpar.parallel.styles.spatial_layers import spatial_refusal

    for name in ("unet", "cosmoflow"):
        with torch.device("meta"):
            m = ZOO[name].build()
        assert [n for n, mod in m.named_modules() if spatial_refusal(mod)] == []
