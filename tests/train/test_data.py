"""--data sets: digits adaptation rule, file validation, batch order; image folders, memory-mapped
arrays, a user's Dataset factory and multi-input .pt files through open_dataset / batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridpar.errors import UserError
from hybridpar.train.data.loader import (
    Dataset,
    StepSampler,
    batch_indices,
    batches,
    load_dataset,
    model_args,
    open_dataset,
    part_rows,
    sample_part,
)


def test_digits_adapted_to_model_input():
    ds = load_dataset("digits", (3, 16, 16), num_classes=10)
    assert ds.x.shape == (1797, 3, 16, 16) and ds.y.shape == (1797,)
    assert ds.num_classes == 10
    assert torch.equal(ds.x[:, 0], ds.x[:, 2])  # grey channel repeated
    assert abs(float(ds.x.mean())) < 1e-4 and abs(float(ds.x.std()) - 1) < 1e-3


def test_digits_needs_enough_model_outputs():
    with pytest.raises(UserError, match="outputs"):
        load_dataset("digits", (1, 8, 8), num_classes=5)


def test_file_dataset_roundtrip_and_errors(tmp_path):
    good = tmp_path / "d.pt"
    torch.save({"x": torch.randn(6, 1, 4, 4), "y": torch.arange(6) % 2}, good)
    ds = load_dataset(str(good), (1, 4, 4))
    assert len(ds) == 6
    with pytest.raises(UserError, match="shape"):
        load_dataset(str(good), (1, 5, 5))
    bad = tmp_path / "b.pt"
    torch.save({"x": torch.randn(6, 1, 4, 4), "y": torch.zeros(6)}, bad)
    with pytest.raises(UserError, match="long"):
        load_dataset(str(bad), (1, 4, 4))
    with pytest.raises(UserError, match="not found"):
        load_dataset(str(tmp_path / "missing.pt"), (1, 4, 4))
    junk = tmp_path / "junk.pt"
    junk.write_text("not a tensor file")
    with pytest.raises(UserError, match="torch.save"):
        load_dataset(str(junk), (1, 4, 4))


def test_no_shuffle_takes_file_order_and_shuffle_is_a_permutation():
    assert batch_indices(10, 4, 1, shuffle=False, seed=0).tolist() == [4, 5, 6, 7]
    assert batch_indices(10, 4, 2, shuffle=False, seed=0).tolist() == [0, 1, 2, 3]  # next epoch
    seen = torch.cat([batch_indices(12, 4, s, shuffle=True, seed=3) for s in range(3)])
    assert sorted(seen.tolist()) == list(range(12))


def test_epochs_count_whole_batches():
    from hybridpar.plans import LayerLayout, Plan
    from hybridpar.train.trainer import TrainConfig, total_steps

    plan = Plan(model="small_cnn", world_size=1, batch=10, default_layout=LayerLayout())
    assert total_steps(TrainConfig.from_options(model="small_cnn", plan=plan, batch=10, steps=None, epochs=3), 95) == 27
    assert total_steps(TrainConfig.from_options(model="small_cnn", plan=plan, batch=10, steps=7), 95) == 7


# ---- batch order and parts -------------------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [True, False])
def test_step_sampler_is_batch_indices_over_epochs_and_parts_tile_the_batch(shuffle):
    n, b = 23, 6  # 3 whole batches per epoch, 5 samples dropped
    whole = list(StepSampler(n, b, 2, 11, shuffle=shuffle, seed=5))
    assert whole == [batch_indices(n, b, s, shuffle=shuffle, seed=5).tolist() for s in range(2, 11)]
    for k in (2, 4, 5):  # 6 over 4 is 2, 2, 2, 0 (torch.chunk's cut); over 5 it is 2, 2, 2, 0, 0
        pieces = [list(StepSampler(n, b, 2, 11, shuffle=shuffle, seed=5, part=(i, k))) for i in range(k)]
        assert [sum((p[j] for p in pieces), []) for j in range(9)] == whole
    assert part_rows(10, (3, 4)) == (9, 1) and part_rows(10, None) == (0, 10)
    with pytest.raises(UserError, match="part"):
        part_rows(10, (4, 4))


def test_batches_of_data_in_memory_are_the_rows_of_batch_indices():
    ds = load_dataset("synthetic", (3, 4, 4), num_classes=5, size=40, seed=1)
    got = list(batches(ds, 8, start=3, stop=9, seed=2))
    assert [s for s, _, _ in got] == list(range(3, 9))
    for step, x, y in got:
        idx = batch_indices(40, 8, step, shuffle=True, seed=2)
        assert torch.equal(x, ds.x[idx]) and torch.equal(y, ds.y[idx])
    # The DataLoader path (workers) stacks the same tensors.
    loaded = list(batches(ds, 8, start=3, stop=9, seed=2, workers=1))
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(got, loaded))


def test_sample_part_of_a_rank_follows_the_plan():
    from hybridpar.plans import LayerLayout, Plan

    cf = Plan(model="small_cnn", world_size=8, batch=16, dp=8, default_layout=LayerLayout(sample=2, channel=2,
                                                                                  filter=2))
    assert [sample_part(cf, r) for r in range(8)] == [(0, 2)] * 4 + [(1, 2)] * 4
    hybrid = Plan(model="small_cnn", world_size=6, batch=12, dp=3, mp=2, default_layout=LayerLayout(sample=3))
    assert [sample_part(hybrid, r) for r in range(6)] == [(0, 3), (0, 3), (1, 3), (1, 3), (2, 3), (2, 3)]
    # The rows a rank reads are the rows its sample group's piece of the global batch holds.
    ds = load_dataset("synthetic", (3, 4, 4), num_classes=5, size=48, seed=1)
    (_, x, _), = batches(ds, 12, start=2, stop=3, seed=4)
    mine = [list(batches(ds, 12, start=2, stop=3, seed=4, part=sample_part(hybrid, r)))[0][1] for r in range(6)]
    assert all(torch.equal(m, t) for m, t in zip(mine[::2], torch.tensor_split(x, 3)))
    with pytest.raises(UserError, match="outside"):
        sample_part(hybrid, 6)


# ---- image folders -----------------------------------------------------------------------------------

def write_image_folder(root, per_class: int = 6, classes=("cat", "dog", "emu")):
    """PNG and JPEG files of assorted sizes and modes, one sub-folder per class; class k is mostly
    colour k so a model can learn it."""
    from PIL import Image

    colours = [(220, 30, 30), (30, 200, 40), (40, 40, 210)]
    rng = np.random.default_rng(0)
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(12, 40)), int(rng.integers(12, 40))
            arr = np.clip(np.array(colours[k]) + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
            img = Image.fromarray(arr)
            if i % 3 == 1:
                img.convert("RGBA").save(root / name / f"{i}.png")
            elif i % 3 == 2:
                img.save(root / name / f"{i}.JPG", quality=95)
            else:
                img.save(root / name / f"{i}.png")
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    return root


def test_image_folder_classes_shapes_and_normalisation(tmp_path):
    from PIL import Image

    root = write_image_folder(tmp_path / "imgs")
    ds = open_dataset(f"imagefolder:{root}", (3, 16, 16), num_classes=10)
    assert len(ds) == 18 and ds.num_classes == 3 and ds.classes == ["cat", "dog", "emu"]
    x, y = ds[7]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and int(y) == 1
    # Mostly green images: after ImageNet normalisation green is high, red and blue low.
    assert float(x[1].mean()) > 0.5 > float(x[0].mean())
    # A known picture: 40 wide x 20 high, left half pure red, right half pure blue, to 10 x 10: scaled
    # to 20 x 10 (covering), the middle 10 columns kept, so red on the left, blue on the right.
    one = tmp_path / "one" / "only"
    one.mkdir(parents=True)
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20, 0] = 255
    arr[:, 20:, 2] = 255
    Image.fromarray(arr).save(one / "a.png")
    t, _ = open_dataset(f"imagefolder:{one.parent}", (3, 10, 10))[0]
    red = torch.tensor([(1 - 0.485) / 0.229, -0.456 / 0.224, -0.406 / 0.225])
    blue = torch.tensor([-0.485 / 0.229, -0.456 / 0.224, (1 - 0.406) / 0.225])
    assert torch.allclose(t[:, 5, 0], red, atol=1e-5) and torch.allclose(t[:, 5, 9], blue, atol=1e-5)
    grey, _ = open_dataset(f"imagefolder:{one.parent}", (1, 10, 10))[0]
    assert grey.shape == (1, 10, 10)


def test_large_jpeg_decoded_at_a_reduced_scale_matches_a_full_decode(tmp_path):
    from PIL import Image

    (tmp_path / "c").mkdir()
    yy, xx = np.mgrid[0:600, 0:800]
    arr = np.stack([xx * 255 // 800, yy * 255 // 600, (xx + yy) * 255 // 1400], -1).astype(np.uint8)
    Image.fromarray(arr).save(tmp_path / "c" / "big.jpg", quality=95)
    ds = open_dataset(f"imagefolder:{tmp_path}", (3, 48, 64))
    drafted = ds[0][0]
    with Image.open(tmp_path / "c" / "big.jpg") as img:  # full decode, the same scaling rule
        full = np.asarray(img.convert("RGB").resize((64, 48), Image.Resampling.BILINEAR), dtype=np.float32)
    ref = (torch.from_numpy(full).permute(2, 0, 1) / 255 - ds._mean) / ds._std
    assert drafted.shape == (3, 48, 64) and float((drafted - ref).abs().mean()) < 0.05


def test_image_folder_batches_with_workers_equal_one_process_and_parts(tmp_path):
    root = write_image_folder(tmp_path / "imgs")
    ds = open_dataset(f"imagefolder:{root}", (3, 12, 12), num_classes=3)
    serial = list(batches(ds, 6, stop=5, seed=1, workers=0))
    parallel = list(batches(ds, 6, stop=5, seed=1, workers=2))
    for (s0, x0, y0), (s1, x1, y1) in zip(serial, parallel, strict=True):
        idx = batch_indices(len(ds), 6, s0, shuffle=True, seed=1)
        assert s0 == s1 and torch.equal(x0, x1) and torch.equal(y0, y1)
        assert torch.equal(x0, torch.stack([ds[int(i)][0] for i in idx]))
    # Rank i of a 2-way sample split reads only its 3 rows of each batch.
    halves = [list(batches(ds, 6, stop=5, seed=1, workers=0, part=(i, 2))) for i in range(2)]
    for j, (_, x, y) in enumerate(serial):
        assert halves[0][j][1].shape[0] == 3
        assert torch.equal(torch.cat([halves[0][j][1], halves[1][j][1]]), x)
        assert torch.equal(torch.cat([halves[0][j][2], halves[1][j][2]]), y)
    whole = load_dataset(f"imagefolder:{root}", (3, 12, 12))
    assert isinstance(whole, Dataset) and whole.x.shape == (18, 3, 12, 12)


def test_image_folder_errors(tmp_path):
    def err(spec, shape=(3, 8, 8), **kw):
        with pytest.raises(UserError) as e:
            open_dataset(spec, shape, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "not a directory" in err(f"imagefolder:{tmp_path / 'nope'}")
    (tmp_path / "empty").mkdir()
    assert "no class sub-folders" in err(f"imagefolder:{tmp_path / 'empty'}")
    (tmp_path / "empty" / "a").mkdir()
    assert "holds no images" in err(f"imagefolder:{tmp_path / 'empty'}")
    (tmp_path / "empty" / "a" / "x.png").write_bytes(b"\x89PNG garbage")
    assert "not an image" in err(f"imagefolder:{tmp_path / 'empty'}")
    root = write_image_folder(tmp_path / "imgs")
    assert "C = 1 or 3" in err(f"imagefolder:{root}", (4, 8, 8))
    assert "C = 1 or 3" in err(f"imagefolder:{root}", (16,), vocab=32)
    assert "2 outputs" in err(f"imagefolder:{root}", num_classes=2)
    # A file that turns out broken later is named when it is read.
    (root / "dog" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    ds = open_dataset(f"imagefolder:{root}", (3, 8, 8))
    bad = next(i for i, (f, _) in enumerate(ds.files) if f.endswith("9.png"))
    with pytest.raises(UserError, match="cannot decode .*9.png"):
        ds[bad]
    # A decompression bomb past the first image of its class (checked at start) is the same bad input.
    (root / "dog" / "8.png").write_bytes(_bomb_png())
    ds = open_dataset(f"imagefolder:{root}", (3, 8, 8))
    bomb = next(i for i, (f, _) in enumerate(ds.files) if f.endswith("8.png"))
    with pytest.raises(UserError, match="cannot decode .*8.png.*decompression bomb"):
        ds[bomb]


def _bomb_png() -> bytes:
    """A tiny PNG whose header claims 20000 x 20000 pixels (over twice Pillow's MAX_IMAGE_PIXELS)."""
    import io
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    at = data.index(b"IHDR")
    data[at + 4:at + 12] = struct.pack(">II", 20000, 20000)
    data[at + 17:at + 21] = struct.pack(">I", zlib.crc32(bytes(data[at:at + 17])))
    return bytes(data)


# ---- memory-mapped arrays ------------------------------------------------------------------------------

def test_npy_directory_is_memory_mapped_and_batched(tmp_path):
    x = np.random.default_rng(0).normal(size=(20, 2, 3, 3)).astype(np.float64)
    y = (np.arange(20) % 4).astype(np.int32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    ds = open_dataset(f"npy:{tmp_path}", (2, 3, 3), num_classes=4)
    assert isinstance(ds.x, np.memmap) and len(ds) == 20 and ds.num_classes == 4
    for step, xb, yb in batches(ds, 5, stop=6, seed=3, workers=1):
        idx = batch_indices(20, 5, step, shuffle=True, seed=3).numpy()
        assert xb.dtype == torch.float32 and yb.dtype == torch.long
        assert torch.equal(xb, torch.from_numpy(x[idx]).float()) and torch.equal(yb, torch.from_numpy(y[idx]).long())
    with pytest.raises(UserError, match="shape"):
        open_dataset(f"npy:{tmp_path}", (2, 3, 4))
    with pytest.raises(UserError, match="3 outputs"):
        open_dataset(f"npy:{tmp_path}", (2, 3, 3), num_classes=3)
    with pytest.raises(UserError, match="integer token ids"):
        open_dataset(f"npy:{tmp_path}", (2, 3, 3), vocab=8)
    np.save(tmp_path / "y.npy", y[:19])
    with pytest.raises(UserError, match="20 samples but y.npy has 19"):
        open_dataset(f"npy:{tmp_path}", (2, 3, 3))
    (tmp_path / "y.npy").unlink()
    with pytest.raises(UserError, match="y.npy not found"):
        open_dataset(f"npy:{tmp_path}", (2, 3, 3))


def test_npy_token_ids_are_checked_when_read(tmp_path):
    np.save(tmp_path / "x.npy", np.array([[1, 2, 3], [4, 5, 40]], dtype=np.int16))
    np.save(tmp_path / "y.npy", np.array([0, 1]))
    ds = open_dataset(f"npy:{tmp_path}", (3,), vocab=32)
    assert ds[0][0].dtype == torch.long
    with pytest.raises(UserError, match="sample 1 has token ids outside"):
        ds[1]


# ---- a user's Dataset factory --------------------------------------------------------------------------

FACTORY = '''
import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset


class Squares(Dataset):
    def __init__(self, n, bad_at=None):
        self.n, self.bad_at = n, bad_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad_at:
            return np.zeros((1, 5, 5), np.float32), 0
        return np.full((1, 4, 4), float(i), np.float64), i % 3


def good():
    return Squares(12)


def bad_later():
    return Squares(12, bad_at=7)


def stream():
    class S(IterableDataset):
        def __iter__(self):
            yield torch.zeros(1, 4, 4), 0
    return S()


def boom():
    raise RuntimeError("no disk")
'''


def test_dataset_factory(tmp_path):
    f = tmp_path / "mydata.py"
    f.write_text(FACTORY)
    ds = open_dataset(f"{f}:good", (1, 4, 4), num_classes=3)
    assert len(ds) == 12
    got = list(batches(ds, 4, stop=3, shuffle=False, workers=1))
    assert [int(x[0, 0, 0, 0]) for _, x, _ in got] == [0, 4, 8]
    assert got[1][1].dtype == torch.float32 and got[1][2].tolist() == [1, 2, 0, 1]
    with pytest.raises(UserError, match="item 0: x has shape"):
        open_dataset(f"{f}:good", (1, 3, 3))
    with pytest.raises(UserError, match="map-style"):
        open_dataset(f"{f}:stream", (1, 4, 4))
    with pytest.raises(UserError, match="RuntimeError: no disk"):
        open_dataset(f"{f}:boom", (1, 4, 4))
    with pytest.raises(UserError, match="no callable 'nothing'"):
        open_dataset(f"{f}:nothing", (1, 4, 4))
    with pytest.raises(UserError, match="item 2: label 2 but the model has 2 outputs"):
        list(batches(open_dataset(f"{f}:good", (1, 4, 4), num_classes=2), 4, stop=1, shuffle=False, workers=0))
    lazy = open_dataset(f"{f}:bad_later", (1, 4, 4))
    with pytest.raises(UserError, match="item 7: x has shape"):
        lazy[7]


# ---- integer and multi-input .pt files -----------------------------------------------------------------

def test_multi_input_pt_tuple_and_dict(tmp_path):
    ids, mask, y = torch.randint(0, 50, (10, 6)), torch.ones(10, 6, dtype=torch.bool), torch.arange(10) % 3
    example = (torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.bool))
    torch.save({"x": (ids.int(), mask), "y": y}, tmp_path / "t.pt")
    ds = open_dataset(str(tmp_path / "t.pt"), (6,), vocab=50, example_inputs=example)
    (_, xb, yb), = list(batches(ds, 4, stop=1, shuffle=False))
    assert isinstance(xb, tuple) and xb[0].dtype == torch.long and torch.equal(xb[0], ids[:4])
    assert torch.equal(xb[1], mask[:4]) and torch.equal(yb, y[:4])
    args, kwargs = model_args(xb)
    assert len(args) == 2 and kwargs == {}
    with pytest.raises(UserError, match="x holds 2 inputs, the model takes 1"):
        open_dataset(str(tmp_path / "t.pt"), (6,), example_inputs=example[:1])
    torch.save({"x": {"input_ids": ids, "attention_mask": mask}, "y": y}, tmp_path / "d.pt")
    ds = open_dataset(str(tmp_path / "d.pt"), (6,), vocab=50)
    (_, xb, _), = list(batches(ds, 4, stop=1, shuffle=False, workers=1))
    assert set(xb) == {"input_ids", "attention_mask"} and torch.equal(xb["input_ids"], ids[:4])
    assert model_args(xb) == ((), xb)
    torch.save({"x": (ids, mask[:9]), "y": y}, tmp_path / "short.pt")
    with pytest.raises(UserError, match=r"x\[1\] has 9 samples but y has 10"):
        open_dataset(str(tmp_path / "short.pt"), (6,), vocab=50)


class _TwoInputs(torch.nn.Module):
    """ids [N, T] and a float mask [N, T] -> logits [N, 5]."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = torch.nn.Embedding(40, 8), torch.nn.Linear(8, 5)

    def forward(self, ids, mask):
        return self.fc((self.emb(ids) * mask.unsqueeze(-1)).mean(1))


def test_multi_input_and_integer_models_without_a_vocabulary(tmp_path):
    from hybridpar.graph.models import LoadedModel
    from hybridpar.train.data.loader import data_spec

    net = _TwoInputs()
    example = (torch.tensor([[3, 7, 9, 1, 0, 2]] * 2), torch.ones(2, 6))
    spec = data_spec(LoadedModel("two.py:model", net, example, "custom", (6,)))
    assert (spec.vocab, spec.num_classes, spec.label_shape) == (None, 5, ())
    # synthetic: one set per input, like the example (ids in the example's range, float mask)
    ds = open_dataset("synthetic", (6,), num_classes=5, size=32, example_inputs=example)
    (_, x, y), = list(batches(ds, 8, stop=1))
    assert isinstance(x, tuple) and x[0].dtype == torch.long and x[1].dtype == torch.float32
    assert int(x[0].min()) >= 0 and int(x[0].max()) <= 9 and x[0].shape == (8, 6) and x[1].shape == (8, 6)
    args, kwargs = model_args(x)
    assert net(*args, **kwargs).shape == (8, 5) and y.shape == (8,)
    # a single integer input without a known vocabulary: integer .pt and npy data are taken as ids
    ids_only = (torch.zeros(2, 6, dtype=torch.long),)
    torch.save({"x": torch.randint(0, 40, (10, 6)), "y": torch.arange(10) % 5}, tmp_path / "ids.pt")
    assert open_dataset(str(tmp_path / "ids.pt"), (6,), example_inputs=ids_only)[0][0].dtype == torch.long
    with pytest.raises(UserError, match="must be a float tensor"):
        open_dataset(str(tmp_path / "ids.pt"), (6,))
    with pytest.raises(UserError, match="integer tensor of token ids"):
        torch.save({"x": torch.randn(10, 6), "y": torch.arange(10) % 5}, tmp_path / "f.pt")
        open_dataset(str(tmp_path / "f.pt"), (6,), example_inputs=ids_only)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).integers(0, 40, (10, 6)))
    np.save(tmp_path / "y.npy", np.arange(10) % 5)
    assert open_dataset(f"npy:{tmp_path}", (6,), example_inputs=ids_only)[3][0].dtype == torch.long
    with pytest.raises(UserError, match="C = 1 or 3"):
        open_dataset(f"imagefolder:{tmp_path}", (6,), example_inputs=ids_only)


def test_unknown_spec_lists_the_kinds():
    with pytest.raises(UserError, match="imagefolder:DIR, npy:DIR"):
        open_dataset("parquet:foo", (3, 8, 8))


# ---- inside ranks ----------------------------------------------------------------------------------------

def _rank_reads(root: str) -> list:
    """On a gloo rank: this rank's half of every batch, through loader workers (ranks may fork them)."""
    import torch.distributed as dist

    from hybridpar.plans import LayerLayout, Plan

    plan = Plan(model="small_cnn", world_size=2, batch=6, dp=2, default_layout=LayerLayout(sample=2))
    ds = open_dataset(f"imagefolder:{root}", (3, 12, 12), num_classes=3)
    mine = [(x, y) for _, x, y in batches(ds, 6, stop=3, seed=2, workers=1,
                                           part=sample_part(plan, dist.get_rank()))]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_read_their_sample_groups_rows_through_worker_processes(tmp_path):
    from hybridpar.train.launch import spawn

    root = write_image_folder(tmp_path / "imgs")
    every = spawn(_rank_reads, 2, str(root))
    ds = open_dataset(f"imagefolder:{root}", (3, 12, 12))
    for j, (_, x, y) in enumerate(batches(ds, 6, stop=3, seed=2, workers=0)):
        assert all(every[r][j][0].shape[0] == 3 for r in range(2))
        assert torch.equal(torch.cat([every[0][j][0], every[1][j][0]]), x)
        assert torch.equal(torch.cat([every[0][j][1], every[1][j][1]]), y)
