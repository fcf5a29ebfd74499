"""The model's own step under a sample or channel/filter layout, as `hybridpar profile --model M --splits
k` measured it on a fake world (hybridpar.profile.layout_steps), in the planner's layer costs.

The op table prices each op at its local shape and the runtime-overhead terms price the runtime's
work per node and per split layer, from synthetic chains. A model's DTensor layout can do work no
chain has (HF MobileNetV2's padding before every depthwise convolution, ConvNeXt's permutes and layer
norms): on 2026-12-04 the fake-world steps of HF ConvNeXt and MobileNetV2 under channel=2 were 1.5x and
1.7x what those terms priced, HF ResNet's 1.0x, a U-Net's 0.9x. Under a sample split the op table
times each op alone, and a step of many small ops (tiny transformers) runs them at another pace: HF
ViT's step at 8 samples per rank 1.2x, tiny BERT's 0.8x. Where the calibration holds such a
measurement for this model (same spec, batch, input shape and world size), every layer's forward and
backward under that layout is scaled by

    factor = measured rest x time share / the graph's priced forward and backward

(the layers and the nodes before the first layer: CosmoFlow's stem convolution is most of its step),
so that the uniform layout's priced compute equals the measurement, and the search compares layouts
with it (a plan mixing layouts takes each layer's own layout's factor; a layout not measured takes the
mean of the measured ones with the same channel x filter, labelled so). Bounded to [1/4, 4]: a factor
outside says the measurement is not of this graph.
"""

from __future__ import annotations

from hybridpar.plans import parse_strategy

FACTOR_RANGE = (0.25, 4.0)


def apply_measured(s, model, calibration, input_shape) -> None:
    """Set `s.ctx.measured` (and its note) from the calibration's fake-world steps of `model` at the
    shape the planner traced (`s.input_shape`; `input_shape`: the one it was given, None for the
    model's own); the layer costs priced before are dropped from the memo. `s`: the planner's _Setup."""
    from hybridpar.cost.compute import layout_steps_for
    from hybridpar.search.layers.planner import _evaluate_uniform, _prefix_time

    ctx = s.ctx
    if not isinstance(model, str) or ctx.ranks < 2:
        return
    steps = layout_steps_for(ctx.cluster.device, calibration, model, ctx.batch, s.input_shape, ctx.ranks)
    if not steps and input_shape is None:  # files before 2026-12-05 held the model's own shape as None
        steps = layout_steps_for(ctx.cluster.device, calibration, model, ctx.batch, None, ctx.ranks)
    factors: dict[tuple[int, int], float] = {}
    parts = []
    for st in steps:
        lay = parse_strategy(st.layout, st.world_size).layout
        if lay.spatial > 1 or (lay.sample > 1 and lay.g_size > 1):  # profile.layout_steps times neither
            continue
        opts, choice, _, _ = _evaluate_uniform(s, lay, "buckets")
        layers = sum(vo.costs[k].fwd_s + vo.costs[k].bwd_s for vo, k in zip(opts, choice))
        prefix = sum(_prefix_time(s.lg, opts[0].dist(choice[0]), ctx))
        if layers + prefix <= 0:
            continue
        want = st.rest_s * ctx.cluster.device.time_share
        raw = want / (layers + prefix)
        lo, hi = FACTOR_RANGE
        factors[(lay.channel, lay.filter)] = min(hi, max(lo, raw))
        parts.append(f"{lay.to_strategy()} x{factors[(lay.channel, lay.filter)]:.2f} ({want * 1e3:.1f} ms measured, "
                     f"{(layers + prefix) * 1e3:.1f} priced{', bounded' if not lo <= raw <= hi else ''})")
    if not factors:
        return
    ctx.layer_memo.clear()  # priced without the factors above
    ctx.measured = factors
    ctx.measured_notes = [
        "compute under " + ", ".join(parts) + ": this model's step measured by `hybridpar profile --model` on a "
        "fake world (collectives and redistributions apart), in place of the op table and the runtime's generic "
        "terms; each layer scaled by its layout's factor (a layout not measured: the mean of those with the "
        "same channel x filter)"]
