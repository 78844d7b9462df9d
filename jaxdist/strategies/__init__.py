"""Strategies: the `Strategy` base and its lower-level API, then one module per strategy.

`base` defines `Strategy` (the cross-replica API and the documented extension points
subclasses override), `extended` `StrategyExtended`, `checks` the argument checks and
messages of both, and `input_methods` the dataset methods `Strategy` inherits. Then
`one_device`, `mirrored`, `central_storage`, `multi_worker`, `tpu` and `fsdp`, the
`default_strategy` in effect outside any scope, sharded creation of training state
(`_sharded_create`) and the multi-process watchdog (`_watchdog`). Internal: the
strategies are exported from `jaxdist` and `jaxdist.experimental`.
"""
