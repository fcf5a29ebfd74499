"""Zoo models at sizes this 2-core machine trains in seconds, for the held-out validation
(benchmarks/holdout.yaml): `hybridpar train --model benchmarks/_holdout_models.py:unet_64`."""

from __future__ import annotations

from hybridpar.graph.models import load_model


def _zoo(name: str, shape: tuple[int, ...]):
    m = load_model(name, batch=2, input_shape=shape)
    return m.module, tuple(m.example_inputs)


def unet_64():
    """The zoo's U-Net (transposed convolutions, skip concatenations) at 3x64x64."""
    return _zoo("unet", (3, 64, 64))


def cosmoflow_32():
    """The zoo's CosmoFlow-like 3-D CNN (Conv3d, MaxPool3d) at 4x32x32x32."""
    return _zoo("cosmoflow", (4, 32, 32, 32))
