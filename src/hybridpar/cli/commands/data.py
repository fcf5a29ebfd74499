"""`hybridpar data`: open a --data set the way `hybridpar train` will, read a few batches through the
loader and say what it holds and how fast it reads (before spending a cluster allocation on it)."""

from __future__ import annotations

import time

import click

from hybridpar.cli.options import batch_option
from hybridpar.cli.output import console, fmt, print_json, table
from hybridpar.errors import UserError


def register(app: click.Group) -> None:
    @app.command("data")
    @click.option("--data", "spec", required=True,
                  help="synthetic | digits | path.pt | imagefolder:DIR | npy:DIR | path/to/file.py:factory")
    @click.option("--model", default=None, help="the model the data is for: its input shape, outputs, vocabulary")
    @click.option("--input-shape", default=None, help="per-sample input shape C,H,W (file models, or no --model)")
    @batch_option()
    @click.option("--steps", type=int, default=3, show_default=True, help="batches to read")
    @click.option("--workers", type=int, default=None,
                  help="loader worker processes [default: none for data in memory, else up to 4]")
    @click.option("--part", default=None, metavar="I/K",
                  help="read only piece I of K of each global batch (a rank's sample group), e.g. 0/2")
    @click.option("--seed", type=int, default=0, show_default=True)
    @click.option("--no-shuffle", is_flag=True, help="batches in file order")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output")
    def data_cmd(spec: str, model: str | None, input_shape: str | None, batch: int, steps: int, workers: int | None,
                 part: str | None, seed: int, no_shuffle: bool, json_: bool) -> None:
        """Open --data for --model, read --steps batches and describe them."""
        info = describe(spec, model=model, input_shape=input_shape, batch=batch, steps=steps, workers=workers,
                        part=_parse_part(part), seed=seed, shuffle=not no_shuffle)
        if json_:
            print_json(info)
            return
        rows = [[k.replace("_", " "), _show(v)] for k, v in info.items() if k != "batches"]
        console.print(table(f"--data {spec}", ["name", "value"], rows, justify_right=lambda c: False))
        for b in info["batches"]:
            console.print(f"step {b['step']}: x {b['x']}, labels {b['labels']}")


def _show(v) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) if v else "-"
    return "-" if v is None else fmt(v)


def _kind(ds) -> str:
    """What holds the samples, in words."""
    from hybridpar.train.data.files import Checked, ImageFolder, NpyArrays
    from hybridpar.train.data.loader import Dataset

    if isinstance(ds, Checked):
        return f"{type(ds.inner).__name__} from a factory, read per item"
    return {Dataset: "tensors in memory", ImageFolder: "image files, decoded per item",
            NpyArrays: "memory-mapped arrays, read per item"}.get(type(ds), type(ds).__name__)


def _parse_part(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        i, k = (int(t) for t in text.split("/"))
    except ValueError:
        raise UserError(f"--part {text!r}: expected I/K, e.g. 0/2") from None
    if not (k >= 1 and 0 <= i < k):
        raise UserError(f"--part {text!r}: needs 0 <= I < K")
    return i, k


def describe(spec: str, *, model: str | None, input_shape: str | None, batch: int, steps: int,
             workers: int | None, part: tuple[int, int] | None, seed: int, shuffle: bool) -> dict:
    from hybridpar.graph.models import parse_shape
    from hybridpar.train.data.loader import batches, data_spec, default_workers, open_dataset, part_rows

    if batch < 1 or steps < 1:
        raise UserError(f"--batch and --steps must be >= 1, got {batch} and {steps}")
    if workers is not None and workers < 0:
        raise UserError(f"--workers must be >= 0, got {workers}")
    shape = parse_shape(input_shape)
    vocab = num_classes = example = None
    label_shape: tuple[int, ...] = ()
    if model is not None:
        from hybridpar.graph.models import load_model

        loaded = load_model(model, batch=1, input_shape=shape)
        shape = tuple(loaded.input_shape or loaded.example_inputs[0].shape[1:])
        ds_spec = data_spec(loaded)
        vocab, num_classes, label_shape, example = (ds_spec.vocab, ds_spec.num_classes, ds_spec.label_shape,
                                                    loaded.example_inputs)
    elif shape is None:
        raise UserError("give --model, or --input-shape for data without a model")
    ds = open_dataset(spec, shape, num_classes=num_classes, vocab=vocab, label_shape=label_shape,
                      example_inputs=example, seed=seed)
    if len(ds) < batch:
        raise UserError(f"--data {spec} has {len(ds)} samples, fewer than --batch {batch}")
    workers = default_workers(ds) if workers is None else workers
    t0 = time.perf_counter()  # read_s includes starting the loader's workers
    read, shown = 0, []
    for step, x, y in batches(ds, batch, stop=steps, seed=seed, shuffle=shuffle, part=part, workers=workers):
        read += int(y.shape[0])
        first = next(iter(x.values())) if isinstance(x, dict) else x[0] if isinstance(x, tuple) else x
        stats = (f"{list(first.shape)} {str(first.dtype).removeprefix('torch.')}"
                 + (f" mean {float(first.float().mean()):+.3f} std {float(first.float().std()):.3f}"
                    if first.is_floating_point() and first.numel() > 1 else ""))
        shown.append({"step": step, "x": stats, "labels": sorted({int(v) for v in y.flatten().tolist()})[:12]})
    elapsed = time.perf_counter() - t0
    x0, _ = ds[0]
    inputs = x0 if isinstance(x0, (tuple, dict)) else (x0,)
    per_sample = ({k: list(v.shape) for k, v in inputs.items()} if isinstance(inputs, dict)
                  else [list(t.shape) for t in inputs])
    classes = getattr(ds, "classes", None)
    return {"data": spec, "kind": _kind(ds), "samples": len(ds),
            "classes": (len(classes) if classes is not None else getattr(ds, "num_classes", None)),
            "class_names": list(classes)[:20] if classes is not None else None,
            "per_sample_input": per_sample, "model_input": list(shape), "batch": batch,
            "rows_per_batch": part_rows(batch, part)[1], "steps_read": steps, "workers": workers,
            "read_s": elapsed, "samples_per_s": read / elapsed if elapsed > 0 else None,
            "batches": shown}
