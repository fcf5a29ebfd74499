"""hybridpar.parallel.dtensor."""
