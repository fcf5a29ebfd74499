"""The projection's step costs from hybridpar's cost model, DLPlacer and the per-layer planner.

Expensive results (traced profiles, placements, plans) are cached in memory and on disk, keyed by the
request and a fingerprint of the code and presets that produce them, so a sweep over 1..4096 GPUs is
fast after the first run and a changed cost model never reuses stale numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from hybridpar.errors import InfeasibleError, UserError
from hybridpar.files import atomic_write
from hybridpar.graph.types import DTYPE_BYTES, Graph
from hybridpar.search.projection.model import CFStep, MPStep, Profile

# Packages whose code decides the numbers cached here.
_FINGERPRINT_DIRS = ("cost", "cluster", "graph", "search")


@cache
def code_fingerprint() -> str:
    root = Path(__file__).resolve().parents[2]  # the hybridpar package (never import it: it is the face)
    h = hashlib.sha1()
    for sub in _FINGERPRINT_DIRS:
        for p in sorted((root / sub).rglob("*")):
            if p.suffix in (".py", ".yaml", ".json") and p.is_file():
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """$HYBRIDPAR_CACHE/projection (default ~/.cache/hybridpar/projection), beside the graph cache."""
    env = os.environ.get("HYBRIDPAR_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "hybridpar") / "projection"


class DiskCache:
    """JSON values under cache_dir(), one file per key; unreadable entries are recomputed."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._mem: dict[str, Any] = {}

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        k = hashlib.sha1(json.dumps([code_fingerprint(), *key], default=str).encode()).hexdigest()
        if k in self._mem:
            return self._mem[k]
        path = cache_dir() / f"{k}.json"
        if self.enabled and path.is_file():
            try:
                self._mem[k] = json.loads(path.read_text())
                return self._mem[k]
            except (OSError, json.JSONDecodeError):
                pass
        val = self._mem[k] = make()
        if self.enabled:
            # atomic: concurrent sweeps never read half a file; a read-only home only costs speed
            with contextlib.suppress(OSError):
                atomic_write(path, json.dumps(val))
        return val


class CostModelBackend:
    """`StepCosts` for a zoo model on a cluster preset (see hybridpar.search.projection)."""

    def __init__(self, model: str, cluster: str, *, dtype: str = "fp32", placer_solver: str = "ilp",
                 placer_time_limit_s: float = 3.0, cf_max_gpus: int = 32, use_disk_cache: bool = True,
                 time_chunks: int | bool | None = None) -> None:
        from hybridpar.cluster import load_cluster
        from hybridpar.graph.zoo import ZOO

        self.model, self.cluster_name, self.dtype = model, cluster, dtype
        self.placer_solver, self.placer_time_limit_s = placer_solver, placer_time_limit_s
        self.cf_max_gpus = cf_max_gpus
        # K recurrent time chunks for DPxMP (None: the placer's choice, as `place`/`train` without
        # --time-chunks; 1: whole layers); the MP runtime executes either (parallel/pipeline/wavefront.py)
        self.time_chunks = time_chunks_option(time_chunks)
        base = load_cluster(cluster)
        self.capacity_bytes = float(base.device.memory_bytes)
        self.gpus_per_node = int(base.gpus_per_node)
        entry = ZOO.get(model)
        self.is_cnn = entry is not None and entry.kind == "cnn"
        self._cache = DiskCache(use_disk_cache)
        self._notes: list[str] = []
        self._schedules: dict[int, dict[str, None]] = {}  # mp -> how DPxMP runs there (ordered set)

    # -- helpers ------------------------------------------------------------------------------------
    @cache  # noqa: B019 - one backend per projection; the cache dies with it
    def cluster(self, gpus: int):
        from hybridpar.cluster import load_cluster

        return load_cluster(self.cluster_name, gpus=gpus)

    @cache  # noqa: B019
    def graph(self, batch: int) -> Graph:
        from hybridpar.graph.models import load_model
        from hybridpar.graph.tracing import trace

        # Build on the meta device: BigLSTM's 1.8 B weights are never allocated.
        with torch.device("meta"):
            lm = load_model(self.model, batch=batch)
        return trace(lm.module, lm.example_inputs, self.model)

    def _key(self, *parts: Any) -> tuple:
        return (self.model, self.cluster_name, self.dtype, *parts)

    # -- StepCosts ----------------------------------------------------------------------------------
    def profile(self, batch: int) -> Profile:
        d = self._cache.get(self._key("profile", batch), lambda: self._profile(batch))
        return Profile(d["fwd_s"], d["bwd_s"], d["param_bytes"], tuple(map(tuple, d["grad_ready"])),
                       d["memory_bytes"])

    def _profile(self, batch: int) -> dict:
        from hybridpar.cost.compute import op_time
        from hybridpar.cost.memory import training_memory

        g = self.graph(batch)
        dev = self.cluster(1).device
        times = {n.name: op_time(n, dev, dtype=self.dtype) for n in g.nodes}
        fwd = sum(t.fwd_s for t in times.values())
        # Backward runs in reverse topological order; a node's weight gradient is ready after it.
        ready, modules, clock = [], [], 0.0
        for n in reversed(g.nodes):
            clock += times[n.name].bwd_data_s + times[n.name].bwd_weight_s
            if n.params:
                ready.append((clock, n.params * DTYPE_BYTES[self.dtype]))
                modules.append(n.module or "")
        mem = training_memory(g, dtype=self.dtype, dp_ranks=2)
        return {"fwd_s": fwd, "bwd_s": clock, "param_bytes": g.params * DTYPE_BYTES[self.dtype],
                "grad_ready": ready, "grad_modules": modules, "memory_bytes": int(mem.total_bytes)}

    @cache  # noqa: B019 - the sensitivity runs and the joint choice repeat the same calls
    def allreduce_s(self, bytes_: int, ranks: int) -> float:
        from hybridpar.cost.collectives import allreduce_time

        return allreduce_time(bytes_, list(range(ranks)), self.cluster(ranks))

    @cache  # noqa: B019
    def hybrid_allreduce_s(self, bytes_: int, replicas: int, mp: int, active: int | None = None) -> float:
        from hybridpar.cost.collectives import concurrent_allreduce_time

        # Worker d holds devices d*mp .. d*mp+mp-1 (inside one node); device j of every worker
        # holds the same weights, so the j-th groups allreduce at once (`active` of them: default all)
        groups = [[d * mp + j for d in range(replicas)] for j in range(active or mp)]
        return concurrent_allreduce_time(bytes_, groups, self.cluster(replicas * mp))

    @property
    def notes(self) -> list[str]:
        """What the projection should say about its figures: how DPxMP runs at each MP degree, then the rest."""
        return ([schedule_note(self._schedules)] if self._schedules else []) + self._notes

    def mp_step(self, mp: int, batch: int) -> MPStep:
        res = self._cache.get(self._key("place", mp, batch, self.placer_solver, self.placer_time_limit_s,
                                        "time_chunks", self.time_chunks, "pipelined"),
                              lambda: self._place(mp, batch))
        if "infeasible" in res:
            raise InfeasibleError(res["infeasible"])
        self._schedules.setdefault(mp, {})[_runs_as(res)] = None
        # the placer's own labels where it priced what the runtime cannot run (torch.export's graph)
        self._notes += [n for n in res.get("what_if", ()) if n not in self._notes]
        # The placer's own 1-device step defines the unit: hybrid and DP then share one compute model
        # and the MP speedup is exactly the placer's ratio.
        scale = self.profile(batch).compute_s / res["single_step_s"]
        return MPStep(res["step_s"] * scale, tuple(res["device_param_bytes"]), tuple(res["memory_bytes"]),
                      res["solver"], res["gap"], self._device_grad_ready(batch, res.get("module_device", {}), mp))

    def _device_grad_ready(self, batch: int, module_device: dict[str, int], mp: int
                           ) -> tuple[tuple[tuple[float, int], ...], ...]:
        """Per device, (fraction of the one-GPU backward done, bytes) of each layer gradient it holds, in
        backward order (the profile's grad_ready); () unless the placement names the modules of at
        least 90% of the weights (as _device_param_bytes)."""
        d = self._cache.get(self._key("profile", batch), lambda: self._profile(batch))
        bwd = d["bwd_s"] or 1.0
        out: list[list[tuple[float, int]]] = [[] for _ in range(mp)]
        for (t, nbytes), mod in zip(d["grad_ready"], d["grad_modules"], strict=True):
            if mod in module_device:
                out[module_device[mod]].append((t / bwd, nbytes))
        if sum(b for lst in out for _, b in lst) < 0.9 * d["param_bytes"]:
            return ()
        return tuple(tuple(lst) for lst in out)

    def _place(self, mp: int, batch: int) -> dict:
        from hybridpar.search.placer import place_model
        from hybridpar.search.placer.config import PROJECTION_OPTIMIZER
        from hybridpar.search.placer.unroll import has_recurrence

        g = self.graph(batch)
        try:
            out = place_model(g, self.cluster_name, mp, solver=self.placer_solver,
                              time_limit_s=self.placer_time_limit_s, batch=batch, dtype=self.dtype,
                              time_chunks=self.time_chunks, **PROJECTION_OPTIMIZER)
        except InfeasibleError as err:
            return {"infeasible": f"{mp} devices at batch {batch}: {err}"}
        res, plan = out.result, out.plan
        # the step and memory as `train` runs the plan: its time chunks and its micro-batch pipeline
        # (placer.micro; one micro-batch for a model with batch norm)
        return {"step_s": out.step_time_s, "single_step_s": out.single_step_s,
                "recurrent": has_recurrence(g), "time_chunks": int(plan.time_chunks or 1),
                "micro_batches": int(plan.micro_batches or 1), "schedule": plan.schedule or "gpipe",
                "memory_bytes": [int(x) for x in out.memory_bytes],
                "solver": f"{res.solver} ({res.status})", "gap": res.gap,
                "what_if": [n for n in plan.notes if n.startswith("WHAT-IF")],
                "device_param_bytes": _device_param_bytes(g, res, mp, self.dtype),
                "module_device": _module_device(res)}

    def fsdp_memory(self, gpus: int, batch: int) -> int:
        """Bytes per GPU of FSDP + full recomputation over `gpus` at `batch` per GPU: the runtime's rule
        (cost.memory.predict_rank_memory with zero=3 and recompute="all")."""
        return int(self._cache.get(self._key("fsdp_memory", gpus, batch), lambda: self._fsdp_memory(gpus, batch)))

    def _fsdp_memory(self, gpus: int, batch: int) -> int:
        from hybridpar.cost.memory import framework_bytes_for, predict_rank_memory
        from hybridpar.layout import LayerLayout

        mem = predict_rank_memory(self.graph(batch), LayerLayout(sample=gpus, zero=3), batch=batch * gpus,
                                  dtype=self.dtype, recompute="all",
                                  framework_bytes=framework_bytes_for(self.cluster(1).device))
        return int(mem.total_bytes)

    def cf_step(self, gpus: int, groups: int, batch_global: int) -> CFStep | None:
        if gpus > self.cf_max_gpus:
            note = (f"channel/filter layouts planned up to {self.cf_max_gpus} GPUs only (planner cost); "
                    "raise --cf-max-gpus")
            if note not in self._notes:
                self._notes.append(note)
            return None
        d = self._cache.get(self._key("cf", gpus, groups, batch_global), lambda: self._cf(gpus, groups, batch_global))
        if d is None:
            return None
        if "error" in d:
            note = f"channel/filter planner failed for {self.model}: {d['error']}"
            if note not in self._notes:
                self._notes.append(note)
            return None
        return CFStep(d["step_s"], d["exposed_comm_s"], d["memory_bytes"], d["method"])

    def _cf(self, gpus: int, groups: int, batch_global: int) -> dict | None:
        from hybridpar.search.layers.planner import plan_model

        # The planner searches per-layer sample/channel/filter layouts at the smaller global batch of
        # `groups` workers (it may well keep some layers sample-parallel).
        try:
            res = plan_model(self.model, self.cluster_name, gpus, batch_global, dtype=self.dtype)
        except InfeasibleError:
            return None
        except UserError as err:  # the planner rejecting this model must not sink the whole projection
            return {"error": " ".join(str(err).split())[:300]}
        pred = res.prediction
        return {"step_s": pred.step_time_s, "exposed_comm_s": pred.exposed_comm_s,
                "memory_bytes": max(pred.memory_bytes) if pred.memory_bytes else 0,
                "method": f"{res.method}: {res.plan.strategy or 'per-layer'}"}


def time_chunks_option(value: int | bool | None) -> int | None:
    """`project --time-chunks`'s K: None (the placer's choice), 1 for whole recurrent layers (0 too), K >= 2.
    The old boolean spelling stays: True is the wavefront at the placer's K, False whole layers."""
    from hybridpar.search.placer.unroll import DEFAULT_TIME_CHUNKS

    if value is None:
        return None
    if isinstance(value, bool):
        return DEFAULT_TIME_CHUNKS if value else 1
    if value < 0:
        raise UserError(f"--time-chunks must be >= 1 (1 = whole recurrent layers), got {value}", param="time_chunks")
    return max(int(value), 1)


def _runs_as(res: dict) -> str:
    """How `train` runs one DPxMP point: its recurrent time chunks (recurrent models) and micro-batches."""
    k, m = res.get("time_chunks", 1), res.get("micro_batches", 1)
    chunks = (f"{k} time chunks" if k > 1 else "whole recurrent layers") if res.get("recurrent") else ""
    pipe = f"{m} micro-batches ({res.get('schedule', 'gpipe')})" if m > 1 else "1 micro-batch"
    return ", ".join(x for x in (chunks, pipe) if x)


def schedule_note(schedules: dict[int, dict[str, None]]) -> str:
    """The projection's note on DPxMP: priced as the MP runtime executes the placer's plan, per MP degree."""
    per = "; ".join(f"mp {mp}: {' / '.join(ways)}" for mp, ways in sorted(schedules.items()))
    return (f"DPxMP priced as `train` runs the placer's plan (recurrent layers whole or as the time-step "
            f"wavefront, parallel/pipeline/wavefront.py; micro-batch pipeline, placer.micro): {per}")


def _module_device(res: Any) -> dict[str, int]:
    """The device of every module a placement's tasks name (the first task naming it)."""
    out: dict[str, int] = {}
    for task, dev in zip(res.problem.tasks, res.assignment, strict=True):
        for mod in task.modules:
            out.setdefault(mod, int(dev))
    return out


def _device_param_bytes(g: Graph, res: Any, mp: int, dtype: str) -> list[int]:
    """Weights each device holds under a placement: the parameters of the modules of its tasks.
    Falls back to an even split (flagged in the cache entry's solver note) when tasks name no modules."""
    per_module: dict[str, int] = {}
    for n in g.nodes:
        if n.params and n.module:
            per_module[n.module] = per_module.get(n.module, 0) + n.params * DTYPE_BYTES[dtype]
    out = [0] * mp
    for mod, dev in _module_device(res).items():
        out[dev] += per_module.get(mod, 0)
    total = g.params * DTYPE_BYTES[dtype]
    if sum(out) < 0.9 * total:
        return [total // mp] * mp
    return out
