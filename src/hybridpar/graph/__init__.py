"""Model graph: nodes with shapes, params, FLOPs and bytes, traced from any nn.Module."""

from hybridpar.graph.types import DTYPE_BYTES, Graph, Node

__all__ = ["DTYPE_BYTES", "Graph", "Node", "load_model", "trace"]


def __getattr__(name):
    # torch-heavy entry points load lazily.
    if name == "trace":
        from hybridpar.graph.tracing import trace

        return trace
    if name == "load_model":
        from hybridpar.graph.models import load_model

        return load_model
    raise AttributeError(name)
