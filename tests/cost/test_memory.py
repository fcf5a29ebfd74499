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
    import torch

    import hybridpar.graph.tracing as trace_mod
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


# -- one rank of the runtime: predict_rank_memory and the planner ------------------------------------

from hybridpar.cost.memory import (  # noqa: E402
    LOCALHOST_FRAMEWORK_BYTES,
    conv_transient_bytes,
    framework_bytes_for,
    optimizer_state_copies,
    optimizer_step_copies,
    predict_rank_memory,
)
from hybridpar.layout import LayerLayout  # noqa: E402


def test_optimizer_state_per_optimizer():
    assert optimizer_state_copies("sgd") == 0  # train's default: --momentum 0 keeps no buffer
    assert optimizer_state_copies("sgd", momentum=0.9) == 1
    assert optimizer_state_copies("lars", momentum=0.9) == 1 and optimizer_state_copies("lars") == 0
    assert optimizer_state_copies("adamw") == 2
    assert optimizer_step_copies("adamw") == 1 and optimizer_step_copies("sgd") == 0
    assert optimizer_step_copies("sgd", weight_decay=1e-4) == 1
    with pytest.raises(ValueError):
        optimizer_state_copies("lbfgs")


def test_rank_memory_terms_by_layout():
    g = _graph(batch=4)
    params = 8 * 27 + 8 + 10 * 512 + 10
    # what autograd keeps: the ReLU's output (its own backward; fc reads it through the flatten view).
    # The conv's output is freed once the ReLU has run; the logits are the output, in io_bytes.
    acts = 4 * (4 * 8 * 64)
    io = 4 * (4 * 3 * 64 + 4 * 10)  # whole input batch and whole output on every rank
    one = predict_rank_memory(g, "sample=1", framework_bytes=100)
    assert one.weights_bytes == one.grads_bytes == 4 * params and one.optimizer_bytes == 0
    assert one.buckets_bytes == 0 and one.framework_bytes == 100 and one.io_bytes == io
    assert one.activations_bytes == acts
    assert one.total_bytes == sum(v for k, v in one.breakdown().items() if k != "total_bytes")
    dp = predict_rank_memory(g, "sample=2", framework_bytes=0)
    assert dp.buckets_bytes == dp.grads_bytes == 4 * params  # every synced gradient in an in-flight bucket
    assert dp.activations_bytes == acts / 2
    ch = predict_rank_memory(g, LayerLayout(channel=2), framework_bytes=0)
    assert ch.weights_bytes == 4 * params / 2 and ch.buckets_bytes == 0
    fi = predict_rank_memory(g, "filter=2", framework_bytes=0)
    # stationary-y keeps the input gathered over the filter group: whole channels of x and of flat
    gathered = 4 * (4 * 2 * 64) * 2 + 4 * (4 * 256) * 2  # ceil(3/2)=2 channels of x, 256 features of flat
    assert fi.activations_bytes == pytest.approx(acts / 2 + gathered)
    adam = predict_rank_memory(g, "sample=1", optimizer="adamw", framework_bytes=0)
    assert adam.optimizer_bytes == 2 * adam.weights_bytes and adam.transient_bytes == adam.weights_bytes


def test_conv_transients_per_algorithm():
    g = _graph(batch=4)
    conv = g.node("conv")
    # stationary-x: partial outputs for all 8 filters before the reduce-scatter, then in backward the
    # gathered dy plus dx for this rank's 2 of 3 input channels
    x = conv_transient_bytes(conv, LayerLayout(channel=2), 4, 4)
    assert x == 4 * (4 * 8 * 64 + 4 * 2 * 64)
    # stationary-y: no partial outputs; dx for all 3 (gathered) channels before its reduce-scatter
    assert conv_transient_bytes(conv, LayerLayout(filter=2), 4, 4) == 4 * 4 * 3 * 64
    assert conv_transient_bytes(conv, LayerLayout(filter=2), 4, 4, input_grad=False) == 0
    assert conv_transient_bytes(conv, LayerLayout(sample=2, channel=2), 4, 4) == x / 2


def test_framework_constant_from_the_calibration():
    from hybridpar.cluster.calibration import Calibration
    from hybridpar.cluster.model import DeviceSpec

    cal = Calibration(cpu_count=2, peak_flops_fp32=1e9, mem_bw_Bps=1e9, framework_bytes=123 << 20)
    assert framework_bytes_for(None, cal) == 123 << 20
    assert framework_bytes_for(None, Calibration(cpu_count=2, peak_flops_fp32=1e9, mem_bw_Bps=1e9)) \
        == LOCALHOST_FRAMEWORK_BYTES
    gpu = DeviceSpec.model_validate({**_device_fields(), "kind": "gpu"})
    assert framework_bytes_for(gpu, cal) == 0


def _device_fields():
    from hybridpar.cluster import load_cluster

    return load_cluster("dgx1-v100").device.model_dump()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy,gpus", [("sample=2", 2), ("channel=2", 2), ("filter=2", 2),
                                           ("channel=2,filter=2", 4), ("sample=2,channel=2", 4)])
def test_planner_states_predict_rank_memory(strategy, gpus, optimizer):
    """`hybridpar plan --strategy S` states per device exactly what predict_rank_memory says."""
    from hybridpar.search.graph_cache import traced_graph
    from hybridpar.search.layers.planner import plan_model

    graph, shape = traced_graph("small_resnet", None)
    res = plan_model("small_resnet", "localhost", gpus, 8, strategy=strategy, optimizer=optimizer)
    mine = predict_rank_memory(graph, strategy, batch=8, optimizer=optimizer)
    assert res.plan.predicted.memory_bytes[0] == int(mine.total_bytes)
    assert mine.framework_bytes > 0


def test_memory_limit_is_kept_by_the_plan():
    from hybridpar.errors import InfeasibleError
    from hybridpar.search.layers.planner import plan_model

    free = plan_model("small_resnet", "localhost", 4, 8)
    need = free.plan.predicted.memory_bytes[0]
    dp = predict_rank_memory(__import__("hybridpar.search.graph_cache", fromlist=["x"]).traced_graph(
        "small_resnet", None)[0], "sample=4", batch=8)
    limit = min(need, dp.total_bytes) - 1  # forbids the unconstrained choice and data parallelism
    try:
        res = plan_model("small_resnet", "localhost", 4, 8, memory_limit=limit)
    except InfeasibleError:
        return  # nothing fits: refused, not a plan over the limit
    assert res.plan.predicted.memory_bytes[0] <= limit
    with pytest.raises(InfeasibleError):
        plan_model("small_resnet", "localhost", 4, 8, memory_limit=LOCALHOST_FRAMEWORK_BYTES / 2)


def test_weights_grads_and_adamw_state_are_what_torch_holds():
    """What predict_rank_memory counts for weights, gradients and AdamW's state equals the bytes of the
    tensors torch holds after one real step of the undistributed model (sample=1)."""
    import torch

    from hybridpar.graph.models import load_model
    from hybridpar.graph.tracing import trace

    m = load_model("small_resnet", batch=4)
    g = trace(m.module, m.example_inputs)
    opt = torch.optim.AdamW(m.module.parameters(), lr=1e-3)
    m.module(*m.example_inputs).sum().backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    params = list(m.module.parameters())
    state = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    pred = predict_rank_memory(g, "sample=1", batch=4, optimizer="adamw", framework_bytes=0)
    assert pred.weights_bytes == nbytes(params)
    assert pred.grads_bytes == nbytes(p.grad for p in params)
    assert pred.optimizer_bytes == nbytes(state)


def test_memory_report_warns_over_the_tolerance():
    from hybridpar.cost.memory import memory_report

    g = _graph()
    pred = predict_rank_memory(g, "sample=2", framework_bytes=1000)
    total = pred.total_bytes
    ok = memory_report([total * 1.1, total * 0.9], pred)
    assert ok["warning"] is None and ok["worst_ratio"] == pytest.approx(1.1)
    assert ok["predicted_bytes"] == int(total) and ok["predicted_breakdown"]["framework_bytes"] == 1000
    bad = memory_report([total * 0.9, total * 1.3, None], pred)
    assert bad["warning"] is not None and "rank 1 " in bad["warning"] and "30%" in bad["warning"]
    assert bad["ranks"][2] == {"rank": 2, "peak_bytes": None, "ratio": None}
    assert memory_report([total * 1.3], total, tolerance=0.5)["warning"] is None
