"""VGG-16 (Simonyan & Zisserman 2015, configuration D) in plain PyTorch, torchvision layout."""

from __future__ import annotations

from torch import nn

from hybridpar.graph.zoo.registry import register

_CFG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    def __init__(self, cfg=_CFG_D, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
                c = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Linear(c * 7 * 7, 4096), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.flatten(self.avgpool(self.features(x))))


@register("vgg16", kind="cnn", input_shape=(3, 224, 224), num_classes=1000, published_params=138_357_544,
          reference="torchvision.models.vgg16 (BSD-3), parameter count as listed in torchvision's model table",
          description="VGG-16 (configuration D, no batch norm; ImageNet 224x224)")
def vgg16(num_classes: int = 1000) -> nn.Module:
    return VGG(_CFG_D, num_classes)
