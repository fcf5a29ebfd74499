"""Write the figures of README.md and docs/ (results.md, spatial.md, planner.md: FILES) that the code
computes, so none is typed by hand.

Each figure lives in a marked region of a Markdown file,

    <!-- figures:NAME -->
    ... generated text ...
    <!-- /figures:NAME -->

and this script recomputes the region's text from the code (the planner and the projection, which are
deterministic: CP-SAT runs on a fixed seed and deterministic time) and writes it back. Text outside the
regions (measured figures, which need a quiet machine and say how and by which command they were
measured) is left alone. tests/test_readme_figures.py fails when a region differs from what this
script computes now.

    python scripts/write_figures.py                  # rewrite every region (make figures)
    python scripts/write_figures.py --check          # exit 1 and show the difference if a region is stale
    python scripts/write_figures.py --only make-run  # one group of GROUPS (make-run, lassen, nvlink,
                                                     # projection, spatial, gpu-check)

Groups and their cost (cold caches, this 2-core machine): `make-run` is one plan (the same call as
`make run`, with --json); `nvlink` prices three allreduces; `lassen` is 15 plans on the `lassen`
preset; `projection` is three `hybridpar project` sweeps on `dgx1-v100`, the slow one (DLPlacer's ILP
for Inception-V3: tens of seconds of CPU, minutes on a loaded machine).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = (ROOT / "README.md", ROOT / "docs" / "results.md", ROOT / "docs" / "spatial.md", ROOT / "docs" / "planner.md")
REGION = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)

MAKE_RUN = ["plan", "--model", "resnet50_w8", "--cluster", "lassen", "--gpus", "256", "--batch", "512"]
LASSEN_MODELS = {"resnet50": "ResNet-50", "resnet50_w2": "ResNet-50 ×2 wide", "resnet50_w4": "ResNet-50 ×4 wide",
                 "resnet50_w8": "ResNet-50 ×8 wide"}
LASSEN_BATCH = 512
# Strong scaling at 64, 256 and 1,024 GPUs. benchmarks/bench_lassen.py also sweeps 4 and 16 GPUs, where every
# model's plan is data parallelism (or nothing fits) and each step is 3-10x slower than at 64, so neither
# fastest step is ever there; ResNet-50 x4 at 16 GPUs alone takes ~90 s to plan.
LASSEN_GPUS = (64, 256, 1024)
LASSEN_LIKE_GPUS = 256
WEAK_MODEL, WEAK_PER_GPU, WEAK_GPUS = "resnet50_w8", 32, (4, 16, 64)
PROJ_CLUSTER = "dgx1-v100"
PROJ_RUNS_AS = "DPxMP priced as `train` runs the placer's plan"  # search/projection/costs.schedule_note
PROJ_NAMES = {"inception_v3": "Inception-V3", "gnmt": "GNMT", "biglstm": "BigLSTM"}
# 2 GPUs gives the placer's 2-device MP speedup; Inception-V3 skips 4..32 GPUs, where its channel/filter
# points (planned up to --cf-max-gpus 32) cost a minute and decide none of the figures below.
PROJ_GPUS = {"inception_v3": (1, 2, *(2**i for i in range(6, 13))), "gnmt": tuple(2**i for i in range(13)),
             "biglstm": tuple(2**i for i in range(13))}


# docs/spatial.md's worked example: strong scaling of one batch of high-resolution images on Lassen
SPATIAL_MODEL, SPATIAL_BATCH, SPATIAL_GPUS, SPATIAL_CLUSTER = "unet", 8, (8, 16, 32, 64), "lassen"
# and ResNet-50 at 224x224 on 64 of them, which stays off spatial: the layout the planner picks (a 20 s
# search; tests/search/layers/test_spatial_plan.py's slow test checks it is this one) against the best
# spatial layout (spatial x filter since the planner prices spatial x channel/filter; the same test checks
# it), both priced as fixed layouts
SPATIAL_RESNET = ("resnet50", 64, "sample=8,channel=2,filter=4", "height=4,width=4,channel=4")


# -- computing ---------------------------------------------------------------------------------------


def make_run() -> dict:
    """`make run`'s plan, as `hybridpar plan ... --json` prints it."""
    from hybridpar.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*MAKE_RUN, "--json"])
    if rc:
        raise RuntimeError(f"hybridpar {' '.join(MAKE_RUN)} --json exited {rc}")
    return json.loads(buf.getvalue())


def _plan_point(model: str, gpus: int, batch: int) -> dict:
    import hybridpar
    from hybridpar.errors import UserError

    try:
        res = hybridpar.plan(model, "lassen", gpus, batch)
    except UserError as err:
        return {"model": model, "gpus": gpus, "batch": batch, "error": str(err)}
    base = res.baseline
    return {"model": model, "gpus": gpus, "batch": batch, "plan_s": res.prediction.step_time_s,
            "plan_gib": res.prediction.memory_bytes[0] / 2**30, "plan_sync_s": res.breakdown.grad_sync_s,
            "dp_s": None if base is None else base.step_time_s,
            "dp_sync_s": None if base is None else res.baseline_breakdown.grad_sync_s, "dp_note": res.baseline_note,
            "layouts": sorted({lay.to_strategy() for lay in res.plan.layers.values()})}


def lassen() -> dict:
    strong = [_plan_point(m, g, LASSEN_BATCH) for m in LASSEN_MODELS for g in LASSEN_GPUS]
    weak = [_plan_point(WEAK_MODEL, g, WEAK_PER_GPU * g) for g in WEAK_GPUS]
    return {"strong": strong, "weak": weak}


def projection() -> dict:
    """`hybridpar project` for the three models, DPxMP as `train` runs the placer's plan (no --time-chunks:
    the placer's choice per MP degree of whole recurrent layers or the time-step wavefront, which the MP
    runtime executes, and its micro-batch pipeline); `runs_as` is the projection's note saying which."""
    import hybridpar

    out = {}
    for model, gpus in PROJ_GPUS.items():
        p = hybridpar.project(model, PROJ_CLUSTER, gpus).projection
        runs_as = next(n for n in p.notes if n.startswith(PROJ_RUNS_AS))
        dp512, dp4k, mp2 = p.best(512, "DP"), p.best(4096, "DP"), p.best(2, "hybrid")
        out[model] = {"crossover": p.crossover(), "lowest_gpus": min(g for g in gpus if g > 2),
                      "dp_512": dp512.speedup, "dp_4096": dp4k.speedup, "margin_4096": p.margin_at_scale(),
                      "best_vs_best": p.margin_best_vs_best(), "paper": p.to_dict()["paper_margin"],
                      "mp2_speedup": mp2.speedup, "runs_as": runs_as.split("): ", 1)[1],
                      "hybrid_4096": p.best(4096, "hybrid").strategy,
                      # one DPxMP(M) worker against one GPU at the same batch: the placer's S_MP(M)
                      "mp_speedups": {m: pt.speedup for pt in p.points for m in (2, 4, 8)
                                      if pt.gpus == m and pt.strategy == f"DPxMP{m}"}}
    return out


def nvlink_allreduce() -> dict:
    """A 64 MB allreduce between GPU 0 and the first GPU it shares 0, 1 and 2 NVLinks with, on dgx1-v100."""
    from hybridpar.cluster import load_cluster
    from hybridpar.cost.collectives import allreduce_time

    cl = load_cluster("dgx1-v100")
    peer: dict[int, int] = {}
    for b in range(1, cl.gpus_per_node):
        peer.setdefault(cl.nvlinks(0, b), b)
    return {links: allreduce_time(64_000_000, [0, b], cl) for links, b in sorted(peer.items())}


# -- rendering ---------------------------------------------------------------------------------------


def _x(v: float) -> str:
    return f"{v:.2f}×"


def _pct(v: float) -> str:
    return f"{v:+.1%}".replace("-", "−")


def render_make_run(d: dict) -> dict[str, str]:
    pred, dp = d["predicted"], d["data_parallel"]
    gib = 2**30
    speed = (f"the plan is **{_x(d['speedup_vs_dp'])}** faster than data parallelism "
             f"({pred['step_time_s'] * 1e3:.0f} vs {dp['step_time_s'] * 1e3:.0f} ms per step) and needs "
             f"{pred['memory_bytes_per_device'] / gib:.2f} GiB per GPU where data parallelism needs "
             f"{dp['memory_bytes_per_device'] / gib:.2f} GiB")
    fsdp = d.get("fsdp_recompute")
    mem = f"{pred['memory_bytes_per_device'] / gib:.2f}"
    if fsdp is None:
        versus = f" FSDP + full recomputation: {d.get('fsdp_recompute_note') or 'not priced'}."
    else:
        s, fmem = d["speedup_vs_fsdp_recompute"], f"{fsdp['memory_bytes_per_device'] / gib:.2f}"
        times = f"{pred['step_time_s'] * 1e3:.0f} vs {fsdp['step_time_s'] * 1e3:.0f} ms per step"
        who = (f"channel/filter still beats it, **{_x(s)}** faster ({times})" if s >= 1 else
               f"it beats channel/filter, **{_x(1 / s)}** faster ({times})")
        versus = (f" Against FSDP + full recomputation (`sample=256,zero=3` with every block recomputed, what a "
                  f"torchtitan user runs by default) {who}; FSDP needs {fmem} GiB per GPU, the plan "
                  f"{_x(pred['memory_bytes_per_device'] / fsdp['memory_bytes_per_device'])} that.")
    return {"make-run": f"For this wide CNN {speed}.{versus}\n",
            "make-run-memory": (f"`make run`'s plan (256 Lassen GPUs, batch 512, 3×224×224) states "
                                f"{mem} GiB per GPU; data parallelism, "
                                f"{dp['memory_bytes_per_device'] / gib:.2f} GiB"
                                + (f"; FSDP + full recomputation, {fsdp['memory_bytes_per_device'] / gib:.2f} GiB"
                                   if fsdp else "") + ".\n")}


def _best(rows: list[dict], key: str) -> dict:
    return min((r for r in rows if r.get(key)), key=lambda r: r[key])


def render_lassen(d: dict) -> dict[str, str]:
    strong = [r for r in d["strong"] if "error" not in r]
    lines = [f"| model | like for like: plan vs DP, {LASSEN_LIKE_GPUS} GPUs | best vs best: fastest plan vs "
             "fastest DP | gradient allreduce, DP / plan, at "
             f"{LASSEN_LIKE_GPUS} GPUs | paper |", "|---|---|---|---|---|"]
    ar_best = None
    for i, (m, name) in enumerate(LASSEN_MODELS.items()):
        rows = [r for r in strong if r["model"] == m]
        like = next(r for r in rows if r["gpus"] == LASSEN_LIKE_GPUS)
        bp, bd = _best(rows, "plan_s"), _best(rows, "dp_s")
        ar = like["dp_sync_s"] / like["plan_sync_s"]
        for r in rows:
            if r["dp_sync_s"] and r["plan_sync_s"] > 0:
                red = r["dp_sync_s"] / r["plan_sync_s"]
                if ar_best is None or red > ar_best[0]:
                    ar_best = (red, name, r["gpus"])
        paper = "up to 4.1× training time, 4× allreduce" if i == 0 else ""
        lines.append(f"| {name} | {_x(like['dp_s'] / like['plan_s'])} ({like['plan_s'] * 1e3:.1f} vs "
                     f"{like['dp_s'] * 1e3:.1f} ms) | {_x(bd['dp_s'] / bp['plan_s'])} ({bp['gpus']:,} vs "
                     f"{bd['gpus']:,} GPUs) | {_x(ar)} | {paper} |")
    no_dp = [r for r in d["weak"] if "error" not in r and r["dp_s"] is None]
    counts = ", ".join(f"{r['gpus']:,}" for r in no_dp)
    plan_gib = ", ".join(f"{r['plan_gib']:.1f}" for r in no_dp)
    # what the planner chose where data parallelism does not fit: FSDP (a zero level) or channel/filter
    kinds = ", ".join(f"{next((f'`{lay}`' for lay in r['layouts'] if 'zero=' in lay), 'channel/filter')} at "
                      f"{r['gpus']:,}" for r in no_dp)
    weak_text = (f"At {WEAK_PER_GPU} samples per GPU (weak scaling) data parallelism does not fit "
                 f"{LASSEN_MODELS[WEAK_MODEL]} in a V100's 16 GiB at {counts} GPUs, and the planner's "
                 f"plans do: {kinds} GPUs ({plan_gib} GiB per GPU; the planner weighs the sample dimension's "
                 "parameters sharded, zero=2|3, and recomputation against channel/filter where data "
                 "parallelism does not fit)." if no_dp else
                 f"At {WEAK_PER_GPU} samples per GPU (weak scaling) data parallelism fits "
                 f"{LASSEN_MODELS[WEAK_MODEL]} at every count tried.")
    text = "\n".join(lines) + (
        f"\n\nGlobal batch {LASSEN_BATCH}, strong scaling over {', '.join(f'{g:,}' for g in LASSEN_GPUS)} GPUs. "
        f"The gradient allreduce falls by up to {_x(ar_best[0])} ({ar_best[1]}, {ar_best[2]:,} GPUs; paper: 4×). "
        f"{weak_text}\n")
    return {"lassen": text}


def render_projection(d: dict) -> dict[str, str]:
    rows = ["| model | DP speedup 512 → 4096 GPUs | hybrid overtakes DP at | margin at 4096 GPUs | "
            "best hybrid vs best DP | paper |", "|---|---|---|---|---|---|"]
    speedups = []
    for m, r in d.items():
        if r["crossover"] is not None and r["crossover"] <= r["lowest_gpus"]:
            raise RuntimeError(f"{m}: hybrid wins already at the sweep's lowest count ({r['lowest_gpus']})")
        cross = f"{r['crossover']:,}" if r["crossover"] else "never"
        paper = f"≥ {r['paper']:.1%}".replace(".0%", "%")
        rows.append(f"| {PROJ_NAMES[m]} | {r['dp_512']:.0f} → {r['dp_4096']:.0f} | {cross} | {_pct(r['margin_4096'])} "
                    f"| {_pct(r['best_vs_best'])} | {paper} |")
        more = ", ".join(f"{v:.2f} on {g}" for g, v in sorted(r["mp_speedups"].items()) if g > 2)
        speedups.append(f"- {PROJ_NAMES[m]}: the paper's margin implies ≥ {1 / (1 - r['paper']):.2f}; the placer "
                        f"predicts {r['mp2_speedup']:.2f}" + (f" ({more} GPUs)" if more else "")
                        + f"; the best hybrid at 4,096 GPUs is {r['hybrid_4096']}.")
    gains = ", ".join(f"{PROJ_NAMES[m]} {r['dp_4096'] / r['dp_512']:.2f}×" for m, r in d.items())
    text = ("\n".join(rows) + "\n\nGoing from 512 to 4,096 GPUs (8× the GPUs) buys data parallelism "
            f"{gains}. The placer's predicted MP speedup on 2 GPUs (the 2-GPU DP×MP point), against the "
            "1 / (1 − margin) the paper's margin implies far past B_noise:\n\n" + "\n".join(speedups) + "\n"
            "\nDP×MP is priced as `hybridpar train` runs the placer's plan (no `--time-chunks`: per MP degree "
            "the placer keeps whole recurrent layers or the time-step wavefront the MP runtime executes, "
            "whichever it predicts faster, with its micro-batch pipeline):\n\n"
            + "\n".join(f"- {PROJ_NAMES[m]}: {r['runs_as']}." for m, r in d.items()) + "\n")
    return {"projection": text}


def render_nvlink(d: dict) -> dict[str, str]:
    words = {0: "with no NVLink", 1: "over one link", 2: "over two"}
    parts = [f"{t * 1e3:.3g} ms {words.get(k, f'over {k} links')}" for k, t in d.items()]
    return {"nvlink-allreduce": f"on `dgx1-v100` a 64 MB allreduce between two GPUs costs {', '.join(parts[:-1])} "
                                f"and {parts[-1]}\n"}


def spatial() -> dict:
    """The U-Net at 3x1024x1024, batch 8, planned on 8..64 Lassen GPUs (spatial layouts as candidates),
    and the memory of one whole sample per GPU (`sample=8` on 8 GPUs) beside each plan's."""
    import hybridpar

    rows = []
    for g in SPATIAL_GPUS:
        res = hybridpar.plan(SPATIAL_MODEL, SPATIAL_CLUSTER, g, SPATIAL_BATCH)
        rows.append({"gpus": g, "layout": res.plan.default_layout.to_strategy(), "step_s": res.prediction.step_time_s,
                     "gib": res.prediction.memory_bytes[0] / 2**30, "halo": res.prediction.comm_bytes.get("halo", 0),
                     "notes": [n for n in res.plan.notes if n.startswith(("spatial chosen", "no layer goes spatial"))]})
    whole = hybridpar.plan(SPATIAL_MODEL, SPATIAL_CLUSTER, SPATIAL_BATCH, SPATIAL_BATCH,
                           strategy=f"sample={SPATIAL_BATCH}")
    model, gpus, *layouts = SPATIAL_RESNET
    resnet = {}
    for lay in layouts:
        res = hybridpar.plan(model, SPATIAL_CLUSTER, gpus, SPATIAL_BATCH, strategy=lay)
        resnet[lay] = {"step_s": res.prediction.step_time_s, "grad_sync_s": res.breakdown.grad_sync_s,
                       "grad_bytes": res.breakdown.grad_bytes, "halo_bytes": res.prediction.comm_bytes.get("halo", 0)}
    return {"rows": rows, "whole_gib": whole.prediction.memory_bytes[0] / 2**30,
            "whole_s": whole.prediction.step_time_s, "resnet": resnet}


def render_spatial(d: dict) -> dict[str, str]:
    lines = ["| GPUs | plan | step (ms) | images/s | memory per GPU | halo bytes per step | why |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for r in d["rows"]:
        why = r["notes"][0] if r["notes"] else ""
        why = " ".join(re.sub(r"\(halo exchanges[^)]*\)", "", why).split()).replace("|", "/")
        lines.append(f"| {r['gpus']} | `{r['layout']}` | {r['step_s'] * 1e3:.1f} | {SPATIAL_BATCH / r['step_s']:.0f} | "
                     f"{r['gib']:.2f} GiB | {r['halo'] / 2**20:.1f} MiB | {why} |")
    lines.append("")
    lines.append(f"One whole 3×1024×1024 sample per GPU (`sample={SPATIAL_BATCH}` on {SPATIAL_BATCH} GPUs) needs "
                 f"{d['whole_gib']:.2f} GiB per GPU and {d['whole_s'] * 1e3:.1f} ms per step.")
    (_, gpus, picked, spatial_lay), r = SPATIAL_RESNET, d["resnet"]
    a, b = r[picked], r[spatial_lay]
    resnet = (f"ResNet-50 at 224×224, batch {SPATIAL_BATCH} on {gpus} GPUs: the planner's layout, `{picked}` "
              f"(priced uniformly), is predicted at {a['step_s'] * 1e3:.1f} ms per step, the best spatial layout, "
              f"`{spatial_lay}`, at {b['step_s'] * 1e3:.1f} ms. The spatial layout's gradient allreduce moves "
              f"{b['grad_bytes'] / 1e6:.1f} MB ({b['grad_sync_s'] * 1e3:.1f} ms: its ranks hold larger weight "
              f"shards) against {a['grad_bytes'] / 1e6:.1f} MB "
              f"({a['grad_sync_s'] * 1e3:.1f} ms) for the channel/filter shards; its halo exchanges send "
              f"{b['halo_bytes'] / 2**20:.2f} MiB per step.\n")
    return {"spatial-unet": "\n".join(lines) + "\n", "spatial-resnet": resnet}


def gpu_check() -> str:
    """The README's "Checked on a GPU" table from the committed bench-results/gpu_check.json (written by
    benchmarks/gpu_check.py on a GPU), or the script's own word that it has not run yet."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.readme_region()


GROUPS: dict[str, tuple[Callable[[], object], Callable[[object], dict[str, str]]]] = {
    "gpu-check": (gpu_check, lambda text: {"gpu-check": text}),
    "make-run": (make_run, render_make_run),
    "lassen": (lassen, render_lassen),
    "projection": (projection, render_projection),
    "nvlink": (nvlink_allreduce, render_nvlink),
    "spatial": (spatial, render_spatial),
}


# the regions each group writes
REGION_NAMES = {"gpu-check": ("gpu-check",),
                "make-run": ("make-run", "make-run-memory"), "lassen": ("lassen",), "projection": ("projection",),
                "nvlink": ("nvlink-allreduce",), "spatial": ("spatial-unet", "spatial-resnet")}


def compute(groups=tuple(GROUPS)) -> dict[str, str]:
    """Region name -> its text, computed now, for the given groups."""
    out: dict[str, str] = {}
    for g in groups:
        fn, render = GROUPS[g]
        texts = render(fn())
        assert set(texts) == set(REGION_NAMES[g]), (g, sorted(texts))
        out.update(texts)
    return out


# -- the files -----------------------------------------------------------------------------------------


def regions(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in REGION.finditer(text)}


def rewrite(text: str, new: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        body = new.get(m["name"], m["body"])
        return m.group(1) + body + m.group(4)

    return REGION.sub(sub, text)


def stale(paths, new: dict[str, str]) -> list[str]:
    """A unified diff per file whose regions differ from `new`; [] when every region is current. A region
    name computed here but found in no file is reported too."""
    out, seen = [], set()
    for p in paths:
        text = Path(p).read_text()
        seen |= regions(text).keys()
        want = rewrite(text, new)
        if want != text:
            out.append("".join(difflib.unified_diff(text.splitlines(True), want.splitlines(True),
                                                    f"{p} (as written)", f"{p} (as computed)")))
    out += [f"region figures:{n} is in none of {', '.join(map(str, paths))}\n" for n in sorted(new.keys() - seen)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if a region is stale")
    ap.add_argument("--only", action="append", choices=list(GROUPS), help="compute only this group (repeatable)")
    args = ap.parse_args(argv)
    new = compute(tuple(args.only or GROUPS))
    diffs = stale(FILES, new)
    if args.check:
        sys.stdout.writelines(diffs)
        return 1 if diffs else 0
    for p in FILES:
        text = p.read_text()
        if (want := rewrite(text, new)) != text:
            p.write_text(want)
            print(f"rewrote {p.relative_to(ROOT)}")
    missing = [d for d in diffs if d.startswith("region ")]
    sys.stdout.writelines(missing)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
