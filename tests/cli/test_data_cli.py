"""Data as users keep it, through the command line: an image folder written here is opened, batched by
the loader (workers, a rank's part of each batch) and trained on; bad folders are one line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridpar.cli.main import main


def image_folder(root, per_class=8):
    """Three classes of PNG/JPEG images of assorted sizes, class k mostly colour k."""
    from PIL import Image

    rng = np.random.default_rng(1)
    for name, colour in {"ant": (210, 40, 40), "bee": (40, 200, 40), "cow": (40, 40, 220)}.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(20, 48)), int(rng.integers(20, 48))
            arr = np.clip(np.array(colour) + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(root / name / (f"{i}.jpeg" if i % 2 else f"{i}.png"))
    return root


def test_image_folder_is_opened_and_batched(tmp_path, capsys):
    root = image_folder(tmp_path / "pics")
    assert main(["data", "--data", f"imagefolder:{root}", "--model", "small_cnn", "--batch", "6", "--steps", "4",
                 "--workers", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "image files, decoded per item"
    assert info["samples"] == 24 and info["classes"] == 3 and info["class_names"] == ["ant", "bee", "cow"]
    assert info["per_sample_input"] == [[3, 32, 32]] and info["workers"] == 1
    assert [b["step"] for b in info["batches"]] == [0, 1, 2, 3]
    assert all(b["x"].startswith("[6, 3, 32, 32] float32") for b in info["batches"])
    assert info["samples_per_s"] > 0
    # A rank of a 2-way sample split reads 3 of the 6 samples of each step.
    assert main(["data", "--data", f"imagefolder:{root}", "--model", "small_cnn", "--batch", "6", "--steps", "2",
                 "--part", "1/2", "--workers", "0", "--json"]) == 0
    part = json.loads(capsys.readouterr().out)
    assert part["rows_per_batch"] == 3 and all(b["x"].startswith("[3, 3, 32, 32]") for b in part["batches"])
    # The table for people names the classes.
    assert main(["data", "--data", f"imagefolder:{root}", "--input-shape", "1,16,16", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "ant, bee, cow" in out and "[4, 1, 16, 16] float32" in out


@pytest.mark.parametrize("setup, args, needle", [
    (lambda r: None, [], "not a directory"),
    (lambda r: r.mkdir(), [], "no class sub-folders"),
    (lambda r: (r / "a").mkdir(parents=True), [], "holds no images"),
    (lambda r: image_folder(r, per_class=2), ["--batch", "7"], "6 samples, fewer than --batch 7"),
    (lambda r: image_folder(r, per_class=2), ["--model", "lstm2"], "C = 1 or 3"),
    (lambda r: image_folder(r, per_class=2), ["--part", "2/2"], "--part '2/2'"),
])
def test_bad_image_folders_are_one_line(tmp_path, capsys, setup, args, needle):
    root = tmp_path / "pics"
    setup(root)
    model = [] if "--model" in args else ["--model", "small_cnn"]
    assert main(["data", "--data", f"imagefolder:{root}", *model, "--batch", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_npy_and_factory_data_through_the_cli(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(12, 3, 32, 32)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.arange(12) % 10)
    assert main(["data", "--data", f"npy:{tmp_path}", "--model", "small_cnn", "--batch", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "memory-mapped arrays, read per item"
    f = tmp_path / "d.py"
    f.write_text("import torch\n"
                 "def make():\n"
                 "    return torch.utils.data.TensorDataset(torch.randn(9, 3, 32, 32), torch.arange(9) % 10)\n")
    assert main(["data", "--data", f"{f}:make", "--model", "small_cnn", "--batch", "3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "TensorDataset from a factory, read per item" and info["samples"] == 9


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_on_an_image_folder(tmp_path, capsys):
    """`hybridpar train --data imagefolder:DIR` on 2 ranks: decoded images reach the model and it learns."""
    root = image_folder(tmp_path / "pics", per_class=8)
    assert main(["train", "--model", "small_cnn", "--strategy", "sample=2", "--nproc", "2",
                 "--data", f"imagefolder:{root}", "--batch", "8", "--steps", "12", "--lr", "0.05",
                 "--momentum", "0.9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    losses = [s["loss"] for s in out["steps"]]
    assert out["world_size"] == 2 and len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3  # three colours are easy to tell apart
