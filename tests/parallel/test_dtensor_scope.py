"""Our DTensor extensions are scoped like torch's `loss_parallel()` / `implicit_replication()`: on
inside a parallelized module's forward (and what its backward runs), stock everywhere else. Real gloo
ranks: after a model with a conv of ours, a depthwise conv (our conv rule) and a plain mask (our
implicit replication) trained a step, and after a parallelized forward that raised, DTensor outside
the module refuses a plain tensor mixed with a DTensor as stock torch does, and torch's own conv on
DTensors goes to torch's handler, not ours."""

from __future__ import annotations

import math

import pytest

from hybridpar.train.launch import spawn

from . import _scope_workers as W

STOCK = {"flag": False, "conv_handler": True, "conv_backward_handler": True, "mode_active": False,
         "mix": "refused", "our_conv_calls": 0}


@pytest.mark.timeout(300)
def test_dtensor_is_stock_outside_a_parallelized_module():
    res = spawn(W.run_scope, 2)
    assert res["inside_conv_calls"] > 0  # the depthwise conv ran through our rule inside the forward
    assert math.isfinite(res["loss"])
    assert res["after_step"] == STOCK
    assert res["after_failed_forward"] == STOCK
