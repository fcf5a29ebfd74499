"""Pipelined model parallelism (1F1B) in your own loop: your model, loss and optimizer; hybridpar cuts the
model into a chain of stages and runs torch.distributed.pipelining's Schedule1F1B over micro-batches.

    torchrun --standalone --nproc-per-node 2 examples/train_own_loop_1f1b.py
    torchrun --standalone --nproc-per-node 4 examples/train_own_loop_1f1b.py --strategy mp=2,sample=2

1F1B starts a micro-batch's backward as soon as its forward left the last stage, so the loss goes into
the schedule (torchtitan's contract) instead of after `model(...)`: `parallelize(..., schedule="1f1b",
loss_fn=my_loss)`, then `model.hybridpar.step(x, target=y, losses=[])` runs one step's forwards and
backwards on every rank (same global batch everywhere) and returns the batch's loss. `my_loss` must be a
mean over the samples (each micro-batch's loss is weighted by its share of the batch). Each rank's
optimizer steps the weights of its own stage. With --check, rank 0 also trains the same model in one
process on the same batches and prints the largest weight difference (JSON)."""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar


def chain_cnn(classes: int = 10) -> nn.Sequential:
    """A chain of layers (each feeds only the next): what 1F1B's stages need. No batch norm (its statistics
    would be each micro-batch's)."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, classes))


def my_loss(logits, y):
    """A mean over the samples, not a plain cross-entropy."""
    return F.cross_entropy(logits, y, label_smoothing=0.1) + 1e-3 * logits.pow(2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="mp=2")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = chain_cnn()
    reference = copy.deepcopy(model) if args.check else None
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, 3, 16, 16, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
               for _ in range(args.steps)]
    # the convolutions on device 0, the classifier on device 1 (a placement Plan from `hybridpar place
    # --schedule 1f1b --out` works too)
    model = hybridpar.parallelize(model, args.strategy, placement={"4": 1, "5": 1, "6": 1, "7": 1},
                                  micro_batches=args.micro_batches, schedule="1f1b", loss_fn=my_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

    for step, (x, y) in enumerate(batches):
        micro: list[torch.Tensor] = []
        loss = model.hybridpar.step(x, target=y, losses=micro)  # forwards and backwards, interleaved
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(json.dumps({"step": step, "loss": loss.item(), "micro_batch_losses": [m.item() for m in micro]}),
                  flush=True)

    state = hybridpar.full_state_dict(model)  # the undistributed weights, on every rank
    if args.check and dist.get_rank() == 0:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.05)
        for x, y in batches:
            my_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        diff = max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items())
        print(json.dumps({"strategy": args.strategy, "max_weight_diff": diff}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo ranks can abort in interpreter teardown


if __name__ == "__main__":
    main()
