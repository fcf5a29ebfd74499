"""A run's options are config objects owned by the components that read them; the flat names (the flags,
run_config's keywords, a TOML file without sections) and the sectioned TOML form build the same config."""

from __future__ import annotations

import tomllib
from pathlib import Path

import click
import pytest

from hybridpar.errors import UserError
from hybridpar.train.config import CheckpointConfig, ParallelConfig, TrainConfig, flat_name
from hybridpar.train.data.config import DataConfig
from hybridpar.train.metrics import MetricsConfig
from hybridpar.train.optim import OptimConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.toml"


def test_flat_options_land_in_their_sections():
    cfg = TrainConfig.from_options(model="small_cnn", strategy="sample=2", nproc=2, data="digits", no_shuffle=True,
                                   lr=0.01, optimizer="adamw", checkpoint_dir="ck", checkpoint_every=3,
                                   resume=True, metrics="m.jsonl", log_every=5, steps=7)
    assert cfg.parallel == ParallelConfig(strategy="sample=2", gpus=2)
    assert cfg.data == DataConfig(source="digits", shuffle=False)
    assert cfg.optim == OptimConfig(lr=0.01, optimizer="adamw")
    assert cfg.checkpoint == CheckpointConfig(dir="ck", every=3, resume="yes")
    assert cfg.metrics == MetricsConfig(jsonl="m.jsonl", log_every=5)
    assert (cfg.model, cfg.steps) == ("small_cnn", 7)
    assert cfg.with_options(precision="fp64").optim.precision == "fp64"
    with pytest.raises(TypeError, match="learning_rate"):
        TrainConfig.from_options(learning_rate=0.1)


def test_each_section_checks_its_own_options():
    ok = TrainConfig.from_options(model="small_cnn", strategy="sample=1")
    assert ok.check().metrics.profile_steps is None
    for options, param in (({"lr": float("nan")}, "lr"), ({"workers": -1}, "workers"),
                           ({"checkpoint_every": 2}, "checkpoint_every"), ({"bn_stats": "x"}, "bn_stats"),
                           ({"profile_dir": "p"}, "profile_dir"), ({"log_every": -1}, "log_every"),
                           ({"steps": 2, "epochs": 1}, "steps"), ({"optimizer": "rmsprop"}, "optimizer")):
        with pytest.raises(UserError) as err:
            ok.with_options(**options).check()
        assert err.value.param == param, options
    with pytest.raises(UserError, match="exactly one of"):
        TrainConfig.from_options(model="small_cnn").check()
    window = ok.with_options(profile_steps="1:3", checkpoint_dir="ck").check().metrics
    assert (window.profile_steps, window.profile_dir) == ((1, 3), "ck/profile")


def test_the_sectioned_example_and_the_flat_form_give_one_config():
    from hybridpar.cli.commands.train import _flat_keys

    sectioned = dict(_flat_keys("x", tomllib.loads(EXAMPLE.read_text())))
    flat = dict(_flat_keys("x", tomllib.loads(
        '[train]\nmodel = "small_cnn"\nbatch = 16\nsteps = 20\nstrategy = "sample=2"\ngpus = 2\ndata = "synthetic"\n'
        'optimizer = "adamw"\nlr = 0.001\nweight-decay = 0.01\nlr-schedule = "cosine"\nwarmup-steps = 3\n'
        'grad-clip = 1.0\nprecision = "bf16"\nlog-every = 5\n')))
    assert sectioned == flat
    assert TrainConfig.from_options(**sectioned).optim == OptimConfig(optimizer="adamw", lr=0.001, weight_decay=0.01,
                                                                      lr_schedule="cosine", warmup_steps=3,
                                                                      grad_clip=1.0, precision="bf16")
    assert flat_name("checkpoint", "dir") == "checkpoint_dir" and flat_name("data", "source") == "data"
    assert flat_name("metrics", "jsonl") == "metrics" and flat_name("optim", "source") is None


def _train_argv(tmp_path, text: str) -> list[str]:
    (tmp_path / "run.toml").write_text(text)
    return ["train", "--config", str(tmp_path / "run.toml")]


@pytest.mark.parametrize("text", [
    '[parallel]\nstrategy = "sample=2"\nnproc = 2\n[optim]\nlr = nan\n',  # sectioned
    'strategy = "sample=2"\nnproc = 2\nlr = nan\n',  # flat keys, as the flags
])
def test_both_config_forms_reach_the_checks(tmp_path, capsys, text):
    from hybridpar.cli.main import main

    assert main([*_train_argv(tmp_path, 'model = "small_cnn"\n' + text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lr must be a finite number" in err, err


def test_an_unknown_key_in_a_section_is_one_line(tmp_path, capsys):
    from hybridpar.cli.main import main

    assert main(_train_argv(tmp_path, '[optim]\nlearning_rate = 0.1\n')) == 2
    assert "unknown option 'learning_rate' in [optim]" in capsys.readouterr().err


def test_gpus_is_the_flag_and_nproc_a_hidden_alias():
    from hybridpar.cli.main import build_app

    cmd = build_app().commands["train"]
    gpus = next(p for p in cmd.params if p.name == "gpus")
    assert gpus.opts[0] == "--gpus" and "--nproc" in gpus.opts
    with click.Context(cmd, info_name="train") as ctx:
        assert "--nproc" not in cmd.get_help(ctx)


def test_the_example_runs_its_checks():
    """The shipped example passes every check before ranks start (run_config), as `train` reads it."""
    from hybridpar.cli.commands.train import _flat_keys
    from hybridpar.train.config import run_config

    options = dict(_flat_keys(str(EXAMPLE), tomllib.loads(EXAMPLE.read_text())))
    options.pop("log_every")
    setup = run_config(TrainConfig.from_options(**options), precision="fp32")
    assert (setup.world_size, setup.config.batch, setup.total_steps) == (2, 16, 20)
    assert setup.config.optim.optimizer == "adamw" and setup.config.plan.world_size == 2
