from cost_flat_cluster import flat_cluster  # noqa: F401  (fixture)
