"""What the host allocator policy for sharded weights costs and saves (issue 31), on 2 CPU ranks.

hybridpar's ranks keep freed memory, except ranks that shard weights with FSDP (`zero=2|3`), which mmap
blocks of 4 MiB and up on transparent huge pages (hybridpar.host_allocator, docs/runtime.md). One
allocator policy holds per process, so each contender is its own 2-rank `torchrun` world, the worlds
run one after another in rounds (order reversed every round), and each reports its median step after
warm-up and its ranks' peak resident set (VmHWM):
- `plain FSDP2, glibc defaults`: `fully_shard` by hand, as a user's own torchrun script runs it;
- `plain FSDP2, freed memory kept`: the same under hybridpar's general policy (what zero ranks had before);
- `plain FSDP2, large blocks on huge pages`: the same under the zero ranks' policy;
- `hybridpar sample=2,zero=3`: hybridpar.parallelize under the zero ranks' policy (as `hybridpar train`).
The model: benchmarks/_fsdp_bench_models.py (wide_cnn; --quick: wide_cnn_quick), AdamW.

    .venv/bin/python benchmarks/bench_fsdp_allocator.py [--quick] [--rounds 3] [--steps 8] [--out FILE.json]

Separate worlds cannot be interleaved step by step: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# name -> (variant, allocator policy)
CONTENDERS = {
    "plain FSDP2, glibc defaults": ("plain", "defaults"),
    "plain FSDP2, freed memory kept": ("plain", "keep"),
    "plain FSDP2, large blocks on huge pages": ("plain", "large"),
    "hybridpar sample=2,zero=3": ("sample=2,zero=3", "large"),
}


def _rank_main() -> None:
    """One rank of one contender's world (under torchrun): steps timed between barriers; rank 0 writes
    the median step and every rank's peak resident set to argv's file."""
    import statistics as st

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hybridpar.host_allocator import keep_freed_memory, return_large_blocks

    variant, policy, model_name, steps, warmup, out = sys.argv[2:8]
    if policy in ("keep", "large"):
        keep_freed_memory()
    if policy == "large" and not return_large_blocks():
        raise SystemExit("large blocks on huge pages: glibc was not started with its huge-page tunable")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from _fsdp_bench_models import MODELS, BlockCNN
    from _timing import barrier_timed

    args, shape, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = BlockCNN(*args)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *(int(v) for v in shape.split(",")), generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    if variant == "plain":
        from bench_fsdp import _by_hand

        model = _by_hand(model)
        rows = slice(rank * batch // world, (rank + 1) * batch // world)
        x, y = x[rows], y[rows]
    else:
        import hybridpar

        model = hybridpar.parallelize(model, variant, inputs="global")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    times = [barrier_timed(step) for _ in range(int(warmup) + int(steps))][int(warmup):]
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))
    peaks = [None] * world
    dist.all_gather_object(peaks, hwm)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": st.median(times), "peaks": peaks}))
    dist.barrier()
    os._exit(0)


def _world(name: str, model: str, steps: int, warmup: int, tmp: str) -> dict:
    from hybridpar.host_allocator import huge_page_environment

    variant, policy = CONTENDERS[name]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GLIBC_TUNABLES", None)
    if policy == "large":  # glibc reads it at a process's start only
        env = huge_page_environment(env)
    out = str(Path(tmp) / "world.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, "--rank-main", variant, policy, model, str(steps), str(warmup), out]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{name} failed ({res.returncode}): {res.stderr[-1500:]}")
    return json.loads(Path(out).read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        _rank_main()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small wide CNN, 1 round (a check that it runs)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = "wide_cnn_quick" if args.quick else "wide_cnn"
    rounds = args.rounds or (1 if args.quick else 3)
    names = list(CONTENDERS)
    got: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                got[name].append(_world(name, model, args.steps, args.warmup, tmp))
                print(f"round {r + 1}/{rounds}: {name} done", file=sys.stderr, flush=True)
    base = statistics.median(w["step_s"] for w in got[names[0]])
    print(f"{model}, 2 ranks, AdamW; medians of {rounds} worlds x {args.steps} steps; load {os.getloadavg()[0]:.1f}")
    summary = {}
    for name in names:
        step = statistics.median(w["step_s"] for w in got[name])
        peak = statistics.median(max(w["peaks"]) for w in got[name])
        summary[name] = {"step_s": step, "peak_bytes": peak, "vs_glibc_defaults": step / base}
        print(f"  {name:<42} {step * 1e3:8.1f} ms/step ({step / base:5.2f}x)   peak {peak / 2**30:.3f} GiB per rank")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": model, "rounds": rounds, "worlds": got,
                                              "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
