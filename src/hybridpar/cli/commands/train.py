"""`hybridpar train`: run training with a layout on local gloo ranks or under torchrun."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path

import click

from hybridpar import startup
from hybridpar.cli.options import gpus_option
from hybridpar.cli.output import console, err_console, human_bytes, print_json, table
from hybridpar.errors import UserError

_OPTIONS = [
    click.option("--model", "model", default=None, help="zoo name or path/to/file.py:factory (default: the plan's)"),
    click.option("--input-shape", default=None, help="per-sample input shape C,H,W (file models)"),
    click.option("--strategy", default=None, help="uniform layout, e.g. sample=2,channel=2"),
    click.option("--plan", "plan", default=None, type=click.Path(), help="plan.json from `hybridpar plan`"),
    gpus_option(default=None, aliases=("--nproc",),
                help="ranks (devices) of the run: local ranks to spawn (default: the plan's or strategy's; ignored "
                     "under torchrun)"),
    click.option("--data", default="synthetic", show_default=True, help="synthetic | digits | path.pt | ..."),
    click.option("--batch", type=int, default=None, help="global batch per step (default: the plan's, else 32)"),
    click.option("--steps", type=int, default=None, help="SGD steps (default 10)"),
    click.option("--epochs", type=int, default=None, help="passes over the data (instead of --steps)"),
    click.option("--lr", type=float, default=0.1, show_default=True),
    click.option("--momentum", type=float, default=0.0, show_default=True),
    click.option("--weight-decay", type=float, default=0.0, show_default=True),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--no-shuffle", "no_shuffle", is_flag=True, help="step i uses samples i*B .. (i+1)*B-1 in file order"),
    click.option("--init-from", type=click.Path(), default=None, help="state_dict of the undistributed model"),
    click.option("--save", type=click.Path(), default=None, help="write final weights (undistributed layout)"),
    click.option("--bn-stats", type=click.Choice(["global", "local"]), default="global", show_default=True,
                 help="batch-norm statistics over the global batch (= serial) or each rank's samples"),
    click.option("--recompute", type=click.Choice(["none", "all"]), default="none", show_default=True,
                 help="all: recompute each block's activations in backward (keeps only block inputs)"),
    click.option("--synthetic-size", type=int, default=1024, show_default=True,
                 help="samples in --data synthetic"),
    click.option("--workers", type=int, default=None,
                 help="data loader processes per rank (default: none for data in memory, else the cores shared)"),
    click.option("--checkpoint-dir", type=click.Path(), default=None,
                 help="write sharded atomic checkpoints here (a directory every rank can reach; one run each)"),
    click.option("--checkpoint-every", type=int, default=0, show_default=True,
                 help="steps between checkpoints (0: only at the end)"),
    click.option("--resume", type=click.Choice(["yes", "if-any"]), default=None, is_flag=False, flag_value="yes",
                 help="continue from this run's newest good checkpoint in --checkpoint-dir (any layout or rank "
                      "count; step 0 when there is none); --resume=if-any also starts at step 0 when every "
                      "checkpoint there is damaged"),
    click.option("--overwrite", is_flag=True,
                 help="let this run replace checkpoints in --checkpoint-dir that are not its own"),
    click.option("--deterministic", is_flag=True,
                 help="deterministic kernels and seeding: bitwise-identical losses and weights across runs"),
    click.option("--loss", default=None,
                 help="cross_entropy (classes on dimension 1: [N, C, H, W] against [N, H, W] labels) | mse | "
                      "path/to/file.py:fn (fn(outputs, target), any output structure; targets from --data "
                      "file.py:factory)  [default: cross-entropy, an LM's [N, T, V] over its last dimension]"),
    click.option("--micro-batches", type=int, default=None,
                 help="model-parallel plans (mp > 1) only: split each replica's batch into K GPipe "
                      "micro-batches (1: no pipelining; a model with batch norm needs --bn-stats local for K > 1, "
                      "its statistics then per micro-batch)  [default: the placer's choice]"),
    click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default=None,
                 help="model-parallel plans (mp > 1) only: gpipe (all forwards, then all backwards; any placement) "
                      "or 1f1b (torch.distributed.pipelining's one-forward-one-backward: a chain of stages, "
                      "K >= stages, at most S micro-batches' activations held)  [default: the placer's choice]"),
    click.option("--time-chunks", type=int, default=None,
                 help="model-parallel plans (mp > 1) only: run recurrent layers (nn.LSTM/GRU/RNN) in K time "
                      "chunks, layer l+1 on its device running chunk t while layer l runs chunk t+1 (1: whole "
                      "layers)  [default: the placer's choice]"),
    click.option("--gns/--no-gns", default=False, show_default=True,
                 help="online gradient noise scale B_noise (McCandlish et al. 2018) from the per-sample-group "
                      "and allreduced gradients, per step and per epoch; needs >1 sample group; adds one "
                      "16-byte allreduce per step (comm kind 'gns')"),
    click.option("--optimizer", type=click.Choice(["sgd", "adamw", "lars"]), default="sgd", show_default=True,
                 help="lars: layer-wise trust ratios as in the MLPerf ResNet-50 reference"),
    click.option("--lr-schedule", type=click.Choice(["constant", "cosine", "poly"]), default="constant",
                 show_default=True, help="after the warm-up: constant, cosine to 0, or poly (power 2) to 0"),
    click.option("--warmup-steps", type=int, default=0, show_default=True, help="linear warm-up steps"),
    click.option("--grad-clip", type=float, default=None, help="clip the global gradient norm to this"),
    click.option("--max-loss-ratio", type=float, default=None,
                 help="stop (exit 3) when the loss exceeds R times its first value (default: off)"),
    click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16", "fp64"]), default="fp32",
                 show_default=True, help="bf16: autocast (CPU and CUDA); fp64: weights, buffers and inputs in "
                                         "float64, for checking a layout against one process"),
    click.option("--channels-last", is_flag=True, default=False,
                 help="4-D weights and image inputs in channels-last (NHWC) memory: oneDNN's and cuDNN's native "
                      "convolution format (same values; speed only; not priced by plan: its figures are NCHW's)"),
    click.option("--metrics", type=click.Path(), default=None,
                 help="stream one JSON record per step to FILE.jsonl (loss, lr, samples/s, FLOP/s, mfu, memory, comm)"),
    click.option("--tensorboard", type=click.Path(), default=None,
                 help="also write those per-step scalars as TensorBoard events to DIR (rank 0; needs the "
                      "tensorboard extra: pip install 'hybridpar[tensorboard]')"),
    click.option("--profile-steps", default=None, metavar="A:B",
                 help="write a torch.profiler chrome trace of steps A..B-1 on rank 0"),
    click.option("--profile-dir", type=click.Path(), default=None,
                 help="where --profile-steps writes its trace (default: CHECKPOINT_DIR/profile, else "
                      "./hybridpar-profile)"),
    click.option("--log-every", type=int, default=10, show_default=True,
                 help="a progress line every N steps when stderr is not a terminal (0: none)"),
    click.option("--config", "config", type=click.Path(), default=None,
                 help="TOML file of train options: sections [parallel] [data] [optim] [checkpoint] [metrics], or "
                      "keys as the flags (lr-schedule = \"cosine\"); flags override it"),
    click.option("--json", "json_", is_flag=True, help="machine-readable output (per-step records)"),
]


def _with_options(fn):
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


@click.command("train")
@_with_options
def train_cmd(json_: bool, config: str | None, **options) -> None:
    """Train a model with a sample/channel/filter (or MP) layout on torch.distributed.

    Exit status: 0 done (or nothing left to do), 1 a rank failed, 2 bad input (nothing started),
    3 a step's loss or gradients were NaN/Inf (nothing saved; the last good checkpoint is intact)."""
    from hybridpar.api import with_placement
    from hybridpar.train import launch
    from hybridpar.train.config import TrainConfig, claim_checkpoint_dir, run_config
    from hybridpar.train.faults import collective_timeout

    collective_timeout()  # a bad HYBRIDPAR_COLLECTIVE_TIMEOUT_S is one line here, not in every rank
    if config:
        options = _with_config(config, options)
    launched = launch.under_launcher()
    rank0 = not launched or os.environ.get("RANK") == "0"
    # Start-up phases: on a terminal each is printed once the checks before it passed; in a log or a
    # script's pipe they are printed together when the first step ran, so that a refusal found later
    # (in the ranks' own checks) is still the one line on stderr that scripts read.
    startup.listen(None)
    # the model's own prints while it is traced and dry-run go to stderr: stdout is the report (--json)
    with contextlib.redirect_stdout(sys.stderr):
        setup = run_config(TrainConfig.from_options(**options),
                           launcher_world=int(os.environ["WORLD_SIZE"]) if launched else None,
                           local_ranks=_local_world() if launched else None,
                           place=None if launched else with_placement)  # ranks must agree: no search there
    if rank0:
        if _live_phases():
            for name, seconds in startup.phases().items():
                _print_phase(name, seconds)
        for note in setup.notes:
            err_console.print(f"hybridpar: {note}", markup=False, highlight=False, soft_wrap=True)
    if setup.nothing_to_do:
        if rank0:
            _nothing_to_do(setup, json_)
        return
    if rank0:
        claim_checkpoint_dir(setup)
    result = _run(setup, json_, setup.config.metrics.log_every)
    if not rank0:  # another rank of a torchrun world: rank 0 reports
        if result.error:
            raise click.exceptions.Exit(result.exit_code or 1)
        return
    if result.error:
        err_console.print(f"hybridpar: error: {result.error}", markup=False, highlight=False, soft_wrap=True)
        raise click.exceptions.Exit(result.exit_code or 1)
    _report(result, setup, json_)
    _where_traces_went(setup.config)


def register(app: click.Group) -> None:
    app.add_command(train_cmd)


def _where_traces_went(cfg) -> None:
    """One stderr line each for the TensorBoard log and the profiler trace this run wrote."""
    from hybridpar.train.trainer import profile_trace_path

    lines = [f"TensorBoard events in {cfg.metrics.tensorboard}"] if cfg.metrics.tensorboard else []
    trace = profile_trace_path(cfg)
    if trace and Path(trace).exists():
        a, b = cfg.metrics.profile_steps
        lines.append(f"profiler trace of steps {a}..{b - 1} (chrome trace) in {trace}")
    for line in lines:
        err_console.print(f"hybridpar: {line}", markup=False, highlight=False, soft_wrap=True)


def _local_world() -> int:
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _nothing_to_do(setup, json_: bool) -> None:
    cfg = setup.config
    line = (f"nothing to do: the checkpoint is at step {setup.start_step} and this run has "
            f"{setup.total_steps} steps")
    if json_:
        print_json(_finite({"model": cfg.model, "strategy": _strategy(cfg), "world_size": setup.world_size,
                            "batch": cfg.batch, "steps": [], "start_step": setup.start_step, "final_loss": None,
                            "saved": None, "note": line}))
    else:
        console.print(line)


def _strategy(cfg) -> str:
    return cfg.plan.strategy or cfg.plan.default_layout.to_strategy()


def _finite(obj):
    """JSON has no NaN or Infinity: non-finite floats become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _run(setup, json_: bool, log_every: int):
    """This rank's TrainResult (rank 0's when spawning), with a progress bar on a terminal or plain
    progress lines every `log_every` steps when stderr is not one (piped, batch jobs, torchrun logs)."""
    from hybridpar.train.trainer import TrainingFailed, train

    cfg = setup.config
    rank0 = os.environ.get("RANK", "0") == "0"
    bar = not json_ and err_console.is_terminal
    with _Progress(cfg, setup.total_steps, enabled=rank0, bar=bar, every=log_every) as prog:
        try:
            return train(cfg, on_step=_first_step_timed(prog.update, rank0))
        except TrainingFailed as err:
            err_console.print(f"hybridpar: error: {err}".replace("with resume from", "with --resume from"),
                              markup=False, highlight=False, soft_wrap=True)
            raise click.exceptions.Exit(1) from None


def _live_phases() -> bool:
    return err_console.is_terminal


def _print_phase(name: str, seconds: float) -> None:
    err_console.print(f"hybridpar: start-up: {name} {seconds:.1f} s", markup=False, highlight=False, soft_wrap=True)


def _first_step_timed(update, rank0: bool):
    """`update`, recording the time until it is first called (the ranks spawned, each building its
    model and running step one) as the last start-up phase."""
    t0, first = time.perf_counter(), [True]

    def timed(info: dict) -> None:
        if first[0]:
            first[0] = False
            name, seconds = "spawning ranks, building and the first step", time.perf_counter() - t0
            startup.record(name, seconds)
            if rank0:
                for phase, took in (startup.phases() if not _live_phases() else {name: seconds}).items():
                    _print_phase(phase, took)
        update(info)
    return timed


class _Progress:
    """On a terminal: a rich progress bar on stderr (steps, loss, samples/s). Otherwise: one plain line
    every `every` steps and at the last step, so piped and batch-job logs show the run as it goes."""

    def __init__(self, cfg, total: int, *, enabled: bool, bar: bool, every: int):
        self.cfg, self.total, self.enabled, self.use_bar, self.every = cfg, total, enabled, bar, every
        self.bar = None

    def __enter__(self):
        if self.enabled and self.use_bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                                *([TextColumn("B_noise {task.fields[gns]}")] if self.cfg.gns else []),
                                TimeElapsedColumn(), console=err_console, transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.total or None, loss="-", rate="-", gns="-")
        return self

    def update(self, info: dict) -> None:
        if self.bar is not None:
            gns = info.get("gns_b_noise")
            self.bar.update(self.task, advance=1, loss=f"{info['loss']:.4f}", rate=f"{info['samples_per_s']:.1f}",
                            gns="-" if gns is None else f"{gns:.3g}")
        elif self.enabled and self.every and ((info["step"] + 1) % self.every == 0 or info["step"] + 1 == self.total):
            from hybridpar.train.metrics import progress_line

            print(progress_line(info, self.total), file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False


_ALIASES = {"nproc": "gpus", "devices": "gpus"}  # old spellings of a flag, still read in a config file


def _with_config(path: str, options: dict) -> dict:
    """Options from a TOML file where the command line gave none: keys as the flags at the top level
    or in a [train] table, and the sections [parallel] [data] [optim] [checkpoint] [metrics] with the
    fields of the run's config objects (hybridpar.train.config.TrainConfig)."""
    import tomllib

    from hybridpar.jsonfile import read_input

    if not os.path.lexists(path):
        raise UserError(f"--config {path}: file not found")
    try:
        doc = tomllib.loads(read_input(path, "--config").decode("utf-8"))  # bounded, never a FIFO
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"--config {path}: not a TOML file ({err})") from None
    out = dict(options)
    for key, value in _flat_keys(path, doc):
        _set_from_file(path, out, key, value)
    return out


def _flat_keys(path: str, doc: dict) -> list[tuple[str, object]]:
    """(flat option name, value) of every key in the file; a section's keys are named as the flags."""
    from hybridpar.train.config import SECTIONS, flat_name

    root = doc["train"] if isinstance(doc.get("train"), dict) else doc
    items = list(root.items())
    if root is not doc:  # [train] with the sections beside it
        items += [(k, v) for k, v in doc.items() if k in SECTIONS and isinstance(v, dict)]
    pairs: list[tuple[str, object]] = []
    for key, value in items:
        if str(key) not in SECTIONS or not isinstance(value, dict):
            pairs.append((str(key).replace("-", "_"), value))
            continue
        for k, v in value.items():
            name = flat_name(str(key), str(k))
            if name is None:
                raise UserError(f"--config {path}: unknown option {k!r} in [{key}]")
            pairs.append(("no_shuffle", not v) if name == "shuffle" else (name, v))
    return pairs


def _set_from_file(path: str, out: dict, name: str, value) -> None:
    """out[name] = value cast as its flag casts it, unless the command line gave that flag."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    key = name
    name = _ALIASES.get(name, name)
    if name in ("config", "json", "json_"):
        raise UserError(f"--config {path}: {key!r} cannot be set in a config file")
    param = params.get(name)
    if param is None or name not in out:
        raise UserError(f"--config {path}: unknown option {key!r}")
    if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
        return  # the command line wins
    if name == "resume" and isinstance(value, bool):
        value = "yes" if value else None
    _check_toml_value(path, key, param, value)
    try:
        out[name] = param.type_cast_value(ctx, value)
    except click.BadParameter as err:
        raise UserError(f"--config {path}: {key}: {err.message}") from None
    except (TypeError, ValueError) as err:
        raise UserError(f"--config {path}: {key}: {err}") from None


def _check_toml_value(path: str, key: str, param, value) -> None:
    """TOML values a flag cannot take: arrays, tables, dates (click cast them or raised a traceback), and
    true/false for a number (Python's bool is an int: `steps = true` ran one step)."""
    import datetime

    if isinstance(value, (list, dict, datetime.date, datetime.time)) and not getattr(param, "multiple", False):
        kind = {list: "array", dict: "table"}.get(type(value), "date/time")
        raise UserError(f"--config {path}: {key}: expected one {param.type.name} value, got a TOML {kind}")
    if isinstance(value, bool) and not (getattr(param, "is_flag", False)
                                        or isinstance(param.type, click.types.BoolParamType)):
        raise UserError(f"--config {path}: {key}: expected {param.type.name}, got the boolean "
                        f"{str(value).lower()}")


def _report(result, setup, json_: bool) -> None:
    from hybridpar.cost.memory import memory_report

    cfg = setup.config
    steps = [s.to_dict() for s in result.steps]
    memory = memory_report(result.peak_memory_bytes_per_rank, setup.memory_per_rank)
    if json_:
        print_json(_finite({"model": cfg.model, "strategy": _strategy(cfg), "world_size": result.world_size,
                            "batch": cfg.batch, "steps": steps, "start_step": result.start_step,
                            "final_loss": result.final_loss, "param_bytes_per_rank": result.param_bytes_per_rank,
                            "param_bytes_by_type_per_rank": result.param_bytes_by_type_per_rank,
                            "saved": result.saved, "memory": memory, **_gns_summary(result, cfg),
                            "startup": startup.phases(), "notes": list(setup.notes)}))
        return
    last = steps[-1]
    rows = [[k, human_bytes(v)] for k, v in last["comm_bytes"].items()]
    console.print(f"trained {cfg.model} for {len(steps)} steps on {result.world_size} ranks "
                  f"({_strategy(cfg)}): final loss {result.final_loss:.4f}, "
                  f"{sum(s['samples_per_s'] for s in steps[1:]) / max(len(steps) - 1, 1):.1f} samples/s")
    if rows:
        console.print(table("communication per step (rank 0)", ["kind", "bytes"], rows,
                            justify_right=lambda c: c == "bytes"))
    console.print("parameter memory per rank: " + ", ".join(human_bytes(b) for b in result.param_bytes_per_rank))
    console.print(f"peak memory per rank: {', '.join(human_bytes(b) for b in result.peak_memory_bytes_per_rank)} "
                  f"(predicted {human_bytes(setup.memory_per_rank)})")
    if cfg.gns:
        g = _gns_summary(result, cfg)
        values = ", ".join("-" if v is None else f"{v:.3g}" for v in g["gns_b_noise_per_epoch"])
        console.print(f"gradient noise scale B_noise (samples) per epoch: {g['gns_note'] or values}")
    if result.saved:
        console.print(f"saved weights to {result.saved}")


def _gns_summary(result, cfg) -> dict:
    """Per-epoch smoothed B_noise (None where not yet defined) and why it is missing, if it is."""
    if not cfg.gns:
        return {}
    return {"gns_b_noise_per_epoch": list(result.gns_per_epoch), "gns_note": result.gns_note}
