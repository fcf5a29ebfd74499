"""Every image-classification family of the installed `transformers`, as tiny random-init models.

Used by tests/conformance/ and benchmarks/bench_conformance.py. Offline: nothing is downloaded, every
model is built from its config class's defaults and random weights.

The shrink rule (generic, so families added to a newer `transformers` are picked up unchanged).
Start from the config class's defaults with `num_labels=10`; nested sub-configs (CLIP's
`vision_config`, ...) are walked like the top level. Each step below is tried on every matching key at
once, and kept only if the model still builds and a forward pass at batch 2 gives logits of shape
(2, 10); when the whole step fails, it is tried key by key and each key that works is kept:

1. depth: integers (and each entry of integer lists) named `depth(s)`, `num_block_repeats`,
   `num_hidden_layers`, `n_layer`, `num_self_attends_per_block` capped at 1 (stages are kept,
   blocks per stage cut); a float `depth_coefficient` capped at 1.0;
2. input: the input is (2, num_channels, S, S) with S the smallest of 32, 64, 96, 112, 128, 160,
   192, 224 (below the config's `image_size`, 224 when it has none) that runs; a config's
   `image_size` (int or list) is set to S;
3. heads: integers (and integer lists) whose name contains `heads` capped at 2;
4. width: integers (and integer lists) whose name ends in `hidden_size(s)`, `embed_dim`,
   `embedding_size`, `intermediate_size`, `hidden_dim`, `n_embd`, `d_model`, `d_latents`,
   `neck_hidden_sizes` divided by 4, rounded up to a multiple of 16; `width_coefficient` capped at 1.0.

A family is *refused*, with the reason, when its model takes no `pixel_values`, also takes `input_ids`
(a multimodal model), or does not run at its defaults (a missing optional library, for instance).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect as pyinspect
import os
import re
import warnings
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch import nn

BATCH = 2
NUM_LABELS = 10

# (step, key pattern, new value of an int, new value of a float); ints in lists are mapped one by one.
_STEPS = (
    ("depth", re.compile(r"^(depths?|num_block_repeats|num_hidden_layers|n_layer|num_self_attends_per_block)$"),
     lambda v: min(v, 1), None),
    ("depth", re.compile(r"^depth_coefficient$"), None, lambda v: min(v, 1.0)),
    ("heads", re.compile(r"heads"), lambda v: min(v, 2), None),
    ("width", re.compile(r"(hidden_sizes?|embed_dim|embedding_size|intermediate_size|hidden_dim|n_embd|d_model|"
                         r"d_latents|neck_hidden_sizes)$"), lambda v: max(16, -(-(v // 4) // 16) * 16), None),
    ("width", re.compile(r"^width_coefficient$"), None, lambda v: min(v, 1.0)),
)

def available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def family_names() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)


@dataclasses.dataclass
class Family:
    name: str
    model_class: str
    refused: str | None = None  # why the family cannot be built (then nothing else is set)
    config: object = None
    image_size: int = 0
    channels: int = 3
    shrunk: tuple[str, ...] = ()  # the steps of the rule that were kept

    def build(self, *, attn: str | None = None, seed: int = 0, dropout: bool = True) -> nn.Module:
        """The tiny model (train mode, random init with `seed`), wrapped as x -> logits.
        dropout=False: every dropout/drop-path probability of the config set to 0 (see no_dropout)."""
        config = self.config if dropout else no_dropout(self.config)
        return Wrapped(_instantiate(self.model_class, config, attn=attn, seed=seed))

    def inputs(self, batch: int = BATCH, seed: int = 0) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, self.channels, self.image_size, self.image_size, generator=g),)


class Wrapped(nn.Module):
    """forward(x) -> model(pixel_values=x).logits, as a user would wrap a Hugging Face classifier."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def no_dropout(config):
    """The config with every float whose key contains `drop` (dropout, attention/classifier dropout,
    drop_path_rate, drop_connect_rate, ...) set to 0: for train checks against one process, whose
    random masks no set of ranks reproduces."""
    zeros = {k: 0.0 for k, v in _flat(config.to_dict()).items()
             if "drop" in k[-1] and isinstance(v, float) and v > 0}
    return _with(config, zeros) if zeros else config


def _model_class_name(family: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    v = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES[family]
    return v if isinstance(v, str) else v[0]


def _instantiate(class_name: str, config, *, attn: str | None = None, seed: int = 0) -> nn.Module:
    import transformers

    cls = getattr(transformers, class_name)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if attn is not None:
            config = config.__class__.from_dict(config.to_dict())
            config._attn_implementation = attn
        model = cls(config)
    return model.train()


def _runs(class_name: str, config, size: int, channels: int) -> bool:
    if config is None:
        return False
    try:
        model = _instantiate(class_name, config)
        x = torch.randn(BATCH, channels, size, size)
        with torch.no_grad():
            out = model(pixel_values=x).logits
        return tuple(out.shape) == (BATCH, NUM_LABELS)
    except Exception:  # noqa: BLE001 -- a step of the rule that this family cannot take
        return False


def _map_values(value, int_fn, float_fn):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and int_fn:
        return int_fn(value)
    if isinstance(value, float) and float_fn:
        return float_fn(value)
    if (int_fn and isinstance(value, list) and value
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        return [int_fn(v) for v in value]
    return value


_DERIVED = ("stage_names", "out_features", "out_indices")  # backbone bookkeeping the config recomputes


def _flat(d: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """Config values by path; nested sub-configs (e.g. CLIP's vision_config) are walked too."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            out.update(_flat(v, (*prefix, k)))
        elif k not in _DERIVED:
            out[(*prefix, k)] = v
    return out


def _stripped(d: dict) -> dict:
    return {k: _stripped(v) if isinstance(v, dict) and "model_type" in v else v
            for k, v in d.items() if k not in _DERIVED}


def _with(config, changes: dict[tuple, object]):
    d = _stripped(config.to_dict())
    for path, v in changes.items():
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = v
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config.__class__.from_dict(d)
    except Exception:  # noqa: BLE001 -- the config refuses this change: the step is not taken
        return None


def _step(config, pattern, int_fn, float_fn, ok: Callable[[object], bool]):
    """Apply the step to every matching key at once; if that fails, key by key.
    Returns (config, keys kept, whether the all-at-once trial ran)."""
    flat = _flat(config.to_dict())
    changes = {k: _map_values(v, int_fn, float_fn) for k, v in flat.items() if pattern.search(k[-1])}
    changes = {k: v for k, v in changes.items() if v != flat[k]}
    if not changes:
        return config, [], True
    trial = _with(config, changes)
    if ok(trial):
        return trial, sorted(".".join(k) for k in changes), True
    kept = []
    for k, v in changes.items():
        trial = _with(config, {k: v})
        if ok(trial):
            config, kept = trial, [*kept, ".".join(k)]
    return config, kept, False


_SIZES = (32, 64, 96, 112, 128, 160, 192, 224)


def _size_path(config) -> tuple | None:
    return next((k for k in _flat(config.to_dict()) if k[-1] == "image_size"), None)


def _size_of(config) -> int:
    path = _size_path(config)
    s = _flat(config.to_dict())[path] if path else 224
    return int(s[0] if isinstance(s, (list, tuple)) else s)


def _cache_file(name: str):
    import transformers

    root = os.environ.get("HYBRIDPAR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridpar")
    return os.path.join(root, "hf_tiny", transformers.__version__, f"{name}.json")


def tiny_family(name: str) -> Family:
    """The family's tiny model per the module's shrink rule (or why it is refused). The result is
    kept in $HYBRIDPAR_CACHE/hf_tiny/<transformers version>/ (shrinking builds each family a few
    times; the cache lets a CLI subprocess or a second run reuse it)."""
    import json

    import transformers

    path = _cache_file(name)
    try:
        with open(path) as f:
            d = json.load(f)
        config = transformers.CONFIG_MAPPING[name].from_dict(d["config"]) if d["config"] else None
        return Family(name, d["model_class"], d["refused"], config, d["image_size"], d["channels"],
                      tuple(d["shrunk"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    fam = _shrink(name)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"model_class": fam.model_class, "refused": fam.refused, "image_size": fam.image_size,
                       "channels": fam.channels, "shrunk": list(fam.shrunk),
                       "config": _stripped(fam.config.to_dict()) if fam.config is not None else None}, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        pass
    return fam


def _shrink(name: str) -> Family:
    import transformers

    class_name = _model_class_name(name)
    cls = getattr(transformers, class_name, None)
    if cls is None:
        return Family(name, class_name, refused=f"{class_name} is not importable")
    if "pixel_values" not in pyinspect.signature(cls.forward).parameters:
        return Family(name, class_name, refused=f"{class_name} takes no pixel_values")
    if "input_ids" in pyinspect.signature(cls.forward).parameters:
        return Family(name, class_name, refused=f"{class_name} also needs input_ids (a multimodal model)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = transformers.CONFIG_MAPPING[name](num_labels=NUM_LABELS)
    except Exception as err:  # noqa: BLE001
        return Family(name, class_name, refused=f"default config fails: {type(err).__name__}: {err}"[:160])
    chans = [v for k, v in _flat(config.to_dict()).items() if k[-1] == "num_channels" and isinstance(v, int)]
    channels = chans[0] if chans else 3

    size = _size_of(config)  # the input's side; the config's image_size when it has one

    def ok(cfg, at: int | None = None) -> bool:
        return cfg is not None and _runs(class_name, cfg, at or size, channels)

    steps: list[str] = []
    for i, (label, pattern, int_fn, float_fn) in enumerate(_STEPS):
        if label == "heads":  # step 2, input size: the smallest that runs
            path = _size_path(config)
            for s in _SIZES:
                if s >= size:
                    break
                if path is None:
                    trial = config
                else:
                    old = _flat(config.to_dict())[path]
                    trial = _with(config, {path: [s] * len(old) if isinstance(old, list) else s})
                if ok(trial, s):
                    config, size = trial, s
                    steps.append(f"input:{s}")
                    break
        before = config
        config, kept, at_once = _step(config, pattern, int_fn, float_fn, ok)
        steps += [f"{label}:{k}" for k in kept]
        if i == 0 and not kept and not at_once and not ok(before):
            return Family(name, class_name,
                          refused=f"does not run at its defaults: {_why(class_name, before, size, channels)}")
    if not ok(config):
        return Family(name, class_name, refused=f"does not run: {_why(class_name, config, size, channels)}")
    return Family(name, class_name, config=config, image_size=size, channels=channels, shrunk=tuple(steps))


def _why(class_name: str, config, size: int, channels: int) -> str:
    try:
        model = _instantiate(class_name, config)
        with torch.no_grad():
            out = model(pixel_values=torch.randn(BATCH, channels, size, size)).logits
        return f"logits of shape {tuple(out.shape)}"
    except Exception as err:  # noqa: BLE001
        return " ".join(f"{type(err).__name__}: {err}".split())[:160]


# `hybridpar inspect --model tests/conformance/hf_families.py:<family>` (dashes as underscores):
# the factory returns (module, example inputs) at batch 2. `<family>_train`: the same without dropout
# (train checks against one process).
def __getattr__(attr: str):
    if attr.startswith("_") or not available():
        raise AttributeError(attr)
    names = {n.replace("-", "_"): n for n in family_names()}
    base = attr.removesuffix("_train")
    if base not in names:
        raise AttributeError(attr)

    def factory():
        fam = tiny_family(names[base])
        if fam.refused:
            raise RuntimeError(fam.refused)
        return fam.build(dropout=attr == base), fam.inputs()

    return factory
