"""Every op a model runs is priced (or refused by name); FLOPs equal FlopCounterMode's; every
trainable parameter is counted; models are traced in the mode and at the batch asked for."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.cli.main import main
from hybridpar.errors import UserError
from hybridpar.graph.flops import matmul_flops, window_reads
from hybridpar.graph.models import load_model
from hybridpar.graph.tracing import trace

sys.path.insert(0, str(Path(__file__).parents[1] / "conformance"))
from reference import step_flops  # noqa: E402 -- FlopCounterMode with the grouped-conv correction

USER = Path(__file__).parent / "data" / "user_models.py"


def _same_flops(m, inputs):
    g = trace(m, inputs)
    mm = matmul_flops(g)
    fwd, bwd = step_flops(m, inputs)
    assert (mm.fwd, mm.bwd_data + mm.bwd_weight) == (fwd, bwd)
    return g


class Einsum(nn.Module):
    """Attention written with einsum and baddbmm, as CvT and older HF models do."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = torch.einsum("bqd,bkd->bqk", q, k)
        s = torch.baddbmm(torch.zeros_like(s), q, k.transpose(1, 2), alpha=0.5) + s
        a = torch.softmax(s, dim=-1)
        return torch.einsum("bqk,bkd->bqd", a, v) + torch.bmm(a, v)


def test_einsum_baddbmm_bmm_equal_flop_counter():
    g = _same_flops(Einsum(), (torch.randn(2, 5, 16),))
    att = [n for n in g.nodes if n.op == "attention"]
    assert len(att) == 4 and all(n.fwd_flops > 0 for n in att)
    # baddbmm contracts over q's last dimension (16), not the bias's (5)
    assert {n.fwd_flops for n in att} == {2 * 2 * 5 * 5 * 16}


def test_einsum_with_many_operands_and_a_summed_index():
    from hybridpar.graph.ops import einsum_flops

    # (b,i,j) x (b,j,k) -> (b,i,k): one bmm of 2*b*i*j*k
    assert einsum_flops("bij,bjk->bik", ((2, 3, 4), (2, 4, 5))) == 2 * 2 * 3 * 4 * 5
    # an index only in one operand is summed first: not part of the product
    assert einsum_flops("bijx,bjk->bik", ((2, 3, 4, 7), (2, 4, 5))) == 2 * 2 * 3 * 4 * 5
    # nothing summed: an elementwise product, which FlopCounterMode does not count
    assert einsum_flops("bi,bi->bi", ((2, 3), (2, 3))) == 0
    a, b, c = torch.randn(2, 3), torch.randn(3, 4), torch.randn(4, 5)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        torch.einsum("ij,jk,kl->il", a, b, c)
    assert einsum_flops("ij,jk,kl->il", ((2, 3), (3, 4), (4, 5))) == fc.get_total_flops()


def test_sdpa_priced_as_eager_attention():
    class Sdpa(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x, eager=False):
            q, k, v = (t.view(2, 5, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            if eager:
                return (torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v).sum()
            return F.scaled_dot_product_attention(q, k, v).sum()

    m, x = Sdpa(), torch.randn(2, 5, 16)
    g = trace(m, (x,))
    mm = matmul_flops(g)

    class Eager(nn.Module):
        def forward(self, x):
            return m(x, eager=True)

    assert (mm.fwd, mm.bwd_data + mm.bwd_weight) == step_flops(Eager(), (x,))


@pytest.mark.parametrize("pool,size,reads", [
    # EfficientNet's pooler: a 320 window with ceil_mode on a 4x4 map reads the 16 values once
    (nn.AvgPool2d(kernel_size=320, ceil_mode=True), 4, 16),
    (nn.MaxPool2d(3, stride=2, padding=1), 8, sum(window_reads(8, 4, 3, 2, 1) for _ in [0]) ** 2),
    (nn.MaxPool2d(2, stride=2, ceil_mode=True), 5, 25),  # ceil_mode's last window holds one row
    (nn.AvgPool1d(3, stride=1, padding=1), 6, 16),
])
def test_pooling_priced_by_the_window_applied(pool, size, reads):
    class P(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1) if not isinstance(pool, nn.AvgPool1d) else nn.Conv1d(3, 4, 1)
            self.pool = pool

        def forward(self, x):
            return self.pool(self.conv(x))

    shape = (2, 3, size, size) if not isinstance(pool, nn.AvgPool1d) else (2, 3, size)
    g = trace(P(), (torch.randn(*shape),))
    node = next(n for n in g.nodes if n.op in ("maxpool", "avgpool"))
    assert node.fwd_flops == 2 * 4 * reads
    assert node.bwd_data_flops == 2 * 4 * (size * size if len(shape) == 4 else size)


def test_window_reads_counts_clipped_windows():
    assert window_reads(4, 1, 320, 320, 0) == 4
    assert window_reads(8, 4, 3, 2, 1) == 2 + 3 + 3 + 3
    assert window_reads(5, 3, 2, 2, 0) == 2 + 2 + 1
    assert window_reads(7, 3, 3, 1, 0, dilation=2) == 9


class FreeParams(nn.Module):
    """A ViT-like embedding: class token and position table joined by ops, a mask token that only a
    masked input would use, a layer-scale vector, and a learned query projected every step."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, 8))
        self.pos = nn.Parameter(torch.zeros(1, 5, 8))
        self.mask_token = nn.Parameter(torch.zeros(1, 8))
        self.gamma = nn.Parameter(torch.ones(8))
        self.query = nn.Parameter(torch.randn(1, 1, 8))
        self.q_proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.unused_head = nn.Linear(8, 3)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1) + self.pos
        t = t * self.gamma
        q = self.q_proj(self.query).expand(t.shape[0], -1, -1)
        pooled = torch.softmax(q @ t.transpose(1, 2), -1) @ t
        self.unused_head(t[:, 0])  # computed, result dropped: no backward
        return self.head(pooled[:, 0])


def test_every_trainable_parameter_is_counted_and_param_only_work_priced():
    m = FreeParams()
    g = _same_flops(m, (torch.randn(2, 3, 8, 8),))
    assert g.params == sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert dict(g.meta)["free_params"] == ("mask_token",)
    names = {n for node in g.nodes for n, _ in node.param_shapes}
    assert names == {n for n, _ in m.named_parameters()}
    dead = [n for n in g.nodes if n.attr("dead_end")]
    assert dead and all(n.bwd_flops == 0 for n in dead)
    # the learned query's projection runs every step: its FLOPs are on the node that consumes it
    carried = [n for n in g.nodes if n.attr("branch_flops")]
    assert carried and carried[0].attr("branch_matmul_flops")[0] == 2 * 8 * 8


def test_frozen_parameters_are_not_trainable():
    m = FreeParams()
    m.mask_token.requires_grad_(False)
    m.pos.requires_grad_(False)
    g = trace(m, (torch.randn(2, 3, 8, 8),))
    assert g.params == sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert "free_params" not in dict(g.meta)


class Unpriced(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x).real


def test_an_op_without_a_rule_is_refused_by_name():
    with pytest.raises(UserError, match="fft"):
        trace(Unpriced(), (torch.randn(2, 8),))


def test_unpriced_op_through_the_cli_is_exit_2(capsys, tmp_path):
    f = tmp_path / "fftnet.py"
    f.write_text("import torch\nfrom torch import nn\n\nclass N(nn.Module):\n    def forward(self, x):\n"
                 "        return torch.fft.fft(x).real\n\ndef factory():\n    return N(), (torch.randn(2, 8),)\n")
    assert main(["inspect", "--model", f"{f}:factory"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fft" in err


class BnHead(nn.Module):
    """Batch norm after global pooling (MobileNet's last stage, Inception's aux head): 1 value per
    channel at batch 1, which PyTorch refuses in training mode."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.drop(self.bn(self.pool(self.conv(x))).flatten(1)))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_traced_at_batch_1_in_training_mode(device):
    with torch.device(device):
        m, x = BnHead(), torch.randn(1, 3, 6, 6)
    g = trace(m, (x,), train=True)
    assert g.batch == 1 and dict(g.meta)["train"] is True
    assert next(n for n in g.nodes if n.op == "batchnorm").out_shape == (1, 8, 1, 1)
    assert m.training and m.bn.training  # the module's own mode is left as it was
    if device == "cpu":
        with pytest.raises(ValueError, match="more than 1 value"):
            m(x)  # PyTorch's own guard is back after tracing


def test_traced_in_the_mode_asked_for():
    m = BnHead().eval()
    g = trace(m, (torch.randn(4, 3, 6, 6),), train=True)
    assert dict(g.meta)["train"] is True and not m.training and not m.bn.training
    g = trace(BnHead(), (torch.randn(4, 3, 6, 6),), train=False)
    assert dict(g.meta)["train"] is False


def _inspect(capsys, *argv):
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_token_model_at_another_batch_keeps_integer_ids(capsys):
    out = _inspect(capsys, "--model", f"{USER}:tokens", "--batch", "3")
    assert out["batch"] == 3
    assert out["layers"][0]["out_shape"] == [3, 12]
    loaded = load_model(f"{USER}:tokens", batch=7)
    (ids,) = loaded.example_inputs
    assert ids.dtype == torch.int64 and ids.shape == (7, 12) and int(ids.min()) >= 0 and int(ids.max()) < 100


def test_token_model_lists_every_parameterised_module(capsys):
    sys.path.insert(0, str(USER.parent))
    from user_models import TokenNet

    net = TokenNet()
    out = _inspect(capsys, "--model", f"{USER}:tokens", "--batch", "3")
    assert out["totals"]["params"] == sum(p.numel() for p in net.parameters())
    modules = {r["module"] for r in out["layers"] if r["params"]}
    leaves = {n for n, mod in net.named_modules() if any(True for _ in mod.parameters(recurse=False))}
    # nn.MultiheadAttention's in/out projections run as functional ops inside it: counted on its scope
    assert leaves - modules <= {"enc.self_attn", "enc.self_attn.out_proj"}
    assert {"emb", "enc.linear1", "enc.linear2", "enc.norm1", "enc.norm2", "lstm", "head"} <= modules
    rows = {r["module"]: r for r in out["layers"] if r["module"]}
    for name in ("emb", "enc.linear1", "lstm", "head"):
        own = sum(p.numel() for p in dict(net.named_modules())[name].parameters())
        assert rows[name]["params"] == own and rows[name]["param_bytes"] == 4 * own
        assert rows[name]["fwd_flops"] > 0 or name == "emb"


def test_multi_input_factory_keeps_every_input_at_another_batch():
    loaded = load_model(f"{USER}:masked_tokens", batch=6)
    ids, mask = loaded.example_inputs
    assert ids.dtype == torch.int64 and ids.shape == (6, 12)
    assert mask.dtype == torch.float32 and mask.shape == (6, 12)
    assert torch.equal(mask[4], mask[0]) and float(mask[:, 9:].abs().sum()) == 0  # rows of the example
    g = trace(loaded.module, loaded.example_inputs)
    assert g.batch == 6 and [n.name for n in g.nodes if n.op == "input"] == ["ids", "mask"]


def test_input_shape_override_keeps_the_dtype():
    loaded = load_model(f"{USER}:tokens", batch=2, input_shape=(20,))
    (ids,) = loaded.example_inputs
    assert ids.dtype == torch.int64 and ids.shape == (2, 20) and int(ids.max()) < 100


@pytest.mark.parametrize("conv,shape", [
    (nn.Conv1d(4, 6, 3, padding=1), (2, 4, 10)),
    (nn.Conv3d(4, 6, 3, stride=2), (2, 4, 7, 7, 7)),
    (nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1), (2, 4, 5, 5)),
    (nn.Conv2d(8, 8, 3, groups=4, padding=1), (2, 8, 6, 6)),
])
def test_other_convolutions_equal_flop_counter(conv, shape):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(shape[-1], shape[-1])  # so the convolution's input needs a gradient
            self.conv = conv

        def forward(self, x):
            return self.conv(self.pre(x))

    g = _same_flops(C(), (torch.randn(*shape),))
    node = next(n for n in g.nodes if n.module == "conv")
    assert node.op == ("conv2d" if isinstance(conv, nn.Conv2d) else "conv") and node.bwd_data_flops > 0


def test_rebatch_keeps_nested_inputs_and_meta_tensors():
    from hybridpar.graph.models import rebatch

    ids = torch.arange(8).view(2, 4)
    extra = {"mask": torch.ones(2, 4, dtype=torch.bool), "scale": torch.tensor(3.0)}
    out = rebatch((ids, extra, "keep"), 5)
    assert out[0].shape == (5, 4) and torch.equal(out[0][2], ids[0]) and torch.equal(out[0][3], ids[1])
    assert out[1]["mask"].shape == (5, 4) and out[1]["mask"].dtype == torch.bool
    assert out[1]["scale"].shape == () and out[2] == "keep"
    meta = rebatch((torch.empty(2, 4, dtype=torch.int64, device="meta"),), 3)[0]
    assert meta.is_meta and meta.shape == (3, 4) and meta.dtype == torch.int64
    with pytest.raises(UserError, match="--input-shape"):
        rebatch(("not a tensor",), 3, (3, 8, 8))


def test_vector_products_are_priced():
    class V(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8))

        def forward(self, x):
            m = torch.mv(x, self.w)  # (4, 8) @ (8,)
            return m + torch.dot(x[0], x[1])

    g = trace(V(), (torch.randn(4, 8),))
    att = sorted(n.fwd_flops for n in g.nodes if n.op == "attention")
    assert att == [2 * 8, 2 * 4 * 8]
