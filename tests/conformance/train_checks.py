"""The train checks of the conformance suite, shared by tests/conformance and
benchmarks/bench_conformance.py: `hybridpar train` per family and layout against one process.

Each run goes the way `hybridpar train --model hf_families.py:<family>_train --strategy S --data
data.pt --batch 4 --steps 2 --lr 0.01 --no-shuffle --init-from init.pt --save out.pt --json` goes:
`hybridpar.train.config.run_config` validates it in this process (for channel/filter layouts
that is the meta-tensor dry run on a fake world, the "refused before any rank starts" of the CLI:
its UserError is the one line `train` prints with exit 2), then `hybridpar.train.trainer.run_rank`
trains on every rank, the per-rank body of `train`. The only difference from the CLI is that many
runs share one spawned world (`launch.spawn` of `run_worlds`), so the ranks import `transformers`
once rather than once per run (one CLI run costs ~50 s here, mostly imports).

The reference is plain PyTorch in this process: the same model, init and batches, SGD (lr 0.01, no
momentum), cross-entropy, 2 steps. A run is exact when every floating entry of the saved state dict
(weights, running statistics) is within TOL of the reference's (max |w - w_ref| / max(1, max |w_ref|)
per tensor: absolute for entries up to 1, relative beyond).

Ill-conditioned families: where one process's own float32 and float64 runs differ by more than TOL
(the "float32 spread": MobileNetV1/V2, LeViT, TextNet, HGNetV2 at 32x32, batch norm over 1x1 maps
with variances far below eps), a float32 run cannot be judged at TOL. There each layout is also run
with `train --precision fp64` and judged against the float64 one-process reference at TOL: "exact
(fp64)" when within it, failed otherwise (the float32 run's error and the spread are kept in the
detail; a float32 run within TOL anyway is plain exact, see `judge_fp64`). The fp64 run is the fp32 run's TrainConfig
with precision fp64 (run_config's checks, including the dry run, do not depend on it), so a
layout's dry run is paid once.

Dropout: the ranks' random streams cannot reproduce one process's dropout masks, so the `_train`
factories (hf_families.py) build each family with every dropout/drop-path probability set to 0.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import hf_families
import torch
import torch.nn.functional as F
from checks import FACTORY_FILE, Result, cli

BATCH, STEPS, LR = 4, 2, 0.01
TOL = 1e-4
# (strategy, ranks): sample=2 must be exact on every family; the others exact or refused up front
# (height=2: spatial, each sample's rows split over 2 ranks with halo exchange; issue 30)
LAYOUTS = (("sample=2", 2), ("channel=2", 2), ("filter=2", 2), ("channel=2,filter=2", 4), ("height=2", 2))


def train_spec(family: str) -> str:
    return f"{FACTORY_FILE}:{family.replace('-', '_')}_train"


@dataclass(frozen=True)
class Inputs:
    family: str
    data: str
    init: str
    shape: tuple[int, ...]


def write_inputs(fam: hf_families.Family, workdir: Path) -> Inputs:
    """The run's data (STEPS batches, fixed seed) and initial weights (the `_train` factory's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    data, init = workdir / f"{fam.name}-data.pt", workdir / f"{fam.name}-init.pt"
    g = torch.Generator().manual_seed(7)
    shape = (fam.channels, fam.image_size, fam.image_size)
    torch.save({"x": torch.randn(STEPS * BATCH, *shape, generator=g),
                "y": torch.randint(0, hf_families.NUM_LABELS, (STEPS * BATCH,), generator=g)}, data)
    torch.save(fam.build(dropout=False).state_dict(), init)
    return Inputs(fam.name, str(data), str(init), shape)


def reference(fam: hf_families.Family, inp: Inputs, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """STEPS SGD steps of the model in one process, plain PyTorch (in `dtype`)."""
    model = fam.build(dropout=False)
    model.load_state_dict(torch.load(inp.init, weights_only=True))
    model.to(dtype)
    data = torch.load(inp.data, weights_only=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        F.cross_entropy(model(data["x"][rows].to(dtype)), data["y"][rows]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def prepare(inp: Inputs, strategy: str, ranks: int, save: str):
    """`train`'s checks before any rank starts: a TrainConfig, or the refusal Result (its one line)."""
    from hybridpar.errors import UserError
    from hybridpar.train.config import run_config

    try:
        setup = run_config(model=train_spec(inp.family), input_shape=inp.shape, strategy=strategy, nproc=ranks,
                           data=inp.data, batch=BATCH, steps=STEPS, lr=LR, shuffle=False, init_from=inp.init,
                           save=save)
    except UserError as err:
        text = str(err)
        return Result("refused", text) if "\n" not in text else Result("failed", f"refusal of many lines: {text}")
    except Exception as err:  # noqa: BLE001 -- a crash before start is a failed check
        return Result("failed", f"before start: {type(err).__name__}: {' '.join(str(err).split())}"[:300])
    return setup.config


def run_worlds(jobs: list[tuple[str, object]], progress: str | None = None) -> list[dict]:
    """Rank function: each job's `run_rank(cfg)` in this world, one after another. Each rank
    reports its own outcome; rank 0 appends each job's record to `progress` (JSON lines) as it
    finishes, so that a world that dies still tells which jobs ran."""
    import torch.distributed as dist

    from hybridpar.train.trainer import run_rank

    records = []
    for key, cfg in jobs:
        try:
            result = run_rank(cfg)
            rec = {"key": key, "error": result.error,
                   "allreduce": result.steps[-1].comm_bytes.get("allreduce", 0) if result.steps else None,
                   "comm_bytes": result.steps[-1].comm_bytes if result.steps else {},
                   "losses": [s.loss for s in result.steps]}
        except Exception as err:  # noqa: BLE001 -- reported as a failure after spawn
            tb = traceback.format_exc().strip().splitlines()
            rec = {"key": key, "error": f"after start: {type(err).__name__}: {' '.join(str(err).split())[:240]}",
                   "where": tb[-3:-1]}
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, rec)
        merged = dict(got[0])
        errors = [r["error"] for r in got if r.get("error")]
        merged["error"] = errors[0] if errors else None
        records.append(merged)
        if progress and dist.get_rank() == 0:
            with open(progress, "a") as f:
                f.write(json.dumps(merged) + "\n")
    return records


def run_jobs(jobs: list[tuple[str, object]], ranks: int, workdir: Path) -> dict[str, dict]:
    """All jobs on one spawned world of `ranks`; if the world dies, the job it died in is failed and
    the rest run on a fresh world."""
    from hybridpar.train.launch import spawn

    done: dict[str, dict] = {}
    todo = list(jobs)
    while todo:
        progress = workdir / f"progress-{ranks}-{os.getpid()}-{len(done)}.jsonl"
        progress.unlink(missing_ok=True)
        try:
            for rec in spawn(run_worlds, ranks, todo, str(progress)):
                done[rec["key"]] = rec
            todo = []
        except Exception as err:  # noqa: BLE001 -- a rank died: keep what finished, fail the next job
            finished = [json.loads(line) for line in progress.read_text().splitlines()] if progress.exists() else []
            for rec in finished:
                done[rec["key"]] = rec
            todo = [j for j in todo if j[0] not in done]
            if todo:
                done[todo[0][0]] = {"key": todo[0][0],
                                    "error": f"after start: rank died: {' '.join(str(err).split())[-240:]}"}
                todo = todo[1:]
    return done


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(1, max |b|), per tensor: the absolute difference for entries of magnitude up
    to 1 (most weights; and tensors whose values stay near 0, such as a key bias whose gradient is
    zero, where a relative error means nothing), relative for larger ones (running variances)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


def max_error(saved: str, ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest per-tensor relative error of the saved state dict against `ref` (floating
    entries; others must be equal)."""
    got = torch.load(saved, weights_only=True)
    if got.keys() != ref.keys():
        return float("inf"), f"keys differ: {sorted(set(got) ^ set(ref))[:3]}"
    worst = (0.0, "")
    for k, v in ref.items():
        if v.is_floating_point() and v.numel():
            worst = max(worst, (_rel(got[k], v), k))
        elif not torch.equal(got[k], v):
            return float("inf"), k
    return worst


def rounding_spread(ref32: dict[str, torch.Tensor], ref64: dict[str, torch.Tensor]) -> float:
    """How far one process's own float32 run is from its float64 run: above TOL, the tiny model is
    ill-conditioned at this size (e.g. MobileNetV2 at 32x32: depthwise convs on 1x1 maps give
    batch-norm variances of 1e-10, far below eps, and ReLU6 masks flip with the last bit)."""
    return max((_rel(ref32[k], v) for k, v in ref64.items() if v.is_floating_point() and v.numel()), default=0.0)


def judge(rec: dict, saved: str, ref: dict[str, torch.Tensor]) -> Result:
    """exact: within TOL of the reference (every floating entry); failed otherwise or on an error."""
    if rec.get("error"):
        return Result("failed", rec["error"])
    err, where = max_error(saved, ref)
    if err <= TOL:
        return Result("exact", f"max error {err:.1e}")
    return Result("failed", f"max error {err:.2e} at {where}")


def judge_fp64(rec32: dict, saved32: str, ref32: dict[str, torch.Tensor], rec64: dict, saved64: str,
               ref64: dict[str, torch.Tensor], spread: float) -> Result:
    """A family whose float32 spread exceeds TOL, run in both precisions: exact when the float32 run
    is within TOL of the float32 reference anyway (the fp64 run's figure in the detail: a model that
    is chaotic in float64 too, such as the tiny CvT, where a 1e-14 relative change of the input moves
    the loss by 6%, cannot be judged there); else "exact (fp64)" when the fp64 run is within TOL of
    the float64 reference; failed otherwise or when either run errs."""
    if rec32.get("error"):
        return Result("failed", f"fp32 run: {rec32['error']}")
    got64 = judge(rec64, saved64, ref64)
    err32, where32 = max_error(saved32, ref32)
    if err32 <= TOL and not rec64.get("error"):
        return Result("exact", f"max error {err32:.1e}; one process float32 vs float64: {spread:.2e}; fp64 run "
                               f"against float64: {got64.detail}")
    why = f"one process float32 vs float64: {spread:.2e}; fp32 run's max error {err32:.2e} at {where32}"
    if got64.status != "exact":
        return Result("failed", f"fp64 run: {got64.detail}; {why}")
    return Result("exact", f"fp64 run's {got64.detail}; {why}", precision="fp64")


def predicted_gradient_bytes(family: str, strategy: str = "sample=2", ranks: int = 2) -> int | Result:
    """`hybridpar plan --strategy sample=2 --json`'s predicted allreduce bytes per step."""
    rc, out, err = cli(["plan", "--model", train_spec(family), "--cluster", "localhost", "--strategy", strategy,
                        "--gpus", str(ranks), "--batch", str(BATCH), "--json"])
    if rc != 0:
        return Result("failed", f"plan exit {rc}: {err.strip()[-200:]}")
    return int(json.loads(out)["predicted"]["comm_bytes"].get("allreduce", 0))


def judge_bytes(predicted: int | Result, rec: dict | None) -> Result:
    if isinstance(predicted, Result):
        return predicted
    if rec is None or rec.get("error") or rec.get("allreduce") is None:
        return Result("failed", "no train run to compare with")
    sent = rec["allreduce"]
    rel = abs(predicted - sent) / max(sent, 1)
    text = f"predicted {predicted:,} B, sent {sent:,} B"
    return Result("exact", text) if rel <= 0.01 else Result("failed", f"{text} ({100 * rel:+.1f}%)")


def check_train(families: list[hf_families.Family], workdir: Path, layouts=LAYOUTS,
                with_bytes: bool = True, fp64: bool = True) -> dict[str, dict[str, Result]]:
    """Every family under every layout: {family: {strategy: Result, "grad_bytes": Result}}.
    `layouts`: (strategy, ranks) pairs for every family, or a dict family name -> pairs.
    One spawned world per rank count serves every family. fp64=False: no fp64 runs (a float32 run
    is then judged at TOL whatever the spread: make test's subset, whose runs are within it)."""

    out: dict[str, dict[str, Result]] = {f.name: {} for f in families}
    refs, refs64, spreads, jobs_by_ranks, saves = {}, {}, {}, {}, {}
    for fam in families:
        inp = write_inputs(fam, workdir)
        refs[fam.name], refs64[fam.name] = reference(fam, inp), reference(fam, inp, torch.float64)
        spreads[fam.name] = rounding_spread(refs[fam.name], refs64[fam.name])
        for strategy, ranks in (layouts[fam.name] if isinstance(layouts, dict) else layouts):
            key = f"{fam.name}|{strategy}"
            saves[key] = str(workdir / f"{fam.name}-{strategy.replace(',', '_').replace('=', '')}.pt")
            cfg = prepare(inp, strategy, ranks, saves[key])
            if isinstance(cfg, Result):
                out[fam.name][strategy] = cfg
                continue
            jobs_by_ranks.setdefault(ranks, []).append((key, cfg))
            if fp64 and spreads[fam.name] > TOL:  # float32 cannot be judged at TOL here: also in float64
                saves[key + "|fp64"] = saves[key][:-3] + "-fp64.pt"
                jobs_by_ranks[ranks].append((key + "|fp64", cfg.with_options(precision="fp64",
                                                                          save=saves[key + "|fp64"])))
    records: dict[str, dict] = {}
    for ranks, jobs in sorted(jobs_by_ranks.items()):
        records.update(run_jobs(jobs, ranks, workdir))
    for key, rec in records.items():
        if key.endswith("|fp64"):
            continue
        name, strategy = key.split("|")
        if key + "|fp64" in saves:
            rec64 = records.get(key + "|fp64", {"error": "the fp64 run did not run"})
            out[name][strategy] = judge_fp64(rec, saves[key], refs[name], rec64, saves[key + "|fp64"],
                                             refs64[name], spreads[name])
        else:
            out[name][strategy] = judge(rec, saves[key], refs[name])
    if with_bytes:
        for fam in families:
            out[fam.name]["grad_bytes"] = judge_bytes(predicted_gradient_bytes(fam.name),
                                                      records.get(f"{fam.name}|sample=2"))
    return out
