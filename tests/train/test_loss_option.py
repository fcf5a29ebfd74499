"""`hybridpar train --loss cross_entropy|mse|path.py:fn` (hybridpar.train.loss).

A small U-Net-like model's dense logits [N, 4, H, W] against per-pixel labels [N, H, W] (from a data
factory) train under sample=2 equal to one fp64 process with F.cross_entropy over dimension 1; a
user's loss over a dict output trains under mp=2 (the module path of hybridpar.parallelize) equal to
one process; losses whose targets synthetic data cannot give are refused in one line (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.cli.main import main
from hybridpar.plans import LayerLayout, Plan

BATCH, STEPS, LR = 4, 2, 0.05
MODEL = """
import torch
import torch.nn.functional as F
from torch import nn


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(8, 6, 2, stride=2)
        self.head = nn.Conv2d(12, 4, 1)

    def forward(self, x):
        d = self.down(x)
        return self.head(torch.cat([d, self.up(self.mid(d))], dim=1))


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.reg = nn.Linear(16, 2)
        self.cls = nn.Linear(16, 3)

    def forward(self, x):
        h = self.body(x)
        return {"reg": self.reg(h), "logits": self.cls(h)}


def unet():
    return UNet()


def two_heads():
    return TwoHeads()


def seg_data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, 8, 8, generator=g)
    y = torch.randint(0, 4, (8, 8, 8), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def reg_data():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 6, generator=g)
    return [(x[i], {"reg": torch.randn(2, generator=g), "cls": i % 3}) for i in range(8)]


def my_loss(out, target):
    return F.mse_loss(out["reg"], target["reg"].to(out["reg"].dtype)) + F.cross_entropy(out["logits"], target["cls"])
"""


def _file(tmp_path) -> dict:
    (tmp_path / "m.py").write_text(MODEL)
    scope: dict = {}
    exec(MODEL, scope)
    return scope


def _one_process(model: nn.Module, data, loss_fn) -> dict:
    model.double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        items = [data[i] for i in range(step * BATCH, (step + 1) * BATCH)]
        x = torch.stack([t[0] for t in items]).double()
        y = torch.utils.data.default_collate([t[1] for t in items])
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(tmp_path, capsys, args: list[str]) -> None:
    code = main(["train", *args, "--batch", str(BATCH), "--steps", str(STEPS), "--no-shuffle", "--lr", str(LR),
                 "--precision", "fp64", "--workers", "0", "--init-from", str(tmp_path / "init.pt"),
                 "--save", str(tmp_path / "out.pt"), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert len(json.loads(out.out)["steps"]) == STEPS


def _same(tmp_path, want: dict) -> None:
    saved = torch.load(tmp_path / "out.pt", weights_only=True)
    assert saved.keys() == want.keys()
    for k, v in want.items():
        if v.is_floating_point():
            torch.testing.assert_close(saved[k].double(), v, rtol=1e-9, atol=1e-10, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unet_pixel_labels_cross_entropy_sample2_equals_one_process(tmp_path, capsys):
    scope = _file(tmp_path)
    torch.manual_seed(1)
    model = scope["unet"]()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    want = _one_process(model, scope["seg_data"](), lambda out, y: F.cross_entropy(out, y))
    _train(tmp_path, capsys, ["--model", f"{tmp_path}/m.py:unet", "--input-shape", "3,8,8", "--strategy",
                              "sample=2", "--nproc", "2", "--loss", "cross_entropy",
                              "--data", f"{tmp_path}/m.py:seg_data"])
    _same(tmp_path, want)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_user_loss_on_dict_outputs_mp2_equals_one_process(tmp_path, capsys):
    """mp=2 through `hybridpar train`: the parallelized module's whole dict output, the user's loss."""
    scope = _file(tmp_path)
    torch.manual_seed(2)
    model = scope["two_heads"]()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    want = _one_process(model, scope["reg_data"](), scope["my_loss"])
    Plan(model=f"{tmp_path}/m.py:two_heads", world_size=2, dp=1, mp=2, batch=BATCH, input_shape=[6],
         default_layout=LayerLayout(sample=1), placement={"reg": 1, "cls": 0}).save(tmp_path / "plan.json")
    _train(tmp_path, capsys, ["--plan", str(tmp_path / "plan.json"), "--model", f"{tmp_path}/m.py:two_heads",
                              "--loss", f"{tmp_path}/m.py:my_loss",
                              "--data", f"{tmp_path}/m.py:reg_data"])
    _same(tmp_path, want)


def _refused(capsys, args: list[str], needle: str) -> None:
    assert main(["train", *args, "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("loss,needle", [("mse", "synthetic labels are random class ids"),
                                         ("MODEL:my_loss", "synthetic labels are random class ids"),
                                         ("hinge", "loss must be cross_entropy, mse or")])
def test_meaningless_losses_refused_before_start(tmp_path, capsys, loss, needle):
    _file(tmp_path)
    _refused(capsys, ["--model", "small_cnn", "--strategy", "sample=2",
                      "--loss", loss.replace("MODEL", f"{tmp_path}/m.py")], needle)


def test_mse_needs_a_data_factory(tmp_path, capsys):
    torch.save({"x": torch.randn(8, 3, 32, 32), "y": torch.zeros(8, dtype=torch.long)}, tmp_path / "d.pt")
    _refused(capsys, ["--model", "small_cnn", "--strategy", "sample=2", "--loss", "mse",
                      "--data", str(tmp_path / "d.pt")], "takes its targets from --data path/to/file.py:factory")


def test_loss_in_the_toml_config(tmp_path, capsys):
    (tmp_path / "run.toml").write_text('[optim]\nloss = "mse"\n')
    _refused(capsys, ["--model", "small_cnn", "--strategy", "sample=2", "--config", str(tmp_path / "run.toml")],
             "--loss mse with --data synthetic")


def test_cross_entropy_labels_follow_dimension_1(tmp_path, capsys):
    """The label shape the data must have: [N, H, W] for [N, C, H, W] logits. Without --loss, such a
    model is refused in one line (the default loss took the last dimension as the classes: it trained
    a U-Net's [N, 4, 8, 8] as 8 classes of labels [N, 4, 8], on synthetic data without a word)."""
    from hybridpar.graph.models import load_model
    from hybridpar.train.loss import loss_data_spec

    _file(tmp_path)
    loaded = load_model(f"{tmp_path}/m.py:unet", input_shape=(3, 8, 8))
    spec = loss_data_spec(loaded, "cross_entropy")
    assert (spec.num_classes, spec.label_shape) == (4, (8, 8))
    _refused(capsys, ["--model", f"{tmp_path}/m.py:unet", "--input-shape", "3,8,8", "--strategy", "sample=2"],
             "returns dense outputs ((4, 8, 8) per sample): say which loss: --loss cross_entropy (classes on "
             "dimension 1, labels [N, 8, 8])")


AUX_MODEL = """
import torch
from torch import nn


class WithAux(nn.Module):
    '''Logits in eval mode, (logits, aux logits) in training mode, as torchvision's Inception-V3.'''

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten())
        self.head, self.aux = nn.Linear(4, 5), nn.Linear(4, 5)

    def forward(self, x):
        h = self.body(x)
        return (self.head(h), self.aux(h)) if self.training else self.head(h)


def build():
    return WithAux(), (torch.randn(2, 3, 8, 8),)
"""


def test_default_loss_refuses_a_tuple_returned_in_training_mode_before_start(tmp_path, capsys):
    """The output check ran in eval mode only: such a model passed it and every rank then failed inside
    the loss ('tuple' object has no attribute 'dim'), after start."""
    path = tmp_path / "aux.py"
    path.write_text(AUX_MODEL)
    code = main(["train", "--model", f"{path}:build", "--strategy", "sample=1", "--nproc", "1", "--batch", "2",
                 "--steps", "1"])
    err = "".join(ln for ln in capsys.readouterr().err.splitlines(True) if not ln.startswith("hybridpar: start-up"))
    assert code == 2, err
    assert "returns tuple in training mode" in err and err.count("\n") == 1, err
