"""`hybridpar train --loss`: the loss a run trains with, and the labels it needs.

- absent ("auto"): the classifier/LM loss `hybridpar train` always had (train.engine.task_loss:
  cross-entropy; sequence logits [N, T, V] against [N, T] token labels over their last dimension);
- `cross_entropy`: torch.nn.functional.cross_entropy as torch takes it, classes on dimension 1, so
  a dense output [N, C, H, W] trains against labels [N, H, W] (a U-Net's segmentation);
- `mse`: torch.nn.functional.mse_loss against targets of the output's shape;
- `path.py:fn`: the user's `fn(outputs, target)` returning a scalar; the outputs as the model returns
  them (a tensor, a tuple or a dict), the target as the data set's items hold it.

Every loss is the mean over the batch's samples (as torch's defaults are): layouts that split the
samples average each group's loss, which equals the global loss only for a mean. `mse` and a user's
loss need their targets from the user's data (`--data file.py:factory`): synthetic labels are class
ids made for cross-entropy, so training on them with another loss would mean nothing (refused)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hybridpar.errors import UserError

NAMED = ("cross_entropy", "mse")


def check_loss(spec: str | None) -> None:
    """UserError (param `loss`) unless `spec` is None, a named loss or `path.py:fn` of an existing file."""
    if spec is None or spec in NAMED:
        return
    if not isinstance(spec, str) or ".py:" not in spec:
        raise UserError(f"loss must be cross_entropy, mse or path/to/file.py:fn, got {spec!r}", param="loss")
    path = Path(spec.rpartition(":")[0])
    if not path.is_file():
        raise UserError(f"loss {spec}: file {str(path)!r} not found", param="loss")


def free_targets(spec: str | None) -> bool:
    """Whether the loss takes targets of its own shape and dtype (mse, a user's loss), not class ids."""
    return spec is not None and spec not in ("cross_entropy",)


def check_loss_data(spec: str | None, data: str) -> None:
    """Refuse, before any rank starts, a loss whose targets the data source cannot give."""
    if not free_targets(spec):
        return
    if data == "synthetic":
        raise UserError(f"--loss {spec} with --data synthetic: synthetic labels are random class ids, which "
                        "mean nothing to this loss; give the targets with --data path/to/file.py:factory",
                        param="loss")
    if ".py:" not in data and not data.endswith(".py"):
        raise UserError(f"--loss {spec} takes its targets from --data path/to/file.py:factory (items (x, target)); "
                        f"--data {data} holds class ids", param="loss")


def make_loss(spec: str | None) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss function `spec` names: (outputs, target) -> the batch's mean loss."""
    if spec is None:
        from hybridpar.train.engine import task_loss

        return task_loss
    if spec == "cross_entropy":
        return _cross_entropy
    if spec == "mse":
        return _mse
    return _user_loss(spec)


def _cross_entropy(out, y: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise UserError(f"--loss cross_entropy needs a tensor output, the model returned {type(out).__name__}; "
                        "give your own loss (--loss path/to/file.py:fn)")
    return F.cross_entropy(out, y)


def _mse(out, y: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise UserError(f"--loss mse needs a tensor output, the model returned {type(out).__name__}; "
                        "give your own loss (--loss path/to/file.py:fn)")
    return F.mse_loss(out, y.to(out.dtype))


def _user_loss(spec: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    path_s, _, name = spec.rpartition(":")
    path = Path(path_s).resolve()
    mod_name = f"_hybridpar_user_{abs(hash(str(path)))}"  # the name user_code gives it: imported once per process
    module = sys.modules.get(mod_name)
    try:
        if module is None:
            mspec = importlib.util.spec_from_file_location(mod_name, path)
            if mspec is None or mspec.loader is None:
                raise UserError(f"loss {spec}: cannot import {path_s!r} as Python", param="loss")
            module = importlib.util.module_from_spec(mspec)
            sys.modules[mod_name] = module
            mspec.loader.exec_module(module)
    except UserError:
        raise
    except BaseException as err:  # noqa: BLE001 - a user's file can raise anything (sys.exit too) on import
        sys.modules.pop(mod_name, None)
        raise UserError(f"loss {spec}: cannot import {path_s!r}: {type(err).__name__}: {err}", param="loss") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"loss {spec}: {path_s!r} has no callable {name!r}", param="loss")

    def loss(out, y):
        value = fn(out, y)
        if not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.is_floating_point():
            raise UserError(f"loss {spec}: must return a floating scalar tensor, got "
                            f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        return value

    return loss


def loss_data_spec(loaded, spec: str | None):
    """The DataSpec the loss needs of the data (hybridpar.train.data.loader.DataSpec): the token
    vocabulary, classes and label shape; `label_shape` None for targets the loss reads freely."""
    from hybridpar.train.data.loader import DataSpec, data_spec

    if spec is None:
        kind = _training_output_kind(loaded)
        if kind is not None:
            raise UserError(f"model {loaded.name} returns {kind} in training mode (e.g. auxiliary heads); the default "
                            "loss takes one tensor of logits: give your own loss (--loss path/to/file.py:fn)"
                            + (f" or use {loaded.name}_noaux" if loaded.name == "inception_v3" else ""), param="loss")
        got = data_spec(loaded)
        if len(got.label_shape) >= 2 and loaded.kind != "seq":
            # the default loss takes the last dimension as the classes (an LM's [N, T, V]): a dense
            # output [N, C, H, W] would train as W classes, which no such model means
            per_sample = (*got.label_shape, got.num_classes)
            labels = ", ".join(["N", *map(str, per_sample[1:])])
            raise UserError(f"model {loaded.name} returns dense outputs ({per_sample} per sample): say which loss: "
                            f"--loss cross_entropy (classes on dimension 1, labels [{labels}]), --loss mse, or "
                            "--loss path/to/file.py:fn", param="loss")
        return got
    vocab = None
    if loaded.kind == "seq":
        from hybridpar.graph.zoo import ZOO

        entry = ZOO.get(loaded.name)
        vocab = (entry.vocab if entry is not None else None) or 32
    if free_targets(spec):
        return DataSpec(vocab, None, None)  # type: ignore[arg-type]  # None: the loss's own targets
    out = _one_sample_output(loaded)
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"model {loaded.name}: forward returned {what}; --loss cross_entropy needs logits "
                        "[N, C, ...] (classes on dimension 1); give your own loss (--loss path/to/file.py:fn)",
                        param="loss")
    return DataSpec(vocab, int(out.shape[1]), tuple(int(d) for d in out.shape[2:]))


def _training_output_kind(loaded) -> str | None:
    """What the model returns in training mode when that is not a tensor (inception's (logits, aux)),
    found by one forward on meta copies of its weights and inputs (no values read, no statistics
    updated); None for a tensor, or when the forward cannot run on meta (the loss then sees it)."""
    from torch.func import functional_call
    from torch.utils._pytree import tree_map_only

    from hybridpar.train.data.loader import model_args

    module = loaded.module
    state = {k: torch.empty_like(v, device="meta") for k, v in module.state_dict(keep_vars=True).items()}
    inputs = tuple(loaded.example_inputs)
    n = inputs[0].shape[0] if isinstance(inputs[0], torch.Tensor) and inputs[0].dim() else None

    def on_meta(x: torch.Tensor) -> torch.Tensor:  # 2 samples at least: batch norm refuses 1 in training
        rows = max(n, 2) if n is not None and x.dim() and x.shape[0] == n else None
        return torch.empty((rows, *x.shape[1:]) if rows else x.shape, dtype=x.dtype, device="meta")

    args, kwargs = model_args(tree_map_only(torch.Tensor, on_meta, inputs))
    was_training = module.training
    try:
        with torch.no_grad():
            out = functional_call(module.train(), state, tuple(args), kwargs, strict=False)
    except Exception:  # noqa: BLE001 - a forward that reads values (.item()) or is not meta-safe
        return None
    finally:
        module.train(was_training)
    return None if isinstance(out, torch.Tensor) else type(out).__name__


def _one_sample_output(loaded):
    from torch.utils._pytree import tree_map_only

    from hybridpar.train.data.loader import model_args

    module = loaded.module
    inputs = tuple(loaded.example_inputs)
    first = inputs[0]
    if isinstance(first, torch.Tensor) and first.dim():
        n = first.shape[0]
        inputs = tree_map_only(torch.Tensor, lambda t: t[:1] if t.dim() and t.shape[0] == n else t, inputs)
    args, kwargs = model_args(inputs)
    was_training = module.training
    with torch.no_grad():
        out = module.eval()(*args, **kwargs)
    module.train(was_training)
    return out
