"""Your model, your loop, your optimizer and loss; hybridpar only splits the work.

    torchrun --standalone --nproc-per-node 4 examples/train_own_loop.py --strategy sample=2,channel=2

Every rank builds the same model and passes the same global batch; the outputs come back whole on
every rank, so the loss is written as in one process. With --check, rank 0 also trains the same
model in one process on the same batches and prints the largest weight difference (JSON)."""

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


class Net(nn.Module):
    """A small CNN with the habits of real models: it checks its input, mixes channels between
    layers (squeeze-excitation) and reshapes with sizes it reads."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.se = nn.Sequential(nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 32), nn.Sigmoid())
        self.head = nn.Linear(32 * 8 * 8, classes)

    def forward(self, x):
        if x.size(1) != 3:
            raise ValueError(f"expected RGB input, got {x.size(1)} channels")
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.conv2(h))
        h = h * self.se(h.mean((2, 3)))[:, :, None, None]
        n, c, hh, ww = h.shape
        return self.head(h.reshape(n, c * hh * ww))


def smooth_l1_on_one_hot(logits, y):
    """Not a cross-entropy: any differentiable loss of the whole outputs works."""
    return F.smooth_l1_loss(logits, F.one_hot(y, logits.shape[-1]).float())


def train(strategy: str, steps: int, batch: int, check: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model) if check else None

    model = hybridpar.parallelize(model, strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(steps)]
    for step, (x, y) in enumerate(batches):
        loss = smooth_l1_on_one_hot(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(json.dumps({"strategy": strategy, "step": step, "loss": loss.item()}), flush=True)

    state = hybridpar.full_state_dict(model)  # the undistributed weights, on every rank
    if check and dist.get_rank() == 0:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.05)
        for x, y in batches:
            smooth_l1_on_one_hot(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        diff = max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items()
                   if v.is_floating_point())
        print(json.dumps({"strategy": strategy, "max_weight_diff": diff}), flush=True)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    # several layouts are trained one after another in the same ranks (the tests check three in one launch)
    ap.add_argument("--strategy", nargs="+", default=["sample=2,channel=2"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    for strategy in args.strategy:
        train(strategy, args.steps, args.batch, args.check)
    dist.destroy_process_group()
    os._exit(0)  # gloo ranks can abort in interpreter teardown


if __name__ == "__main__":
    main()
