"""The per-layer planner with spatial layouts (search.layers.spatial_plan): `--strategy height=2`
evaluated with the halo exchanges' bytes, the runtime's refusals, and the uniform spatial layouts as
candidates beside the sample/channel/filter search, with the reason in the plan's notes."""

import re

import pytest
import torch
from torch import nn

from hybridpar.cost.layout_comm import halo_collectives
from hybridpar.cost.scaling import graph_at_batch
from hybridpar.cost.spatial import SLIDING
from hybridpar.errors import UserError
from hybridpar.graph.tracing import trace
from hybridpar.layout import LayerLayout
from hybridpar.search.graph_cache import traced_graph
from hybridpar.search.layers.planner import plan_model


def test_fixed_height2_is_evaluated_with_its_halo_bytes():
    r = plan_model("small_cnn", "localhost", gpus=2, batch=2, strategy="height=2")
    assert r.plan.default_layout == LayerLayout(height=2) and r.plan.layers == {} and r.plan.batch == 2
    # the bytes: every conv's and pool's halo as cost.layout_comm prices it (= what the runtime sends)
    graph = graph_at_batch(traced_graph("small_cnn", None)[0], 2)
    first = next(n for n in graph.nodes if n.op in SLIDING)
    want = sum(op.bytes_ for n in graph.nodes if n.op in SLIDING
               for op in halo_collectives(n, LayerLayout(height=2), input_grad=n is not first))
    assert want > 0 and r.prediction.comm_bytes["halo"] == want
    assert any("fixed layout height=2" in n for n in r.plan.notes)
    assert all(row.choice == "height=2" for row in r.layers)
    # a rank holds half of each sample's rows: less activation memory than one process on the batch
    whole = plan_model("small_cnn", "localhost", gpus=1, batch=2, strategy="sample=1")
    assert r.prediction.memory_bytes[0] < whole.prediction.memory_bytes[0]


def test_refused_spatial_layouts():
    with pytest.raises(UserError, match="depth split on a 2-D layer"):
        plan_model("small_cnn", "localhost", gpus=2, batch=2, strategy="depth=2")


def test_refused_module_is_named():
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv2d(8, 4, 3, padding=1))
    g = trace(m, torch.randn(1, 3, 8, 8), "gn")
    with pytest.raises(UserError, match=r"module '1' is a layer/group/instance norm"):
        plan_model(g, "localhost", gpus=2, batch=2, strategy="height=2")


def _speedup(notes: list[str]) -> float:
    note = next(n for n in notes if n.startswith("spatial chosen for time"))
    return float(re.search(r"\(([\d.]+)x speed-up\)", note).group(1))


def test_unet_goes_spatial_for_time():
    r = plan_model("unet", "lassen", gpus=16, batch=2, input_shape=(3, 256, 256))
    lay = r.plan.default_layout
    assert lay.spatial > 1 and lay.sample * lay.spatial == 16 and r.plan.layers == {}
    assert _speedup(r.plan.notes) > 1.2
    assert any(n.startswith("spatial: ") and "27 convolutions and poolings" in n for n in r.plan.notes)
    assert r.prediction.comm_bytes.get("halo", 0) > 0
    # the baseline it names, evaluated as a fixed layout, is the slower one
    base = re.search(r"uniform ([a-z=0-9,]+) \(", next(n for n in r.plan.notes if "chosen for time" in n)).group(1)
    other = plan_model("unet", "lassen", gpus=16, batch=2, input_shape=(3, 256, 256), strategy=base)
    assert other.prediction.step_time_s > r.prediction.step_time_s
    assert other.prediction.step_time_s / r.prediction.step_time_s == pytest.approx(_speedup(r.plan.notes), rel=0.01)


def test_small_resnet_stays_off_spatial():
    r = plan_model("small_resnet", "lassen", gpus=16, batch=2)
    assert r.plan.default_layout.spatial == 1
    assert any(n.startswith("no layer goes spatial: the best uniform spatial layout") and n.endswith("slower")
               for n in r.plan.notes)


@pytest.mark.slow
def test_acceptance_unet_1024_and_resnet50_on_64_lassen_gpus():
    r = plan_model("unet", "lassen", gpus=64, batch=8)
    assert r.plan.default_layout.spatial > 1 and _speedup(r.plan.notes) > 1
    r = plan_model("resnet50", "lassen", gpus=64, batch=8)
    # the layouts docs/spatial.md's figures price (scripts/write_figures.py's SPATIAL_RESNET): the plan's,
    # and the best spatial one, which splits channels too (spatial x channel/filter is searched; with one
    # sample group no rank sums the head's gradient: every rank computes the same one)
    assert r.plan.default_layout.to_strategy() == "sample=8,channel=2,filter=4"
    assert any(n.startswith("no layer goes spatial") for n in r.plan.notes)
    assert r.spatial["chosen"] is False and r.spatial["reason"] == "slower"
    assert r.spatial["best_spatial"]["layout"] == "height=4,width=4,channel=4"


def test_evaluate_plan_prices_a_spatial_plan_as_planned():
    from hybridpar.search.layers.planner import evaluate_plan

    r = plan_model("small_cnn", "localhost", gpus=2, batch=2, strategy="height=2")
    again = evaluate_plan(r.plan)
    assert again.step_time_s == pytest.approx(r.prediction.step_time_s)
    assert again.comm_bytes == r.prediction.comm_bytes and again.memory_bytes == r.prediction.memory_bytes


def test_split_output_is_gathered_for_the_loss():
    # the U-Net's per-pixel logits [N, 2, H, W] are split on height: gathered whole (the gathered result)
    r = plan_model("unet", "localhost", gpus=4, batch=4, input_shape=(3, 32, 48), strategy="sample=2,height=2")
    assert r.prediction.comm_bytes["allgather"] == 2 * 2 * 32 * 48 * 4  # this rank's 2 samples
    flat = plan_model("small_cnn", "localhost", gpus=2, batch=2, strategy="height=2")  # ends in [N, 10]
    assert "allgather" not in flat.prediction.comm_bytes


@pytest.mark.parametrize("strategy", ["height=2,channel=2", "height=2,filter=2"])
def test_spatial_channel_filter_is_priced(strategy):
    # spatial x channel/filter in one layer (issue 30): the halo on the channel piece and the channel/filter
    # collectives on the spatial window (tests/parallel/test_spatial_plan_bytes.py: = what the runtime sends)
    r = plan_model("small_cnn", "localhost", gpus=4, batch=2, strategy=strategy)
    assert r.plan.default_layout.to_strategy() == strategy and r.plan.layers == {}
    spatial = plan_model("small_cnn", "localhost", gpus=2, batch=2, strategy="height=2").prediction
    got = r.prediction.comm_bytes
    assert got["reduce_scatter"] > 0 and got["allgather"] > 0 and 0 < got["halo"] < spatial.comm_bytes["halo"]
    # a rank holds half of each piece's channels or filters: less memory than height=2 alone
    assert r.prediction.memory_bytes[0] < spatial.memory_bytes[0]
    # and the memory `hybridpar train` checks its peak against is the plan's (one proxy layout)
    from hybridpar.cost.memory import predict_rank_memory

    graph = traced_graph("small_cnn", None)[0]
    assert r.prediction.memory_bytes[0] == int(predict_rank_memory(graph, strategy, batch=2).total_bytes)


def test_plan_cli_states_the_spatial_comparison(capsys):
    """`hybridpar plan` says whether the plan goes spatial and why, in its notes (text) and as data
    (`--json`'s "spatial"): the U-Net at 256x256 on 16 Lassen GPUs goes spatial for time; a small ResNet
    does not, its best spatial layout predicted slower."""
    import json

    from hybridpar.cli.main import main

    args = ["plan", "--model", "unet", "--input-shape", "3,256,256", "--cluster", "lassen", "--gpus", "16",
            "--batch", "2"]
    assert main(args) == 0
    assert "note: spatial chosen for time" in " ".join(capsys.readouterr().out.split())
    assert main([*args, "--json"]) == 0
    sp = json.loads(capsys.readouterr().out)["spatial"]
    assert sp["chosen"] is True and sp["reason"] == "time" and sp["speedup"] > 1.2
    assert sp["best_spatial"]["step_time_s"] < sp["best_non_spatial"]["step_time_s"]
    assert sp["best_spatial"]["halo_bytes"] > 0
    assert main(["plan", "--model", "small_resnet", "--cluster", "lassen", "--gpus", "16", "--batch", "2",
                 "--json"]) == 0
    sp = json.loads(capsys.readouterr().out)["spatial"]
    assert sp["chosen"] is False and sp["reason"] == "slower" and sp["speedup"] < 1
    assert sp["best_spatial"]["step_time_s"] > sp["best_non_spatial"]["step_time_s"]
