"""Training data for `hybridpar train --data` and for users' own loops.

Data sets (`--data SPEC`):
- synthetic: Gaussian images and uniform labels from --seed (for timing, not learning).
- digits: scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes; no download).
  Adapted to the model's input (C, H, W) by one rule: pixels scaled to [0, 1] (÷16), bilinearly
  resized to H x W (align_corners=False), the grey channel repeated C times, then standardised to
  zero mean and unit variance over the whole set.
- path.pt: a file saved with torch.save({"x": ..., "y": long tensor [N, ...]}); x is a tensor
  [N, *input_shape] (float for image models, integer token ids for sequence models), or a tuple of
  such tensors (the model's positional inputs) or a dict of them (its keyword inputs), each with N rows.
- imagefolder:DIR: one sub-folder per class (classes in sorted folder order), PNG/JPEG/... files
  decoded with Pillow on demand (hybridpar.train.data.files).
- npy:DIR: DIR/x.npy and DIR/y.npy, memory-mapped; samples are read when a batch needs them.
- path.py:factory: `factory()` returns a map-style torch.utils.data.Dataset whose items are (x, y).

Sequence models (zoo kind "seq", given a `vocab`) take integer token ids: synthetic data draws them
uniformly from [0, vocab), a data file must hold integer x (ids in range), and digits is refused.
Labels follow the model's output: [N] for a classifier, [N, *label_shape] (e.g. [N, T] for a
language model's [N, T, V] logits).

The API (plain functions):
    ds = open_dataset(spec, input_shape, num_classes=..., vocab=..., label_shape=...)  # a torch Dataset
    for step, x, y in batches(ds, batch, start=0, stop=steps, seed=0, shuffle=True, workers=2):
        loss = task_loss(model(*model_args(x)...), y)
Every rank draws the same global batch of step s (`batch_indices`: a per-epoch permutation seeded by
(seed, epoch), or file order), so a run is a function of (data, seed, batch, step) whatever the
layout or rank count. `batches(..., part=(i, k))` reads only the i-th of k contiguous pieces of each
global batch (torch.chunk's cut, as DTensor shards the sample dimension): a rank whose step takes
only its sample group's rows reads only those samples. `hybridpar.parallelize` takes the global
batch on every rank, so `hybridpar train` reads whole batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.data as tud
from torch.utils._pytree import tree_map_only

from hybridpar.errors import UserError


@dataclass(frozen=True)
class Dataset(tud.Dataset):
    """A data set held in memory: x is a tensor [N, ...], or a tuple or dict of them (several model
    inputs); y [N, *label_shape] int64. Item i is (x[i], y[i]) with the same structure."""

    x: Any  # torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
    y: torch.Tensor
    name: str

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __getitem__(self, i: int):
        return _take(self.x, i), self.y[i]

    def take(self, idx: torch.Tensor):
        """The batch of rows `idx`: the same as stacking the items, without the per-item loop."""
        return _take(self.x, idx), self.y[idx]

    @property
    def num_classes(self) -> int:
        return int(self.y.max().item()) + 1 if len(self) else 0


def _take(x, idx):
    return tree_map_only(torch.Tensor, lambda t: t[idx], x)


def open_dataset(spec: str, input_shape: tuple[int, ...], *, num_classes: int | None = None,
                 size: int = 1024, seed: int = 0, vocab: int | None = None,
                 label_shape: tuple[int, ...] | None = (), example_inputs: tuple | None = None) -> tud.Dataset:
    """The data set `spec` for a model with per-sample `input_shape`, as a map-style
    torch.utils.data.Dataset of (x, y) items; UserError (one line) on anything unusable.

    Cheap for every kind: files on disk are listed and checked (headers, shapes, dtypes, label
    range), not read whole. `vocab` marks a token model (x holds ids in [0, vocab)); `label_shape`
    is the per-sample label shape (() for one class per sample); `num_classes` the model's outputs;
    `example_inputs` (the model's, batch first) checks a multi-input .pt against the model, makes
    synthetic data for every input of a multi-input model, and marks a model whose first input is
    integer (token ids) even without a known `vocab`."""
    if label_shape is None:  # a loss's own targets (hybridpar.train.loss: mse, a user's loss): the user's data only
        if ".py:" not in spec and not spec.endswith(".py"):
            raise UserError(f"--data {spec}: holds class ids; this loss takes its targets from "
                            "--data path/to/file.py:factory")
        from hybridpar.train.data.files import from_factory

        return from_factory(spec, input_shape, vocab=vocab, label_shape=None, num_classes=None)
    label_shape = tuple(label_shape)
    ids = vocab is not None or (bool(example_inputs) and isinstance(example_inputs[0], torch.Tensor)
                                and _is_int(example_inputs[0]))
    if spec == "synthetic":
        ds = (_synthetic_like(example_inputs, input_shape, num_classes or 10, size, seed, vocab, label_shape)
              if _needs_example(example_inputs, vocab) else
              _synthetic(input_shape, num_classes or 10, size, seed, vocab, label_shape))
    elif spec == "digits":
        if ids:
            raise UserError("--data digits holds images; a sequence model needs synthetic or a .pt of token ids")
        ds = _digits(input_shape)
    elif spec.startswith("imagefolder:"):
        from hybridpar.train.data.files import ImageFolder

        return ImageFolder.open(spec.removeprefix("imagefolder:"), input_shape, ids=ids,
                                label_shape=label_shape, num_classes=num_classes)
    elif spec.startswith("npy:"):
        from hybridpar.train.data.files import NpyArrays

        return NpyArrays.open(spec.removeprefix("npy:"), input_shape, vocab=vocab, ids=ids,
                              label_shape=label_shape, num_classes=num_classes)
    elif ".py:" in spec or spec.endswith(".py"):
        from hybridpar.train.data.files import from_factory

        return from_factory(spec, input_shape, vocab=vocab, label_shape=label_shape, num_classes=num_classes)
    elif spec.endswith(".pt") or Path(spec).is_file():
        ds = _from_file(spec, input_shape, vocab, label_shape, example_inputs, ids)
    else:
        raise UserError(f"--data {spec!r}: expected synthetic, digits, a .pt file, imagefolder:DIR, npy:DIR "
                        "or path/to/file.py:factory")
    check_num_classes(spec, ds.num_classes, num_classes)
    return ds


def load_dataset(spec: str, input_shape: tuple[int, ...], *, num_classes: int | None = None,
                 size: int = 1024, seed: int = 0, vocab: int | None = None,
                 label_shape: tuple[int, ...] = (), example_inputs: tuple | None = None) -> Dataset:
    """open_dataset, held whole in memory (a `Dataset` with tensors x and y). Files read on demand
    (imagefolder, npy, a factory's data set) are read and decoded completely: fine for small sets;
    large ones belong to `open_dataset` + `batches`."""
    ds = open_dataset(spec, input_shape, num_classes=num_classes, size=size, seed=seed, vocab=vocab,
                      label_shape=label_shape, example_inputs=example_inputs)
    if isinstance(ds, Dataset):
        return ds
    if len(ds) == 0:
        raise UserError(f"--data {spec}: no samples")
    x, y = tud.default_collate([ds[i] for i in range(len(ds))])
    return Dataset(x, y, getattr(ds, "name", spec))


def check_num_classes(spec: str, have: int | None, model_outputs: int | None) -> None:
    if model_outputs is not None and have is not None and have > model_outputs:
        raise UserError(f"--data {spec}: labels go up to {have - 1} but the model has {model_outputs} outputs")


def _synthetic(shape, classes: int, size: int, seed: int, vocab: int | None = None,
               label_shape: tuple[int, ...] = ()) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(size, *shape, generator=g) if vocab is None
         else torch.randint(0, vocab, (size, *shape), generator=g))
    return Dataset(x, torch.randint(0, classes, (size, *label_shape), generator=g), "synthetic")


def _needs_example(example: tuple | None, vocab: int | None) -> bool:
    """Synthetic data must follow the example inputs: several batched inputs, or integer ids of a
    model whose vocabulary is unknown."""
    if not example or not isinstance(example[0], torch.Tensor) or example[0].dim() == 0:
        return False
    n = example[0].shape[0]
    if not all(isinstance(e, torch.Tensor) and e.dim() and e.shape[0] == n for e in example):
        return False
    return len(example) > 1 or (vocab is None and _is_int(example[0]))


def _synthetic_like(example: tuple, shape, classes: int, size: int, seed: int, vocab: int | None,
                    label_shape: tuple[int, ...]) -> Dataset:
    """One synthetic sample set per model input, each like the example input: its dtype and
    per-sample shape (the first input's shape is `shape`), floats Gaussian, booleans True, integers
    within [0, vocab) for the first input of a token model, else within the example's own range."""
    g = torch.Generator().manual_seed(seed)

    def fresh(k: int, e: torch.Tensor) -> torch.Tensor:
        dims = (size, *(shape if k == 0 else e.shape[1:]))
        if e.dtype == torch.bool:
            return torch.ones(dims, dtype=torch.bool)
        if e.is_floating_point():
            return torch.randn(dims, generator=g)
        lo, hi = (0, vocab - 1) if (k == 0 and vocab) else ((int(e.min()), int(e.max())) if e.numel() else (0, 0))
        return torch.randint(lo, hi + 1, dims, generator=g)

    xs = tuple(fresh(k, e.cpu()) for k, e in enumerate(example))
    y = torch.randint(0, classes, (size, *label_shape), generator=g)
    return Dataset(xs if len(xs) > 1 else xs[0], y, "synthetic")


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


def _from_file(path: str, shape, vocab: int | None = None, label_shape: tuple[int, ...] = (),
               example_inputs: tuple | None = None, ids: bool | None = None) -> Dataset:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--data {path}: file not found") from None
    except Exception as err:  # noqa: BLE001 - a bad file can fail in many ways inside torch.load
        raise UserError(f"--data {path}: not a torch.save file ({type(err).__name__})") from None
    if not isinstance(obj, dict) or "x" not in obj or "y" not in obj:
        raise UserError(f"--data {path}: expected a dict with keys 'x' and 'y'")
    x, y = obj["x"], obj["y"]
    check_labels(f"--data {path}", y, label_shape)
    n = int(y.shape[0])
    if isinstance(x, torch.Tensor):
        x = _check_input(path, "'x'", x, n, shape, vocab, vocab is not None if ids is None else ids)
    elif isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        x = tuple(_check_input(path, f"x[{i}]", t, n, None, None, False) for i, t in enumerate(x))
        if example_inputs is not None:
            _check_against_example(path, x, example_inputs)
    elif isinstance(x, dict) and x and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in x.items()):
        x = {k: _check_input(path, f"x[{k!r}]", t, n, None, None, False) for k, t in x.items()}
    else:
        raise UserError(f"--data {path}: 'x' must be a tensor, a tuple of tensors or a dict of str -> tensor")
    return Dataset(x, y.contiguous(), Path(path).name)


def check_labels(where: str, y, label_shape: tuple[int, ...]) -> None:
    """y must be an int64 tensor [N, *label_shape] of labels >= 0."""
    ydim = 1 + len(label_shape)
    if not isinstance(y, torch.Tensor) or y.dtype != torch.long or y.dim() != ydim:
        raise UserError(f"{where}: 'y' must be a {ydim}-D long (int64) tensor")
    if tuple(y.shape[1:]) != tuple(label_shape):
        raise UserError(f"{where}: labels have shape {tuple(y.shape[1:])} per sample, the model's "
                        f"output needs {tuple(label_shape)}")
    if y.numel() and int(y.min()) < 0:
        raise UserError(f"{where}: labels must be >= 0")


def _is_int(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _check_input(path: str, what: str, x: torch.Tensor, n: int, shape, vocab: int | None,
                 ids: bool) -> torch.Tensor:
    """One input tensor of a .pt: N rows; with `shape` (the single-input case) its per-sample shape
    and kind (float images, or integer token ids, < vocab when the vocabulary is known) are the model's."""
    if x.dim() == 0 or x.shape[0] != n:
        raise UserError(f"--data {path}: {what} has {x.shape[0] if x.dim() else 0} samples but y has {n}")
    if shape is not None:
        if not ids and not x.is_floating_point():
            raise UserError(f"--data {path}: {what} must be a float tensor")
        if ids and not _is_int(x):
            raise UserError(f"--data {path}: {what} must be an integer tensor of token ids for a sequence model")
        if tuple(x.shape[1:]) != tuple(shape):
            raise UserError(f"--data {path}: samples have shape {tuple(x.shape[1:])}, the model expects "
                            f"{tuple(shape)}")
        if vocab is not None and x.numel() and (int(x.min()) < 0 or int(x.max()) >= vocab):
            raise UserError(f"--data {path}: token ids must lie in [0, {vocab}) (the model's vocabulary), "
                            f"got {int(x.min())}..{int(x.max())}")
    if x.is_floating_point():
        return x.float().contiguous()
    return x.long().contiguous() if _is_int(x) else x.contiguous()


def _check_against_example(path: str, xs: tuple, example: tuple) -> None:
    """A tuple x is the model's positional inputs: as many, each with the example's per-sample shape
    and kind (float or integer) where the example input is a batched tensor."""
    if len(xs) != len(example):
        raise UserError(f"--data {path}: x holds {len(xs)} inputs, the model takes {len(example)}")
    for i, (t, e) in enumerate(zip(xs, example)):
        if not isinstance(e, torch.Tensor) or e.dim() == 0:
            continue
        if tuple(t.shape[1:]) != tuple(e.shape[1:]):
            raise UserError(f"--data {path}: x[{i}] has samples of shape {tuple(t.shape[1:])}, the model's "
                            f"input {i} has {tuple(e.shape[1:])}")
        if t.is_floating_point() != e.is_floating_point():
            raise UserError(f"--data {path}: x[{i}] is {t.dtype}, the model's input {i} is {e.dtype}")


def model_args(x) -> tuple[tuple, dict]:
    """How a batch's x is passed to the model: a tensor as the one positional input, a tuple as the
    positional inputs, a dict as keyword inputs: `model(*args, **kwargs)`."""
    if isinstance(x, dict):
        return (), x
    if isinstance(x, (tuple, list)):
        return tuple(x), {}
    return (x,), {}


def to_device(tree, device, *, non_blocking: bool = False):
    """Every tensor in a batch (x may be a tensor, tuple or dict) moved to `device`."""
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=non_blocking), tree)


# ---- batch order ---------------------------------------------------------------------------------

def batch_indices(n: int, batch: int, step: int, *, shuffle: bool, seed: int) -> torch.Tensor:
    """Sample indices of global step `step`: in file order (no shuffle: samples step*B .. step*B+B-1,
    wrapping per epoch) or from a per-epoch permutation seeded by (seed, epoch), same on every rank."""
    per_epoch = n // batch
    epoch, k = divmod(step, per_epoch)
    if not shuffle:
        return torch.arange(k * batch, (k + 1) * batch)
    return _epoch_order(n, seed, epoch)[k * batch:(k + 1) * batch]


def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))


def part_rows(batch: int, part: tuple[int, int] | None) -> tuple[int, int]:
    """(offset, rows) of piece i of k of a global batch of `batch` samples, cut as torch.chunk and
    DTensor's Shard(0) cut the sample dimension (ceil(B/k) each, the last ones smaller)."""
    if part is None:
        return 0, batch
    from hybridpar.layout import piece_offsets, piece_sizes

    i, k = part
    if not (k >= 1 and 0 <= i < k):
        raise UserError(f"part must be (index, count) with 0 <= index < count, got {part}")
    return piece_offsets(batch, k)[i], piece_sizes(batch, k)[i]


def sample_part(plan, rank: int) -> tuple[int, int]:
    """(i, k) for `batches(part=...)`: rank `rank`'s sample group among the k of a Plan. Under a
    sample/channel/filter layout the G = channel*filter consecutive ranks of one sample group share
    its samples (group rank // G of `sample`); under hybrid DP x MP the M devices of one replica do
    (replica rank // M of dp). The pieces are torch.chunk's (DTensor's Shard(0)); the MP engine's
    tensor_split gives the same rows whenever dp divides the batch."""
    if not 0 <= rank < plan.world_size:
        raise UserError(f"rank {rank} is outside the plan's {plan.world_size} ranks")
    if plan.mp > 1:
        return rank // plan.mp, plan.dp
    lay = plan.default_layout
    return rank // lay.g_size, lay.sample


class StepSampler(tud.Sampler):
    """The index lists of steps start .. stop-1 (batch_indices, cut to `part`), for a DataLoader's
    batch_sampler. The epoch's permutation is computed once per epoch, not once per step."""

    def __init__(self, n: int, batch: int, start: int, stop: int, *, shuffle: bool, seed: int,
                 part: tuple[int, int] | None = None):
        if batch < 1 or n < batch:
            raise UserError(f"batch must be between 1 and the data set's {n} samples, got {batch}")
        self.n, self.batch, self.start, self.stop = n, batch, start, stop
        self.shuffle, self.seed = shuffle, seed
        self.offset, self.rows = part_rows(batch, part)

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        per_epoch = self.n // self.batch
        cached: tuple[int, torch.Tensor] | None = None
        for step in range(self.start, self.stop):
            epoch, k = divmod(step, per_epoch)
            lo = k * self.batch + self.offset
            if not self.shuffle:
                yield list(range(lo, lo + self.rows))
                continue
            if cached is None or cached[0] != epoch:
                cached = (epoch, _epoch_order(self.n, self.seed, epoch))
            yield cached[1][lo:lo + self.rows].tolist()


def default_workers(dataset, local_ranks: int = 1) -> int:
    """Loader worker processes per rank: none for data held in memory; otherwise this machine's
    cores shared among its ranks, at most 4 each, at least 1."""
    import os

    if isinstance(dataset, Dataset):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // max(1, local_ranks)))


PREFETCH_FACTOR = 2  # batches each loader process prepares ahead


def die_with_parent(_worker_id: int = 0) -> None:
    """A loader worker's worker_init_fn: the kernel SIGKILLs it when its rank exits (PR_SET_PDEATHSIG).
    A rank dies with its launcher (train/launch.py), so a SIGKILLed launcher takes the workers down
    at once; torch's own check of the parent only runs between batches, and a worker blocked in
    the user's __getitem__ outlived a killed launcher by minutes."""
    import signal

    from hybridpar.train.launch import die_with_parent as _die

    _die(signal.SIGKILL)


def batches(dataset, batch: int, *, start: int = 0, stop: int, seed: int = 0, shuffle: bool = True,
            part: tuple[int, int] | None = None, workers: int | None = None, device=None,
            pin_memory: bool | None = None) -> Iterator[tuple[int, Any, torch.Tensor]]:
    """(step, x, y) for the global steps start .. stop-1 of `batch` samples each (epochs wrap; the
    last partial batch of an epoch is dropped), in the order `batch_indices` gives on every rank.

    `part=(i, k)`: only piece i of k of each global batch is read (see part_rows). `workers`: loader
    processes (None: default_workers; 0 reads in this process); data held in memory is indexed
    directly, which gives the same tensors a DataLoader would stack. `device`: where batches go
    (pinned memory and non-blocking copies for CUDA)."""
    sampler = StepSampler(len(dataset), batch, start, stop, shuffle=shuffle, seed=seed, part=part)
    cuda = device is not None and torch.device(device).type == "cuda"
    pin = cuda if pin_memory is None else pin_memory
    if workers is None:
        # data in memory for a GPU: one loader process indexes and stacks the next batch, its pin thread
        # pins it, while this step runs (H200, ResNet-50 batch 64: 35.8 ms per step against 36.7 ms with
        # the batch indexed in the step's process and copied from pageable memory)
        workers = 1 if cuda and isinstance(dataset, Dataset) else default_workers(dataset)
    if workers < 0:
        raise UserError(f"workers must be >= 0, got {workers}")
    if isinstance(dataset, Dataset) and workers == 0:
        source = (dataset.take(torch.tensor(idx, dtype=torch.long)) for idx in sampler)
    else:
        source = iter(tud.DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=pin,
                                     prefetch_factor=PREFETCH_FACTOR if workers else None,
                                     persistent_workers=False, worker_init_fn=die_with_parent))
    for step, (x, y) in zip(range(start, stop), source):
        if isinstance(x, list):  # default_collate turns a tuple of inputs into a list
            x = tuple(x)
        if device is not None:
            x, y = to_device((x, y), device, non_blocking=pin)
        yield step, x, y


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
    inputs = tuple(loaded.example_inputs)
    first = inputs[0]
    if isinstance(first, torch.Tensor) and first.dim():  # one sample of every batched input
        n = first.shape[0]
        inputs = tree_map_only(torch.Tensor, lambda t: t[:1] if t.dim() and t.shape[0] == n else t, inputs)
    args, kwargs = model_args(inputs)
    with torch.no_grad():
        out = module.eval()(*args, **kwargs)
    module.train(was_training)
    if isinstance(out, torch.Tensor) and not out.is_floating_point():  # cross-entropy needs float logits
        raise UserError(f"model {loaded.name}: forward returned {out.dtype} logits; training needs floating "
                        "point logits (a float/double output)", param="model")
    if not any(p.requires_grad for p in module.parameters()):  # else every rank's optimizer refuses it
        raise UserError(f"model {loaded.name}: has no trainable parameters; there is nothing to train",
                        param="model")
    if out.dim() > 2:
        return DataSpec(vocab, int(out.shape[-1]), tuple(int(d) for d in out.shape[1:-1]))
    return DataSpec(vocab, int(out.shape[1]), ())
