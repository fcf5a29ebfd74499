"""The memory of the framework itself: resident set of an initialised gloo rank that holds no model.

A rank of `hybridpar train` on this machine holds, besides its model's bytes: the Python interpreter,
torch (its libraries, the CPU kernels' code it has run, the allocator), the gloo process group with
its sub-groups, and hybridpar's runtime. `measure_framework_bytes(world)` starts `world` such ranks as
separate processes (as `hybridpar train` does); each imports what a training rank imports, joins a gloo
world, creates the per-dimension sub-groups and runs one small allreduce in each, then trains a tiny
model (small_cnn, channel parallel) for two steps through the runtime so that the kernels and the
DTensor/autograd machinery a training rank uses are paged in, and reports its VmRSS less that model's
weights and gradients. The largest is the constant the memory model adds per rank
(hybridpar.cost.memory, `Calibration.framework_bytes`). Without the tiny training (an initialised rank
that imported torch and ran collectives only) it was 300 MiB here.

Run as `python -m hybridpar.profile.framework_memory --world W --rank R --port P --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hybridpar.errors import UserError
from hybridpar.ports import free_port
from hybridpar.profile.ranks import run_local_ranks


def resident_bytes(pid: int | str = "self") -> int:
    """Resident set of a process (Linux /proc), else the peak resident set of this process (getrusage).
    smaps_rollup first: it walks the page tables, while status's VmRSS is a counter the kernel syncs
    lazily (a test saw it unchanged after 64 MiB were written)."""
    for name, key in (("smaps_rollup", "Rss:"), ("status", "VmRSS:")):
        try:
            for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


TINY_MODEL = "small_cnn"


def _tiny_training(world: int) -> int:
    """Two training steps of a tiny zoo model through the runtime (channel parallel over the world):
    pages in the kernels, DTensor dispatch and autograd machinery a training rank uses. Returns the
    bytes the model itself still holds (weights and gradients), which are not the framework's."""
    import torch

    from hybridpar.graph.models import load_model
    from hybridpar.parallel.api import parallelize

    torch.manual_seed(0)
    loaded = load_model(TINY_MODEL, batch=2 * world)
    model = parallelize(loaded.module, f"channel={world}" if world > 1 else "sample=1")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        out = model(*loaded.example_inputs)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients: counted below, as the model's
    params = list(model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return sum(2 * t.numel() * t.element_size() for t in local)


def _worker(world: int, rank: int, port: int, out: Path, tiny_model: bool = True) -> None:
    import torch
    import torch.distributed as dist

    import hybridpar.train.trainer  # noqa: F401 - what a training rank imports
    from hybridpar.parallel import api as parallel_model  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    try:
        groups = [None]
        for size in sorted({g for g in range(2, world) if world % g == 0}):
            for start in range(0, world, size):
                pg = dist.new_group(list(range(start, start + size)))
                if start <= rank < start + size:
                    groups.append(pg)
        for pg in groups:
            dist.all_reduce(torch.ones(1024), group=pg)
        own = _tiny_training(world) if tiny_model else 0
        dist.barrier()
        (out / f"rank{rank}.json").write_text(json.dumps({"rss_bytes": resident_bytes() - own}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_framework_bytes(world: int = 2, timeout_s: float = 300.0) -> int:
    """The largest resident set over `world` initialised gloo ranks holding no model (bytes)."""
    if world < 1:
        raise UserError(f"world must be >= 1, got {world}")
    with tempfile.TemporaryDirectory(prefix="hybridpar-fwmem-") as tmp:
        args = ["--world", str(world), "--port", str(free_port()), "--out", tmp]
        errors = run_local_ranks("hybridpar.profile.framework_memory", args, world, timeout_s,
                                 "framework memory probe")
        files = sorted(Path(tmp).glob("rank*.json"))
        if errors or len(files) != world:
            raise UserError(f"framework memory probe failed: {errors[0] if errors else 'no output'}")
        return max(int(json.loads(f.read_text())["rss_bytes"]) for f in files)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _worker(a.world, a.rank, a.port, Path(a.out))


if __name__ == "__main__":
    main()
