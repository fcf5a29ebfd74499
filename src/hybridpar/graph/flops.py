"""FLOP rules per op kind, from shapes alone (so they work on the `meta` device).

Convention: torch.utils.flop_counter.FlopCounterMode, i.e. 2 FLOPs per multiply-add, bias adds not
counted. FlopCounterMode only counts matrix products and convolutions (mm/addmm/bmm/baddbmm,
convolution and its backward, SDPA); our "matmul-class" ops (`MATMUL_OPS`) follow exactly those
rules, so `matmul_flops(graph)` is comparable with it like for like.

attention: an activation x activation product (matmul/mm/bmm/baddbmm: 2 * out * K), an einsum
(each pairwise contraction as the batched matmul torch runs), or scaled_dot_product_attention as its
math path runs it. Opaque torch.nn leaves are measured instead (graph/measured.py).
Other ops are counted too so the cost model sees them, with these documented approximations
(n = elements of the output unless stated):
  relu/pointwise/dropout: fwd n, bwd n.   add: fwd n, bwd 0 (gradient passes through).   mul: fwd n, bwd 2n.
  batchnorm/layernorm: fwd 5n (mean, variance, normalise, scale, shift), bwd_data 8n, bwd_weight 2n.
  max/avg pool: fwd = input elements the windows read (clipped to the input: padding, ceil_mode and
  windows larger than the input add nothing), bwd = input elements.
  adaptive pooling and reductions (mean/sum/max/norm): fwd = bwd = input elements.
  softmax: fwd 5n, bwd 4n.   loss (cross-entropy on logits): fwd 6*logits, bwd 2*logits.
  embedding, concat, flatten, reshape: 0 (memory movement only).
LSTM: gate and projection matrix products only (the elementwise gate math, ~0.5% for hidden >= 256,
is left out), which is what FlopCounterMode counts for nn.LSTM where its aten op decomposes into
mm/addmm (on the meta device, and on CPU with projections; CPU's oneDNN kernel, used without
projections, is opaque to FlopCounterMode); backward skips the gradient into the zero initial state,
as autograd does. tests/graph checks the rule against FlopCounterMode on meta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from hybridpar.graph.types import Graph

MATMUL_OPS = frozenset({"conv2d", "conv", "linear", "lstm", "attention"})


@dataclass(frozen=True)
class Flops:
    fwd: int = 0
    bwd_data: int = 0
    bwd_weight: int = 0


Shape = tuple[int, ...]


def node_flops(op: str, in_shapes: Sequence[Shape], out_shape: Shape, attrs: Mapping[str, Any],
               input_grads: Sequence[bool], has_weight: bool) -> Flops:
    """FLOPs of one op. `input_grads[i]` says whether input i needs a gradient (backward-data work
    for it); `has_weight` whether the op owns trainable parameters (backward-weight work)."""
    rule = _RULES.get(op)
    if rule is None:
        return Flops()
    return rule(in_shapes, out_shape, attrs, tuple(input_grads), has_weight)


def _n(shape: Shape) -> int:
    return prod(shape) if shape else 0


def _conv2d(ins, out, a, grads, has_w) -> Flops:
    # per output element: one multiply-add per input channel of its group and kernel tap; a transposed
    # convolution does the same work per *input* element
    n = _n(ins[0]) if a.get("transposed") else _n(out)
    per = (a["out_channels"] if a.get("transposed") else a["in_channels"]) // a["groups"]
    f = 2 * n * per * prod(a["kernel"])
    return Flops(f, f if any(grads) else 0, f if has_w else 0)


def _linear(ins, out, a, grads, has_w) -> Flops:
    f = 2 * _n(out[:-1]) * a["in_features"] * a["out_features"]
    return Flops(f, f if any(grads) else 0, f if has_w else 0)


def _attention(ins, out, a, grads, has_w) -> Flops:
    if a.get("sdpa"):
        return _sdpa(a.get("qkv") or ins, grads)
    # An activation x activation product (attention scores / context): out = A @ B over K; an einsum
    # carries its own count (graph/ops.py: einsum_flops). Each operand's gradient is a product of the
    # same size; a bias (baddbmm) needs none.
    f = int(a["flops"]) if "flops" in a else 2 * prod(out) * int(a["k"])  # prod(()) = 1: a dot product
    operands = grads[-2:] if len(grads) > 2 else grads
    data = sum(f for g in operands if g)
    return Flops(f, data, f if has_w else 0)


def _sdpa(ins, grads) -> Flops:
    # scaled_dot_product_attention as its math path runs it: scores = Q K^T, out = softmax(scores) V;
    # backward: grad scores, grad V, grad Q, grad K (4 batched matmuls).
    q, k, v = ins[0], ins[1], ins[2]
    bh, sq, dq, sk, dv = _n(q[:-2]), q[-2], q[-1], k[-2], v[-1]
    base = 2 * bh * sq * sk
    return Flops(base * (dq + dv), base * (2 * dq + 2 * dv) if any(grads) else 0, 0)


def lstm_flops(*, batch: int, steps: int, input_size: int, hidden: int, proj: int = 0, layers: int = 1,
               bidirectional: bool = False, input_grad: bool = True, gates: int = 4) -> Flops:
    """Gate and projection matmuls of nn.LSTM (gates=4), nn.GRU (3) or nn.RNN (1) over `steps` time
    steps (see module docstring)."""
    dirs = 2 if bidirectional else 1
    rec = proj or hidden  # width of the recurrent state fed back into the gates
    fwd = bwd_data = bwd_weight = 0
    for layer in range(layers):
        in_l = input_size if layer == 0 else rec * dirs
        x_mm = 2 * batch * steps * gates * hidden * in_l
        h_mm = 2 * batch * steps * gates * hidden * rec
        p_mm = 2 * batch * steps * hidden * proj if proj else 0
        fwd += dirs * (x_mm + h_mm + p_mm)
        bwd_weight += dirs * (x_mm + h_mm + p_mm)
        # No gradient flows into the (zero) initial state, so the first step's recurrent
        # product has no data gradient.
        h_data = 2 * batch * (steps - 1) * gates * hidden * rec
        x_data = x_mm if (layer > 0 or input_grad) else 0
        bwd_data += dirs * (x_data + h_data + p_mm)
    return Flops(fwd, bwd_data, bwd_weight)


def _lstm(ins, out, a, grads, has_w) -> Flops:
    x = ins[0]
    batch, steps = (x[0], x[1]) if a.get("batch_first", False) else (x[1], x[0])
    if len(x) == 2:  # unbatched input (T, C)
        batch, steps = 1, x[0]
    return lstm_flops(batch=batch, steps=steps, input_size=a["input_size"], hidden=a["hidden"],
                      proj=a.get("proj", 0), layers=a["layers"], bidirectional=a["bidirectional"],
                      input_grad=bool(grads and grads[0]), gates=a.get("gates", 4))


def _per_elem(fwd: float, bwd: float):
    def rule(ins, out, a, grads, has_w) -> Flops:
        n = _n(out)
        return Flops(int(fwd * n), int(bwd * n) if any(grads) else 0, 0)
    return rule


def _norm(ins, out, a, grads, has_w) -> Flops:
    n = _n(out)
    return Flops(5 * n, 8 * n if any(grads) else 0, 2 * n if has_w else 0)


def window_reads(length: int, out_len: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    """Input elements that the windows of one spatial dimension actually cover: each output position's
    window clipped to the input (padding, ceil_mode's extra window and a window larger than the input
    read nothing outside it)."""
    total = 0
    for o in range(out_len):
        start = o * stride - padding
        total += sum(1 for j in range(kernel) if 0 <= start + j * dilation < length)
    return total


def _pool(ins, out, a, grads, has_w) -> Flops:
    """One FLOP per input element read by a window (max: a compare, average: an add); backward
    touches each input element once."""
    x = ins[0] if ins else ()
    nd = len(a.get("kernel", ()))
    if not x or not out or nd == 0 or len(x) < nd or len(out) < nd:
        return Flops(_n(out), _n(x) if any(grads) else 0, 0)
    reads = prod(window_reads(x[-nd + i], out[-nd + i], a["kernel"][i], a["stride"][i], a["padding"][i],
                              a.get("dilation", (1,) * nd)[i]) for i in range(nd))
    return Flops(_n(out[:-nd]) * reads, _n(x) if any(grads) else 0, 0)


def _adaptive_pool(ins, out, a, grads, has_w) -> Flops:
    n = _n(ins[0]) if ins else 0
    return Flops(n, n if any(grads) else 0, 0)


def _loss(ins, out, a, grads, has_w) -> Flops:
    n = _n(ins[0]) if ins else 0
    return Flops(6 * n, 2 * n if any(grads) else 0, 0)


_RULES = {
    "conv2d": _conv2d,
    "linear": _linear,
    "attention": _attention,
    "lstm": _lstm,
    "batchnorm": _norm,
    "layernorm": _norm,
    "relu": _per_elem(1, 1),
    "pointwise": _per_elem(1, 1),
    "dropout": _per_elem(1, 1),
    "add": _per_elem(1, 0),
    "mul": _per_elem(1, 2),
    "softmax": _per_elem(5, 4),
    "maxpool": _pool,
    "avgpool": _pool,
    "adaptive_avgpool": _adaptive_pool,
    "reduce": _adaptive_pool,
    "conv": _conv2d,
    "loss": _loss,
}


def matmul_flops(graph: Graph) -> Flops:
    """Sum over the matmul-class nodes and the measured opaque modules: what FlopCounterMode counts.
    A node's parameter-only upstream work (attrs `branch_flops`) counts by its own ops' class."""
    fwd = bwd_data = bwd_weight = 0
    for n in graph.nodes:
        total = n.attr("branch_flops") or (0, 0, 0)
        mm = n.attr("branch_matmul_flops") or (0, 0, 0)
        own = (n.fwd_flops - total[0], n.bwd_data_flops - total[1], n.bwd_weight_flops - total[2])
        if not (n.op in MATMUL_OPS or n.attr("flops_source") == "flop_counter"):
            own = (0, 0, 0)
        fwd, bwd_data, bwd_weight = fwd + own[0] + mm[0], bwd_data + own[1] + mm[1], bwd_weight + own[2] + mm[2]
    return Flops(fwd, bwd_data, bwd_weight)
