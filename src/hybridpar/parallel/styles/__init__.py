"""hybridpar.parallel.styles."""
