"""`hybridpar train` with model-parallel plans: sequence models on token data (= serial SGD), the
plan checked before any rank starts, --micro-batches validated."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpar.cli.main import main
from hybridpar.graph.models import load_model
from hybridpar.plans import LayerLayout, Plan

from .test_mp_cli import serial_sgd

STEPS, BATCH, LR, MOMENTUM = 3, 8, 0.1, 0.9


def _one_line_exit_2(capsys, args: list[str], needle: str) -> None:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_bad_placement_is_one_line(tmp_path, capsys):
    Plan(model="lstm2", world_size=2, dp=1, mp=2, batch=8, default_layout=LayerLayout(sample=1),
         placement={"no_such_layer": 1}).save(tmp_path / "p.json")
    _one_line_exit_2(capsys, ["--plan", str(tmp_path / "p.json"), "--nproc", "2"], "no_such_layer")


def test_batch_smaller_than_replicas_is_one_line(capsys):
    _one_line_exit_2(capsys, ["--model", "lstm2", "--strategy", "mp=2,sample=2", "--nproc", "4", "--batch", "1"],
                     "smaller than dp=2")


@pytest.mark.parametrize("args,needle", [
    (["--model", "small_cnn", "--strategy", "sample=2", "--micro-batches", "2"], "needs a model-parallel plan"),
    (["--model", "lstm2", "--strategy", "mp=2", "--micro-batches", "0"], ">= 1"),
    (["--model", "lstm2", "--strategy", "mp=2", "--batch", "4", "--micro-batches", "5"], "exceeds the 4 samples"),
    (["--model", "lstm2", "--strategy", "mp=2", "--data", "digits"], "sequence model"),
])
def test_bad_mp_options_are_one_line(capsys, args, needle):
    _one_line_exit_2(capsys, [*args, "--nproc", "2"], needle)


def test_float_tokens_rejected(tmp_path, capsys):
    torch.save({"x": torch.rand(16, 16), "y": torch.zeros(16, dtype=torch.long)}, tmp_path / "d.pt")
    _one_line_exit_2(capsys, ["--model", "lstm2", "--strategy", "mp=2", "--nproc", "2", "--data",
                              str(tmp_path / "d.pt")], "integer tensor of token ids")


def test_tokens_outside_vocab_rejected(tmp_path, capsys):
    torch.save({"x": torch.full((16, 16), 64), "y": torch.zeros(16, dtype=torch.long)}, tmp_path / "d.pt")
    _one_line_exit_2(capsys, ["--model", "lstm2", "--strategy", "mp=2", "--nproc", "2", "--data",
                              str(tmp_path / "d.pt")], "[0, 64)")


def test_synthetic_tokens_fit_the_model():
    from hybridpar.train.data.loader import data_spec, load_dataset

    spec = data_spec(load_model("lstm2"))
    assert (spec.vocab, spec.num_classes, spec.label_shape) == (64, 10, ())
    ds = load_dataset("synthetic", (16,), num_classes=spec.num_classes, size=256, vocab=spec.vocab)
    assert ds.x.dtype == torch.long and ds.x.shape == (256, 16)
    assert int(ds.x.min()) >= 0 and int(ds.x.max()) < 64 and int(ds.x.max()) >= 32  # the whole vocabulary
    assert ds.y.shape == (256,) and int(ds.y.max()) < 10


def _serial(model, data):
    return serial_sgd(model, data, steps=STEPS, batch=BATCH, lr=LR, momentum=MOMENTUM)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("micro", [1, 2])
def test_lstm2_mp_train_matches_serial(tmp_path, capsys, micro):
    g = torch.Generator().manual_seed(5)
    data = {"x": torch.randint(0, 64, (STEPS * BATCH, 16), generator=g),
            "y": torch.randint(0, 10, (STEPS * BATCH,), generator=g)}
    torch.save(data, tmp_path / "data.pt")
    torch.manual_seed(11)
    model = load_model("lstm2").module
    torch.save(model.state_dict(), tmp_path / "init.pt")

    if micro == 1:  # the placer chooses
        layout = ["--model", "lstm2", "--strategy", "mp=2"]
    else:  # a fixed placement (the LSTM layers on different devices) skips the placer's search
        Plan(model="lstm2", world_size=2, dp=1, mp=2, batch=BATCH, default_layout=LayerLayout(sample=1),
             placement={"lstm2": 1, "fc": 1}).save(tmp_path / "plan.json")
        layout = ["--plan", str(tmp_path / "plan.json")]
    code = main(["train", *layout, "--nproc", "2", "--data",
                 str(tmp_path / "data.pt"), "--batch", str(BATCH), "--steps", str(STEPS), "--no-shuffle",
                 "--lr", str(LR), "--momentum", str(MOMENTUM), "--micro-batches", str(micro),
                 "--init-from", str(tmp_path / "init.pt"), "--save", str(tmp_path / "out.pt"), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    losses = _serial(model, data)  # no batch statistics: micro-batching changes nothing
    saved, ref = torch.load(tmp_path / "out.pt", weights_only=True), model.state_dict()
    assert saved.keys() == ref.keys()
    for k in ref:
        err = ((saved[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item()
        assert err <= 1e-4, f"{k}: rel err {err:.2e}"
    assert [s["loss"] for s in report["steps"]] == pytest.approx(losses, rel=1e-4)


def test_sequence_labels_follow_the_output(tmp_path):
    """Logits [N, T, V] want labels [N, T]; a file with [N] labels is refused in one line."""
    from hybridpar.errors import UserError
    from hybridpar.graph.models import LoadedModel
    from hybridpar.train.data.loader import data_spec, load_dataset

    lm = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))  # [N, T] -> [N, T, 50]
    spec = data_spec(LoadedModel("lm", lm, (torch.zeros(1, 6, dtype=torch.long),), "seq", (6,)))
    assert (spec.vocab, spec.num_classes, spec.label_shape) == (32, 50, (6,))  # no zoo vocab: the example ids'
    ds = load_dataset("synthetic", (6,), num_classes=50, size=20, vocab=spec.vocab, label_shape=spec.label_shape)
    assert ds.y.shape == (20, 6) and int(ds.x.max()) < 32
    torch.save({"x": torch.zeros(4, 6, dtype=torch.long), "y": torch.zeros(4, dtype=torch.long)}, tmp_path / "d.pt")
    with pytest.raises(UserError, match="2-D long"):
        load_dataset(str(tmp_path / "d.pt"), (6,), vocab=32, label_shape=(6,))
