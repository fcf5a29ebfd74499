"""ResNet-50/101/152 (He et al. 2016, v1.5: stride on the 3x3 conv) and its wide variants, in plain PyTorch.

Layer names follow torchvision (conv1, bn1, layer1.0.conv1, ..., fc) so that published checkpoints and
plans keyed by module name line up. Parameter counts equal torchvision's (reference in each `register`).

Widening rule (Wide-ResNet-50-2, Zagoruyko & Komodakis 2016, as in torchvision, and the wide ResNet-50s of
Dryden et al. SC19): the bottleneck width -- in and out channels of every 3x3 convolution, hence the
output of the 1x1 reduce and the input of the 1x1 expand -- is multiplied by k; the outer (expanded)
channels, the stem and the classifier are unchanged. So `resnet50_w2` is Wide-ResNet-50-2.
"""

from __future__ import annotations

from torch import nn

from hybridpar.graph.zoo.registry import register

_TV = "torchvision.models.resnet (BSD-3), parameter count as listed in torchvision's model table"


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, width_factor: int = 1):
        super().__init__()
        width = planes * width_factor
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, int, int, int], num_classes: int = 1000, width_factor: int = 1,
                 in_channels: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = 64
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stage = []
            for b in range(blocks):
                stride = 2 if (i > 0 and b == 0) else 1
                stage.append(Bottleneck(inplanes, planes, stride, width_factor))
                inplanes = planes * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.avgpool(x)))


_IMG = {"kind": "cnn", "input_shape": (3, 224, 224), "num_classes": 1000}


@register("resnet50", **_IMG, published_params=25_557_032, reference=_TV,
          description="ResNet-50 v1.5 (ImageNet, 224x224)")
def resnet50(num_classes: int = 1000) -> nn.Module:
    return ResNet((3, 4, 6, 3), num_classes)


@register("resnet101", **_IMG, published_params=44_549_160, reference=_TV,
          description="ResNet-101 v1.5 (ImageNet, 224x224)")
def resnet101(num_classes: int = 1000) -> nn.Module:
    return ResNet((3, 4, 23, 3), num_classes)


@register("resnet152", **_IMG, published_params=60_192_808, reference=_TV,
          description="ResNet-152 v1.5 (ImageNet, 224x224)")
def resnet152(num_classes: int = 1000) -> nn.Module:
    return ResNet((3, 8, 36, 3), num_classes)


@register("wide_resnet50_2", **_IMG, published_params=68_883_240, reference=_TV,
          description="Wide-ResNet-50-2: bottleneck (3x3) width x2 (Zagoruyko & Komodakis 2016)")
def wide_resnet50_2(num_classes: int = 1000) -> nn.Module:
    return ResNet((3, 4, 6, 3), num_classes, width_factor=2)


def _wide(k: int):
    def factory(num_classes: int = 1000) -> nn.Module:
        return ResNet((3, 4, 6, 3), num_classes, width_factor=k)
    return factory


_DRYDEN = ("Dryden et al., 'Channel and Filter Parallelism for Large-Scale CNN Training', SC19 (wide "
           "ResNet-50s); widening rule of Wide-ResNet (see module docstring). No published count: ours.")

for _k in (2, 4, 8):
    register(f"resnet50_w{_k}", **_IMG, reference=_DRYDEN,
             published_params=68_883_240 if _k == 2 else None,
             description=f"ResNet-50 with every 3x3 bottleneck conv widened x{_k} (Dryden et al. SC19)")(_wide(_k))
