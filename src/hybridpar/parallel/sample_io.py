"""Inputs and outputs of a sample-only parallelized model (no DTensor): each rank takes its sample
group's rows of the global batch, and the outputs are gathered back so every rank sees the whole
batch's outputs. The gather's backward hands each rank the gradient rows of its own samples: every
rank computes the same loss, so nothing is counted twice."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._pytree import tree_map, tree_map_only

from hybridpar.parallel.comm.collectives import all_gather_dim


def map_tensors(fn, tree):
    """tree_map_only(torch.Tensor, fn, tree) that also enters dataclasses pytree does not know (a
    user's output dataclass; HF ModelOutput is registered): pytree takes those as leaves, so their
    tensors would pass through unsplit or ungathered, a silently wrong output."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return fn(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: map_tensors(fn, getattr(x, f.name))
                                             for f in dataclasses.fields(x) if f.init})
        return x
    return tree_map(leaf, tree)


def split_samples(tree, grid):
    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        per = t.shape[0] // grid.sample
        return t[grid.s * per:(grid.s + 1) * per]
    return map_tensors(one, tree)


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
    return map_tensors(one, tree)


def _rows(tree, n: int, batch: int):
    return tree_map_only(torch.Tensor, lambda t: t[:n] if t.dim() and t.shape[0] == batch else t, tree)


def _outputs(out) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def samples_mixed(module: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Whether `module`'s forward mixes samples: in eval mode, without gradients, sample 0's outputs
    computed beside sample 1 against computed alone. A sample-only layout runs each rank's rows on
    their own (as DDP does), which is exact only when the forward treats samples independently
    (batch norm aside: the runtime gives it global statistics). Returns a one-line reason, or None
    when the forward is independent or cannot be checked here (fewer than 2 rows, a random or
    failing forward, batch norm without running statistics). RNG, modes and buffers are left as
    they were, so training stays equal to one process."""
    from torch.utils._pytree import tree_flatten

    batch = next((t.shape[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()),
                 0)
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
             and "BatchNorm" in type(m).__name__]
    if batch < 2 or any(not m.track_running_stats for m in norms):
        return None
    modes = {m: m.training for m in module.modules()}
    try:
        module.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            two = [_outputs(module.forward(*_rows(args, 2, batch), **_rows(kwargs, 2, batch))) for _ in range(2)]
            one = _outputs(module.forward(*_rows(args, 1, batch), **_rows(kwargs, 1, batch)))
    except Exception:  # noqa: BLE001 - a forward that cannot run on 1-2 rows fails in training, with its error
        return None
    finally:
        for m, was in modes.items():
            m.training = was
    if any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(*two)):
        return None  # random even in eval mode: sample 0 alone is not comparable
    for k, (pair, alone) in enumerate(zip(two[0], one)):
        if pair.dim() == 0 or pair.shape[0] != 2 or alone.shape[0] != 1:
            return (f"the model's output {k} has {pair.shape[0] if pair.dim() else 'no'} leading rows for a batch "
                    "of 2 (not one row per sample): a sample-only layout would compute it from each rank's "
                    "samples alone; return per-sample outputs, or use a channel/filter layout (exact)")
        scale = float(pair[:1].abs().max()) if pair.numel() else 0.0
        if not torch.allclose(pair[:1], alone, rtol=1e-4, atol=1e-5 * max(1.0, scale)):
            return ("the model's forward mixes samples (in eval mode, sample 0's output changes with the other "
                    "samples of its batch): a sample-only layout runs each rank's samples alone and would "
                    "train a different model; use a channel/filter layout (exact), or make the forward per-sample")
    return None
