"""Data sets read from disk on demand: `imagefolder:DIR`, `npy:DIR` and `path.py:factory`
(see hybridpar.train.data.loader for the API). Opening one lists and checks it; samples are read when a
batch asks for them, in the loader's worker processes.

imagefolder:DIR
    DIR/<class>/<image>: one sub-folder per class, classes numbered in sorted folder-name order
    (torchvision's ImageFolder convention); files ending in .png .jpg .jpeg .bmp .gif .webp .tif .tiff
    (any case); hidden files and folders are skipped. Each image is decoded with Pillow, converted to
    RGB (C = 3) or grey (C = 1), scaled (bilinear) so it covers H x W with its aspect ratio kept, cut
    to H x W at the centre, divided by 255 and normalised per channel with the ImageNet statistics
    torchvision's pretrained models use (mean 0.485, 0.456, 0.406; std 0.229, 0.224, 0.225; a grey
    image uses their averages, 0.449 and 0.226). A large JPEG is decoded at the smallest DCT scale
    (1/2, 1/4, 1/8) that still covers H x W.
npy:DIR
    DIR/x.npy [N, *input_shape] (floating point for image models, integers for token models) and
    DIR/y.npy [N, *label_shape] (integers >= 0), opened with numpy's mmap_mode="r": only the rows of
    a batch are read. Float samples become float32, integer ones int64.
path.py:factory
    `factory()` returns a map-style torch.utils.data.Dataset (with __len__) whose items are (x, y):
    x a tensor or array of the model's per-sample input shape (or a tuple/dict of them), y an int or
    an integer tensor of the label shape. The first item is checked when the data set is opened,
    every item when it is read.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils._pytree import tree_map

from hybridpar.errors import UserError
from hybridpar.user_code import call_factory

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _check_classes(where: str, have: int, model_outputs: int | None) -> None:
    if model_outputs is not None and have > model_outputs:
        raise UserError(f"{where}: labels go up to {have - 1} but the model has {model_outputs} outputs")


class ImageFolder(tud.Dataset):
    """Images in one sub-folder per class, decoded and shaped to (C, H, W) when read."""

    def __init__(self, root: Path, files: list[tuple[str, int]], classes: list[str], shape: tuple[int, int, int]):
        self.root, self.files, self.classes, self.shape = root, files, classes, shape
        self.name = f"imagefolder:{root}"
        c = shape[0]
        self._mean = torch.tensor(IMAGENET_MEAN if c == 3 else (sum(IMAGENET_MEAN) / 3,)).view(c, 1, 1)
        self._std = torch.tensor(IMAGENET_STD if c == 3 else (sum(IMAGENET_STD) / 3,)).view(c, 1, 1)

    @classmethod
    def open(cls, directory: str, input_shape: tuple[int, ...], *, ids: bool = False,
             label_shape: tuple[int, ...] = (), num_classes: int | None = None) -> ImageFolder:
        where = f"--data imagefolder:{directory}"
        if ids or len(input_shape) != 3 or input_shape[0] not in (1, 3):
            raise UserError(f"{where}: images need a model whose input is C,H,W with C = 1 or 3, "
                            f"got input shape {tuple(input_shape)}")
        if tuple(label_shape):
            raise UserError(f"{where}: an image folder gives one class per image; the model's output "
                            f"needs labels of shape {tuple(label_shape)}")
        root = Path(directory)
        if not root.is_dir():
            raise UserError(f"{where}: not a directory")
        classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not classes:
            raise UserError(f"{where}: no class sub-folders (expected DIR/<class>/<image>.png|jpg)")
        files: list[tuple[str, int]] = []
        for label, name in enumerate(classes):
            found = sorted(str(p) for p in (root / name).rglob("*")
                           if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(root).parts))
            if not found:
                raise UserError(f"{where}: class folder {name!r} holds no images "
                                f"({', '.join(IMAGE_SUFFIXES)})")
            _check_image(where, found[0])  # a wrong format fails here, before any rank starts
            files += [(f, label) for f in found]
        _check_classes(where, len(classes), num_classes)
        return cls(root, files, classes, tuple(input_shape))

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        return self.decode(path), torch.tensor(label, dtype=torch.long)

    def decode(self, path: str) -> torch.Tensor:
        """The image at `path` as a normalised float32 tensor (C, H, W)."""
        from PIL import Image

        c, h, w = self.shape
        try:
            with Image.open(path) as img:
                if img.format == "JPEG":  # decode big photos at a reduced DCT scale, still covering H x W
                    s0 = max(h / img.height, w / img.width)
                    img.draft("RGB" if c == 3 else "L", (math.ceil(img.width * s0), math.ceil(img.height * s0)))
                img = img.convert("RGB" if c == 3 else "L")
                scale = max(h / img.height, w / img.width)
                size = (max(w, round(img.width * scale)), max(h, round(img.height * scale)))
                img = img.resize(size, Image.Resampling.BILINEAR)
                left, top = (size[0] - w) // 2, (size[1] - h) // 2
                img = img.crop((left, top, left + w, top + h))
                arr = np.asarray(img, dtype=np.uint8)
        except (OSError, ValueError, Image.DecompressionBombError) as err:  # a bomb is bad input, as a corrupt file
            raise UserError(f"--data {self.name}: cannot decode {path}: {err}") from None
        t = torch.from_numpy(arr.copy()).float().div_(255.0)
        t = t.permute(2, 0, 1) if t.dim() == 3 else t.unsqueeze(0)
        return ((t - self._mean) / self._std).contiguous()


def _check_image(where: str, path: str) -> None:
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as err:  # noqa: BLE001 - Pillow raises many kinds on a bad file
        raise UserError(f"{where}: {path} is not an image Pillow can read ({type(err).__name__})") from None


class NpyArrays(tud.Dataset):
    """x.npy / y.npy memory-mapped; item i reads row i."""

    def __init__(self, directory: Path, x: np.ndarray, y: np.ndarray, vocab: int | None, ids: bool = False):
        self.directory, self.x, self.y, self.vocab, self.ids = directory, x, y, vocab, ids or vocab is not None
        self.name = f"npy:{directory}"
        self._num_classes = int(y.max()) + 1 if len(y) else 0

    @classmethod
    def open(cls, directory: str, input_shape: tuple[int, ...], *, vocab: int | None = None, ids: bool = False,
             label_shape: tuple[int, ...] = (), num_classes: int | None = None) -> NpyArrays:
        where = f"--data npy:{directory}"
        root = Path(directory)
        if not root.is_dir():
            raise UserError(f"{where}: not a directory")
        x, y = (_load_npy(where, root / f"{k}.npy") for k in ("x", "y"))
        if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
            raise UserError(f"{where}: x.npy has {x.shape[0] if x.ndim else 0} samples but y.npy has "
                            f"{y.shape[0] if y.ndim else 0}")
        if tuple(x.shape[1:]) != tuple(input_shape):
            raise UserError(f"{where}: samples in x.npy have shape {tuple(x.shape[1:])}, the model expects "
                            f"{tuple(input_shape)}")
        ids = ids or vocab is not None
        if not ids and x.dtype.kind != "f":
            raise UserError(f"{where}: x.npy must hold floating point samples, got {x.dtype}")
        if ids and x.dtype.kind not in "iu":
            raise UserError(f"{where}: x.npy must hold integer token ids for a sequence model, got {x.dtype}")
        if y.dtype.kind not in "iu" or tuple(y.shape[1:]) != tuple(label_shape):
            want = ", ".join(["N", *map(str, label_shape)])
            raise UserError(f"{where}: y.npy must hold integer labels of shape [{want}], got {y.dtype} {list(y.shape)}")
        if y.size and int(y.min()) < 0:
            raise UserError(f"{where}: labels must be >= 0")
        ds = cls(root, x, y, vocab, ids)
        _check_classes(where, ds._num_classes, num_classes)
        return ds

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int):
        x = torch.from_numpy(np.array(self.x[i]))
        if self.ids:
            x = x.long()
            if self.vocab is not None and x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.vocab):
                raise UserError(f"--data {self.name}: sample {i} has token ids outside [0, {self.vocab})")
        else:
            x = x.float()
        return x, torch.from_numpy(np.array(self.y[i])).long()


def _load_npy(where: str, path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise UserError(f"{where}: {path.name} not found (expected x.npy and y.npy)") from None
    except (ValueError, OSError) as err:
        raise UserError(f"{where}: {path.name} is not a numpy array file ({type(err).__name__})") from None


def held_inputs(ds) -> list[torch.Tensor]:
    """The input tensors a data set holds in memory (a loader.Dataset's x: a tensor, tuple or dict of
    them), for checks over all of them; [] for data read on demand (image folders, memory-mapped
    .npy arrays, which are never evaluated as truth values here, and factories' data sets)."""
    from hybridpar.train.data.loader import Dataset

    if not isinstance(ds, Dataset):
        return []
    x = ds.x
    items = [x] if torch.is_tensor(x) else list(x.values()) if isinstance(x, dict) else list(x)
    return [t for t in items if torch.is_tensor(t)]


class Checked(tud.Dataset):
    """A user's data set with every item brought to the shapes and dtypes training needs."""

    def __init__(self, inner: tud.Dataset, name: str, shape: tuple[int, ...], vocab: int | None,
                 label_shape: tuple[int, ...] | None, num_classes: int | None = None,
                 source: tuple[str, str] | None = None):
        self.inner, self.name, self.shape, self.vocab, self.label_shape = inner, name, shape, vocab, label_shape
        self.model_outputs = num_classes
        self.source = source  # (the user's .py file, the module name it was imported as)

    def __getstate__(self) -> dict:
        """Pickled for a loader worker (spawned: it has none of this process's modules): the user's
        data set as bytes, unpickled only after `__setstate__` has imported its file again under the
        same module name."""
        import pickle

        state = dict(self.__dict__)
        state["inner"] = pickle.dumps(self.inner)
        return state

    def __setstate__(self, state: dict) -> None:
        import pickle
        import sys

        source = state.get("source")
        if source is not None and source[1] not in sys.modules:
            import importlib.util

            spec = importlib.util.spec_from_file_location(source[1], source[0])
            module = importlib.util.module_from_spec(spec)
            sys.modules[source[1]] = module
            spec.loader.exec_module(module)
        state = dict(state, inner=pickle.loads(state["inner"]))
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return self.convert(i, self.inner[i])

    def convert(self, i: int, item):
        where = f"--data {self.name}: item {i}"
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise UserError(f"{where} is not an (x, y) pair")
        x, y = item
        if isinstance(x, dict):
            x = {k: _tensor(where, v) for k, v in x.items()}
        elif isinstance(x, (tuple, list)):
            x = tuple(_tensor(where, v) for v in x)
        else:
            x = _tensor(where, x)
            if tuple(x.shape) != tuple(self.shape):
                raise UserError(f"{where}: x has shape {tuple(x.shape)}, the model expects {tuple(self.shape)}")
            if self.vocab is not None and (x.is_floating_point() or (x.numel() and (int(x.min()) < 0
                                                                                    or int(x.max()) >= self.vocab))):
                raise UserError(f"{where}: x must hold token ids in [0, {self.vocab})")
        if self.label_shape is None:  # the targets of the run's own loss (hybridpar.train.loss): as given
            return x, tree_map(lambda v: _tensor(where, v) if isinstance(v, (np.ndarray, torch.Tensor)) else v, y)
        y = torch.as_tensor(np.asarray(y) if not isinstance(y, torch.Tensor) else y)
        if y.is_floating_point() or y.dtype == torch.bool or tuple(y.shape) != tuple(self.label_shape):
            raise UserError(f"{where}: y must be an integer label of shape {tuple(self.label_shape)}, "
                            f"got {y.dtype} {tuple(y.shape)}")
        if y.numel() and int(y.min()) < 0:
            raise UserError(f"{where}: labels must be >= 0")
        if self.model_outputs is not None and y.numel() and int(y.max()) >= self.model_outputs:
            raise UserError(f"{where}: label {int(y.max())} but the model has {self.model_outputs} outputs")
        return x, y.long()


def _tensor(where: str, v) -> torch.Tensor:
    if isinstance(v, np.ndarray):
        v = torch.from_numpy(np.array(v))
    if not isinstance(v, torch.Tensor):
        raise UserError(f"{where}: inputs must be tensors or numpy arrays, got {type(v).__name__}")
    if v.is_floating_point():
        return v.float()
    return v.long() if not (v.is_complex() or v.dtype == torch.bool) else v


def _user_module(spec: str) -> tuple[str, str] | None:
    """(file, module name) under which `call_factory` imported the .py of `spec`, for workers."""
    import sys

    target = Path(spec.rpartition(".py:")[0] + ".py" if ".py:" in spec else spec).resolve()
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if name.startswith("_hybridpar_user_") and where and Path(where).resolve() == target:
            return str(target), name
    return None


MAX_SAMPLES = 2**31  # each rank shuffles a permutation of the whole data set: 8 bytes a sample (16 GiB here)


def _length(made, where: str) -> int:
    """len() of the user's data set: what it raises, a negative length (Python's ValueError) and more
    samples than a shuffle can hold (10**12: an 8 TB permutation in every rank) are one line."""
    try:
        n = len(made)
    except Exception as err:  # noqa: BLE001 - their __len__ can raise anything
        raise UserError(f"{where}: len() of the data set raised {type(err).__name__}: {err}") from None
    if n > MAX_SAMPLES:
        raise UserError(f"{where}: the data set has {n:,} samples, over {MAX_SAMPLES:,} (each rank shuffles a "
                        "permutation of them, 8 bytes a sample)")
    return n


def from_factory(spec: str, input_shape: tuple[int, ...], *, vocab: int | None = None,
                 label_shape: tuple[int, ...] | None = (), num_classes: int | None = None) -> Checked:
    """`path/to/file.py:factory` -> the data set factory() returns, checked."""
    where = f"--data {spec}"
    made = call_factory(spec, "dataset", where, sep=".py:")
    if isinstance(made, tud.IterableDataset) or not hasattr(made, "__getitem__") or not hasattr(made, "__len__"):
        raise UserError(f"{where}: the factory must return a map-style torch.utils.data.Dataset (with __len__ "
                        f"and __getitem__), got {type(made).__name__}")
    n = _length(made, where)
    if n < 1:
        raise UserError(f"{where}: the data set is empty")
    ds = Checked(made, spec, tuple(input_shape), vocab, None if label_shape is None else tuple(label_shape),
                 num_classes, _user_module(spec))
    try:
        ds.convert(0, made[0])
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - their __getitem__ can raise anything
        raise UserError(f"{where}: reading item 0 raised {type(err).__name__}: {err}") from None
    return ds
