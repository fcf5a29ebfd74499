"""A small training loop over the engine contract, checkpointing as the train loop does; run in
spawned gloo ranks by the checkpoint tests (module-level so that spawn can import it)."""

from __future__ import annotations

import os

import torch

from hybridpar.plans import Plan, parse_strategy
from hybridpar.train import checkpoint as ckpt
from hybridpar.train import faults

# Test-only crash points inside save_checkpoint, to prove a kill at any moment is safe.
CRASH_ENV = "HYBRIDPAR_TEST_CRASH"


def plan_for(strategy: str, world: int, batch: int = 16) -> Plan:
    s = parse_strategy(strategy, world)
    return Plan(model="small_cnn", world_size=world, batch=batch, dp=world // s.mp, mp=s.mp,
                default_layout=s.layout, strategy=strategy)


def train(root: str, strategy: str, world: int, steps: int, every: int, resume: bool, stop_after: int | None = None):
    import torch.distributed as dist

    from hybridpar.graph.models import load_model
    from hybridpar.train.data.loader import batch_indices, load_dataset
    from hybridpar.train.engine import make_engine

    plan = plan_for(strategy, world)
    torch.manual_seed(0)
    module = load_model("small_cnn").module
    ds = load_dataset("synthetic", (3, 32, 32), num_classes=10, size=64, seed=0)
    info = ckpt.latest_checkpoint(root) if resume else None
    loaded = ckpt.load_checkpoint(info, module) if info else None
    engine = make_engine(module, plan)
    opt = torch.optim.SGD(engine.parameters(), lr=0.05, momentum=0.9)
    start = ckpt.restore_training_state(loaded, engine, opt) if loaded else 0
    losses = []
    for step in range(start, steps):
        if stop_after is not None and step == stop_after:
            break
        faults.maybe_inject_failure(step)
        idx = batch_indices(len(ds), plan.batch, step, shuffle=True, seed=0)
        x, y = engine.local_batch(ds.x[idx], ds.y[idx])
        losses.append(engine.train_step(x, y))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if every and (step + 1) % every == 0:
            crash = os.environ.get(CRASH_ENV)
            if crash == "enospc" and dist.get_rank() == dist.get_world_size() - 1:
                _disk_full()
            elif crash and crash != "enospc" and dist.get_rank() == 0:
                _arm_crash(crash)
            try:
                ckpt.save_checkpoint(root, step + 1, engine, opt, meta={"model": "small_cnn"})
            except ckpt.CheckpointWriteError as err:  # raised on every rank together
                return {"error": str(err), "losses": losses, "start": start}
    return {"state": engine.full_state_dict(), "losses": losses, "start": start}


def _disk_full() -> None:
    """This rank's next file write fails as on a full disk (after writing part of the file)."""
    import errno

    def save(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    ckpt.torch.save = save


def _arm_crash(point: str) -> None:
    """Make rank 0 die (os._exit, like SIGKILL) at `point` of the next save_checkpoint."""
    def die(*_a, **_k):
        os._exit(9)

    if point == "before-manifest":
        ckpt._sha256 = die  # first call comes after the shards, before the manifest
    elif point == "before-rename":
        ckpt._fsync_dir = die  # first call comes after the manifest, before the rename
    elif point == "after-rename":
        real = ckpt._prune
        ckpt._prune = lambda *a: (real(*a), os._exit(9))
    elif point == "mid-shard":
        real_agree = ckpt._agree
        calls = {"n": 0}

        def agree(*a, **k):
            calls["n"] += 1
            if calls["n"] == 2:  # the shards are being written: rank 0 dies before the ranks agree on them
                os._exit(9)
            return real_agree(*a, **k)

        ckpt._agree = agree


def lose_lock(root: str) -> dict:
    """Issue 33, red-team 8: lock `root`, save step 1, then the directory is deleted and another
    writer makes it again with its own step-00000001; the next save must stop, touching nothing."""
    import shutil
    from pathlib import Path

    from hybridpar.graph.models import load_model
    from hybridpar.train.engine import make_engine

    torch.manual_seed(0)
    engine = make_engine(load_model("small_cnn").module, plan_for("sample=1", 1))
    opt = torch.optim.SGD(engine.parameters(), lr=0.05)
    ckpt.lock_directory(root)
    ckpt.save_checkpoint(root, 1, engine, opt, meta={"run_id": "mine"})
    shutil.rmtree(root)
    Path(root, "step-00000001").mkdir(parents=True)
    Path(root, "step-00000001", "theirs.txt").write_text("theirs")
    Path(root, ckpt.LOCK_FILE).write_text("999\n")
    try:
        ckpt.save_checkpoint(root, 2, engine, opt, meta={"run_id": "mine"}, keep=1)
    except ckpt.CheckpointWriteError as err:
        return {"first": 1, "error": str(err)}
    finally:
        ckpt.unlock_directory(root)
    return {"first": 1, "error": None}
