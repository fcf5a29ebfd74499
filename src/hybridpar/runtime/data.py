"""Training data for `hybridpar train --data`: `synthetic`, `digits` or a `path.pt` file.

- synthetic: Gaussian images and uniform labels from --seed (for timing, not learning).
- digits: scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes; no download).
  Adapted to the model's input (C, H, W) by one rule: pixels scaled to [0, 1] (÷16), bilinearly
  resized to H x W (align_corners=False), the grey channel repeated C times, then standardised to
  zero mean and unit variance over the whole set.
- path.pt: a file saved with torch.save({"x": float tensor [N, C, H, W], "y": long tensor [N]}),
  used as is (its per-sample shape must equal the model's input shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridpar.errors import UserError


@dataclass(frozen=True)
class Dataset:
    x: torch.Tensor  # [N, *input_shape] float32
    y: torch.Tensor  # [N] int64
    name: str

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def num_classes(self) -> int:
        return int(self.y.max().item()) + 1 if len(self) else 0


def load_dataset(spec: str, input_shape: tuple[int, ...], *, num_classes: int | None = None,
                 size: int = 1024, seed: int = 0) -> Dataset:
    """The data set `spec` adapted to per-sample `input_shape`; UserError on anything unusable."""
    if spec == "synthetic":
        ds = _synthetic(input_shape, num_classes or 10, size, seed)
    elif spec == "digits":
        ds = _digits(input_shape)
    elif spec.endswith(".pt") or Path(spec).is_file():
        ds = _from_file(spec, input_shape)
    else:
        raise UserError(f"--data {spec!r}: expected synthetic, digits or a .pt file")
    if num_classes is not None and len(ds) and ds.num_classes > num_classes:
        raise UserError(f"--data {spec}: labels go up to {ds.num_classes - 1} but the model has "
                        f"{num_classes} outputs")
    return ds


def _synthetic(shape, classes: int, size: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset(torch.randn(size, *shape, generator=g), torch.randint(0, classes, (size,), generator=g),
                   "synthetic")


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


def _from_file(path: str, shape) -> Dataset:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--data {path}: file not found") from None
    except Exception as err:  # noqa: BLE001 - a bad file can fail in many ways inside torch.load
        raise UserError(f"--data {path}: not a torch.save file ({type(err).__name__})") from None
    if not isinstance(obj, dict) or "x" not in obj or "y" not in obj:
        raise UserError(f"--data {path}: expected a dict with keys 'x' and 'y'")
    x, y = obj["x"], obj["y"]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise UserError(f"--data {path}: 'x' must be a float tensor")
    if not isinstance(y, torch.Tensor) or y.dtype != torch.long or y.dim() != 1:
        raise UserError(f"--data {path}: 'y' must be a 1-D long (int64) tensor")
    if x.shape[0] != y.shape[0]:
        raise UserError(f"--data {path}: x has {x.shape[0]} samples but y has {y.shape[0]}")
    if tuple(x.shape[1:]) != tuple(shape):
        raise UserError(f"--data {path}: samples have shape {tuple(x.shape[1:])}, the model expects "
                        f"{tuple(shape)}")
    if len(y) and int(y.min()) < 0:
        raise UserError(f"--data {path}: labels must be >= 0")
    return Dataset(x.float().contiguous(), y.contiguous(), Path(path).name)


def batch_indices(n: int, batch: int, step: int, *, shuffle: bool, seed: int) -> torch.Tensor:
    """Sample indices of global step `step`: in file order (no shuffle: samples step*B .. step*B+B-1,
    wrapping per epoch) or from a per-epoch permutation seeded by (seed, epoch), same on every rank."""
    per_epoch = n // batch
    epoch, k = divmod(step, per_epoch)
    if not shuffle:
        return torch.arange(k * batch, (k + 1) * batch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return perm[k * batch:(k + 1) * batch]
