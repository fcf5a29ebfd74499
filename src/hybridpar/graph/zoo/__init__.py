"""Built-in model zoo in plain PyTorch (torchvision does not work with this torch build).

Each model module registers its factories with `@register`; importing this package imports them all.
"""

from __future__ import annotations

import importlib
import pkgutil

from hybridpar.graph.zoo.registry import ZOO, ZooEntry, register

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "registry":
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["ZOO", "ZooEntry", "register"]
