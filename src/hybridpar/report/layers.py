"""Per-layer rows of the report: every layer the runtime splits, with its layout and predictions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hybridpar.plans import LayerLayout, Plan

# The layers whose weights a layout splits; the rest follow their neighbours' layout.
_SPLIT_TYPES = (nn.Conv2d, nn.Linear)


@dataclass(frozen=True)
class LayerRow:
    name: str
    kind: str
    layout: LayerLayout
    overridden: bool  # set in plan.layers (else the plan's default layout)
    predicted: dict[str, float] = field(default_factory=dict)


def zoo_split_layers(model: str) -> tuple[list[tuple[str, str]] | None, str | None]:
    """(module name, kind) of a zoo model's conv/linear layers, or (None, why) when not a zoo model.

    Built on the meta device: no memory, so a 1.8 B-parameter model lists as fast as a small one.
    User factory files are not imported: a report never runs a user's code.
    """
    from hybridpar.graph.zoo import ZOO

    entry = ZOO.get(model)
    if entry is None:
        return None, f"model {model!r} is not in the zoo; layers listed from the plan only"
    try:
        with torch.device("meta"):
            module = entry.build()
    except Exception as err:  # a zoo factory that cannot build on meta still gets a report
        return None, f"could not list the layers of {model!r} ({type(err).__name__}); plan layers only"
    return [(n, type(m).__name__) for n, m in module.named_modules() if isinstance(m, _SPLIT_TYPES)], None


def layer_rows(plan: Plan, model_layers: list[tuple[str, str]] | None) -> list[LayerRow]:
    per_layer = plan.predicted.per_layer if plan.predicted else {}
    rows: list[LayerRow] = []
    seen: set[str] = set()
    names = [(n, k) for n, k in (model_layers or [])]
    names += [(n, "?") for n in plan.layers if n not in {m for m, _ in names}]
    names += [(n, "?") for n in per_layer if n not in {m for m, _ in names}]
    for name, kind in names:
        if name in seen:
            continue
        seen.add(name)
        rows.append(LayerRow(name, kind, plan.layout_of(name), name in plan.layers,
                             dict(per_layer.get(name, {}))))
    return rows
