"""Inputs and outputs of a sample-only parallelized model (no DTensor): each rank takes its sample
group's rows of the global batch, and the outputs are gathered back so every rank sees the whole
batch's outputs. The gather's backward hands each rank the gradient rows of its own samples: every
rank computes the same loss, so nothing is counted twice."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from hybridpar.runtime.collectives import all_gather_dim


def split_samples(tree, grid):
    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        per = t.shape[0] // grid.sample
        return t[grid.s * per:(grid.s + 1) * per]
    return tree_map_only(torch.Tensor, one, tree)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, grid):
        ctx.rows = (grid.s * t.shape[0], t.shape[0])
        return all_gather_dim(t.contiguous(), 0, grid.replica_group, [t.shape[0]] * grid.sample,
                              grid.comm_log, "output:fwd")

    @staticmethod
    def backward(ctx, d):
        off, n = ctx.rows
        return d.narrow(0, off, n).contiguous(), None


def gather_samples(tree, grid):
    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:  # e.g. a loss computed inside the model: it saw only this rank's samples
            from hybridpar.errors import UserError

            raise UserError("the model returns a scalar computed from its batch; under a sample-only layout "
                            "each rank computes it from its own samples: return per-sample outputs and "
                            "compute the loss outside the model")
        return _GatherRows.apply(t, grid)
    return tree_map_only(torch.Tensor, one, tree)
