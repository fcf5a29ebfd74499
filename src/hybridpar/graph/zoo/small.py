"""Small models for fast CPU runs and distributed tests (our own definitions, no published size)."""

from __future__ import annotations

from torch import nn

from hybridpar.graph.zoo.registry import register


def _conv_bn_relu(cin: int, cout: int, k: int = 3, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=False)]


@register("small_cnn", kind="cnn", input_shape=(3, 32, 32), num_classes=10,
          description="4 conv-BN-ReLU layers, 2 max-pools, GAP and an FC (fast CPU tests)",
          reference="hybridpar's own test model")
def small_cnn(in_channels: int = 3, num_classes: int = 10, width: int = 16) -> nn.Module:
    w = width
    return nn.Sequential(
        *_conv_bn_relu(in_channels, w), *_conv_bn_relu(w, w), nn.MaxPool2d(2),
        *_conv_bn_relu(w, 2 * w), *_conv_bn_relu(2 * w, 2 * w), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, num_classes),
    )


class BasicBlock(nn.Module):
    """ResNet basic block (He et al. 2016): two 3x3 convs and a residual add."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class SmallResNet(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 16, blocks: int = 1):
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(in_channels, w, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU()
        layers = []
        cin = w
        for stage, cout in enumerate((w, 2 * w, 4 * w)):
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, stride=2 if (stage > 0 and b == 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(self.flatten(self.avgpool(x)))


@register("small_resnet", kind="cnn", input_shape=(3, 32, 32), num_classes=10,
          description="3-stage ResNet of basic blocks (16/32/64 channels) for fast CPU runs",
          reference="hybridpar's own test model (ResNet basic block, He et al. 2016)")
def small_resnet(in_channels: int = 3, num_classes: int = 10, width: int = 16, blocks: int = 1) -> nn.Module:
    return SmallResNet(in_channels, num_classes, width, blocks)
