"""hybridpar.search: the strategy space and its optimisers.

- `layers`: the per-layer decomposition planner (`plan_model`, also `hybridpar.plan`).
- `placer`: DLPlacer device placement for model parallelism (`place_model`, also `hybridpar.place`)
  and the hybrid DP x MP step.
- `projection`: end-to-end time to target over GPU counts and the joint batch/MP choice.
- `graph_cache`: traced graphs on disk, shared by the planners.

The search reads graph, cost, cluster, convergence and plans; it never imports the runtime.
"""
