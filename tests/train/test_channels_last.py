"""`hybridpar train --channels-last` (hybridpar.train.memory_format): the model's 4-D weights and each
batch's images run in NHWC under every layout kind, and the run trains to the same weights as the NCHW
run (fp64: the formats may only change a kernel's summation order)."""

from __future__ import annotations

import pytest
import torch

FORMATS: list[tuple[int, int]] = []  # (4-D weights in channels-last, 4-D weights) per step, rank 0


def record(info, engine, opt) -> None:
    """How many of this rank's 4-D weights (their local pieces) lie channels-last during the run."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in engine.module.parameters()]
    four = [t for t in local if t.dim() == 4 and t.shape[1] * t.shape[2] * t.shape[3] > 1]
    FORMATS.append((sum(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
                        for t in four), len(four)))


def _run(strategy: str, channels_last: bool, save: str):
    from hybridpar.train.config import run_config
    from hybridpar.train.trainer import run_rank

    setup = run_config(model="small_cnn", strategy=strategy, batch=8, steps=3, precision="fp64", lr=0.05,
                       momentum=0.9, channels_last=channels_last, save=save, callbacks=(f"{__name__}:record",))
    FORMATS.clear()
    run_rank(setup.config)
    return list(FORMATS)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sample=2", "channel=2", "height=2"])
def test_channels_last_runs_nhwc_and_trains_like_nchw(strategy, tmp_path):
    from hybridpar.train.launch import spawn

    nchw, nhwc = tmp_path / "nchw.pt", tmp_path / "nhwc.pt"
    plain = spawn(_run, 2, strategy, False, str(nchw))
    converted = spawn(_run, 2, strategy, True, str(nhwc))
    assert plain and all(n == 0 for n, _ in plain)
    assert converted and all(n == total > 0 for n, total in converted), converted
    a, b = torch.load(nchw), torch.load(nhwc)
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            assert torch.allclose(a[k], b[k], rtol=0, atol=1e-12), k


def test_inputs_and_buffers_convert_and_other_ranks_are_left():
    from torch import nn

    from hybridpar.train.memory_format import inputs_to_channels_last, module_to_channels_last

    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv3d(4, 4, 1))
    m.register_buffer("mask", torch.ones(1, 4, 2, 2))
    assert module_to_channels_last(m) == 2  # the conv2d weight and the 4-D buffer; not the 5-D conv3d weight
    assert m[0].weight.is_contiguous(memory_format=torch.channels_last) and not m[0].weight.is_contiguous()
    assert m[2].weight.is_contiguous()
    x = {"image": torch.randn(2, 3, 5, 5), "ids": torch.ones(2, 3, 5, 5, dtype=torch.long),
         "volume": torch.randn(2, 1, 3, 3, 3)}
    y = inputs_to_channels_last(x)
    assert not y["image"].is_contiguous() and y["image"].is_contiguous(memory_format=torch.channels_last)
    assert y["ids"].is_contiguous() and y["volume"].is_contiguous()
    assert torch.equal(y["image"], x["image"])


def test_bad_channels_last_value_is_one_line():
    from hybridpar.errors import UserError
    from hybridpar.train.config import TrainConfig

    with pytest.raises(UserError, match="channels_last must be true or false"):
        TrainConfig.from_options(model="small_cnn", strategy="sample=2", channels_last="yes").check()
