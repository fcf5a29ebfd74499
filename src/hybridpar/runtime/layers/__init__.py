"""The parallel layer kinds, one module each, as torchtitan keeps one parallel style per technique:
`conv` (Conv2d stationary-x/y/w, and Linear as a 1x1 convolution: row/column parallel), `norm`
(batch norm with the global batch's statistics), `concat` (torch.cat along split channels as one
all-to-all), `redistribute` (a layer on another sample/channel grid than the model's). Each takes
DTensors in and gives DTensors out when the model runs with global semantics
(hybridpar.runtime.parallel_model), and runs our autograd functions with explicit collectives on the
local pieces. `PARALLEL_STYLES` names, per module type, the builder parallel_model applies."""
