"""The graph checks of the conformance suite, shared by tests/conformance and
benchmarks/bench_conformance.py. Each check gives a `Result`: exact, refused (exit 2 with its
one-line reason) or failed (what differed, or the unexpected error)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import hf_families
import torch
from reference import step_flops

FACTORY_FILE = Path(hf_families.__file__).resolve()


@dataclass(frozen=True)
class Result:
    status: str  # "exact" | "ran" (exit 0, nothing compared: plan, place) | "refused" | "failed"
    detail: str = ""
    precision: str = "fp32"  # train: "fp64" when judged by its --precision fp64 run (train_checks.py)

    @property
    def ok(self) -> bool:
        return self.status in ("exact", "ran")


def cli(argv: list[str]) -> tuple[int, str, str]:
    """Runs `hybridpar ARGV` in this process: (exit code, stdout, stderr)."""
    from hybridpar.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # click's own usage errors
            rc = e.code if isinstance(e.code, int) else 1
        except Exception as e:  # noqa: BLE001 -- a crash is a failed check, reported as such
            return 1, out.getvalue(), f"{type(e).__name__}: {e}"
    return rc, out.getvalue(), err.getvalue()


def _cli_result(rc: int, err: str) -> Result | None:
    if rc == 0:
        return None
    line = " ".join(err.strip().splitlines()[-1:]) if err.strip() else f"exit {rc}"
    if rc == 2 and err.count("\n") <= 1:
        return Result("refused", line)
    return Result("failed", f"exit {rc}: {line}"[:300])


def model_spec(family: str) -> str:
    return f"{FACTORY_FILE}:{family.replace('-', '_')}"


def check_inspect(fam: hf_families.Family, batch: int | None = None) -> Result:
    argv = ["inspect", "--model", model_spec(fam.name), "--json"]
    if batch is not None:
        argv += ["--batch", str(batch)]
    rc, out, err = cli(argv)
    bad = _cli_result(rc, err)
    if bad:
        return bad
    got = json.loads(out)["totals"]["params"]
    want = sum(p.numel() for p in fam.build().parameters() if p.requires_grad)
    return Result("exact", f"{got:,} params") if got == want else Result("failed", f"params {got:,} != {want:,}")


def check_graph(fam: hf_families.Family) -> dict[str, Result]:
    """params == sum(p.numel()) and matmul-class FLOPs == FlopCounterMode (eager attention) at batch 2."""
    from hybridpar.errors import UserError
    from hybridpar.graph import trace
    from hybridpar.graph.flops import matmul_flops

    model, x = fam.build(), fam.inputs()
    try:
        g = trace(model, x, fam.name, train=True)
    except UserError as e:
        r = Result("refused", str(e)[:300])
        return {"params": r, "fwd_flops": r, "bwd_flops": r}
    want = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = (Result("exact", f"{want:,}") if g.params == want
              else Result("failed", f"{g.params:,} != {want:,}"))
    fwd, bwd = step_flops(fam.build(attn="eager"), x)
    mm = matmul_flops(g)
    got_bwd = mm.bwd_data + mm.bwd_weight
    return {
        "params": params,
        "fwd_flops": Result("exact", f"{fwd:,}") if mm.fwd == fwd else Result("failed", f"{mm.fwd:,} != {fwd:,}"),
        "bwd_flops": Result("exact", f"{bwd:,}") if got_bwd == bwd else Result("failed", f"{got_bwd:,} != {bwd:,}"),
    }


def check_plan(fam: hf_families.Family, gpus: int, batch: int) -> Result:
    rc, _, err = cli(["plan", "--model", model_spec(fam.name), "--cluster", "localhost", "--gpus", str(gpus),
                      "--batch", str(batch), "--json"])
    return _cli_result(rc, err) or Result("ran", "planned")  # exit 0 only: nothing is compared


def check_place(fam: hf_families.Family, gpus: int = 2, batch: int = 8, time_limit: float = 10.0) -> Result:
    rc, _, err = cli(["place", "--model", model_spec(fam.name), "--cluster", "localhost", "--gpus", str(gpus),
                      "--batch", str(batch), "--time-limit", str(time_limit), "--json"])
    return _cli_result(rc, err) or Result("ran", "placed")


def setup_environment() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(1)
