"""--data sets: digits adaptation rule, file validation, batch order."""

from __future__ import annotations

import pytest
import torch

from hybridpar.errors import UserError
from hybridpar.runtime.data import batch_indices, load_dataset


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
    from hybridpar.runtime.train_loop import TrainConfig, total_steps

    plan = Plan(model="small_cnn", world_size=1, batch=10, default_layout=LayerLayout())
    assert total_steps(TrainConfig(model="small_cnn", plan=plan, batch=10, steps=None, epochs=3), 95) == 27
    assert total_steps(TrainConfig(model="small_cnn", plan=plan, batch=10, steps=7), 95) == 7
