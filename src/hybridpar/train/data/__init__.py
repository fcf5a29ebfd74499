"""Data sets for `hybridpar train`: `loader` (specs, the built-in sets, batches), `files` (npy arrays,
image folders, factories in user files)."""
