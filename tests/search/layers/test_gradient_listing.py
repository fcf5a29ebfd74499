"""Issue 13: the planner's and the placer's JSON list every parameterised module with its gradient
bytes, and the listed bytes sum to the predicted gradient allreduce (token model: embedding,
transformer encoder layer with attention and layer norms, LSTM, linear head)."""

from __future__ import annotations

import json

import pytest

from hybridpar.cli.main import main

MODEL = "tests/graph/data/user_models.py:tokens"


def _param_modules() -> dict[str, int]:
    """module -> elements of its own trainable parameters, from the model itself."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_models", "tests/graph/data/user_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, _ = mod.tokens()
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            owner = name.rpartition(".")[0]
            out[owner] = out.get(owner, 0) + p.numel()
    return out


def _json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("strategy,gpus", [("sample=2", 2), ("filter=2", 2)])
def test_plan_json_lists_every_parameterised_module(capsys, strategy, gpus):
    # --no-dry-run: the listing, not whether DTensor serves an LSTM under filter=2
    d = _json(capsys, ["plan", "--model", MODEL, "--strategy", strategy, "--gpus", str(gpus), "--batch", "6",
                       "--json", "--no-dry-run"])
    listed: dict[str, int] = {}
    for row in d["parameters"]:
        listed[row["module"]] = listed.get(row["module"], 0) + row["numel"]
    assert listed == _param_modules()  # embedding, attention, norms, feed-forward, LSTM, head
    ops = {row["op"] for row in d["parameters"]}
    assert {"embedding", "layernorm", "lstm", "linear"} <= ops
    total = sum(row["allreduce_bytes"] for row in d["parameters"])
    assert total == d["breakdown"]["grad_bytes"]
    if strategy == "sample=2":
        # the gradient allreduce plus the 4-byte loss allreduce hybridpar train reports
        assert d["predicted"]["comm_bytes"]["allreduce"] == total + 4
    else:  # one sample group: nothing to sum, yet every rank holds a gradient
        assert total == 0 and all(row["grad_bytes"] > 0 for row in d["parameters"])
    if strategy == "sample=2":
        assert total == 4 * sum(_param_modules().values())


def test_sharded_layers_list_their_shards(capsys):
    """Under sample=2,channel=2 conv and batch-norm gradients are the rank's channel shard; the
    listing still sums to the prediction's gradient allreduce."""
    d = _json(capsys, ["plan", "--model", "small_resnet", "--strategy", "sample=2,channel=2", "--gpus", "4",
                       "--batch", "8", "--json"])
    rows = d["parameters"]
    assert {r["op"] for r in rows} >= {"conv2d", "batchnorm", "linear"}
    assert sum(r["allreduce_bytes"] for r in rows) == d["breakdown"]["grad_bytes"] > 0
    whole = 4 * sum(r["numel"] for r in rows)
    assert sum(r["grad_bytes"] for r in rows) < whole  # shards, not whole layers


def test_norm_after_a_weight_layer_is_counted_once(tmp_path, capsys):
    """A LayerNorm folded into the linear layer before it was counted twice (as a follower and as a
    replicated layer)."""
    f = tmp_path / "ln.py"
    f.write_text("import torch\nfrom torch import nn\n\ndef factory():\n"
                 "    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))\n"
                 "    return m, (torch.randn(4, 8),)\n")
    d = _json(capsys, ["plan", "--model", f"{f}:factory", "--strategy", "sample=2", "--gpus", "2", "--batch", "6",
                       "--json"])
    params = (8 * 16 + 16) + 2 * 16 + (16 * 4 + 4)
    assert d["breakdown"]["grad_bytes"] == 4 * params
    assert d["predicted"]["comm_bytes"]["allreduce"] == 4 * params + 4


def test_place_json_lists_every_parameterised_module(capsys):
    d = _json(capsys, ["place", "--model", MODEL, "--gpus", "2", "--batch", "6", "--time-limit", "5", "--json"])
    listed: dict[str, int] = {}
    for row in d["parameters"]:
        listed[row["module"]] = listed.get(row["module"], 0) + row["numel"]
        assert row["device"] in d["device_ids"]
    assert listed == _param_modules()
    assert sum(row["grad_bytes"] for row in d["parameters"]) == d["grad_bytes"] == 4 * sum(listed.values())
