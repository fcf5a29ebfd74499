"""The recurrent time-step wavefront executed (issue 32 item 3): recurrent layers split into K time
chunks across the placement's devices, their state carried chunk to chunk and their chunk outputs
device to device, backward in reverse; a 4-layer LSTM LM (one stacked nn.LSTM, split per layer) and
the zoo's GNMT (tiny) train under mp=2 with K=4 equal to one process (fp64), in the user's own loop."""

from __future__ import annotations

import pytest
from torch import nn

from hybridpar.train.launch import spawn

from . import _mp_wavefront_workers as w


def _check(cases, results, tol=1e-9):
    for (name, how, k), res in zip(cases, results):
        ref, ref_losses = w.serial(name)
        label = f"{name} {how} K={k}"
        assert res["state"].keys() == ref.keys(), label
        for key, v in ref.items():
            err = float((res["state"][key] - v).abs().max())
            assert err <= tol, f"{label}: {key} differs by {err:.2e}"
        assert res["losses"] == pytest.approx(ref_losses, rel=tol, abs=tol), label
        assert res["time_chunks"] == k, label


@pytest.mark.slow  # one 2-rank world for the three cases: ~16-28 s here, most of it starting the ranks
@pytest.mark.timeout(300)
def test_wavefront_mp2_k4_equals_one_process():
    cases = [("lm4", "plan", 4), ("gnmt", "plan", 4), ("lm4", "placer", 4)]
    results = spawn(w.run_cases, 2, cases)
    _check(cases, results)
    for (name, how, _k), res in zip(cases, results):
        # the layers' time chunks cross devices one by one (the wavefront), not whole sequences
        assert res["chunk_moves"] >= 4, (name, how, res["chunk_moves"])
    assert results[0]["placement"]["lstm[2]"] == 1  # one nn.LSTM's layers on two devices
    # the placer's own placement splits the stacked LSTM too (devices too small for the whole model)
    placed = results[2]["placement"]
    assert {placed[f"lstm[{i}]"] for i in range(4)} == {0, 1}, placed


@pytest.mark.slow  # a 4-rank world: ~20-40 s here
@pytest.mark.timeout(300)
def test_wavefront_mp2_sample2_uneven_chunks_equals_one_process():
    """mp=2 x sample=2 with K=3 chunks of 8 steps (3, 3, 2): each replica's samples through the wavefront."""
    cases = [("lm4", "plan", 3), ("gnmt", "plan", 3)]
    results = spawn(w.run_hybrid, 4, [name for name, _, _ in cases], 3)
    _check(cases, results)
    assert all(res["chunk_moves"] >= 3 for res in results), [res["chunk_moves"] for res in results]


def test_refusals_are_one_line_before_start():
    from torch import nn

    from hybridpar.errors import UserError
    from hybridpar.parallel.pipeline.partition import partition_module

    from .wavefront_models import LSTMLM

    lm = LSTMLM()
    lm.lstm.dropout = 0.1  # dropout between the stacked layers
    with pytest.raises(UserError, match="dropout") as err:
        partition_module(lm, {"lstm[2]": 1}, 2, time_chunks=4)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="time chunks"):
        partition_module(LSTMLM(), {"lstm[2]": 1}, 2, time_chunks=1)  # a layer placed alone needs K >= 2
    bi = LSTMLM()
    bi.lstm = nn.LSTM(12, 6, num_layers=2, batch_first=True, bidirectional=True)
    with pytest.raises(UserError, match="bidirectional"):
        partition_module(bi, {"lstm[1]": 1}, 2, time_chunks=4)
    # a bidirectional module is served whole, on its device
    part = partition_module(bi, {"lstm": 1}, 2, time_chunks=4)
    assert [n for n in part.device_of if n.startswith("lstm")] == ["lstm"]


def _place_on_small_devices(tmp_path, capsys, model: str, out) -> int:
    """`hybridpar place` with time chunks on two localhost-like devices of 600 KB each (tiny GNMT needs
    838 KiB in all): its placement must use both."""
    import yaml

    from hybridpar.cli.main import main
    from hybridpar.cluster.loader import PRESET_DIR

    spec = yaml.safe_load((PRESET_DIR / "localhost.yaml").read_text())
    spec.update(name="two-small-devices", gpus_per_node=2)
    spec["device"]["memory_bytes"]["value"] = 6.0e5
    cluster = tmp_path / "small.yaml"
    cluster.write_text(yaml.safe_dump(spec))
    code = main(["place", "--model", model, "--cluster", str(cluster), "--gpus", "2", "--batch", "8",
                 "--time-chunks", "4", "--time-limit", "5", "--out", str(out)])  # any feasible placement splits
    capsys.readouterr()
    return code


def _train(tmp_path, capsys, model: str, *args: str) -> tuple[dict, list[float], dict]:
    import json

    import torch

    from hybridpar.cli.main import main

    out = tmp_path / f"w{len(list(tmp_path.iterdir()))}.pt"
    code = main(["train", "--model", model, *args, "--batch", "8", "--steps", "3", "--no-shuffle",
                 "--precision", "fp64", "--save", str(out), "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    res = json.loads(cap.out)
    return torch.load(out, weights_only=True), [s["loss"] for s in res["steps"]], res


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_cli_time_chunks_equals_one_process(tmp_path, capsys):
    """`hybridpar train --time-chunks 4` under mp=2: the LM with a plan placing its stacked LSTM's
    layers on two devices, and tiny GNMT placed by `hybridpar place` on devices too small to hold it
    whole (so that the placer's placement splits it), equal one process (fp64)."""
    import json
    from pathlib import Path


    models = Path(__file__).with_name("wavefront_models.py")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "lm", "world_size": 2, "batch": 8, "dp": 1, "mp": 2,
                                "placement": {"lstm[2]": 1, "lstm[3]": 1, "head": 1}}))
    placed = tmp_path / "gnmt_plan.json"
    assert _place_on_small_devices(tmp_path, capsys, f"{models}:gnmt_tiny", placed) == 0
    for factory, how in (("lm_logits", ["--plan", str(plan)]), ("gnmt_tiny", ["--plan", str(placed)])):
        model = f"{models}:{factory}"
        one, loss1, _ = _train(tmp_path, capsys, model, "--strategy", "sample=1", "--nproc", "1")
        got, loss2, res = _train(tmp_path, capsys, model, *how, "--time-chunks", "4")
        assert loss2 == pytest.approx(loss1, rel=1e-9), factory
        for k in one:
            err = float((got[k] - one[k]).abs().max())
            assert err <= 1e-9, f"{factory} {k}: {err:.2e}"
        if factory == "lm_logits":  # the one nn.LSTM's layers are split between the ranks, two each
            by_type = res["param_bytes_by_type_per_rank"]
            assert by_type[0]["other"] == by_type[1]["other"] > 0, by_type
        assert min(res["param_bytes_per_rank"]) > 0, (factory, res["param_bytes_per_rank"])  # both ranks compute


class _Stack(nn.Module):
    """Embedding, a stacked recurrent module (any cell, either layout, LSTM with a projection), a scaled
    dropout and a residual between it and a second one, and a head; returns the final state too."""

    def __init__(self, cell: type, batch_first: bool, proj: int = 0):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.rnn = cell(8, 8, num_layers=3, batch_first=batch_first, **({"proj_size": proj} if proj else {}))
        self.drop = nn.Dropout(0.0)
        self.rnn2 = cell(proj or 8, proj or 8, batch_first=batch_first)
        self.head = nn.Linear(proj or 8, 20)
        self.lstm, self.seq_first = cell is nn.LSTM, not batch_first

    def forward(self, ids, bias):
        x = self.embed(ids)
        y, state = self.rnn(x.transpose(0, 1) if self.seq_first else x)
        z, _ = self.rnn2(self.drop(y) * 2.0 + bias)
        return self.head(z + y), state[0] if self.lstm else state


@pytest.mark.parametrize("cell,batch_first,proj", [(nn.LSTM, True, 0), (nn.LSTM, False, 4), (nn.GRU, True, 0),
                                                   (nn.RNN, False, 0)])
@pytest.mark.parametrize("steps", [7, 2])  # 2 steps in 3 chunks: an empty chunk
def test_rewritten_graph_equals_the_module_in_one_process(cell, batch_first, proj, steps):
    """The wavefront graph (every layer per chunk, the state carried, time-wise ops per chunk, a whole-
    sequence input sliced per chunk) computes the module's outputs and gradients (fp64)."""
    import torch

    from hybridpar.parallel.pipeline.partition import partition_module

    torch.manual_seed(0)
    m = _Stack(cell, batch_first, proj).double()
    ids = torch.randint(0, 20, (3, steps))
    width = proj or 8
    bias = torch.randn((3, steps, width) if batch_first else (steps, 3, width), dtype=torch.float64)
    part = partition_module(m, {"rnn[1]": 1, "rnn2": 1, "head": 0}, 2, time_chunks=3)
    assert any(n.name.startswith("rnn2_l0_t2") for n in part.nodes)  # chunked, not whole
    results = []
    for fn in (m, part.gm):
        m.zero_grad()
        out, h = fn(ids, bias)
        (out.square().sum() + h.sum()).backward()
        results.append((out, h, [p.grad.clone() for p in m.parameters()]))
    (o1, h1, g1), (o2, h2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-12)
    torch.testing.assert_close(h2, h1, rtol=0, atol=1e-12)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_time_chunks_without_model_parallelism_is_refused():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hybridpar
    from hybridpar.errors import UserError

    from .wavefront_models import LSTMLM

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(UserError, match="model-parallel"):
            hybridpar.parallelize(LSTMLM(), "sample=2", time_chunks=4)
        with pytest.raises(UserError, match="time_chunks must be an integer"):
            hybridpar.parallelize(LSTMLM(), "mp=2", placement={"head": 1}, time_chunks=0)
    finally:
        dist.destroy_process_group()


class _WithState(nn.Module):
    """A stacked module given its initial state, a second one reading the first's final state."""

    def __init__(self, cell: type):
        super().__init__()
        self.rnn = cell(6, 6, num_layers=2, batch_first=True)
        self.rnn2 = cell(6, 6, num_layers=2, batch_first=True)

    def forward(self, x, h0):
        y, state = self.rnn(x, h0)
        z, _ = self.rnn2(y, state)
        return z


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_initial_state_and_final_state_are_carried(cell):
    import torch

    from hybridpar.parallel.pipeline.partition import partition_module

    torch.manual_seed(1)
    m = _WithState(cell).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    h = torch.randn(2, 2, 6, dtype=torch.float64)
    h0 = (h, torch.randn(2, 2, 6, dtype=torch.float64)) if cell is nn.LSTM else h
    part = partition_module(m, {"rnn[1]": 1, "rnn2[0]": 0, "rnn2[1]": 1}, 2, time_chunks=2)
    assert {"rnn_h0_l1", "rnn2_h0_l1", "rnn2_l1_t1"} <= {n.name for n in part.nodes}  # layer by layer, chunked
    ref = m(x, h0)
    ref.sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out = part.gm(x, h0)
    out.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip((p.grad for p in m.parameters()), grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


class _TupleState(nn.Module):
    """An LSTM given its initial state as a literal tuple `(h2, c)` built in forward, h2 from a layer
    placed apart (the tuple's nodes must be mapped into the rewritten graph, not left in the old one)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.rnn = nn.LSTM(6, 6, num_layers=2, batch_first=True)

    def forward(self, x, h, c):
        h2 = self.proj(h)
        y, _ = self.rnn(x, (h2, c))
        return y


def test_literal_tuple_initial_state_equals_one_process():
    import torch

    from hybridpar.parallel.pipeline.partition import partition_module

    torch.manual_seed(2)
    m = _TupleState().double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    h, c = torch.randn(2, 2, 6, dtype=torch.float64), torch.randn(2, 2, 6, dtype=torch.float64)
    part = partition_module(m, {"proj": 1, "rnn[1]": 1}, 2, time_chunks=2)
    assert {"rnn_h0_l0", "rnn_l1_t1"} <= {n.name for n in part.nodes}  # layer by layer, chunked
    ref = m(x, h, c)
    ref.square().sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out = part.gm(x, h, c)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip((p.grad for p in m.parameters()), grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
