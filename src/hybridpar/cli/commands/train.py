"""`hybridpar train`: run training with a layout on local gloo ranks or under torchrun."""

from __future__ import annotations

import click

from hybridpar.cli.output import console, err_console, human_bytes, print_json, table
from hybridpar.errors import UserError


def register(app: click.Group) -> None:
    @app.command("train")
    @click.option("--model", "model", default=None, help="zoo name or path/to/file.py:factory")
    @click.option("--input-shape", default=None, help="per-sample input shape C,H,W (file models)")
    @click.option("--strategy", default=None, help="uniform layout, e.g. sample=2,channel=2")
    @click.option("--plan", "plan_path", default=None, type=click.Path(), help="plan.json from `hybridpar plan`")
    @click.option("--nproc", type=int, default=None, help="local ranks to spawn (ignored under torchrun)")
    @click.option("--data", default="synthetic", show_default=True, help="synthetic | digits | path.pt")
    @click.option("--batch", type=int, default=32, show_default=True, help="global batch per step")
    @click.option("--steps", type=int, default=None, help="SGD steps (default 10)")
    @click.option("--epochs", type=int, default=None, help="passes over the data (instead of --steps)")
    @click.option("--lr", type=float, default=0.1, show_default=True)
    @click.option("--momentum", type=float, default=0.0, show_default=True)
    @click.option("--weight-decay", type=float, default=0.0, show_default=True)
    @click.option("--seed", type=int, default=0, show_default=True)
    @click.option("--no-shuffle", is_flag=True, help="step i uses samples i*B .. (i+1)*B-1 in file order")
    @click.option("--init-from", type=click.Path(), default=None, help="state_dict of the undistributed model")
    @click.option("--save", type=click.Path(), default=None, help="write final weights (undistributed layout)")
    @click.option("--bn-stats", type=click.Choice(["global", "local"]), default="global", show_default=True,
                  help="batch-norm statistics over the global batch (= serial) or each rank's samples")
    @click.option("--synthetic-size", type=int, default=1024, show_default=True,
                  help="samples in --data synthetic")
    @click.option("--checkpoint-dir", type=click.Path(), default=None,
                  help="write sharded atomic checkpoints here (a directory every rank can reach)")
    @click.option("--checkpoint-every", type=int, default=0, show_default=True,
                  help="steps between checkpoints (0: only at the end)")
    @click.option("--resume", is_flag=True,
                  help="continue from the newest complete checkpoint in --checkpoint-dir (if there is one), "
                       "with any layout or rank count")
    @click.option("--deterministic", is_flag=True,
                  help="deterministic kernels and seeding: bitwise-identical losses and weights across runs")
    @click.option("--micro-batches", type=int, default=1, show_default=True,
                  help="model-parallel plans (mp > 1) only: split each replica's batch into K GPipe "
                       "micro-batches; batch-norm statistics are then per micro-batch")
    @click.option("--gns/--no-gns", default=False, show_default=True,
                  help="online gradient noise scale B_noise (McCandlish et al. 2018) from the per-sample-group "
                       "and allreduced gradients, per step and per epoch; needs >1 sample group; adds one "
                       "16-byte allreduce per step (comm kind 'gns')")
    @click.option("--json", "json_", is_flag=True, help="machine-readable output (per-step records)")
    def train_cmd(model, input_shape, strategy, plan_path, nproc, data, batch, steps, epochs, lr, momentum,
                  weight_decay, seed, no_shuffle, init_from, save, bn_stats, synthetic_size, checkpoint_dir,
                  checkpoint_every, resume, deterministic, micro_batches, gns, json_) -> None:
        """Train a model with a sample/channel/filter (or MP) layout on torch.distributed."""
        from hybridpar.runtime import launch

        cfg = build_config(model=model, input_shape=input_shape, strategy=strategy, plan_path=plan_path,
                           nproc=nproc, data=data, batch=batch, steps=steps, epochs=epochs, lr=lr,
                           momentum=momentum, weight_decay=weight_decay, seed=seed, shuffle=not no_shuffle,
                           init_from=init_from, save=save, bn_stats=bn_stats, synthetic_size=synthetic_size,
                           micro_batches=micro_batches, gns=gns)
        cfg = _with_hardening(cfg, checkpoint_dir, checkpoint_every, resume, deterministic)
        if launch.under_launcher():
            result = _run_torchrun(cfg, json_)
            if result is None:  # not rank 0
                return
        else:
            result = _run_local(cfg, json_)
        _report(result, cfg, json_)


def build_config(*, model, input_shape, strategy, plan_path, nproc, data, batch, steps, epochs, lr, momentum,
                 weight_decay, seed, shuffle, init_from, save, bn_stats, synthetic_size, micro_batches=1,
                 gns=False):
    """Validate every option (before any process starts) and return a TrainConfig."""
    import os

    from hybridpar.graph.models import load_model, parse_shape
    from hybridpar.plans import Plan, load_plan, parse_strategy
    from hybridpar.runtime import launch
    from hybridpar.runtime.data import data_spec, load_dataset
    from hybridpar.runtime.parallelize import as_layouts, check_parallelizable
    from hybridpar.runtime.train_loop import TrainConfig, total_steps

    if (strategy is None) == (plan_path is None):
        raise UserError("give exactly one of --strategy or --plan")
    if steps is not None and epochs is not None:
        raise UserError("give --steps or --epochs, not both")
    for name, v in (("--batch", batch), ("--steps", steps), ("--epochs", epochs), ("--nproc", nproc),
                    ("--synthetic-size", synthetic_size), ("--micro-batches", micro_batches)):
        if v is not None and v < 1:
            raise UserError(f"{name} must be >= 1, got {v}")
    if lr <= 0 or momentum < 0 or weight_decay < 0:
        raise UserError("--lr must be > 0, --momentum and --weight-decay >= 0")
    world = int(os.environ["WORLD_SIZE"]) if launch.under_launcher() else nproc
    if plan_path is not None:
        plan = load_plan(plan_path)
        model = model or plan.model
        if input_shape is None and plan.input_shape:
            input_shape = ",".join(map(str, plan.input_shape))
        world = world or plan.world_size
        if plan.world_size != world:
            raise UserError(f"plan is for {plan.world_size} ranks but {world} were given")
    else:
        if model is None:
            raise UserError("--model is required with --strategy")
        world = world or 1
        strat = parse_strategy(strategy, world)
        plan = Plan(model=model, world_size=world, batch=batch, dp=world // strat.mp, mp=strat.mp,
                    default_layout=strat.layout, strategy=strategy)
    if model is None:
        raise UserError("--model is required")
    shape = parse_shape(input_shape)
    loaded = load_model(model, batch=1, input_shape=shape)
    shape = tuple(loaded.input_shape or loaded.example_inputs[0].shape[1:])
    if plan.mp == 1:
        if micro_batches != 1:
            raise UserError(f"--micro-batches {micro_batches} needs a model-parallel plan (mp > 1)")
        check_parallelizable(loaded.module, as_layouts(plan), batch)
    else:
        from hybridpar.runtime.mp import check_mp_plan

        check_mp_plan(loaded.module, plan, batch)  # bad placement: one line here, not a rank traceback
        if micro_batches > batch // plan.dp:
            raise UserError(f"--micro-batches {micro_batches} exceeds the {batch // plan.dp} samples per replica")
    spec = data_spec(loaded)
    n = len(load_dataset(data, shape, num_classes=spec.num_classes, size=synthetic_size, seed=seed,
                         vocab=spec.vocab, label_shape=spec.label_shape))
    if n < batch:
        raise UserError(f"--data {data} has {n} samples, fewer than --batch {batch}")
    if init_from is not None:
        _check_init(loaded.module, init_from)
    cfg = TrainConfig(model=model, plan=plan, data=data, batch=batch, steps=steps if epochs is None else None,
                      epochs=epochs, lr=lr, momentum=momentum, weight_decay=weight_decay, seed=seed,
                      shuffle=shuffle, init_from=init_from, save=save, input_shape=shape, bn_stats=bn_stats,
                      synthetic_size=synthetic_size, micro_batches=micro_batches, gns=gns)
    if steps is None and epochs is None:
        cfg = TrainConfig(**{**cfg.__dict__, "steps": 10})
    if total_steps(cfg, n) < 1:
        raise UserError("nothing to train: 0 steps")
    return cfg


def _with_hardening(cfg, checkpoint_dir, every: int, resume: bool, deterministic: bool):
    """Checkpoint/resume/determinism options, validated before any process starts."""
    from dataclasses import replace

    from hybridpar.runtime.checkpoint import check_resumable

    if every < 0:
        raise UserError(f"--checkpoint-every must be >= 0, got {every}")
    if (every or resume) and not checkpoint_dir:
        raise UserError("--checkpoint-every and --resume need --checkpoint-dir")
    if checkpoint_dir:
        check_resumable(checkpoint_dir, cfg, resume)
    return replace(cfg, checkpoint_dir=checkpoint_dir, checkpoint_every=every, resume=resume,
                   deterministic=deterministic)


def _check_init(module, path: str) -> None:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--init-from {path}: file not found") from None
    except Exception as err:  # noqa: BLE001 - torch.load fails in many ways on a bad file
        raise UserError(f"--init-from {path}: not a torch.save'd state_dict ({type(err).__name__})") from None
    if not isinstance(state, dict):
        raise UserError(f"--init-from {path}: expected a state_dict")
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise UserError(f"--init-from {path} does not match the model: {first}") from None


def _run_local(cfg, json_: bool):
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from hybridpar.runtime.launch import spawn
    from hybridpar.runtime.train_loop import run_rank

    queue = mp.get_context("spawn").Queue()
    steps = []
    with _Progress(cfg, enabled=not json_) as prog:
        def poll():
            while not queue.empty():
                info = queue.get()
                steps.append(info)
                prog.update(info)
        try:
            result = spawn(run_rank, cfg.plan.world_size, cfg, queue, poll=poll)
        except ProcessException as err:  # a rank died or raised: one line, exit 1, no hang
            lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
            err_console.print(f"hybridpar: error: training failed: {lines[-1] if lines else err}"
                              + (f" (resume with --resume from {cfg.checkpoint_dir})" if cfg.checkpoint_dir else ""),
                              markup=False, highlight=False, soft_wrap=True)
            raise click.exceptions.Exit(1) from None
    return result


def _run_torchrun(cfg, json_: bool):
    import torch.distributed as dist

    from hybridpar.runtime import launch
    from hybridpar.runtime.train_loop import run_rank

    launch.init()
    rank = dist.get_rank()

    class _Q:
        def __init__(self, prog):
            self.prog = prog

        def put(self, info):
            self.prog.update(info)

    with _Progress(cfg, enabled=not json_ and rank == 0) as prog:
        result = run_rank(cfg, _Q(prog) if rank == 0 else None)
    dist.destroy_process_group()
    return result if rank == 0 else None


class _Progress:
    """Rich progress bar on stderr: steps, loss, samples/s."""

    def __init__(self, cfg, enabled: bool):
        self.enabled, self.cfg = enabled, cfg
        self.bar = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                                *([TextColumn("B_noise {task.fields[gns]}")] if self.cfg.gns else []),
                                TimeElapsedColumn(), console=err_console, transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.cfg.steps or None, loss="-", rate="-", gns="-")
        return self

    def update(self, info: dict) -> None:
        if self.bar is not None:
            gns = info.get("gns_b_noise")
            self.bar.update(self.task, advance=1, loss=f"{info['loss']:.4f}", rate=f"{info['samples_per_s']:.1f}",
                            gns="-" if gns is None else f"{gns:.3g}")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False


def _report(result, cfg, json_: bool) -> None:
    steps = [s.to_dict() for s in result.steps]
    if json_:
        print_json({"model": cfg.model, "strategy": cfg.plan.strategy or cfg.plan.default_layout.to_strategy(),
                    "world_size": result.world_size, "batch": cfg.batch, "steps": steps,
                    "final_loss": result.final_loss, "param_bytes_per_rank": result.param_bytes_per_rank,
                    "param_bytes_by_type_per_rank": result.param_bytes_by_type_per_rank,
                    "saved": result.saved, **_gns_summary(result, cfg)})
        return
    last = steps[-1]
    rows = [[k, human_bytes(v)] for k, v in last["comm_bytes"].items()]
    console.print(f"trained {cfg.model} for {len(steps)} steps on {result.world_size} ranks "
                  f"({cfg.plan.strategy or cfg.plan.default_layout.to_strategy()}): final loss {result.final_loss:.4f}, "
                  f"{sum(s['samples_per_s'] for s in steps[1:]) / max(len(steps) - 1, 1):.1f} samples/s")
    if rows:
        console.print(table("communication per step (rank 0)", ["kind", "bytes"], rows,
                            justify_right=lambda c: c == "bytes"))
    console.print("parameter memory per rank: " + ", ".join(human_bytes(b) for b in result.param_bytes_per_rank))
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
