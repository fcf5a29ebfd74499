"""hybridpar.train: a training job around a parallelized module.

`config` (the run's options, checked before any rank starts), `trainer` (the per-rank loop), `engine`
(one step of the parallelized module), `data/` (data sets and loaders), `optim`, `checkpoint`,
`metrics`, `launch` (ranks) and `faults` (restarts). It reads the cost model only to check a run
before it starts (memory), and never searches."""
