import pytest

from hybridpar.cost.memory import kept_activations, training_memory
from hybridpar.graph.types import Graph, Node


def _graph(batch=4) -> Graph:
    x = (batch, 3, 8, 8)
    y = (batch, 8, 8, 8)
    return Graph("tiny", (
        Node("x", "input", out_shape=x),
        Node("conv", "conv2d", ("x",), (x,), y, "conv", (("weight", (8, 3, 3, 3)), ("bias", (8,)))),
        Node("relu", "relu", ("conv",), (y,), y, "relu"),
        Node("flat", "flatten", ("relu",), (y,), (batch, 512)),
        Node("fc", "linear", ("flat",), ((batch, 512),), (batch, 10), "fc", (("weight", (10, 512)), ("bias", (10,)))),
    ), batch=batch)


def test_breakdown_by_optimizer_and_dtype():
    g = _graph()
    params = 8 * 27 + 8 + 10 * 512 + 10
    m = training_memory(g, optimizer="sgd")
    assert m.params_bytes == m.grads_bytes == 4 * params and m.optimizer_bytes == 0
    assert training_memory(g, optimizer="momentum").optimizer_bytes == 4 * params
    assert training_memory(g, optimizer="adam").optimizer_bytes == 8 * params
    half = training_memory(g, dtype="fp16", optimizer="adam")
    assert half.params_bytes == 6 * params and half.grads_bytes == 2 * params  # fp16 + fp32 master
    assert m.total_bytes == sum(v for k, v in m.breakdown().items() if k != "total_bytes")
    with pytest.raises(ValueError):
        training_memory(g, optimizer="lbfgs")


def test_activations_kept_for_backward():
    g = _graph()
    # conv keeps its input; relu keeps its output, which the linear also needs through the flatten view.
    assert kept_activations(g) == ["x", "relu"]
    m = training_memory(g)
    assert m.activations_bytes == 4 * (4 * 3 * 64 + 4 * 8 * 64)
    assert training_memory(g, sample_frac=0.5).activations_bytes == m.activations_bytes / 2


def test_weight_shards_and_buffers():
    g = _graph()
    full = training_memory(g)
    split = training_memory(g, layouts={"fc": (1.0, 0.5, 1.0)})  # row-parallel FC: half its weights
    assert split.params_bytes == pytest.approx(full.params_bytes - 4 * (10 * 512 + 10) / 2)
    assert training_memory(g, dp_ranks=4).comm_buffers_bytes == full.grads_bytes  # buckets capped
    assert training_memory(g, comm_buffer_bytes=123).comm_buffers_bytes == 123


@pytest.mark.parametrize("name", ["small_cnn", "small_resnet"])
def test_activations_match_what_autograd_saves(name):
    trace_mod = pytest.importorskip("hybridpar.graph.tracing")
    import torch

    from hybridpar.graph.models import load_model

    m = load_model(name, batch=8)
    g = trace_mod.trace(m.module, m.example_inputs)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m.module(*m.example_inputs)
    params = {p.untyped_storage().data_ptr() for p in m.module.parameters()}
    real = sum(v for k, v in saved.items() if k not in params)
    assert training_memory(g).activations_bytes == pytest.approx(real, rel=0.05)
