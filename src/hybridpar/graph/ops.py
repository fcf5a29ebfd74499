"""Tracer-neutral op records and the mapping from torch ops/modules to our op kinds and attrs.

The same names cover nn.Module class names (lower-cased), torch/functional/method names seen by
torch.fx, and ATen op names seen by torch.export, so both tracers share one table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

Shape = tuple[int, ...]
# A parameter seen by an op: (qualified name, shape, identity key for de-duplicating shared weights).
ParamRef = tuple[str, Shape, int]


@dataclass(frozen=True)
class OpRecord:
    name: str
    kind: str  # one of types.OP_KINDS, or "fold" for shape-only / constant ops
    args: tuple[str, ...]  # producing records, in argument order
    in_shapes: tuple[Shape | None, ...]
    out_shape: Shape | None
    module: str | None = None  # qualified nn.Module name when the op *is* that (leaf) module
    scope: str | None = None  # innermost enclosing module, for grouping
    params: tuple[ParamRef, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)
    is_input: bool = False


_FOLD = {
    "getattr", "getitem", "size", "dim", "numel", "view", "reshape", "_reshape_alias", "_unsafe_view",
    "contiguous", "clone", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "expand_as",
    "view_as", "alias", "detach", "to", "type", "float", "half", "_to_copy", "chunk", "split", "unbind",
    "narrow", "slice", "select", "identity", "zeros", "zeros_like", "ones", "ones_like", "empty",
    "full", "arange", "lift_fresh_copy", "sym_size", "repeat", "tile", "reshape_as", "unflatten",
}

_KINDS = {
    "conv2d": "conv2d", "convolution": "conv2d", "_convolution": "conv2d",
    "linear": "linear", "addmm": "linear",
    "scaled_dot_product_attention": "sdpa", "_scaled_dot_product_flash_attention_for_cpu": "sdpa",
    "matmul": "matmul", "mm": "matmul", "bmm": "matmul", "baddbmm": "matmul",
    "batchnorm1d": "batchnorm", "batchnorm2d": "batchnorm", "batch_norm": "batchnorm",
    "_native_batch_norm_legit_functional": "batchnorm", "_native_batch_norm_legit": "batchnorm",
    "_native_batch_norm_legit_no_training": "batchnorm", "native_batch_norm": "batchnorm",
    "layernorm": "layernorm", "layer_norm": "layernorm", "native_layer_norm": "layernorm",
    "groupnorm": "layernorm", "group_norm": "layernorm",
    "relu": "relu", "relu_": "relu", "relu6": "relu",
    "add": "add", "add_": "add", "iadd": "add", "sub": "add", "sub_": "add", "isub": "add", "rsub": "add",
    "mul": "mul", "mul_": "mul", "imul": "mul", "div": "mul", "div_": "mul", "truediv": "mul",
    "true_divide": "mul",
    "cat": "concat", "concat": "concat", "concatenate": "concat", "stack": "concat",
    "maxpool2d": "maxpool", "max_pool2d": "maxpool", "_max_pool2d": "maxpool",
    "max_pool2d_with_indices": "maxpool", "avgpool2d": "avgpool", "avg_pool2d": "avgpool",
    "adaptiveavgpool2d": "adaptive_avgpool", "adaptive_avg_pool2d": "adaptive_avgpool",
    "_adaptive_avg_pool2d": "adaptive_avgpool",
    "flatten": "flatten",
    "dropout": "dropout", "dropout2d": "dropout", "native_dropout": "dropout", "feature_dropout": "dropout",
    "lstm": "lstm", "embedding": "embedding",
    "softmax": "softmax", "_softmax": "softmax", "log_softmax": "softmax", "_log_softmax": "softmax",
    "logsoftmax": "softmax",
    "crossentropyloss": "loss", "cross_entropy": "loss", "cross_entropy_loss": "loss", "nll_loss": "loss",
    "nllloss": "loss",
    "tanh": "pointwise", "sigmoid": "pointwise", "gelu": "pointwise", "silu": "pointwise", "exp": "pointwise",
    "neg": "pointwise", "sqrt": "pointwise", "rsqrt": "pointwise", "hardtanh": "pointwise",
    "leaky_relu": "pointwise", "leakyrelu": "pointwise", "elu": "pointwise", "clamp": "pointwise",
    "pow": "pointwise", "hardswish": "pointwise", "abs": "pointwise",
}


def shape_of(meta) -> Shape | None:
    """Output shape from fx TensorMetadata / export FakeTensor; first tensor of a tuple output."""
    if meta is None:
        return None
    if hasattr(meta, "shape") and hasattr(meta, "dtype"):  # TensorMetadata is a NamedTuple: test first
        return tuple(int(d) for d in meta.shape)
    if isinstance(meta, (tuple, list)):
        for m in meta:
            s = shape_of(m)
            if s is not None:
                return s
    return None


def is_opaque(mod: nn.Module) -> bool:
    """A leaf module our op table has no rule for (its FLOPs get measured instead)."""
    name = type(mod).__name__.lower()
    return name not in _FOLD and _KINDS.get(name, "other") == "other" and any(True for _ in mod.parameters())


def classify(op_name: str, mod: nn.Module | None, args: tuple, kwargs: dict,
             in_shapes: tuple, out: Shape | None) -> tuple[str, dict]:
    """(op kind, attrs) for an op named `op_name`; `mod` is the leaf module it runs in, if any."""
    name = op_name.lower()
    if name in _FOLD or out is None:
        return "fold", {}
    kind = _KINDS.get(name, "other")
    if kind == "matmul":
        return "attention", {"k": _matmul_k(in_shapes)}
    if kind == "sdpa":
        return "attention", {"sdpa": True, "k": in_shapes[0][-1] if in_shapes and in_shapes[0] else 1}
    extract = _ATTRS.get(kind)
    return kind, (extract(mod, args, kwargs, in_shapes, out) if extract else {})


def _matmul_k(in_shapes: tuple) -> int:
    a = next((s for s in in_shapes if s), ())
    return int(a[-1]) if a else 1


def _arg(args: tuple, kwargs: dict, i: int, key: str, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(key, default)


def _pair(v) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        return (int(v[0]), int(v[-1])) if v else (1, 1)
    return (int(v), int(v))


def _conv_attrs(mod, args, kwargs, ins, out) -> dict:
    if isinstance(mod, nn.Conv2d):
        return {"in_channels": mod.in_channels, "out_channels": mod.out_channels, "kernel": tuple(mod.kernel_size),
                    "stride": tuple(mod.stride), "padding": _pair(mod.padding) if not isinstance(mod.padding, str)
                    else mod.padding, "dilation": tuple(mod.dilation), "groups": mod.groups, "bias": mod.bias is not None}
    w = ins[1]
    groups = int(_arg(args, kwargs, 6, "groups", 1))
    return {"in_channels": w[1] * groups, "out_channels": w[0], "kernel": tuple(w[2:]),
                "stride": _pair(_arg(args, kwargs, 3, "stride", 1)), "padding": _pair(_arg(args, kwargs, 4, "padding", 0)),
                "dilation": _pair(_arg(args, kwargs, 5, "dilation", 1)), "groups": groups,
                "bias": _arg(args, kwargs, 2, "bias") is not None}


def _linear_attrs(mod, args, kwargs, ins, out) -> dict:
    if isinstance(mod, nn.Linear):
        return {"in_features": mod.in_features, "out_features": mod.out_features, "bias": mod.bias is not None}
    if len(ins) >= 2 and ins[1] is not None and len(ins[1]) == 2:  # F.linear / aten.linear: W is (out, in)
        return {"in_features": ins[1][1], "out_features": ins[1][0], "bias": len(ins) > 2}
    if len(ins) == 3:  # aten.addmm(bias, x, W^T)
        return {"in_features": ins[1][-1], "out_features": ins[2][-1], "bias": True}
    return {"in_features": ins[0][-1], "out_features": out[-1], "bias": False}


def _lstm_attrs(mod, args, kwargs, ins, out) -> dict:
    if not isinstance(mod, nn.LSTM):
        raise TypeError("an LSTM op outside nn.LSTM is not supported")
    return {"input_size": mod.input_size, "hidden": mod.hidden_size, "proj": mod.proj_size, "layers": mod.num_layers,
                "bidirectional": mod.bidirectional, "batch_first": mod.batch_first, "bias": mod.bias}


def _pool_attrs(mod, args, kwargs, ins, out) -> dict:
    if isinstance(mod, (nn.MaxPool2d, nn.AvgPool2d)):
        k, s, p = mod.kernel_size, mod.stride, mod.padding
    else:
        k = _arg(args, kwargs, 1, "kernel_size", 1)
        s = _arg(args, kwargs, 2, "stride", None) or k
        p = _arg(args, kwargs, 3, "padding", 0)
    return {"kernel": _pair(k), "stride": _pair(s if s is not None else k), "padding": _pair(p)}


def _embedding_attrs(mod, args, kwargs, ins, out) -> dict:
    if isinstance(mod, nn.Embedding):
        return {"num_embeddings": mod.num_embeddings, "embedding_dim": mod.embedding_dim}
    w = next((s for s in ins if s and len(s) == 2), (0, out[-1]))
    return {"num_embeddings": w[0], "embedding_dim": w[1]}


def _norm_attrs(mod, args, kwargs, ins, out) -> dict:
    n = getattr(mod, "num_features", None) or (out[1] if len(out) > 1 else out[-1])
    return {"num_features": int(n), "eps": float(getattr(mod, "eps", 1e-5))}


_ATTRS = {
    "conv2d": _conv_attrs, "linear": _linear_attrs, "lstm": _lstm_attrs, "maxpool": _pool_attrs,
    "avgpool": _pool_attrs, "embedding": _embedding_attrs, "batchnorm": _norm_attrs,
}
