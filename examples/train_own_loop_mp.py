"""Model parallelism in your own loop: your model, loss and optimizer; hybridpar runs the layers on the
devices the placement gives them and hands the whole outputs back on every rank.

    torchrun --standalone --nproc-per-node 2 examples/train_own_loop_mp.py --strategy mp=2
    torchrun --standalone --nproc-per-node 4 examples/train_own_loop_mp.py --strategy mp=2,sample=2

Every rank builds the same model and passes the same global batch, here two inputs (an image and a
vector); the model returns a dict, and the loss is written as in one process. `loss.backward()` sends
the gradients back through the stages; each rank's optimizer steps the weights of its own stage (the
others are freed: meta tensors without gradients). Without --placement, rank 0 runs DLPlacer on the
example batch and every rank takes its answer (a placement plan from `hybridpar place --out` works too:
pass the Plan). With --check, rank 0 also trains the same model in one process on the same batches and
prints the largest weight difference (JSON)."""

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


class ImageAndVector(nn.Module):
    """A CNN branch for the image and an MLP branch for the vector, joined; batch norm in both."""

    def __init__(self, classes: int = 10, features: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.mlp = nn.Sequential(nn.Linear(features, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Linear(64, classes)
        self.value = nn.Linear(32, 1)

    def forward(self, image, vector):
        h = F.relu(self.conv2(F.relu(self.bn1(self.conv1(image))))).mean((2, 3))
        v = self.mlp(vector)
        return {"logits": self.head(torch.cat([h, v], dim=1)), "value": self.value(v).squeeze(1)}


def my_loss(out, y, target_value):
    """Any differentiable function of the whole outputs: here two heads, neither a plain cross-entropy."""
    smooth = F.cross_entropy(out["logits"], y, label_smoothing=0.1)
    return smooth + 0.5 * F.huber_loss(out["value"], target_value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="mp=2")
    ap.add_argument("--placement", default=None, help='JSON {"module": device}, e.g. {"mlp": 1, "head": 1}')
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = ImageAndVector()
    reference = copy.deepcopy(model) if args.check else None

    g = torch.Generator().manual_seed(1)
    batches = [((torch.randn(args.batch, 3, 16, 16, generator=g), torch.randn(args.batch, 8, generator=g)),
                torch.randint(0, 10, (args.batch,), generator=g), torch.randn(args.batch, generator=g))
               for _ in range(args.steps)]
    if args.placement:
        model = hybridpar.parallelize(model, args.strategy, placement=json.loads(args.placement))
    else:  # rank 0 places the model on the example batch, every rank runs its answer
        model = hybridpar.parallelize(model, args.strategy, example_inputs=batches[0][0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)

    for step, (inputs, y, value) in enumerate(batches):
        loss = my_loss(model(*inputs), y, value)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(json.dumps({"step": step, "loss": loss.item()}), flush=True)

    state = hybridpar.full_state_dict(model)  # the undistributed weights, on every rank
    if args.check and dist.get_rank() == 0:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.05)
        for inputs, y, value in batches:
            my_loss(reference(*inputs), y, value).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        diff = max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items()
                   if v.is_floating_point())
        print(json.dumps({"strategy": args.strategy, "max_weight_diff": diff}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo ranks can abort in interpreter teardown


if __name__ == "__main__":
    main()
