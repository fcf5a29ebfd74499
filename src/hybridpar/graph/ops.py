"""Tracer-neutral op records and the mapping from torch ops/modules to our op kinds and attrs.

The same names cover nn.Module class names (lower-cased), torch/functional/method names seen by
torch.fx, and ATen op names seen by torch.export, so both tracers share one table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from math import prod
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
    # memory movement and constants: no arithmetic (a padded or re-indexed tensor stands for its input)
    "split_with_sizes", "tensor_split", "pad", "constant_pad_nd", "constantpad1d", "constantpad2d",
    "constantpad3d", "zeropad1d", "zeropad2d", "zeropad3d", "reflectionpad2d", "replicationpad2d",
    "reflection_pad2d", "replication_pad2d", "new_ones", "new_zeros", "new_empty", "new_full", "new_tensor",
    "empty_like", "full_like", "rand", "randn", "rand_like", "randn_like", "randint", "bernoulli",
    "bernoulli_", "linspace", "meshgrid", "index", "index_select", "gather", "take_along_dim", "roll",
    "flip", "movedim", "moveaxis", "swapaxes", "as_strided", "diagonal", "tril", "triu", "masked_select",
    "fold", "unfold", "im2col", "col2im", "pixel_shuffle", "pixel_unshuffle", "pixelshuffle",
    "pixelunshuffle", "channel_shuffle", "copy", "copy_", "fill_", "zero_", "cpu", "cuda", "bool", "long",
    "int", "double", "bfloat16", "requires_grad_", "_assert_tensor_metadata", "_assert_scalar",
    "sym_constrain_range_for_size", "scalar_tensor", "item", "eq", "ne", "lt", "le", "gt", "ge",
    "__and__", "__or__", "__invert__", "logical_and", "logical_or", "logical_not", "argmax", "argmin",
    "flatten_dense_tensors", "bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "logical_xor",
    "isnan", "isinf", "isfinite", "any", "all", "nonzero", "one_hot", "scatter", "scatter_", "scatter_add",
    "scatter_add_", "index_add", "index_add_", "index_put", "index_put_", "index_fill", "index_fill_",
    "masked_scatter", "repeat_interleave", "unsqueeze_", "squeeze_", "transpose_", "t_", "detach_", "fill",
    "resize_", "lift", "_local_scalar_dense", "sym_numel", "sym_stride", "sym_storage_offset", "stride",
    "expand_copy", "view_copy", "permute_copy", "slice_copy", "select_copy", "unsqueeze_copy",
    "squeeze_copy", "transpose_copy", "t_copy", "alias_copy", "_unsafe_index", "_unsafe_index_put",
    "unfold_copy", "split_copy", "unbind_copy", "narrow_copy", "diagonal_copy", "as_strided_copy",
}

_KINDS = {
    "conv2d": "conv2d", "convolution": "conv2d", "_convolution": "conv2d",
    "conv1d": "conv", "conv3d": "conv", "conv_transpose1d": "conv", "conv_transpose2d": "conv",
    "conv_transpose3d": "conv", "convtranspose1d": "conv", "convtranspose2d": "conv", "convtranspose3d": "conv",
    "linear": "linear", "addmm": "linear", "bilinear": "linear",
    "scaled_dot_product_attention": "sdpa", "_scaled_dot_product_flash_attention_for_cpu": "sdpa",
    "_scaled_dot_product_flash_attention": "sdpa", "_scaled_dot_product_efficient_attention": "sdpa",
    "_scaled_dot_product_cudnn_attention": "sdpa",
    "matmul": "matmul", "mm": "matmul", "bmm": "matmul", "baddbmm": "matmul", "addbmm": "matmul",
    "mv": "matmul", "addmv": "matmul", "dot": "matmul", "vdot": "matmul", "einsum": "einsum",
    "outer": "mul", "ger": "mul",
    "batchnorm1d": "batchnorm", "batchnorm2d": "batchnorm", "batchnorm3d": "batchnorm", "syncbatchnorm": "batchnorm",
    "batch_norm": "batchnorm",
    "_native_batch_norm_legit_functional": "batchnorm", "_native_batch_norm_legit": "batchnorm",
    "_native_batch_norm_legit_no_training": "batchnorm", "native_batch_norm": "batchnorm",
    "layernorm": "layernorm", "layer_norm": "layernorm", "native_layer_norm": "layernorm",
    "groupnorm": "layernorm", "group_norm": "layernorm", "native_group_norm": "layernorm",
    "instancenorm1d": "layernorm", "instancenorm2d": "layernorm", "instancenorm3d": "layernorm",
    "instance_norm": "layernorm", "localresponsenorm": "layernorm", "local_response_norm": "layernorm",
    "rmsnorm": "layernorm", "rms_norm": "layernorm", "_fused_rms_norm": "layernorm",
    "relu": "relu", "relu_": "relu", "relu6": "relu",
    "add": "add", "add_": "add", "iadd": "add", "sub": "add", "sub_": "add", "isub": "add", "rsub": "add",
    "mul": "mul", "mul_": "mul", "imul": "mul", "div": "mul", "div_": "mul", "truediv": "mul",
    "true_divide": "mul", "floordiv": "mul", "floor_divide": "mul", "addcmul": "mul", "addcdiv": "mul",
    "cat": "concat", "concat": "concat", "concatenate": "concat", "stack": "concat", "hstack": "concat",
    "vstack": "concat",
    "maxpool2d": "maxpool", "max_pool2d": "maxpool", "_max_pool2d": "maxpool",
    "max_pool2d_with_indices": "maxpool", "avgpool2d": "avgpool", "avg_pool2d": "avgpool",
    "maxpool1d": "maxpool", "max_pool1d": "maxpool", "max_pool1d_with_indices": "maxpool",
    "maxpool3d": "maxpool", "max_pool3d": "maxpool", "max_pool3d_with_indices": "maxpool",
    "avgpool1d": "avgpool", "avg_pool1d": "avgpool", "avgpool3d": "avgpool", "avg_pool3d": "avgpool",
    "adaptiveavgpool2d": "adaptive_avgpool", "adaptive_avg_pool2d": "adaptive_avgpool",
    "_adaptive_avg_pool2d": "adaptive_avgpool", "adaptiveavgpool1d": "adaptive_avgpool",
    "adaptive_avg_pool1d": "adaptive_avgpool", "adaptiveavgpool3d": "adaptive_avgpool",
    "adaptive_avg_pool3d": "adaptive_avgpool", "_adaptive_avg_pool3d": "adaptive_avgpool",
    "adaptivemaxpool1d": "adaptive_avgpool", "adaptivemaxpool2d": "adaptive_avgpool",
    "adaptive_max_pool1d": "adaptive_avgpool", "adaptive_max_pool2d": "adaptive_avgpool",
    "flatten": "flatten",
    "dropout": "dropout", "dropout1d": "dropout", "dropout2d": "dropout", "dropout3d": "dropout",
    "native_dropout": "dropout", "feature_dropout": "dropout", "alphadropout": "dropout", "dropout_": "dropout",
    "alpha_dropout": "dropout", "feature_alpha_dropout": "dropout",
    "lstm": "lstm", "gru": "lstm", "rnn": "lstm", "rnn_tanh": "lstm", "rnn_relu": "lstm",
    "embedding": "embedding", "embeddingbag": "embedding", "embedding_bag": "embedding",
    "_embedding_bag": "embedding",
    "softmax": "softmax", "_softmax": "softmax", "log_softmax": "softmax", "_log_softmax": "softmax",
    "logsoftmax": "softmax", "softmin": "softmax", "softmax2d": "softmax",
    "crossentropyloss": "loss", "cross_entropy": "loss", "cross_entropy_loss": "loss", "nll_loss": "loss",
    "nllloss": "loss", "mse_loss": "loss", "mseloss": "loss", "l1_loss": "loss", "l1loss": "loss",
    "smooth_l1_loss": "loss", "binary_cross_entropy_with_logits": "loss", "bcewithlogitsloss": "loss",
    # elementwise math and activations (modules and functions): 1 FLOP per output element each way
    "tanh": "pointwise", "sigmoid": "pointwise", "gelu": "pointwise", "silu": "pointwise", "exp": "pointwise",
    "neg": "pointwise", "sqrt": "pointwise", "rsqrt": "pointwise", "hardtanh": "pointwise",
    "leaky_relu": "pointwise", "leakyrelu": "pointwise", "elu": "pointwise", "clamp": "pointwise",
    "pow": "pointwise", "hardswish": "pointwise", "abs": "pointwise", "clamp_min": "pointwise",
    "clamp_max": "pointwise", "clip": "pointwise", "floor": "pointwise", "ceil": "pointwise",
    "round": "pointwise", "sign": "pointwise", "log": "pointwise", "log1p": "pointwise", "expm1": "pointwise",
    "log2": "pointwise", "reciprocal": "pointwise", "square": "pointwise", "sin": "pointwise",
    "cos": "pointwise", "erf": "pointwise", "erfc": "pointwise", "softplus": "pointwise",
    "softsign": "pointwise", "mish": "pointwise", "selu": "pointwise", "celu": "pointwise",
    "prelu": "pointwise", "rrelu": "pointwise", "glu": "pointwise", "hardsigmoid": "pointwise",
    "hardshrink": "pointwise", "softshrink": "pointwise", "tanhshrink": "pointwise", "threshold": "pointwise",
    "logsigmoid": "pointwise", "relu6_": "relu", "gelu_": "pointwise", "silu_": "pointwise",
    "sigmoid_": "pointwise", "tanh_": "pointwise", "hardswish_": "pointwise", "hardsigmoid_": "pointwise",
    "leaky_relu_": "pointwise", "elu_": "pointwise", "clamp_": "pointwise", "where": "pointwise",
    "masked_fill": "pointwise", "masked_fill_": "pointwise", "lerp": "pointwise", "maximum": "pointwise",
    "minimum": "pointwise", "fmod": "pointwise", "remainder": "pointwise", "mod": "pointwise",
    "upsample_bilinear2d": "pointwise", "upsample_nearest2d": "pointwise", "upsample_bicubic2d": "pointwise",
    "upsample_nearest1d": "pointwise", "upsample_linear1d": "pointwise", "upsample_nearest3d": "pointwise",
    "upsample_trilinear3d": "pointwise", "interpolate": "pointwise", "upsample": "pointwise",
    "upsamplingbilinear2d": "pointwise",
    "upsamplingnearest2d": "pointwise", "grid_sample": "pointwise", "cumsum": "pointwise",
    "cumprod": "pointwise", "softmax_": "softmax", "nan_to_num": "pointwise", "logit": "pointwise",
    "exp2": "pointwise", "log10": "pointwise", "sinh": "pointwise", "cosh": "pointwise", "tan": "pointwise",
    "atan": "pointwise", "atan2": "pointwise", "asin": "pointwise", "acos": "pointwise", "trunc": "pointwise",
    "frac": "pointwise", "sgn": "pointwise", "hypot": "pointwise", "copysign": "pointwise",
    "heaviside": "pointwise", "xlogy": "pointwise", "sigmoid_backward": "pointwise",
    # reductions over the input: 1 FLOP per input element each way
    "mean": "reduce", "sum": "reduce", "max": "reduce", "min": "reduce", "amax": "reduce", "amin": "reduce",
    "prod": "reduce", "std": "reduce", "var": "reduce", "var_mean": "reduce", "std_mean": "reduce",
    "norm": "reduce", "linalg_vector_norm": "reduce", "vector_norm": "reduce", "normalize": "reduce",
    "logsumexp": "reduce", "cosine_similarity": "reduce", "pairwise_distance": "reduce",
    "cosinesimilarity": "reduce", "pairwisedistance": "reduce", "linalg_norm": "reduce",
    "frobenius_norm": "reduce", "sum_to_size": "reduce", "topk": "reduce", "sort": "reduce", "argsort": "reduce",
    "kthvalue": "reduce", "median": "reduce", "dist": "reduce", "cdist": "reduce", "aminmax": "reduce",
}

# Modules whose work is given by a measured FlopCounterMode run when they are leaves of the graph.
_MEASURED_KINDS = {"multiheadattention": "attention"}


# image ops whose kernels take another path on channels-last memory (oneDNN/ATen): the ones the trace
# marks NHWC_IN and `hybridpar profile` times channels-last where the model hands them NHWC inputs
NHWC_KINDS = ("conv2d", "maxpool", "avgpool", "adaptive_avgpool", "batchnorm")


def channels_last_strides(shape, stride) -> bool:
    """A 4-D shape's strides are channels-last's and not NCHW's. Strides compared, not contiguity: a
    1x1 image is contiguous both ways, yet oneDNN ran a 7x7 depthwise convolution on it in 0.04 ms with
    the strides a permute leaves (192, 1, 192, 192) and 0.9 ms with NCHW's (192, 1, 1, 1)."""
    if len(shape) != 4 or stride is None:
        return False
    n, c, h, w = (int(d) for d in shape)
    return tuple(int(x) for x in stride) == (h * w * c, 1, w * c, c) != (c * h * w, h * w, w, 1)


def nhwc_strided(kind: str, meta) -> bool:
    """An input of an image op `kind` in channels-last strides, from fx TensorMetadata or an export
    FakeTensor."""
    if kind not in NHWC_KINDS or meta is None:
        return False
    shape = tuple(meta.shape) if hasattr(meta, "shape") else ()
    stride = meta.stride() if callable(getattr(meta, "stride", None)) else getattr(meta, "stride", None)
    return channels_last_strides(shape, stride)


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
    return name in _MEASURED_KINDS or (name not in _FOLD and _KINDS.get(name, "other") == "other")


class UnpricedOp(Exception):
    """An op with no FLOP rule of ours (the tracer turns it into a UserError naming op and module)."""


def classify(op_name: str, mod: nn.Module | None, args: tuple, kwargs: dict,
             in_shapes: tuple, out: Shape | None) -> tuple[str, dict]:
    """(op kind, attrs) for an op named `op_name`; `mod` is the leaf module it runs in, if any."""
    name = op_name.lower()
    if name in _FOLD or out is None:
        return "fold", {}
    if mod is not None and type(mod).__name__.lower() in _MEASURED_KINDS and name == type(mod).__name__.lower():
        return _MEASURED_KINDS[name], {}
    kind = _KINDS.get(name, "other")
    if kind == "matmul":
        return "attention", {"k": _matmul_k(name, in_shapes)}
    if kind == "einsum":
        return "attention", {"flops": einsum_flops(args[0] if args else kwargs.get("equation", ""), in_shapes)}
    if kind == "sdpa":
        # q, k and v from the call itself: the graph's inputs name each producer once, so a
        # self-attention called as sdpa(q, q, q) has one input shape, not three
        qkv = tuple(_node_shape(_arg(args, kwargs, i, key)) for i, key in enumerate(("query", "key", "value")))
        attrs = {"sdpa": True, "k": in_shapes[0][-1] if in_shapes and in_shapes[0] else 1}
        if all(qkv):
            attrs["qkv"] = qkv
        p = _arg(args, kwargs, 4, "dropout_p", 0.0)  # decides what autograd keeps (cost.memory.internal_numel)
        return "attention", {**attrs, "dropout": float(p)} if isinstance(p, (int, float)) and p > 0 else attrs
    if kind == "other":
        raise UnpricedOp(op_name)
    extract = _ATTRS.get(kind)
    attrs = extract(mod, args, kwargs, in_shapes, out) if extract else {}
    attrs = {**attrs, **_saved_attrs(name, kind, mod, args, kwargs, out), **_upsample_attrs(name, mod, args, kwargs)}
    if kind == "conv2d" and (len(attrs["kernel"]) != 2 or attrs.get("transposed")):
        kind = "conv"  # 1-D/3-D and transposed convolutions: priced, but no channel/filter layouts
    return kind, attrs


# What autograd saves for backward where the op kind's rule (cost.memory.kept_activations) does not say
# it (torch 2.13, measured with saved_tensors_hooks): these keep their output, not their input;
# upsampling (every mode but "area", an adaptive average pool) keeps nothing.
_KEEPS_OUTPUT = {"sigmoid", "sigmoid_", "tanh", "tanh_", "exp", "sqrt", "rsqrt", "reciprocal"}
_KEEPS_NOTHING = {"neg", "interpolate", "upsample", "upsamplingbilinear2d", "upsamplingnearest2d",
                  "upsample_bilinear2d", "upsample_nearest2d", "upsample_bicubic2d", "upsample_nearest1d",
                  "upsample_linear1d", "upsample_nearest3d", "upsample_trilinear3d"}


def _upsample_attrs(name: str, mod, args: tuple, kwargs: dict) -> dict:
    """An upsampling's interpolation, which decides how a spatial layout runs it
    (parallel.styles.spatial_layers.spatial_style: nearest by integer factors on the pieces, any other
    on the gathered input, cost.spatial.gathered): 'upsample_mode', 'upsample_scale' (the scale
    factors, a tuple, or None) and 'upsample_size' (whether an output size was given). From the module
    (nn.Upsample and its subclasses), F.interpolate's arguments, or an aten upsample_<mode><n>d name."""
    if name not in _KEEPS_NOTHING or name == "neg":
        return {}
    if isinstance(mod, nn.Upsample):
        mode, size, scale = mod.mode, mod.size, mod.scale_factor
    elif name == "interpolate":
        mode, size, scale = (_arg(args, kwargs, 3, "mode", "nearest"), _arg(args, kwargs, 1, "size"),
                             _arg(args, kwargs, 2, "scale_factor"))
    elif name.startswith("upsample_"):  # aten: the output size is always given there
        mode, size, scale = name.removeprefix("upsample_").rstrip("d").rstrip("0123456789"), True, None
    else:
        return {}
    if scale is not None:
        scale = tuple(float(v) for v in scale) if isinstance(scale, (tuple, list)) else (float(scale),)
    return {"upsample_mode": str(mode), "upsample_scale": scale, "upsample_size": size is not None}


def _saved_attrs(name: str, kind: str, mod, args: tuple, kwargs: dict, out) -> dict:
    """Attributes that decide what autograd keeps (cost.memory): 'saves' ('output' or 'nothing') for
    ops outside their kind's rule, 'scalar' for a product with a number (keeps nothing), 'max' for an
    adaptive max-pool (its int64 indices), a norm's statistics (`_norm_stats`)."""
    if name in _KEEPS_OUTPUT:
        return {"saves": "output"}
    if name in _KEEPS_NOTHING and (getattr(mod, "mode", None) or _arg(args, kwargs, 3, "mode", "nearest")) != "area":
        return {"saves": "nothing"}
    if kind == "mul" and len(args) == 2 and any(isinstance(a, (int, float)) and not isinstance(a, bool)
                                                for a in args):
        return {"scalar": True}
    if kind == "adaptive_avgpool" and "max" in name:
        return {"max": True}
    if kind == "layernorm" and out:
        return _norm_stats(name, mod, args, kwargs, out)
    return {}


def _norm_stats(name: str, mod, args: tuple, kwargs: dict, out) -> dict:
    """Elements each statistic normalises ('stat_numel': a layer/group norm keeps a mean and a 1/std
    per group of them, an RMS norm a 1/rms, 'rms') and, for an RMS norm with a weight, 'rms_weight'
    (torch's composite RMS norm keeps the normalised input for the weight's gradient too)."""
    sample = prod(out[1:]) if len(out) > 1 else prod(out)
    if isinstance(mod, nn.GroupNorm) or name in ("group_norm", "native_group_norm"):
        groups = mod.num_groups if isinstance(mod, nn.GroupNorm) else _arg(args, kwargs, 6 if name[0] == "n" else 1,
                                                                          "num_groups", 1)
        return {"stat_numel": sample // int(groups)} if isinstance(groups, int) and groups > 0 else {}
    if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
        shape, weight = mod.normalized_shape, mod.weight is not None
    elif name in ("layer_norm", "native_layer_norm", "rms_norm"):
        shape, weight = _arg(args, kwargs, 1, "normalized_shape", None), _arg(args, kwargs, 2, "weight") is not None
    else:  # instance, local response, fused RMS norms: per-channel or unmeasured statistics (left out)
        return {}
    if not isinstance(shape, (tuple, list)) or not all(isinstance(d, int) for d in shape):
        return {}
    rms = isinstance(mod, nn.RMSNorm) or name == "rms_norm"
    return {"stat_numel": prod(shape), **({"rms": True, "rms_weight": weight} if rms else {})}


def _matmul_k(name: str, in_shapes: tuple) -> int:
    # baddbmm(bias, a, b) / addmm(bias, a, b): the contraction is over a's last dimension.
    shapes = [s for s in in_shapes if s]
    a = shapes[1] if name in ("baddbmm", "addmm", "addbmm") and len(shapes) >= 3 else (shapes[0] if shapes else ())
    return int(a[-1]) if a else 1


def einsum_flops(equation, in_shapes: tuple) -> int:
    """FLOPs of torch.einsum as FlopCounterMode counts it: torch contracts the operands left to right,
    each pairwise contraction that sums over an index is one batched matmul of 2 * (product of every
    index size of the pair) FLOPs; a pair with nothing to sum is an elementwise product (not counted)."""
    if not isinstance(equation, str) or "->" not in equation or "..." in equation:
        raise UnpricedOp(f"einsum {equation!r}")
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    shapes = [s for s in in_shapes if s is not None]
    if len(terms) != len(shapes):
        raise UnpricedOp(f"einsum {equation!r}")
    size: dict[str, int] = {}
    for t, s in zip(terms, shapes):
        size.update(zip(t, s))
    total, acc = 0, terms[0]
    for i, t in enumerate(terms[1:], start=1):
        later = set(out).union(*terms[i + 1:])
        # an index in one operand only, used nowhere later, is summed out before the product
        pair = list(dict.fromkeys([c for c in acc if c in later or c in t] + [c for c in t if c in later or c in acc]))
        summed = [c for c in pair if c in acc and c in t and c not in later]
        if summed:
            total += 2 * prod(size[c] for c in pair)
        acc = "".join(c for c in pair if c in later)
    return total


def _node_shape(a) -> Shape | None:
    """The shape of a traced argument (an fx node's tensor_meta, an exported node's val), else None."""
    meta = getattr(a, "meta", None)
    return shape_of(meta.get("tensor_meta", meta.get("val"))) if isinstance(meta, dict) else None


def _arg(args: tuple, kwargs: dict, i: int, key: str, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(key, default)


def _conv_attrs(mod, args, kwargs, ins, out) -> dict:
    if isinstance(mod, nn.modules.conv._ConvNd):
        return {"in_channels": mod.in_channels, "out_channels": mod.out_channels, "kernel": tuple(mod.kernel_size),
                "stride": tuple(mod.stride),
                "padding": mod.padding if isinstance(mod.padding, str) else tuple(mod.padding),
                "dilation": tuple(mod.dilation), "groups": mod.groups, "bias": mod.bias is not None,
                "transposed": bool(mod.transposed),
                # another padding mode runs whole in the runtime (cost.layout_comm.runs_distributed)
                **({"padding_mode": mod.padding_mode} if mod.padding_mode != "zeros" else {})}
    w = ins[1]
    nd = len(w) - 2
    # F.convNd(x, w, b, stride, padding, dilation, groups); aten.convolution(x, w, b, stride, padding,
    # dilation, transposed, output_padding, groups)
    aten_conv = len(args) > 6 and isinstance(args[6], bool)
    transposed = bool(_arg(args, kwargs, 6, "transposed", False)) if aten_conv else False
    groups = int(_arg(args, kwargs, 8, "groups", 1) if aten_conv else _arg(args, kwargs, 6, "groups", 1))
    cin = w[0] if transposed else w[1] * groups
    cout = w[1] * groups if transposed else w[0]
    pad = _arg(args, kwargs, 4, "padding", 0)
    return {"in_channels": cin, "out_channels": cout, "kernel": tuple(w[2:]),
            "stride": _tuple(_arg(args, kwargs, 3, "stride", 1), nd),
            "padding": pad if isinstance(pad, str) else _tuple(pad, nd),
            "dilation": _tuple(_arg(args, kwargs, 5, "dilation", 1), nd), "groups": groups,
            "bias": _arg(args, kwargs, 2, "bias") is not None, "transposed": transposed}


def _tuple(v, nd: int) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)):
        v = [int(x) for x in v]
        return tuple(v * nd if len(v) == 1 else v)
    return (int(v),) * nd


def _linear_attrs(mod, args, kwargs, ins, out) -> dict:
    if isinstance(mod, nn.Linear):
        return {"in_features": mod.in_features, "out_features": mod.out_features, "bias": mod.bias is not None}
    if isinstance(mod, nn.Bilinear):
        return {"in_features": mod.in1_features * mod.in2_features, "out_features": mod.out_features,
                "bias": mod.bias is not None}
    if len(ins) >= 2 and ins[1] is not None and len(ins[1]) == 2:  # F.linear / aten.linear: W is (out, in)
        return {"in_features": ins[1][1], "out_features": ins[1][0], "bias": len(ins) > 2}
    if len(ins) == 3:  # aten.addmm(bias, x, W^T)
        return {"in_features": ins[1][-1], "out_features": ins[2][-1], "bias": True}
    return {"in_features": ins[0][-1], "out_features": out[-1], "bias": False}


_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _lstm_attrs(mod, args, kwargs, ins, out) -> dict:
    if not isinstance(mod, nn.RNNBase):
        raise UnpricedOp("a recurrent op outside nn.LSTM/nn.GRU/nn.RNN")
    return {"input_size": mod.input_size, "hidden": mod.hidden_size, "proj": getattr(mod, "proj_size", 0),
            "layers": mod.num_layers, "bidirectional": mod.bidirectional, "batch_first": mod.batch_first,
            "bias": mod.bias,
            "cell": mod.mode.split("_")[0].lower() if mod.mode.startswith("RNN") else mod.mode.lower(),
            "gates": _GATES.get(mod.mode.split("_")[0], 1)}


def _pool_attrs(mod, args, kwargs, ins, out, *, is_max: bool) -> dict:
    """Window, stride, padding, dilation per spatial dimension, and ceil_mode, as the op applies them.
    F.max_poolNd(x, kernel, stride, padding, dilation, ceil_mode); F.avg_poolNd(x, kernel, stride,
    padding, ceil_mode, count_include_pad)."""
    nd = max(1, len(out) - 2) if out else 2
    if isinstance(mod, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)):
        k, s, p = mod.kernel_size, mod.stride, mod.padding
        d, ceil = getattr(mod, "dilation", 1), bool(mod.ceil_mode)
    else:
        k = _arg(args, kwargs, 1, "kernel_size", 1)
        s = _arg(args, kwargs, 2, "stride", None) or k
        p = _arg(args, kwargs, 3, "padding", 0)
        d = _arg(args, kwargs, 4, "dilation", 1) if is_max else 1
        ceil = bool(_arg(args, kwargs, 5 if is_max else 4, "ceil_mode", False))
    return {"kernel": _tuple(k, nd), "stride": _tuple(s if s is not None else k, nd), "padding": _tuple(p, nd),
            "dilation": _tuple(d, nd), "ceil_mode": ceil}


def _embedding_attrs(mod, args, kwargs, ins, out) -> dict:
    if isinstance(mod, nn.Embedding):
        return {"num_embeddings": mod.num_embeddings, "embedding_dim": mod.embedding_dim}
    w = next((s for s in ins if s and len(s) == 2), (0, out[-1]))
    return {"num_embeddings": w[0], "embedding_dim": w[1]}


def _dropout_attrs(mod, args, kwargs, ins, out) -> dict:
    """The drop probability when the op drops (training, p > 0): autograd then keeps its noise and its
    output is a new tensor (cost.memory); otherwise it is the identity."""
    if isinstance(mod, nn.modules.dropout._DropoutNd):
        p, train = mod.p, mod.training
    else:
        p, train = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", kwargs.get("train", True))
    return {"p": float(p)} if isinstance(p, (int, float)) and p > 0 and train is True else {}


def _norm_attrs(mod, args, kwargs, ins, out) -> dict:
    n = getattr(mod, "num_features", None) or (out[1] if len(out) > 1 else out[-1])
    return {"num_features": int(n), "eps": float(getattr(mod, "eps", 1e-5))}


_ATTRS = {
    "conv2d": _conv_attrs, "conv": _conv_attrs, "linear": _linear_attrs, "lstm": _lstm_attrs,
    "maxpool": functools.partial(_pool_attrs, is_max=True), "avgpool": functools.partial(_pool_attrs, is_max=False),
    "embedding": _embedding_attrs, "batchnorm": _norm_attrs, "dropout": _dropout_attrs,
}
