"""Issue 33, item 1: never save or continue from non-finite state (weights, buffers, optimizer state
after every update), and --max-loss-ratio."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from hybridpar.cli.main import main
from hybridpar.errors import UserError
from hybridpar.train import checkpoint as ckpt
from hybridpar.train.guard import StateGuard, check_max_loss_ratio, first_nonfinite, named_state

pytestmark = pytest.mark.timeout(300)


class _Engine:
    """What named_state needs from an engine (the MP engine's form: whole tensors by name)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._local_state = module.state_dict(keep_vars=True)

    def parameters(self):
        return self.module.parameters()


def _model_and_opt():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    m(torch.randn(2, 3, 6, 6))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 3, 6, 6)).sum().backward()
    opt.step()
    return m, opt


def test_every_tensor_a_checkpoint_holds_is_checked_and_named():
    m, opt = _model_and_opt()
    engine = _Engine(m)
    names = [n for n, _ in named_state(engine, opt)]
    assert "1.running_var" in names and "0.weight" in names and "0.weight (optimizer momentum_buffer)" in names
    assert "1.num_batches_tracked" not in names  # integers cannot be NaN
    guard = StateGuard(engine, opt, "cpu", agreed=True)
    assert guard.after_update() is None
    m[1].running_var[2] = math.inf  # a buffer: what lr 1e7 does to small_cnn
    assert guard.after_update() == "1.running_var"
    m[1].running_var.fill_(1.0)
    opt.state[m[0].weight]["momentum_buffer"][0, 0, 0, 0] = math.nan  # the optimizer's state
    assert guard.after_update() == "0.weight (optimizer momentum_buffer)"


def test_a_large_float64_value_is_finite():
    assert first_nonfinite([("a", torch.tensor([1e300], dtype=torch.float64)), ("b", torch.ones(2))]) is None
    assert first_nonfinite([("a", torch.ones(2)), ("b", torch.tensor([0.0, math.nan]))]) == "b"


def test_loss_ratio():
    guard = StateGuard(None, None, "cpu", agreed=True, max_loss_ratio=100.0)
    assert guard.loss_exploded(2.0) is None and guard.loss_exploded(199.0) is None
    assert "exceeds 100 times its first value 2" in guard.loss_exploded(201.0)
    assert StateGuard(None, None, "cpu", agreed=True).loss_exploded(1e30) is None  # off by default
    for bad in (0.5, 1, math.inf, math.nan, True, "2"):
        with pytest.raises(UserError, match="max_loss_ratio must be a finite number > 1"):
            check_max_loss_ratio(bad)


def _stored_tensors(info) -> list:
    """Every tensor a checkpoint holds (weights, buffers, optimizer state), in either format."""
    if info.manifest.get("version") == ckpt.VERSION_DCP:
        from hybridpar.train import checkpoint_dcp as cd

        reader = cd._CheckedReader(info.path, info.manifest)
        out = {k: cd.empty_like_stored(m) for k, m in cd.stored(reader.read_metadata(), "").items()}
        cd.load_boxes(info.path, info.manifest, {k: (tuple(t.shape), cd.boxes(t, None)) for k, t in out.items()},
                      reader)
        return list(out.values())
    parts = ckpt._load_rank_files(info)
    tensors = [t for p in parts for t in p["tensors"].values()]
    return tensors + [v for p in parts for st in p["optimizer"].values() for v in st.values() if torch.is_tensor(v)]


def _all_finite(info) -> bool:
    tensors = [t for t in _stored_tensors(info) if t.is_floating_point()]
    assert tensors, info.path  # an empty read would pass for the wrong reason
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sample=2", "channel=2"])
def test_a_diverged_run_stops_with_exit_3_naming_the_tensor_and_keeps_only_finite_checkpoints(
        tmp_path, capsys, strategy):
    """The issue's reproducer: lr 1e7 leaves the loss finite (6.3e6) but running_var = inf in three
    batch norms; before the guard this exited 0 and every kept checkpoint held the Infs. Under
    channel=2 the ranks hold different weights, so the verdict is agreed with the next step
    (hybridpar.train.guard.submit) and its checkpoints are DCP's: the step named, the steps reported
    and the checkpoints kept are still those before the bad one."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    code = main(["train", "--model", "small_cnn", "--strategy", strategy, "--nproc", "2", "--batch", "16",
                 "--steps", "16", "--lr", "1e7", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                 "--metrics", str(metrics)])
    out, err = capsys.readouterr()
    assert code == 3, (out, err)
    err = "".join(ln for ln in err.splitlines(True) if not ln.startswith("hybridpar: start-up: "))  # phases: info
    assert err.startswith("hybridpar: error: step ") and err.count("\n") == 1, err
    assert "running_var is not finite after the update" in err, err
    bad = int(err.split("step ")[1].split(":")[0])
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == list(range(bad))
    kept = [ckpt.checkpoint_info(p) for p in sorted(ck.iterdir()) if p.name.startswith("step-")]
    assert kept and all(_all_finite(info) for info in kept)


def test_max_loss_ratio_stops_an_exploding_loss(tmp_path, capsys):
    argv = ["train", "--model", "small_cnn", "--strategy", "sample=1", "--nproc", "1", "--batch", "8",
            "--steps", "6", "--lr", "1e4", "--save", str(tmp_path / "w.pt")]
    code = main([*argv, "--max-loss-ratio", "2"])
    _, err = capsys.readouterr()
    err = "".join(ln for ln in err.splitlines(True) if not ln.startswith("hybridpar: start-up: "))  # phases: info
    assert code == 3 and "(--max-loss-ratio)" in err and err.count("\n") == 1, err
    assert not (tmp_path / "w.pt").exists()
    assert main([*argv, "--max-loss-ratio", "0.5"]) == 2
    assert "max-loss-ratio must be a finite number > 1" in capsys.readouterr().err
