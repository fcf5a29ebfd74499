"""`make bench`: run every benchmarks/bench_*.py and write one summary.

Contract with each benchmark: it runs as `python benchmarks/bench_X.py` with the environment variable
HYBRIDPAR_BENCH_OUT set to a JSON path, prints its table, and writes its summary (a JSON object) there.
Each runs in its own subprocess with a timeout, so one hung or failing benchmark never stops the others.

Writes bench-results/summary.json, bench-results/summary.md (a table of each benchmark's ratios), the
per-benchmark JSON and logs, and a report of a small plan (with its headless-Chromium screenshot when
Chromium is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADLINE_WORDS = ("ratio", "speedup", "error", "overhead", "vs", "margin", "reduction")


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | timeout | no-json | skipped
    wall_s: float = 0.0
    rc: int | None = None
    result: dict = field(default_factory=dict)
    note: str = ""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: one thread per process keeps ratios sane
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


# The full validation (19 real training runs, ~15 min) is its own acceptance run; `make bench` takes
# the quick form so the whole suite stays under 20 minutes. `--full` runs it whole.
QUICK_ARGS = {"validation": ["--quick"],
              # placer: Inception-V3 on 2 and 4 GPUs beside the previous placer (~4 min); --full adds GNMT,
              # BigLSTM and the coarsening study (~15 min on the loaded machine)
              "placer": ["--quick"]}


def run_one(script: Path, out_dir: Path, timeout_s: float, extra: list[str] | None = None) -> Outcome:
    name = script.stem.removeprefix("bench_")
    json_path, log_path = out_dir / f"{name}.json", out_dir / f"{name}.log"
    json_path.unlink(missing_ok=True)
    env = {**_env(), "HYBRIDPAR_BENCH_OUT": str(json_path)}
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        # New session: on timeout the whole process group (its workers too) is killed.
        proc = subprocess.Popen([sys.executable, str(script), *(extra or [])], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return Outcome(name, "timeout", time.perf_counter() - t0, None, note=f"killed after {timeout_s:.0f} s")
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return Outcome(name, "failed", wall, rc, note=tail[0][:200])
    try:
        result = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return Outcome(name, "no-json", wall, rc, note=f"no JSON summary at HYBRIDPAR_BENCH_OUT ({err})")
    return Outcome(name, "ok", wall, rc, result if isinstance(result, dict) else {"result": result})


def headline(result: dict, limit: int = 6) -> list[tuple[str, float]]:
    """The ratios worth a table cell: numeric leaves whose key names a ratio/speedup/error."""
    flat: list[tuple[str, float]] = []

    def walk(obj, prefix: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            flat.append((prefix, float(obj)))

    walk(result, "")
    picked = [kv for kv in flat if any(w in kv[0].lower() for w in HEADLINE_WORDS)]
    return (picked or flat)[:limit]


def _run_cli(args: list[str], out_dir: Path, log_name: str, timeout_s: float,
             stdout_to: Path | None = None) -> bool:
    with (out_dir / log_name).open("a") as log, (stdout_to.open("w") if stdout_to else log) as out:
        try:
            return subprocess.run([sys.executable, "-m", "hybridpar.cli.main", *args], cwd=ROOT, env=_env(),
                                  stdout=out, stderr=log, timeout=timeout_s, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def report_demo(out_dir: Path, timeout_s: float) -> Outcome:
    """Plan a small model, train it briefly, report predicted vs measured, screenshot in Chromium."""
    t0 = time.perf_counter()
    plan, run, proj, page, shot = (out_dir / n for n in ("demo-plan.json", "demo-run.json", "demo-projection.json",
                                                         "report.html", "report.png"))
    log = "report.log"
    (out_dir / log).unlink(missing_ok=True)
    if not _run_cli(["plan", "--model", "small_resnet", "--cluster", "localhost", "--gpus", "4", "--batch", "32",
                     "--out", str(plan), "--json"], out_dir, log, timeout_s):
        return Outcome("report", "failed", time.perf_counter() - t0, note="hybridpar plan failed (see report.log)")
    measured = _run_cli(["train", "--plan", str(plan), "--data", "synthetic", "--steps", "6", "--json"],
                        out_dir, log, timeout_s, stdout_to=run)
    # The zoo's small models have no convergence curve: the scaling section shows ResNet-50's, labelled.
    projected = _run_cli(["project", "--model", "resnet50", "--cluster", "dgx1-v100", "--gpus", "1,8,64,512",
                          "--json"], out_dir, log, timeout_s, stdout_to=proj)
    args = ["report", "--plan", str(plan), "--out", str(page), "--json"]
    args += ["--measured", str(run)] if measured else []
    args += ["--projection", str(proj)] if projected else []
    if not _run_cli(args, out_dir, log, timeout_s):
        return Outcome("report", "failed", time.perf_counter() - t0, note="hybridpar report failed")
    result: dict = {"report_bytes": page.stat().st_size, "measured": measured, "projection": projected}
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    note = "" if measured else "train failed: report without measured run. "
    if chromium:
        try:
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                            "--no-first-run", "--disable-background-networking", "--disable-component-update",
                            "--disable-sync", f"--user-data-dir={out_dir / '.chromium'}", "--window-size=1200,3000",
                            f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
            result["screenshot_bytes"] = shot.stat().st_size
        except (subprocess.SubprocessError, OSError) as err:
            note += f"screenshot failed: {type(err).__name__}"
        shutil.rmtree(out_dir / ".chromium", ignore_errors=True)
    else:
        note += "chromium not installed: no screenshot"
    return Outcome("report", "ok", time.perf_counter() - t0, 0, result, note.strip())


def write_summary(outcomes: list[Outcome], out_dir: Path, total_s: float) -> None:
    import torch

    meta = {"date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "total_s": round(total_s, 1),
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}
    (out_dir / "summary.json").write_text(json.dumps({**meta, "benchmarks": [asdict(o) for o in outcomes]},
                                                     indent=2, default=str))
    lines = [(f"Benchmarks of {meta['date_utc']} UTC on {meta['cpus']} CPU cores (torch {meta['torch']}), "
             f"{total_s / 60:.1f} min in all. Ratios are measured side by side in the same run."), "",
             "| benchmark | status | time | headline figures |", "|---|---|---:|---|"]
    for o in outcomes:
        figs = "; ".join(f"{k} = {v:.3g}" for k, v in headline(o.result)) or o.note or "-"
        if o.note and o.status == "ok" and figs != o.note:
            figs += f" ({o.note})"
        lines.append(f"| {o.name} | {o.status} | {o.wall_s:.0f} s | {figs.replace('|', '/')} |")
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(ROOT / "bench-results"))
    ap.add_argument("--bench-dir", default=str(ROOT / "benchmarks"), help="where the bench_*.py live")
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds per benchmark")
    ap.add_argument("--budget", type=float, default=18 * 60.0, help="seconds for the whole run")
    ap.add_argument("--only", nargs="*", default=None, help="benchmark names (bench_<name>.py)")
    ap.add_argument("--no-report", action="store_true", help="skip the report/screenshot demo")
    ap.add_argument("--full", action="store_true", help="run the slow benchmarks whole (validation: ~15 min)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scripts = sorted(Path(args.bench_dir).glob("bench_*.py"))
    if args.only is not None:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.only]
    t0, outcomes = time.perf_counter(), []
    for script in scripts:
        left = args.budget - (time.perf_counter() - t0)
        name = script.stem.removeprefix("bench_")
        if left < 10:
            outcomes.append(Outcome(name, "skipped", note="time budget spent"))
            continue
        print(f"[bench] {name} ...", flush=True)
        extra = [] if args.full else QUICK_ARGS.get(name, [])
        outcomes.append(run_one(script, out_dir, min(args.timeout, left), extra))
        o = outcomes[-1]
        print(f"[bench] {name}: {o.status} in {o.wall_s:.0f} s {o.note}", flush=True)
    if not args.no_report:
        left = args.budget - (time.perf_counter() - t0)
        outcomes.append(report_demo(out_dir, max(30.0, min(180.0, left))))
        print(f"[bench] report: {outcomes[-1].status} {outcomes[-1].note}", flush=True)
    total = time.perf_counter() - t0
    write_summary(outcomes, out_dir, total)
    print((out_dir / "summary.md").read_text())
    return 0 if all(o.status in ("ok", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
