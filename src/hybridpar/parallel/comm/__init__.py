"""hybridpar.parallel.comm."""
