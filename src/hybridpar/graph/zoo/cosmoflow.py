"""CosmoFlow-like 3-D CNN (Mathuriya et al. SC18; the MLPerf HPC CosmoFlow reference): 4x128^3 dark
matter density volumes to 4 cosmological parameters, the 3-D model of spatial parallelism (Oyama et
al. TPDS'21 split its depth). Five conv3d-LeakyReLU-maxpool levels, then a small MLP."""

from __future__ import annotations

from torch import nn

from hybridpar.graph.zoo.registry import register


class CosmoFlow(nn.Module):
    """`levels` x [Conv3d(k=3, padding 1) -> LeakyReLU -> MaxPool3d(2)], channels `base * 2**min(i, 3)`
    (32, 64, 128, 256, 256 at the default), average-pooled to `edge`^3 (an identity at 128^3: the
    reference's 4^3; it lets --input-shape change the volume), flattened into Linear(128) -> Linear(64)
    -> Linear(outputs)."""

    def __init__(self, in_channels: int = 4, outputs: int = 4, base: int = 32, levels: int = 5, edge: int = 4):
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for i in range(levels):
            cout = base * 2 ** min(i, 3)
            layers += [nn.Conv3d(cin, cout, 3, 1, 1), nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
            cin = cout
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool3d(edge))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(cin * edge**3, 128), nn.LeakyReLU(0.3),
                                  nn.Linear(128, 64), nn.LeakyReLU(0.3), nn.Linear(64, outputs))

    def forward(self, x):
        return self.head(self.features(x))


@register("cosmoflow", kind="cnn", input_shape=(4, 128, 128, 128), num_classes=4,
          description="CosmoFlow-like 3-D CNN: 5 conv3d-LeakyReLU-maxpool levels on 4x128^3 volumes "
                      "(--input-shape C,D,H,W), MLP head",
          reference="Mathuriya et al. SC18, MLPerf HPC CosmoFlow (our sizes)")
def cosmoflow(in_channels: int = 4, outputs: int = 4, base: int = 32, levels: int = 5, edge: int = 4) -> nn.Module:
    return CosmoFlow(in_channels, outputs, base, levels, edge)
