"""A forward that mixes samples is refused under sample-only layouts (they run each rank's rows alone,
as DDP does, which would silently train another model); one that treats samples alone runs."""

from pathlib import Path

import torch
from tests.parallel.mixing_models import BatchCentered, PerSample
from torch import nn

from hybridpar.parallel.sample_io import samples_mixed

HERE = Path(__file__).parent


def test_batch_mean_in_forward_is_found():
    torch.manual_seed(0)
    reason = samples_mixed(BatchCentered(), (torch.randn(4, 8),), {})
    assert reason is not None and "mixes samples" in reason


def test_per_sample_forward_passes_and_state_is_kept():
    torch.manual_seed(0)
    m = PerSample()
    m.fc2.eval()  # a submodule's own mode survives the check
    x = torch.randn(4, 8)
    before = torch.random.get_rng_state()
    assert samples_mixed(m, (x,), {}) is None
    assert torch.equal(before, torch.random.get_rng_state()) and m.training and not m.fc2.training


def test_batch_norm_with_running_stats_is_not_mixing_but_without_them_is_unchecked():
    net = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    assert samples_mixed(net, (torch.randn(4, 8),), {}) is None
    net[1] = nn.BatchNorm1d(6, track_running_stats=False)  # batch statistics in eval: served globally
    assert samples_mixed(net, (torch.randn(4, 8),), {}) is None


def test_an_output_without_a_row_per_sample_is_found():
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(x).mean(0)

    reason = samples_mixed(Pooled(), (torch.randn(4, 8),), {})
    assert reason is not None and "leading rows" in reason


def test_train_refuses_a_mixing_model_with_one_line(capsys):
    # the CLI in this process: a fresh interpreter's start-up (torch, the fork server) was most of its time
    from hybridpar.cli.main import main

    rc = main(["train", "--model", f"{HERE / 'mixing_models.py'}:mixing", "--strategy", "sample=2", "--nproc", "2",
               "--batch", "8", "--steps", "1", "--json"])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "mixes samples" in lines[0] and "Traceback" not in err


def test_the_dry_run_of_a_sample_layout_does_not_judge_meta_tensors():
    """hybridpar.check runs on meta tensors: no values, so no mixing verdict (it refused every model)."""
    import hybridpar

    dry = hybridpar.check(PerSample(), "sample=2", torch.randn(4, 8), world_size=2)
    assert dry.world_size == 2 and dry.output_shapes == [(4, 4)]  # the whole batch's outputs
