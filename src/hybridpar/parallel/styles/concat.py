"""Concatenation along channels of channel-split activations (Inception/DenseNet-style `torch.cat`).

Each input is split into G pieces of its own channel count, but the concatenated tensor must be split
into G pieces of the total, so rank g's output piece is made of parts several ranks hold: one
all-to-all in the sample group moves exactly those parts (its backward is the inverse move).
`parallelize` installs `ChannelCatMode` around the model's forward (a TorchFunctionMode, our
scoped DTensor rules with the concatenation added: hybridpar.parallel.dtensor.rules), so the user's
`torch.cat(..., dim=1)` calls are caught without tracing. The runtime's own code never calls
torch.cat along dim 1 inside a forward (it copies into preallocated buffers), so only model code
is intercepted."""

from __future__ import annotations

from math import prod

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_map_only

from hybridpar.layout import held, needed
from hybridpar.layout import inter as _inter
from hybridpar.parallel.comm.collectives import all_to_all_flat
from hybridpar.parallel.dtensor.boundary import boundary_placements, from_local
from hybridpar.parallel.dtensor.rules import DTensorRules
from hybridpar.parallel.mesh import Meshes, ProcessGrid

_CATS = {torch.cat, torch.concat, torch.concatenate}


def _blocks(c_sizes: list[int], G: int, src: int, dst: int) -> list[tuple[int, tuple[int, int]]]:
    """(input k, channel range of the concatenation) for each part of the concatenation that rank
    `src` holds (its piece of input k) and rank `dst` needs (its piece of the total), in input order."""
    want = needed(c_sizes, G, dst)
    return [(k, i) for k, r in enumerate(held(c_sizes, G, src)) if (i := _inter(r, want))]


def _exchange(c_sizes: list[int], group, inverse: bool, cut, like: torch.Tensor, per_chan: int, log, tag):
    """The one all-to-all of a concatenation (inverse=False: input pieces -> concatenation pieces) or
    of its gradient (inverse=True: the same blocks travelling back). `cut(k, rng)` is this rank's
    block to send; yields (k, rng, flat block received), in sender order, each sender's blocks in
    input order (the order the sender cut them in)."""
    G, g = group.size, group.index
    # forward: g sends what it holds and q needs, and receives what r holds and g needs; inverse: mirrored
    send_to = [_blocks(c_sizes, G, q, g) if inverse else _blocks(c_sizes, G, g, q) for q in range(G)]
    recv_from = [_blocks(c_sizes, G, g, r) if inverse else _blocks(c_sizes, G, r, g) for r in range(G)]
    sends = [cut(k, i).reshape(-1) for blocks in send_to for k, i in blocks]
    send_sizes = [sum(i[1] - i[0] for _, i in blocks) * per_chan for blocks in send_to]
    recv_sizes = [sum(i[1] - i[0] for _, i in blocks) * per_chan for blocks in recv_from]
    flat = all_to_all_flat(sends, send_sizes, recv_sizes, like, group, log, tag)
    pos = 0
    for blocks in recv_from:
        for k, i in blocks:
            n = (i[1] - i[0]) * per_chan
            yield k, i, flat[pos:pos + n]
            pos += n


def _to_pieces(parts: list[torch.Tensor], c_sizes: list[int], group, log, tag) -> torch.Tensor:
    """parts[i] = this rank's piece of input i -> this rank's piece of the concatenation."""
    G, g = group.size, group.index
    n, inner = parts[0].shape[0], parts[0].shape[2:]
    mine, want = held(c_sizes, G, g), needed(c_sizes, G, g)
    out = parts[0].new_empty(n, want[1] - want[0], *inner)

    def cut(k, i):
        return parts[k][:, i[0] - mine[k][0]:i[1] - mine[k][0]]

    for _, i, flat in _exchange(c_sizes, group, False, cut, parts[0], n * prod(inner), log, tag):
        out[:, i[0] - want[0]:i[1] - want[0]] = flat.view(n, i[1] - i[0], *inner)
    return out


def _from_piece(d: torch.Tensor, c_sizes: list[int], group, log, tag) -> list[torch.Tensor]:
    """Inverse of _to_pieces: this rank's piece of the concatenation's gradient -> its input pieces."""
    G, g = group.size, group.index
    n, inner = d.shape[0], d.shape[2:]
    mine, want = held(c_sizes, G, g), needed(c_sizes, G, g)
    grads = [d.new_zeros(n, r[1] - r[0], *inner) for r in mine]

    def cut(_k, i):
        return d[:, i[0] - want[0]:i[1] - want[0]]

    for k, i, flat in _exchange(c_sizes, group, True, cut, d, n * prod(inner), log, tag):
        grads[k][:, i[0] - mine[k][0]:i[1] - mine[k][0]] = flat.view(n, i[1] - i[0], *inner)
    return grads


class _ChannelCat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c_sizes, group, log, tag, *parts):
        ctx.args = (c_sizes, group, log, tag)
        return _to_pieces([p.contiguous() for p in parts], c_sizes, group, log, f"{tag}:fwd")

    @staticmethod
    def backward(ctx, d):
        c_sizes, group, log, tag = ctx.args
        return (None, None, None, None, *_from_piece(d.contiguous(), c_sizes, group, log, f"{tag}:bwd"))


class ChannelCatMode(DTensorRules):
    """Active during a parallelized model's forward only: our DTensor rules, and torch.cat along dim 1
    of DTensors that are channel-split at the layer boundary becomes the distributed concatenation
    (one all-to-all of exactly the channels that change hands) instead of DTensor's gather-everything
    rule."""

    def __init__(self, grid: ProcessGrid, meshes: Meshes):
        super().__init__()
        self.grid, self.meshes = grid, meshes
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CATS and self.grid.g_size > 1:
            tensors = args[0] if args else kwargs.get("tensors")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
            places = boundary_placements(self.meshes)
            if (isinstance(tensors, (list, tuple)) and len(tensors) > 1
                    and all(isinstance(t, DTensor) and tuple(t.placements) == tuple(places) for t in tensors)
                    and tensors[0].dim() >= 2 and dim % tensors[0].dim() == 1):
                return self._cat(list(tensors))
        rules = super().__torch_function__
        try:
            return rules(func, types, args, kwargs)
        except (RuntimeError, NotImplementedError) as err:
            # DTensor refuses some ops on its placements before computing anything: a view of a tensor
            # sharded unevenly ("Cannot flatten unevenly sharded tensor": torch.chunk's pieces of a
            # channel count the ranks do not divide), or an op whose strategies cover only some
            # shardings. Those are not ops without a strategy (a registered rule serves those:
            # dtensor.rules.serve_replicated), but torch's own strategies refusing one sharding, and
            # a registered rule would replace torch's strategy for every sharding; DTensor raises them
            # as plain RuntimeErrors, so its message is the only thing that tells them from the op's
            # own errors. Served on inputs gathered on channel_filter, then on whole inputs; what
            # still fails is the op's own error.
            if not _is_sharding_refusal(err):
                raise
            for level in ("channel_filter", "all"):
                try:
                    return rules(func, types, _gathered(args, level), _gathered(kwargs, level))
                except (RuntimeError, NotImplementedError) as again:
                    if not _is_sharding_refusal(again):
                        raise
            raise

    def _cat(self, tensors) -> torch.Tensor:
        k = self.calls
        self.calls += 1
        group, log = self.grid.sample_group, self.grid.comm_log
        sizes = [t.shape[1] for t in tensors]  # global shapes: no handshake needed
        local = _ChannelCat.apply(sizes, group, log, f"cat{k}", *[t.to_local() for t in tensors])
        shape = list(tensors[0].shape)
        shape[1] = sum(sizes)
        return from_local(local, self.meshes, boundary_placements(self.meshes), shape)


def _is_sharding_refusal(err: BaseException) -> bool:
    text = str(err)
    return ("unevenly sharded" in text or "sharding strategy" in text or "Sharding propagation failed" in text
            or "redistribute the tensor" in text)


def _gathered(tree, level: str):
    def one(t: DTensor) -> DTensor:
        places = [Replicate()] * len(t.placements) if level == "all" else \
            [*t.placements[:-1], Replicate()]
        return t.redistribute(t.device_mesh, places) if tuple(places) != tuple(t.placements) else t
    return tree_map_only(DTensor, one, tree)


def install(module: torch.nn.Module, grid: ProcessGrid, meshes: Meshes) -> None:
    """Run `module`'s forward under ChannelCatMode (forward pre-hook enters it, forward hook leaves,
    also when the forward raises: outside the forward, DTensor is stock),
    with scaled_dot_product_attention pinned to its math kernel: the dry run (on meta tensors, where
    SDPA always decomposes into bmm/softmax) validates that one, while CPU would pick its flash
    kernel, whose backward has no DTensor strategy and whose output strides break DTensor's
    view of a reshape (both measured on HF BEiT/CLIP, torch 2.13: crashes after the ranks started)."""
    mode = ChannelCatMode(grid, meshes)
    pinned: list = []

    def enter(_m, _inputs):
        mode.calls = 0
        mode.__enter__()
        ctx = sdpa_kernel([SDPBackend.MATH])
        ctx.__enter__()
        pinned.append(ctx)

    def leave(_m, _inputs, _output):
        if not pinned:  # the forward failed before entering (a pre-hook raised)
            return
        while pinned:
            pinned.pop().__exit__(None, None, None)
        mode.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
