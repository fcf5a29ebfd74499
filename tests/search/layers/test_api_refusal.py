"""One rule refuses a layout the runtime cannot run, in the Python API and the CLI alike: a recurrent
layer (nn.LSTM/GRU/RNN) under a channel/filter layout (the runtime's dry run fails inside it:
"aten.addmm got mixed torch.Tensor and DTensor"). `plan_model` planned filter=2 and channel=2 for
lstm2 where `hybridpar plan --strategy` refused (with --dry-run), and its search planned channel/filter
layouts for lstm2 at a batch data parallelism cannot split (`--gpus 2 --batch 1`)."""

from __future__ import annotations

import pytest

from hybridpar.cli.main import main
from hybridpar.cost.layout_comm import layout_refusal
from hybridpar.errors import UserError
from hybridpar.graph.models import load_model
from hybridpar.graph.tracing import trace
from hybridpar.search.layers.planner import plan_model


@pytest.fixture(scope="module")
def lstm2_graph():
    m = load_model("lstm2", batch=2)
    return trace(m.module, m.example_inputs)


@pytest.mark.parametrize("strategy", ["filter=2", "channel=2"])
def test_api_and_cli_refuse_with_one_message(strategy, lstm2_graph, capsys):
    reason = layout_refusal(lstm2_graph, strategy)
    assert reason and "lstm1" in reason and "\n" not in reason
    with pytest.raises(UserError) as err:
        plan_model("lstm2", "localhost", 2, 8, strategy=strategy)
    assert str(err.value) == reason
    capsys.readouterr()
    assert main(["plan", "--model", "lstm2", "--gpus", "2", "--batch", "8", "--strategy", strategy]) == 2
    assert capsys.readouterr().err.strip() == f"hybridpar: error: {reason}"


def test_sample_layouts_and_models_without_recurrent_layers_pass(lstm2_graph):
    assert layout_refusal(lstm2_graph, "sample=2") is None
    m = load_model("small_cnn", batch=2)
    assert layout_refusal(trace(m.module, m.example_inputs), "filter=2") is None


def test_search_offers_only_what_the_rule_accepts():
    """At batch 4 on 2 devices the search keeps to sample=2; at batch 1 nothing is left: refused."""
    res = plan_model("lstm2", "localhost", 2, 4)
    assert res.plan.default_layout.channel * res.plan.default_layout.filter == 1
    assert all(lay.channel * lay.filter == 1 for lay in res.plan.layers.values())
    with pytest.raises(UserError, match="lstm1"):
        plan_model("lstm2", "localhost", 2, 1)


def test_what_if_prices_it_and_says_so(capsys):
    """runnable_only=False (the CLI's --no-dry-run) prices the layout anyway, labelled a what-if."""
    res = plan_model("lstm2", "localhost", 2, 8, strategy="filter=2", runnable_only=False)
    assert any(n.startswith("WHAT-IF") and "lstm1" in n for n in res.plan.notes)
    capsys.readouterr()
    assert main(["plan", "--model", "lstm2", "--gpus", "2", "--batch", "8", "--strategy", "filter=2",
                 "--no-dry-run"]) == 0
    assert "WHAT-IF" in capsys.readouterr().out
