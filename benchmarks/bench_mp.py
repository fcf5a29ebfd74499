"""Model-parallel runtime on this machine: does the placer's predicted MP speedup hold when run?

For each model (the branchy CNN and the two-tower LSTM written in bench_validation.py, inception_mini
and lstm2 from the zoo), after `hybridpar profile` has measured the model's ops and gloo's p2p
transfers into a private calibration file:
  1. `hybridpar.place` puts the model on 2 `localhost` devices (ILP) and predicts the MP step and the
     one-device step from the same cost model: the predicted speedup;
  2. 2 gloo ranks run, interleaved trial by trial so that both see the same load from other jobs:
     one process alone (plain eager PyTorch on rank 0, rank 1 waiting in a barrier), the MP engine
     with the placer's placement, and the MP engine with every node on device 0 (the executor's own
     overhead over eager). Medians over the trials after warm-up; measured speedup = eager / MP.
Beside every figure: the machine's load average and the time the ranks' main threads waited on a
run queue (/proc/thread-self/schedstat) per step: CPU time taken by other jobs, which the cost model
does not know about. A run-queue wait above a few percent of the step means the figure is not a
quiet-machine figure.

    python benchmarks/bench_mp.py [--models branchy,inception_mini,...] [--trials 12] [--worlds 3] [--no-profile]

Every model is measured in `--worlds` fresh 2-rank worlds one after another; its measured speedup is
the median of the per-world ratios (each world's is printed too).

The wavefront row (lstm4_k4: one nn.LSTM(num_layers=4) written in _wavefront_model.py) is placed and
run with 4 time chunks per recurrent layer (parallel/pipeline/wavefront.py: the layers of the stacked
module placed one by one, layer l+1 running chunk t while layer l runs chunk t+1), and also placed and
run whole (`--time-chunks 1`, which puts the one module on one device), interleaved in the same trials:
both measured speed-ups over one process beside both predictions.

    python benchmarks/bench_mp.py --models lstm4_k4 --quick   # a smaller model, 1 world x 4 trials, 1 round

Prints a table and writes JSON to $HYBRIDPAR_BENCH_OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_validation import BRANCHY, TWO_TOWER  # noqa: E402
from bench_validation import profile as profile_rounds  # noqa: E402

from hybridpar.graph.models import load_model  # noqa: E402
from hybridpar.parallel.pipeline import MPEngine  # noqa: E402
from hybridpar.plans import Plan  # noqa: E402
from hybridpar.train.engine import task_loss_sum  # noqa: E402
from hybridpar.train.launch import spawn  # noqa: E402

MODELS = {"branchy": BRANCHY, "inception_mini": "inception_mini", "two_tower_lstm": TWO_TOWER, "lstm2": "lstm2",
          "lstm4_k4": f"{HERE / '_wavefront_model.py'}:lstm4"}
CHUNKS = {"lstm4_k4": 4}  # placed and run with K time chunks per recurrent layer (and also whole: K = 1)
BATCH, WARMUP = 32, 2
QUIET = 0.05  # a trial counts as quiet when no rank waited on a run queue for more than 5% of it


def run_queue_s() -> float:
    """Seconds this thread has waited on a run queue (runnable, not running) since it started."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


def profile(specs: list[str], path: Path, rounds: int = 3, keep: str = "median") -> float:
    """`hybridpar profile` of each model's ops at the benchmark's batch and of gloo (p2p included) at 2
    ranks, `rounds` times, keeping per op the median round (bench_validation.profile: this VM's speed
    drifts over tens of seconds, so the fastest round is biased low)."""
    return profile_rounds(set(specs), dict.fromkeys(specs, BATCH), path, rounds=rounds, ranks="2",
                          splits_of=dict.fromkeys(specs, "1"), keep=keep)


def _batches(spec: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = load_model(spec, batch=BATCH).example_inputs[0]
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        xx = torch.randn(x.shape, generator=g) if x.is_floating_point() else torch.randint(0, 64, x.shape, generator=g)
        out.append((xx, torch.randint(0, 10, (BATCH,), generator=g)))
    return out


def _timed(fn, *args) -> tuple[float, float, float]:
    """(wall seconds, run-queue seconds, CPU seconds of this thread) of fn(*args)."""
    q0, c0, t0 = run_queue_s(), time.thread_time(), time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0, run_queue_s() - q0, time.thread_time() - c0


def _eager_step(model, opt, x, y) -> None:
    (task_loss_sum(model(x), y) / len(y)).backward()
    opt.step()
    opt.zero_grad()


def _engine_step(eng, opt, x, y) -> None:
    eng.train_step(*eng.local_batch(x, y))
    opt.step()
    opt.zero_grad()


def _summary(trials: list[tuple[float, float, float, float]]) -> dict:
    """Medians over the quiet trials: those whose ranks waited on a run queue for less than QUIET of
    the step (all trials, flagged, when none was quiet)."""
    quiet = [t for t in trials if t[1] <= QUIET * t[0]]
    use = quiet or trials
    return {"step_s": statistics.median(t[0] for t in use), "quiet_trials": len(quiet), "trials": len(trials),
            "run_queue_s": statistics.median(t[1] for t in use),
            "run_queue_mean_of_ranks_s": statistics.median(t[2] for t in use),
            "cpu_s": statistics.median(t[3] for t in use),
            "cpu_sum_s": statistics.median(t[4] for t in use)}


def _ranks(cases: list[tuple]) -> dict:
    """In each of 2 ranks: for every (label, model, placement, trials, time chunks, whole placement)
    case, interleave eager (rank 0 alone), MP, all-on-device-0 steps and, with time chunks, the whole-
    layer placement's MP steps; rank 0 returns medians (wall, and both ranks' run-queue wait)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = {}
    for label, spec, placement, trials, chunks, whole in cases:
        torch.manual_seed(0)
        eager = load_model(spec, batch=BATCH).module if rank == 0 else None
        eopt = torch.optim.SGD(eager.parameters(), lr=0.01) if eager is not None else None
        engines = {}
        # with time chunks also the same K-chunk program on device 0 alone: what the two ranks' CPU time
        # together is compared with (the MP split's own cost, which no profile record holds)
        variants = [("mp", placement, chunks), ("all_on_0", {}, 1)] + (
            [("whole", whole, 1), ("all_on_0_k", {}, chunks)] if chunks > 1 else [])
        for name, pl, k in variants:
            plan = Plan(model=spec, world_size=2, batch=BATCH, mp=2, placement=pl, time_chunks=k)
            eng = MPEngine(load_model(spec, batch=BATCH).module, plan, loss_fn=task_loss_sum)
            engines[name] = (eng, torch.optim.SGD(eng.parameters(), lr=0.01))
        rec: dict[str, list] = {"eager": [], **{name: [] for name in engines}}

        for i, (x, y) in enumerate(_batches(spec, WARMUP + trials)):
            dist.barrier()
            wall = q = cpu = 0.0
            if rank == 0:
                wall, q, cpu = _timed(_eager_step, eager, eopt, x, y)
            if i >= WARMUP:
                rec["eager"].append((wall, q, q, cpu, cpu))
            for name, (eng, opt) in engines.items():
                dist.barrier()
                wall, q, cpu = _timed(_engine_step, eng, opt, x, y)
                both = torch.tensor([wall, q, cpu])
                dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the step ends when the later rank ends
                qs = torch.tensor([q, cpu])
                dist.all_reduce(qs)
                if i >= WARMUP:  # (the later rank's wall, the longer run-queue wait, the mean wait, the busier
                    # rank's CPU time: its own work, without waits; both ranks' CPU time together)
                    rec[name].append((float(both[0]), float(both[1]), float(qs[0]) / 2, float(both[2]),
                                      float(qs[1])))
        sent = sum(r.bytes_ for r in engines["mp"][0].comm_log.step_records() if r.kind == "send")
        tot = torch.tensor([float(sent)])
        dist.all_reduce(tot)
        out[label] = {k: _summary(v) for k, v in rec.items()}
        out[label]["p2p_bytes"] = int(tot)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--trials", type=int, default=12, help="measured steps per case (after 2 warm-up)")
    ap.add_argument("--no-profile", action="store_true", help="reuse $HYBRIDPAR_CALIBRATION as it is")
    ap.add_argument("--time-limit", type=float, default=10.0, help="placer ILP time limit")
    ap.add_argument("--worlds", type=int, default=3,
                    help="fresh 2-rank worlds, one after another; a model's figures are the medians over them")
    ap.add_argument("--rounds", type=int, default=3, help="hybridpar profile rounds (per op the median is kept)")
    ap.add_argument("--keep", choices=("median", "fastest"), default="median",
                    help="per op, which profile round to keep (fastest: the choice before 2026-12-01)")
    ap.add_argument("--quick", action="store_true",
                    help="a check that it runs: 1 world x 4 trials, 1 profile round, lstm4_k4 at 96 units x 16 steps")
    args = ap.parse_args()
    if args.quick:
        args.trials, args.worlds, args.rounds = 4, 1, 1
        os.environ["HYBRIDPAR_BENCH_LSTM4"] = "96,16"  # before the ranks load the model
    names = [m for m in args.models.split(",") if m]
    bad = [m for m in names if m not in MODELS]
    if bad:
        sys.exit(f"unknown model {bad[0]!r}; choose from {', '.join(MODELS)}")
    if not args.no_profile:
        tmp = Path(tempfile.mkdtemp(prefix="hybridpar-bench-mp-"))
        os.environ["HYBRIDPAR_CALIBRATION"] = str(tmp / "calibration.json")
    from hybridpar.search.placer import place_model
    from hybridpar.search.placer.module_placement import placement_from_outcome, predicted_p2p_bytes

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    prof_s = 0.0 if args.no_profile else profile([MODELS[m] for m in names],
                                                 Path(os.environ["HYBRIDPAR_CALIBRATION"]), args.rounds, args.keep)
    placed, whole = {}, {}
    for m in names:
        # what the runs train with (train's default), with the time chunks they run (1: whole recurrent
        # layers); the wavefront row is also placed whole (K = 1)
        for k, into in ((CHUNKS.get(m, 1), placed), *(((1, whole),) if m in CHUNKS else ())):
            outcome = place_model(MODELS[m], "localhost", 2, batch=BATCH, time_limit_s=args.time_limit,
                                  optimizer="sgd", time_chunks=k)
            into[m] = (outcome, placement_from_outcome(outcome, load_model(MODELS[m]).module))
    load_run = os.getloadavg()
    # Each world is one draw of this VM's drifting speed (a process's speed is set for tens of seconds):
    # a model's figures are medians over fresh worlds, its speedup the median of the per-world ratios
    worlds = [spawn(_ranks, 2, [(m, MODELS[m], placed[m][1], args.trials, CHUNKS.get(m, 1),
                                 whole[m][1] if m in whole else None) for m in names])
              for _ in range(args.worlds)]
    load_after = os.getloadavg()
    rows = {}
    for m in names:
        outcome, placement = placed[m]
        per_world = [w[m]["eager"]["step_s"] / w[m]["mp"]["step_s"] for w in worlds]
        r = {k: {f: statistics.median(w[m][k][f] for w in worlds)
                 for f in ("step_s", "run_queue_s", "run_queue_mean_of_ranks_s", "cpu_s", "cpu_sum_s")}
             | {"quiet_trials": sum(w[m][k]["quiet_trials"] for w in worlds),
                "trials": sum(w[m][k]["trials"] for w in worlds)}
             for k in ("eager", "mp", "all_on_0", "whole", "all_on_0_k") if k in worlds[0][m]}
        r["p2p_bytes"] = worlds[0][m]["p2p_bytes"]
        measured = statistics.median(per_world)
        bd = outcome.result.breakdown
        rows[m] = {
            "model": MODELS[m], "placement": placement, "solver": f"{outcome.result.solver} ({outcome.result.status})",
            "devices_used": len(set(outcome.result.assignment)),
            "predicted_speedup": outcome.speedup, "measured_speedup": measured,
            "speedup_rel_error": (outcome.speedup - measured) / measured,
            "predicted_single_s": outcome.single_step_s, "predicted_mp_s": outcome.result.step_time_s,
            "predicted_exposed_comm_s": bd.exposed_comm_s, "predicted_comm_s": bd.comm_s,
            "measured_eager_s": r["eager"]["step_s"], "measured_mp_s": r["mp"]["step_s"],
            # the busier rank's own work per step: predicted (the schedule's busiest device) and measured
            # (its thread's CPU time): an excess here is work the op table misses, the rest is waiting
            "predicted_mp_busy_s": max(bd.busy_s), "measured_mp_cpu_s": r["mp"]["cpu_s"],
            "measured_all_on_0_s": r["all_on_0"]["step_s"],
            "executor_overhead_vs_eager": r["all_on_0"]["step_s"] / r["eager"]["step_s"],
            "single_rel_error": (outcome.single_step_s - r["eager"]["step_s"]) / r["eager"]["step_s"],
            "run_queue_share_eager": r["eager"]["run_queue_s"] / r["eager"]["step_s"],
            "run_queue_share_mp": r["mp"]["run_queue_mean_of_ranks_s"] / r["mp"]["step_s"],
            "p2p_bytes_measured_vs_predicted": r["p2p_bytes"] / max(predicted_p2p_bytes(outcome), 1),
            "quiet_trials": {k: f"{r[k]['quiet_trials']}/{r[k]['trials']}" for k in ("eager", "mp", "all_on_0")},
            "measured_speedup_per_world": per_world,
            "time_chunks": CHUNKS.get(m, 1),
        }
        if m in whole:  # the same model placed and run with whole recurrent layers
            rows[m] |= {"mp_cpu_together_over_one_device": r["mp"]["cpu_sum_s"] / r["all_on_0_k"]["cpu_sum_s"],
                        "whole_placement": whole[m][1], "whole_predicted_speedup": whole[m][0].speedup,
                        "whole_measured_speedup": statistics.median(
                            w[m]["eager"]["step_s"] / w[m]["whole"]["step_s"] for w in worlds)}
    summary = {"batch": BATCH, "trials": args.trials, "worlds": args.worlds, "profile_rounds": args.rounds,
               "profile_keep": args.keep, "load_avg_before": load_before, "load_avg_at_run": load_run,
               "load_avg_after": load_after, "profile_s": prof_s, "wall_s": time.perf_counter() - t0,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    print(f"2 gloo ranks on localhost, batch {BATCH}, {args.worlds} worlds x {args.trials} interleaved trials "
          f"(medians over worlds; profile: {args.rounds} rounds, {args.keep} kept per op); load avg (1/5/15 min) "
          f"{' / '.join(f'{x:.2f}' for x in load_run)} at the start, "
          f"{' / '.join(f'{x:.2f}' for x in load_after)} at the end")
    head = (f"{'model':16s} {'pred':>6s} {'meas':>6s} {'err':>7s} {'1-dev pred/meas ms':>19s} "
            f"{'MP pred/meas ms':>17s} {'exec ovh':>8s} {'runq 1/MP':>10s} {'p2p B':>6s} quiet trials 1/MP")
    print(head)
    for m, r in rows.items():
        print(f"{m:16s} {r['predicted_speedup']:6.2f} {r['measured_speedup']:6.2f} {r['speedup_rel_error']:+7.1%} "
              f"{r['predicted_single_s'] * 1e3:8.1f} / {r['measured_eager_s'] * 1e3:7.1f} "
              f"{r['predicted_mp_s'] * 1e3:7.1f} / {r['measured_mp_s'] * 1e3:7.1f} "
              f"{r['executor_overhead_vs_eager']:8.2f} "
              f"{r['run_queue_share_eager']:4.0%}/{r['run_queue_share_mp']:4.0%} "
              f"{r['p2p_bytes_measured_vs_predicted']:6.3f} {r['quiet_trials']['eager']} {r['quiet_trials']['mp']}"
              f"   per world: {' '.join(f'{v:.2f}' for v in r['measured_speedup_per_world'])}")
        if "whole_measured_speedup" in r:
            print(f"{'':16s} K={r['time_chunks']} time chunks above; whole layers (K=1): predicted "
                  f"{r['whole_predicted_speedup']:.2f}, measured {r['whole_measured_speedup']:.2f}; "
                  f"measured K={r['time_chunks']} / whole: {r['measured_speedup'] / r['whole_measured_speedup']:.2f}")
        print(f"{'':16s} MP busier rank's own work per step: predicted {r['predicted_mp_busy_s'] * 1e3:.1f} ms, "
              f"measured {r['measured_mp_cpu_s'] * 1e3:.1f} ms of CPU time")
        if "mp_cpu_together_over_one_device" in r:
            print(f"{'':16s} both MP ranks' CPU time together / the same {r['time_chunks']}-chunk program on one "
                  f"device: {r['mp_cpu_together_over_one_device']:.2f}x (the split's own work, not priced)")
    out = os.environ.get("HYBRIDPAR_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
