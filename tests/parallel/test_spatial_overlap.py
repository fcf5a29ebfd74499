"""The halo exchange of a spatially split convolution is overlapped with its interior: the interior
rows' convolution runs while the peer's halo rows are still on the way (the peer sends them late),
the boundary rows once they arrive, and the result is the whole convolution's (fp64)."""

from __future__ import annotations

import pytest

from hybridpar.train.launch import spawn

from ._spatial_overlap_workers import overlap_case

DELAY = 1.0


@pytest.mark.slow
def test_interior_conv_runs_before_the_halo_arrives():
    r0 = spawn(overlap_case, 2, DELAY)
    assert r0["err"] <= 1e-12, r0["err"]
    ev = r0["events"]
    halo = next(t for k, t in ev if k == "halo")  # the forward's wait returning: rank 1's rows arrived
    convs = [t for k, t in ev if k == "conv"]
    assert halo >= DELAY * 0.9, ev  # it did wait for the late peer
    assert convs[0] < halo - DELAY / 2, ev  # the interior conv started well before that
    assert any(t >= halo for t in convs), ev  # and the boundary rows after it
