"""On-disk cache of traced graphs, so that planning a zoo model needs neither torch nor a trace.

Key: the model spec, the input shape, and a hash of the sources that decide the graph (the
hybridpar.graph package, and the user's model file for `file.py:factory` specs). The graph is traced
at batch 1; the planner scales it to the global batch. Location: $HYBRIDPAR_CACHE or
~/.cache/hybridpar. A corrupt or unreadable entry is traced again.

The cache is data, not code: an entry is unpickled with only the graph's own two classes (Node,
Graph) and plain containers allowed, so a pickle planted in $HYBRIDPAR_CACHE whose `__reduce__`
names any other callable (`os.system`) is refused before anything runs, and traced again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
from pathlib import Path

from hybridpar.files import atomic_write
from hybridpar.graph.types import Graph, Node

_GRAPH_PKG = Path(__file__).resolve().parent.parent / "graph"


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDPAR_CACHE") or Path.home() / ".cache" / "hybridpar") / "graphs"


def _sources_hash(spec: str) -> str:
    h = hashlib.sha256()
    files = sorted(_GRAPH_PKG.rglob("*.py"))
    path = spec.rpartition(":")[0] if ":" in spec else (spec if spec.endswith(".py") else "")
    if path:
        files.append(Path(path).resolve())
    for f in files:
        try:
            h.update(str(f).encode())
            h.update(f.read_bytes())
        except OSError:
            h.update(b"missing")
    return h.hexdigest()[:16]


def _key(spec: str, input_shape: tuple[int, ...] | None) -> str:
    raw = f"{spec}|{input_shape}|{_sources_hash(spec)}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def traced_graph(spec: str, input_shape: tuple[int, ...] | None) -> tuple[Graph, tuple[int, ...] | None]:
    """(graph at batch 1, per-sample input shape) from the cache, tracing on a miss."""
    path = cache_dir() / f"{_key(spec, input_shape)}.pkl"
    try:
        with open(path, "rb") as f:
            graph, shape = _GraphUnpickler(f).load()
        if isinstance(graph, Graph) and _is_shape(shape):
            return graph, shape
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RecursionError, MemoryError):
        pass
    from hybridpar.graph.models import load_model
    from hybridpar.graph.tracing import trace

    loaded = load_model(spec, batch=1, input_shape=input_shape, device="meta")  # shapes only: meta inputs
    graph = trace(loaded.module, loaded.example_inputs, name=loaded.name)
    _store(path, (graph, loaded.input_shape))
    return graph, loaded.input_shape


class _GraphUnpickler(pickle.Unpickler):
    """Unpickles a cached graph and nothing else: every global but Node and Graph is refused, so no
    callable other than their constructors can be reached (REDUCE/NEWOBJ/BUILD need one)."""

    _ALLOWED = {("hybridpar.graph.types", "Node"): Node, ("hybridpar.graph.types", "Graph"): Graph}

    def find_class(self, module: str, name: str):
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"graph cache entry names {module}.{name}") from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("graph cache entry holds a persistent id")


def _is_shape(shape: object) -> bool:
    return shape is None or (isinstance(shape, tuple) and all(type(d) is int for d in shape))


def _store(path: Path, obj: object) -> None:
    with contextlib.suppress(OSError):  # a read-only home only costs a re-trace next time
        atomic_write(path, lambda f: pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL))
