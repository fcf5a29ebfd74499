"""Every module with parameters is named in the placer's placement, including those whose weights no
module call uses (nn.MultiheadAttention's in-projection), and a module the MP runtime runs as one node
(torch.nn's own, e.g. attention or a Transformer layer) is one task of the placer: one device."""

import torch
from torch import nn

from hybridpar.search.placer import place_model
from hybridpar.search.placer.adapter import runtime_leaves
from hybridpar.search.placer.api import model_graph


class _AttnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.fc = nn.Linear(16, 10)

    def forward(self, t):
        x = self.emb(t)
        a, _ = self.attn(x, x, x)
        return self.fc(self.enc(a)[:, -1])


def test_every_parameterised_module_is_placed_and_runtime_leaves_stay_whole():
    from hybridpar.parallel.pipeline.partition import partition_module

    torch.manual_seed(0)
    model = _AttnModel()
    assert runtime_leaves(model) == ("emb", "attn", "enc", "fc")
    fine, _ = model_graph((model, (torch.randint(0, 50, (4, 8)),)), 4)
    out = place_model(fine, "dgx1-v100", 2, solver="etf")
    placement = out.plan.placement
    owners = {name for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    assert "attn" in owners and "enc.self_attn" in owners  # in-projections: parameters of the attention
    assert owners <= set(placement)
    # a leaf's nodes (in-projection, attention, out-projection, ...) are members of one task
    task_of = {m: n.name for n in out.graph.nodes for m in (n.attr("members") or (n.name,))}
    for leaf in ("attn", "enc"):
        inside = [n.name for n in fine.nodes if (n.attr("scope") or "") in (leaf,) or
                  (n.attr("scope") or "").startswith(f"{leaf}.")]
        assert len(inside) > 3 and len({task_of[x] for x in inside}) == 1
    # the runtime takes the placement as it is and puts the weights where the placer priced them
    part = partition_module(model, placement, 2)
    assert part.owner_of_key["attn.in_proj_weight"] == placement["attn"] == placement["attn.out_proj"]
    assert part.owner_of_key["enc.self_attn.in_proj_weight"] == placement["enc"] == placement["enc.self_attn"]
