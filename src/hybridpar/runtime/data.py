"""Training data for `hybridpar train --data`: `synthetic`, `digits` or a `path.pt` file.

- synthetic: Gaussian images and uniform labels from --seed (for timing, not learning).
- digits: scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes; no download).
  Adapted to the model's input (C, H, W) by one rule: pixels scaled to [0, 1] (÷16), bilinearly
  resized to H x W (align_corners=False), the grey channel repeated C times, then standardised to
  zero mean and unit variance over the whole set.
- path.pt: a file saved with torch.save({"x": float tensor [N, C, H, W], "y": long tensor [N]}),
  used as is (its per-sample shape must equal the model's input shape).

Sequence models (zoo kind "seq", given a `vocab`) take integer token ids: synthetic data draws them
uniformly from [0, vocab), a path.pt must hold an integer x (ids in range), and digits is refused.
Labels follow the model's output: [N] for a classifier, [N, *label_shape] (e.g. [N, T] for a
language model's [N, T, V] logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridpar.errors import UserError


@dataclass(frozen=True)
class Dataset:
    x: torch.Tensor  # [N, *input_shape] float32 (images) or int64 (token ids)
    y: torch.Tensor  # [N, *label_shape] int64
    name: str

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def num_classes(self) -> int:
        return int(self.y.max().item()) + 1 if len(self) else 0


def load_dataset(spec: str, input_shape: tuple[int, ...], *, num_classes: int | None = None,
                 size: int = 1024, seed: int = 0, vocab: int | None = None,
                 label_shape: tuple[int, ...] = ()) -> Dataset:
    """The data set `spec` adapted to per-sample `input_shape`; UserError on anything unusable.
    `vocab` marks a token model (x holds ids in [0, vocab)); `label_shape` is the per-sample label
    shape (() for one class per sample)."""
    label_shape = tuple(label_shape)
    if spec == "synthetic":
        ds = _synthetic(input_shape, num_classes or 10, size, seed, vocab, label_shape)
    elif spec == "digits":
        if vocab is not None:
            raise UserError("--data digits holds images; a sequence model needs synthetic or a .pt of token ids")
        ds = _digits(input_shape)
    elif spec.endswith(".pt") or Path(spec).is_file():
        ds = _from_file(spec, input_shape, vocab, label_shape)
    else:
        raise UserError(f"--data {spec!r}: expected synthetic, digits or a .pt file")
    if num_classes is not None and len(ds) and ds.num_classes > num_classes:
        raise UserError(f"--data {spec}: labels go up to {ds.num_classes - 1} but the model has "
                        f"{num_classes} outputs")
    return ds


def _synthetic(shape, classes: int, size: int, seed: int, vocab: int | None = None,
               label_shape: tuple[int, ...] = ()) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(size, *shape, generator=g) if vocab is None
         else torch.randint(0, vocab, (size, *shape), generator=g))
    return Dataset(x, torch.randint(0, classes, (size, *label_shape), generator=g), "synthetic")


def _digits(shape) -> Dataset:
    from sklearn.datasets import load_digits

    if len(shape) != 3:
        raise UserError(f"--data digits needs an image model (input C,H,W), got input shape {shape}")
    c, h, w = shape
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False).repeat(1, c, 1, 1)
    x = (x - x.mean()) / x.std()
    return Dataset(x.contiguous(), torch.tensor(d.target, dtype=torch.long), "digits")


def _from_file(path: str, shape, vocab: int | None = None, label_shape: tuple[int, ...] = ()) -> Dataset:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--data {path}: file not found") from None
    except Exception as err:  # noqa: BLE001 - a bad file can fail in many ways inside torch.load
        raise UserError(f"--data {path}: not a torch.save file ({type(err).__name__})") from None
    if not isinstance(obj, dict) or "x" not in obj or "y" not in obj:
        raise UserError(f"--data {path}: expected a dict with keys 'x' and 'y'")
    x, y = obj["x"], obj["y"]
    if vocab is None and (not isinstance(x, torch.Tensor) or not x.is_floating_point()):
        raise UserError(f"--data {path}: 'x' must be a float tensor")
    if vocab is not None and (not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex()
                              or x.dtype == torch.bool):
        raise UserError(f"--data {path}: 'x' must be an integer tensor of token ids for a sequence model")
    ydim = 1 + len(label_shape)
    if not isinstance(y, torch.Tensor) or y.dtype != torch.long or y.dim() != ydim:
        raise UserError(f"--data {path}: 'y' must be a {ydim}-D long (int64) tensor")
    if tuple(y.shape[1:]) != tuple(label_shape):
        raise UserError(f"--data {path}: labels have shape {tuple(y.shape[1:])} per sample, the model's "
                        f"output needs {tuple(label_shape)}")
    if x.shape[0] != y.shape[0]:
        raise UserError(f"--data {path}: x has {x.shape[0]} samples but y has {y.shape[0]}")
    if tuple(x.shape[1:]) != tuple(shape):
        raise UserError(f"--data {path}: samples have shape {tuple(x.shape[1:])}, the model expects "
                        f"{tuple(shape)}")
    if len(y) and int(y.min()) < 0:
        raise UserError(f"--data {path}: labels must be >= 0")
    if vocab is None:
        return Dataset(x.float().contiguous(), y.contiguous(), Path(path).name)
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= vocab):
        raise UserError(f"--data {path}: token ids must lie in [0, {vocab}) (the model's vocabulary), "
                        f"got {int(x.min())}..{int(x.max())}")
    return Dataset(x.long().contiguous(), y.contiguous(), Path(path).name)


def batch_indices(n: int, batch: int, step: int, *, shuffle: bool, seed: int) -> torch.Tensor:
    """Sample indices of global step `step`: in file order (no shuffle: samples step*B .. step*B+B-1,
    wrapping per epoch) or from a per-epoch permutation seeded by (seed, epoch), same on every rank."""
    per_epoch = n // batch
    epoch, k = divmod(step, per_epoch)
    if not shuffle:
        return torch.arange(k * batch, (k + 1) * batch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return perm[k * batch:(k + 1) * batch]


@dataclass(frozen=True)
class DataSpec:
    """What a model's data must look like: token vocabulary (None: float inputs), number of output
    classes and the per-sample label shape."""

    vocab: int | None
    num_classes: int
    label_shape: tuple[int, ...]


def data_spec(loaded) -> DataSpec:
    """DataSpec of a hybridpar.graph.models.LoadedModel, from one eval-mode forward of its example
    input: logits [1, C] -> labels [N]; sequence logits [1, T, V] -> labels [N, T]."""
    vocab = None
    if loaded.kind == "seq":
        from hybridpar.graph.zoo import ZOO

        entry = ZOO.get(loaded.name)
        vocab = (entry.vocab if entry is not None else None) or 32  # 32: the ids zoo example inputs use
    module = loaded.module
    was_training = module.training
    with torch.no_grad():
        out = module.eval()(loaded.example_inputs[0][:1])
    module.train(was_training)
    if out.dim() > 2:
        return DataSpec(vocab, int(out.shape[-1]), tuple(int(d) for d in out.shape[1:-1]))
    return DataSpec(vocab, int(out.shape[1]), ())
