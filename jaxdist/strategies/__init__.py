"""Strategies: the `Strategy` base and its lower-level API, then one module per strategy.

`base` defines `Strategy` (the cross-replica API and the documented extension points
subclasses override), `extended` `StrategyExtended`, `checks` the argument checks and
messages of both, and `input_methods` the dataset methods `Strategy` inherits. Then
`one_device`, `mirrored`, `central_storage`, `multi_worker`, `tpu`, `fsdp` and `mesh`,
the `default_strategy` in effect outside any scope, sharded creation of training state
(`_sharded_create`), the leaves of a state with their logical names (`_state_leaves`),
layouts by logical axis rules (`_logical_layout`), every device of the job (`_job`) and
the multi-process watchdog (`_watchdog`). Internal: the
strategies are exported from `jaxdist` and `jaxdist.experimental`.
"""
