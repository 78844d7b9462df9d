"""The train step: one compiled, donated update of the training state per call.

`train_step` builds a `TrainStep`; `program` is the compiled step; `arguments`
sorts its arguments into state, batches and the rest; `grouped` runs several steps
per call; `guards` checks what a step is handed; `sharded_state` and
`state_placement` place the state; `state` is `TrainState`; `losses`,
`accumulate` and `mixed_precision` are what a step function calls. Internal: the
public names are exported from `jaxdist.training`.
"""
