"""DTensor's redistributions in the CommLog as gloo sends them (issue 30): a bilinear F.interpolate
under height=2 has DTensor gather its spatially split input inside DTensor's own dispatch, which the
log's dispatch mode (hybridpar.parallel.dtensor.log) did not see; the nn.Upsample twin gathers
through our SpatialGathered. Each rank's logged bytes per kind in a training step equal those gloo was
handed (torch.profiler's gloo events), and the gather is there: in forward the input (uneven 5/4-row
pieces, padded), in backward the output's gradient, and the loss's gather of the logits."""

from __future__ import annotations

import pytest

from hybridpar.train.launch import spawn

from ._dtensor_log_bytes_workers import BATCH, SHAPES, logged_and_sent

CASES = [("interp_net", "height=2"), ("upsample_net", "height=2")]


def _gathers(c: int, h: int, w: int) -> int:
    """The allgather bytes of a step by the log's convention (the gathered result, fp32): the
    upsampling's input (4 channels, rows padded to the larger piece), its output's gradient
    (4 channels, 2h x 2w), the logits for the loss (2 channels, 2h x 2w)."""
    rows = -(-h // 2)
    return 4 * BATCH * (4 * rows * w * 2 + 4 * 2 * h * 2 * w + 2 * 2 * h * 2 * w)


@pytest.mark.slow
def test_log_counts_the_bytes_gloo_sends_around_upsampling():
    results = spawn(logged_and_sent, 2, CASES)
    for (factory, strategy), ranks in zip(CASES, results):
        for rank, r in enumerate(ranks):
            assert r["logged"] == r["sent"], (factory, strategy, rank, r)
            assert r["sent"]["allgather"] == _gathers(*SHAPES[factory]), (factory, rank, r)
            assert r["sent"]["halo"] > 0 and r["sent"]["allreduce"] > 0
