"""trace(): node kinds, shapes, module names, parameter attribution, FLOPs; torch.export fallback."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.errors import UserError
from hybridpar.graph.flops import lstm_flops, matmul_flops
from hybridpar.graph.models import load_model
from hybridpar.graph.tracing import trace


def _acyclic_and_ordered(g) -> bool:
    seen = set()
    for n in g.nodes:
        if not set(n.inputs) <= seen:
            return False
        seen.add(n.name)
    return True


def test_small_resnet_nodes_map_back_to_modules():
    lm = load_model("small_resnet", batch=2)
    g = trace(lm.module, lm.example_inputs, "small_resnet")
    mods = dict(lm.module.named_modules())
    assert dict(g.meta)["tracer"] == "torch.fx"
    assert _acyclic_and_ordered(g)
    assert g.params == sum(p.numel() for p in lm.module.parameters())
    convs = [n for n in g.nodes if n.op == "conv2d"]
    assert convs and all(isinstance(mods[n.module], nn.Conv2d) for n in convs)
    first = g.node("conv1")
    assert first.attr("kernel") == (3, 3) and first.attr("out_channels") == 16 and first.attr("bias") is False
    assert first.out_shape == (2, 16, 32, 32) and first.in_shapes == ((2, 3, 32, 32),)
    # First layer: no gradient w.r.t. the input image; later ones have one.
    assert first.bwd_data_flops == 0 and first.bwd_weight_flops == first.fwd_flops
    assert all(n.bwd_data_flops == n.fwd_flops for n in convs[1:])
    adds = [n for n in g.nodes if n.op == "add"]
    assert len(adds) == 3 and all(len(n.inputs) == 2 for n in adds) and all(n.module is None for n in adds)
    assert adds[0].attr("scope") == "layers.0"
    # Every non-input node reads something: shape-only ops were folded without cutting the DAG.
    assert all(n.inputs for n in g.nodes if n.op != "input")
    assert not any(n.op in ("fold", "reshape") for n in g.nodes)


def test_functional_ops_and_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, ids):
            h = self.emb(ids) * self.scale
            return F.linear(torch.tanh(h), self.emb.weight)  # output layer tied to the embedding

    m = Tied()
    g = trace(m, (torch.randint(0, 50, (3, 4)),))
    assert g.params == 50 * 8 + 8  # the tied weight counts once
    lin = next(n for n in g.nodes if n.op == "linear")
    assert lin.attr("in_features") == 8 and lin.attr("out_features") == 50
    assert lin.fwd_flops == 2 * 12 * 8 * 50 and lin.bwd_weight_flops == lin.fwd_flops
    assert [n.op for n in g.nodes] == ["input", "embedding", "mul", "pointwise", "linear"]


class ShapeBranch(nn.Module):
    """Python control flow on a tensor's shape: torch.fx cannot trace it, torch.export can."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        if y.shape[-1] > 4:
            y = F.max_pool2d(y, 2)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def test_export_fallback_for_untraceable_module(flop_counter):
    m = ShapeBranch()
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(m)
    g = trace(m, (x,))
    assert dict(g.meta)["tracer"] == "torch.export"
    assert [n.op for n in g.nodes] == ["input", "conv2d", "batchnorm", "relu", "maxpool", "adaptive_avgpool",
                                       "flatten", "linear"]
    conv = g.nodes[1]
    assert conv.module == "conv" and conv.attr("kernel") == (3, 3) and conv.out_shape == (2, 8, 16, 16)
    assert g.node(g.nodes[-1].name).module == "fc"
    assert g.params == sum(p.numel() for p in m.parameters())
    fwd, bwd = flop_counter(m, (x,))
    mm = matmul_flops(g)
    assert mm.fwd == fwd and mm.bwd_data + mm.bwd_weight == bwd


def test_value_dependent_control_flow_is_a_user_error():
    class ValueBranch(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(UserError, match="cannot trace"):
        trace(ValueBranch(), (torch.randn(2, 3),))


def test_wrong_input_shape_is_a_user_error():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 30 * 30, 2))
    with pytest.raises(UserError):
        trace(m, (torch.randn(1, 3, 16, 16),))


@pytest.mark.parametrize("cfg", [
    {"input_size": 6, "hidden": 8, "proj": 0, "layers": 1, "bidirectional": False, "input_grad": True},
    {"input_size": 6, "hidden": 8, "proj": 3, "layers": 2, "bidirectional": False, "input_grad": False},
    {"input_size": 5, "hidden": 4, "proj": 0, "layers": 2, "bidirectional": True, "input_grad": True},
])
def test_lstm_rule_matches_flop_counter(cfg, flop_counter):
    # On the meta device nn.LSTM decomposes into mm/addmm that FlopCounterMode counts; on CPU the
    # oneDNN kernel (used without projections) is opaque to it and counts 0.
    with torch.device("meta"):
        lstm = nn.LSTM(cfg["input_size"], cfg["hidden"], num_layers=cfg["layers"], proj_size=cfg["proj"],
                       bidirectional=cfg["bidirectional"], batch_first=True)
        x = torch.randn(3, 7, cfg["input_size"], requires_grad=cfg["input_grad"])
    fwd, bwd = flop_counter(lambda t: lstm(t)[0], (x,))
    ours = lstm_flops(batch=3, steps=7, **cfg)
    assert ours.fwd == fwd and ours.bwd_data + ours.bwd_weight == bwd


def test_meta_model_traces_without_weights():
    lm = load_model("biglstm", batch=1, device="meta")
    assert all(p.is_meta for p in lm.module.parameters())
    g = trace(lm.module, lm.example_inputs, "biglstm")
    assert g.params == 1_776_948_095
    lstm = next(n for n in g.nodes if n.op == "lstm")
    assert dict(lstm.attrs)["hidden"] == 8192 and dict(lstm.attrs)["proj"] == 1024
    assert g.nodes[-1].out_shape == (1, 20, 793_471)


def test_batch_one_with_batchnorm_after_global_pooling():
    # Training-mode BN cannot run on one value per channel; tracing must not need to.
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    g = trace(m, (torch.randn(1, 3, 8, 8),))
    assert [n.op for n in g.nodes][3] == "batchnorm" and g.nodes[3].out_shape == (1, 4, 1, 1)
    assert m.training and m[2].training


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bidirectional,proj", [(False, 0), (True, 0), (True, 3)])
def test_traced_lstm_shapes_equal_real_run(batch_first, bidirectional, proj):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(5, 6, num_layers=2, bidirectional=bidirectional, proj_size=proj,
                               batch_first=batch_first)

        def forward(self, x):
            out, (h, c) = self.rnn(x)
            return out.sum() + h.sum() + c.sum()

    m = Net()
    x = torch.randn(2, 7, 5)
    g = trace(m, (x,))
    assert g.node("rnn").out_shape == tuple(m.rnn(x)[0].shape)


def test_export_fallback_with_lstm_and_weight_matmul_on_meta(flop_counter):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.rnn = nn.LSTM(4, 8, batch_first=True, proj_size=2)
            self.w = nn.Parameter(torch.randn(2, 8))

        def forward(self, x):
            y = F.relu(self.conv(x))
            if y.shape[-1] > 2:  # defeats torch.fx
                y = F.max_pool2d(y, 2)
            out, _ = self.rnn(y.flatten(2).transpose(1, 2))
            return torch.matmul(out, self.w)

    with torch.device("meta"):
        m, x = Net(), torch.randn(2, 3, 8, 8)
    g = trace(m, (x,))
    assert dict(g.meta)["tracer"] == "torch.export"
    assert [n.op for n in g.nodes] == ["input", "conv2d", "relu", "maxpool", "flatten", "lstm", "linear"]
    assert g.node("lstm").module == "rnn" and g.node("lstm").out_shape == (2, 16, 2)
    assert g.nodes[-1].attr("in_features") == 2 and g.nodes[-1].attr("out_features") == 8
    assert g.params == sum(p.numel() for p in m.parameters())
    fwd, bwd = flop_counter(m, (x,))
    mm = matmul_flops(g)
    assert (mm.fwd, mm.bwd_data + mm.bwd_weight) == (fwd, bwd)


@pytest.mark.parametrize("shared", [False, True], ids=["q,k,v", "q,q,q"])
def test_scaled_dot_product_attention_flops(flop_counter, shared):
    """Separate q, k, v, and one tensor as all three (sdpa(q, q, q): the graph records its producer once;
    its FLOPs come from the call's own arguments, which raised an IndexError before)."""
    class SelfAttention(nn.Module):
        def __init__(self, d=16, heads=4):
            super().__init__()
            self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, q, q) if shared else F.scaled_dot_product_attention(q, k, v)
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

    # On CPU, SDPA may run the fused flash kernel that FlopCounterMode does not see; meta runs the
    # math path (batched matmuls), which it counts.
    with torch.device("meta"):
        m, x = SelfAttention(), torch.randn(2, 10, 16, requires_grad=True)
    g = trace(m, (x,))
    assert [n.op for n in g.nodes] == ["input", "linear", "attention", "linear"]
    assert g.nodes[1].bwd_data_flops == 0  # the traced input does not require a gradient
    fwd, bwd = flop_counter(m, (x,))
    mm = matmul_flops(g)
    assert mm.fwd == fwd
    assert mm.bwd_data + mm.bwd_weight == bwd - g.nodes[1].fwd_flops  # FlopCounter also did dL/dx


class _EncGru(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.enc = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.gru = nn.GRU(16, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        y, _ = self.gru(self.enc(self.emb(ids)))
        return self.head(y)


def test_transformer_layers_are_decomposed_and_recurrent_layers_priced(flop_counter):
    # torch.fx keeps nn.TransformerEncoderLayer as a leaf we have no rule for; the graph comes from
    # torch.export instead, with its linear layers, attention and norms as their own nodes.
    with torch.device("meta"):
        m, ids = _EncGru(), torch.randint(0, 20, (2, 6))
    g = trace(m, (ids,))
    assert dict(g.meta)["tracer"] == "torch.export"
    mods = {n.module for n in g.nodes}
    assert {"emb", "enc.linear1", "enc.linear2", "enc.norm1", "enc.norm2", "gru", "head"} <= mods
    assert any(n.op == "attention" and n.attr("scope") == "enc.self_attn" for n in g.nodes)
    gru = next(n for n in g.nodes if n.op == "lstm")
    assert gru.attr("cell") == "gru" and gru.attr("gates") == 3
    assert g.params == sum(p.numel() for p in m.parameters())
    fwd, bwd = flop_counter(m, (ids,))
    mm = matmul_flops(g)
    assert (mm.fwd, mm.bwd_data + mm.bwd_weight) == (fwd, bwd)


def test_opaque_module_is_measured_when_export_fails(flop_counter, monkeypatch):
    import hybridpar.graph.tracing as tracing

    def no_export(*a, **k):
        raise RuntimeError("export unavailable")

    monkeypatch.setattr(tracing, "_export_records", no_export)
    with torch.device("meta"):
        m, ids = _EncGru(), torch.randint(0, 20, (2, 6))
    g = trace(m, (ids,))
    enc = g.node("enc")
    assert enc.op == "other" and enc.attr("flops_source") == "flop_counter"
    assert enc.fwd_flops > 0 and enc.bwd_data_flops > 0 and enc.bwd_weight_flops > 0
    assert g.params == sum(p.numel() for p in m.parameters())
    fwd, bwd = flop_counter(m, (ids,))
    mm = matmul_flops(g)
    assert (mm.fwd, mm.bwd_data + mm.bwd_weight) == (fwd, bwd)


def test_graph_trace_is_a_plain_function():
    import inspect

    import hybridpar.graph
    import hybridpar.graph.tracing  # importing the module must not shadow the function

    assert inspect.isfunction(hybridpar.graph.trace)
    assert hybridpar.graph.trace is hybridpar.graph.tracing.trace
    from hybridpar.graph import trace as fn

    assert inspect.isfunction(fn)
