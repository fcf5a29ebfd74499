"""The per-layer decomposition planner (Dryden et al.): one sample/channel/filter layout per layer.

`plan_model` (also `hybridpar.plan`) is the entry point. Inside: `decomposition` (the layouts a layer
can take), `layer_cost` (a layer's time, memory and collectives under a layout), `layer_graph` (the
model as weight and join vertices), `sp_dp` / `layout_ilp` (the optimisers: series-parallel dynamic
programming, ILP fallback), `planner` (search, prediction, the Plan).
"""

from hybridpar.search.layers.planner import LayerChoice, PlanResult, evaluate_plan, plan_model

__all__ = ["LayerChoice", "PlanResult", "evaluate_plan", "plan_model"]
