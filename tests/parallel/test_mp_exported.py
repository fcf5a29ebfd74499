"""Model parallelism for a model torch.fx cannot trace (Hugging Face GPT-2): the MP runtime runs
torch.export's graph (hybridpar.graph.runnable), the graph the placer prices such a model on, and
trains it equal to one process (issue 13: the MP runtime executes what the placer prices)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from .fp64_runs import train_fp64

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
GPT2 = f"{Path(__file__).with_name('hf_token_models.py')}:gpt2"


def test_exported_partition_runs_on_meta_and_crosses_devices():
    from hybridpar.graph.runnable import is_exported
    from hybridpar.parallel.pipeline.executor import crossings, meta_copy, meta_values
    from hybridpar.parallel.pipeline.partition import partition_module

    from .hf_token_models import gpt2

    model, (ids,) = gpt2()
    model.train()
    part = partition_module(model, {"net.transformer.h.1": 1, "net.transformer.ln_f": 1, "net.score": 1}, 2,
                            example_inputs=(ids,))
    assert is_exported(part.gm) and part.output_device == 1
    assert set(part.owner_of_key.values()) == {0, 1}
    # the export saw device=cpu (arange, .to(cpu, int32)): rewritten, so the graph runs on meta
    cross = crossings(part, meta_values(part, meta_copy(part.gm).train(), (ids,)))
    shapes = [tuple(t.shape) for c in cross.values() for t in c.tensor_leaves]
    assert (4, 12, 32) in shapes  # the hidden state crosses to device 1


def _train(tmp_path, capsys, strategy: str, n: str):
    return train_fp64(tmp_path, capsys, GPT2, strategy, n)


@pytest.mark.slow
def test_gpt2_model_parallel_and_hybrid_train_like_one_process(tmp_path, capsys):
    one, loss1, _ = _train(tmp_path, capsys, "sample=1", "1")
    for strategy, n in (("mp=2", "2"), ("mp=2,sample=2", "4")):
        got, loss, res = _train(tmp_path, capsys, strategy, n)
        assert loss == pytest.approx(loss1, rel=1e-9), strategy
        for k in one:
            torch.testing.assert_close(got[k], one[k], rtol=1e-9, atol=1e-9,
                                       msg=lambda m, k=k, s=strategy: f"{s} {k}: {m}")
        assert res["steps"][-1]["comm_bytes"].get("send", 0) > 0, res["steps"][-1]["comm_bytes"]  # activations crossed
    assert loss1[0] != loss1[-1]  # it trained


def test_take_over_frees_what_other_devices_own_in_the_exported_graph():
    """The exported graph holds its own references to the weights (ep.module()): after the engine
    takes the module over, every one another device owns is on meta there too, so it is freed."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridpar.parallel.pipeline.engine import MPEngine, micro_batch_inputs
    from hybridpar.plans import Plan

    from .hf_token_models import gpt2

    model, examples = gpt2()
    plan = Plan(model="gpt2", world_size=2, batch=8, dp=1, mp=2, default_layout={"sample": 1},
                placement={"net.transformer.h.1": 1, "net.transformer.ln_f": 1, "net.score": 1})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        engine = MPEngine(model, plan, example_inputs=micro_batch_inputs(examples, plan))
        assert engine.exported
        held = dict(engine.partition.gm.named_parameters())
        owner = engine.partition.owner_of_key
        assert {owner[k] for k in held} == {0, 1}
        for k, p in held.items():
            assert (p.device.type == "meta") == (owner[k] != 0), k
        assert engine.param_bytes() == sum(p.numel() * 4 for k, p in held.items() if owner[k] == 0)
    finally:
        dist.destroy_process_group()
