"""U-Net for 2-D segmentation (Ronneberger et al. 2015), the high-resolution model of spatial
parallelism (issue 30): padded 3x3 conv-BN-ReLU pairs, max-pool (or strided-conv) downsampling,
transposed-conv upsampling and skip concatenation. Our own sizes (no published count to match):
`base` channels at full resolution, doubled per level, `depth` downsamplings."""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.graph.zoo.registry import register


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    """Encoder of `depth` levels (a double conv, then downsampling by 2), a bottleneck, and a decoder that
    upsamples by a 2x2 stride-2 transposed conv, concatenates the skip and runs a double conv; a 1x1
    conv makes `num_classes` logits per pixel. Sizes divisible by 2**depth keep every skip aligned."""

    def __init__(self, in_channels: int = 3, num_classes: int = 2, base: int = 32, depth: int = 4,
                 down: str = "pool"):
        super().__init__()
        if down not in ("pool", "conv"):
            raise ValueError(f"down must be 'pool' or 'conv', got {down!r}")
        widths = [base * 2**i for i in range(depth + 1)]
        self.enc = nn.ModuleList()
        self.down = nn.ModuleList()
        cin = in_channels
        for w in widths[:-1]:
            self.enc.append(_double_conv(cin, w))
            self.down.append(nn.MaxPool2d(2) if down == "pool" else nn.Conv2d(w, w, 2, 2))
            cin = w
        self.bottleneck = _double_conv(cin, widths[-1])
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for w_hi, w in zip(reversed(widths[1:]), reversed(widths[:-1])):
            self.up.append(nn.ConvTranspose2d(w_hi, w, 2, 2))
            self.dec.append(_double_conv(2 * w, w))
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for enc, down in zip(self.enc, self.down):
            x = enc(x)
            skips.append(x)
            x = down(x)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


@register("unet", kind="cnn", input_shape=(3, 1024, 1024), num_classes=2,
          description="2-D segmentation U-Net, 4 levels (32..512 channels), max-pool down, transposed-conv up, "
                      "skip concat; 3x1024x1024 by default (any size divisible by 16: --input-shape)",
          reference="Ronneberger et al. 2015 (our sizes)")
def unet(in_channels: int = 3, num_classes: int = 2, base: int = 32, depth: int = 4, down: str = "pool") -> nn.Module:
    return UNet(in_channels, num_classes, base, depth, down)
