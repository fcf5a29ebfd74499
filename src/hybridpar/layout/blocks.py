"""Blocks: the units FSDP shards and recomputation checkpoints (hybridpar.parallel.fsdp.blocks on a
module; `block_of` from module names alone, for the cost model and the planner), and a plan's per-block
choice of sharding read from its per-layer layouts (issue 31: each block replicated, zero=2 or zero=3).
Pure Python: the runtime, the cost model and the plan checks share one rule."""

from __future__ import annotations

from collections.abc import Mapping

from hybridpar.layout.layer import LayerLayout

__all__ = ["block_of", "block_zeros", "same_but_zero"]


def block_of(module: str) -> str:
    """The runtime's block (hybridpar.parallel.fsdp.blocks: what FSDP shards and recomputation
    checkpoints) that module `module` belongs to: the root's child, or an item of a ModuleList child
    ("layers.3"); "" for the root itself."""
    parts = module.split(".") if module else []
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0] if parts else ""


def same_but_zero(a: LayerLayout, b: LayerLayout) -> bool:
    """Whether two layouts split the same way and differ at most in how the sample dimension holds the
    parameters (a mixed per-block plan)."""
    return a.model_copy(update={"zero": 0}) == b.model_copy(update={"zero": 0})


def block_zeros(layers: Mapping[str, LayerLayout], default: LayerLayout) -> tuple[dict[str, int], str | None]:
    """(block -> zero level of the layers a plan names in it, why not): the layers of one block must
    agree (FSDP shards a block as one unit); blocks no layer names take the default layout's."""
    out: dict[str, int] = {}
    for name, lay in sorted(layers.items()):
        b = block_of(name)
        if out.setdefault(b, lay.zero) != lay.zero:
            return out, (f"block {b or '<root>'!r}: its layers differ in zero level ({out[b]} and {lay.zero} at "
                         f"{name!r}); a block is sharded or replicated as one unit")
    return out, None
