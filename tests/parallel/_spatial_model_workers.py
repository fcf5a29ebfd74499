"""Models and rank functions for tests/parallel/test_spatial_model.py: CNNs written for these tests (not
the zoo's), trained through `hybridpar.parallelize` under spatial layouts and in one process."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridpar


class UNetish(nn.Module):
    """Strided convs, batch norm, max pool, a transposed conv and a nearest upsample back up, skip
    concatenation along channels; odd input sizes (33 x 47)."""

    def __init__(self, c: int = 4, classes: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.down1 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU())
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=2, dilation=2)
        self.up1 = nn.ConvTranspose2d(2 * c, 2 * c, 3, stride=2, padding=1)  # 9x12 -> 17x23 (= down1's)
        self.fuse1 = nn.Conv2d(4 * c, 2 * c, 3, padding=1)
        self.up2 = nn.Upsample(scale_factor=2, mode="nearest")  # 17x23 -> 34x46
        self.fuse2 = nn.Conv2d(3 * c, c, (3, 5), padding=(1, 2))
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x):
        s = self.stem(x)                     # 33 x 47
        d = self.down1(s)                    # 17 x 24
        m = F.relu(self.mid(self.pool(d)))   # 9 x 12
        u = self.up1(m)                      # 17 x 23
        u = torch.cat([u, d[..., :23]], 1)   # skip (cropped as U-Nets do)
        u = F.relu(self.fuse1(u))
        u = self.up2(u)[..., :33, :]         # 34 x 46 -> 33 x 46
        u = torch.cat([u, s[..., :46]], 1)
        return self.head(F.relu(self.fuse2(u)))  # per-pixel logits [N, classes, 33, 46]


class Dilated(nn.Module):
    """A dilated conv net with residual adds, avg pooling, global average pooling and a linear head."""

    def __init__(self, c: int = 6, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 5, stride=2, padding=2, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.blocks = nn.ModuleList(nn.Conv2d(c, c, 3, padding=d, dilation=d) for d in (1, 2, 4))
        self.pool = nn.AvgPool2d(2)
        self.grouped = nn.Conv2d(c, 2 * c, 3, padding=1, groups=2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        x = F.relu(self.grouped(self.pool(x)))
        return self.fc(torch.flatten(self.gap(x), 1))


class Small3d(nn.Module):
    """A CosmoFlow-like 3-D CNN: conv3d, batch norm, max/avg pooling, global pooling, MLP head."""

    def __init__(self, c: int = 4, out: int = 4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(2, c, 3, padding=1), nn.BatchNorm3d(c), nn.LeakyReLU(0.1), nn.MaxPool3d(2),
            nn.Conv3d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(), nn.AvgPool3d(2, stride=1),
            nn.Conv3d(2 * c, 2 * c, 2), nn.ReLU())
        self.gap = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * c, 8), nn.ReLU(), nn.Linear(8, out))

    def forward(self, x):
        return self.head(self.gap(self.features(x)))


class TFPadded(nn.Module):
    """TensorFlow-style "same" padding computed from the conv module's own geometry, as Hugging Face's
    MobileNet V1/V2 and EfficientNet do (`apply_tf_padding` reads `conv.stride`, `conv.kernel_size`,
    `conv.dilation`): the spatial layer that replaces the conv must answer those reads."""

    def __init__(self, c: int = 4, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c, classes)

    @staticmethod
    def _tf_pad(x, conv):
        pads = []
        for size, k, s, d in zip(x.shape[-2:], conv.kernel_size, conv.stride, conv.dilation):
            total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
            pads.append((total // 2, total - total // 2))
        (top, bottom), (left, right) = pads
        return F.pad(x, (left, right, top, bottom))

    def forward(self, x):
        x = F.relu(self.bn(self.conv(self._tf_pad(x, self.conv))))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean((2, 3)))


MODELS = {
    "unet": (UNetish, (4, 3, 33, 47), "pixels"),
    "dilated": (Dilated, (4, 3, 29, 19), "labels"),
    "cnn3d": (Small3d, (4, 2, 13, 11, 10), "labels"),
    "tfpad": (TFPadded, (4, 3, 15, 12), "labels"),
}


def build(name: str, dtype=torch.float64):
    cls, shape, kind = MODELS[name]
    torch.manual_seed(0)
    model = cls().to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    with torch.no_grad():
        out = model(x)
    if kind == "pixels":
        y = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]))
    else:
        y = torch.randint(0, out.shape[1], (out.shape[0],))
    return model, x, y


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def train_case(name: str, strategy: str, steps: int = 2, lr: float = 0.1) -> dict:
    """`steps` SGD steps of model `name` parallelized with `strategy` and in one process on the same
    batch: the largest weight, output and loss differences, and this rank's halo bytes per step."""
    ref, x, y = build(name)
    model = copy.deepcopy(ref)
    rec: dict = {"case": f"{name}/{strategy}"}
    try:
        hybridpar.parallelize(model, strategy)
        log = model.hybridpar.grid.comm_log
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
        out_err = loss_err = 0.0
        for _ in range(steps):
            log.mark_step()
            out, ref_out = model(x), ref(x)
            loss, ref_loss = F.cross_entropy(out, y), F.cross_entropy(ref_out, y)
            out_err = max(out_err, _err(out.detach(), ref_out.detach()))
            loss_err = max(loss_err, abs(float(loss.detach()) - float(ref_loss.detach())))
            loss.backward()
            ref_loss.backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        halo = log.step_bytes_by_kind().get("halo", 0)
        model.eval()
        ref.eval()
        with torch.no_grad():
            eval_err = _err(model(x), ref(x))
        full = hybridpar.full_state_dict(model)
        ref_state = ref.state_dict()
        assert set(full) == set(ref_state), sorted(set(full) ^ set(ref_state))
        w_err, where = max((_err(full[k], v), k) for k, v in ref_state.items() if v.is_floating_point())
        rec.update(weights=w_err, where=where, out=out_err, loss=loss_err, eval=eval_err, halo=halo)
    except Exception as e:  # noqa: BLE001 - reported per case, so the test names the failing one
        import traceback

        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}\n{traceback.format_exc()[-1500:]}"
        print(f"rank {dist.get_rank()} {rec['case']}: {rec['error']}", file=sys.stderr, flush=True)
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, rec)
    return {"case": rec["case"], "ranks": got}


def train_cases(cases: list[tuple[str, str]]) -> list[dict]:
    import faulthandler
    import os

    if os.environ.get("HP_DUMP"):
        faulthandler.dump_traceback_later(int(os.environ["HP_DUMP"]), exit=True)
    return [train_case(name, strategy) for name, strategy in cases]
