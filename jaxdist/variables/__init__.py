"""Distributed variables: `Variable` with tf.distribute's synchronization and aggregation.

One concept in six modules: `_variable` (the `Variable` pytree and its updates in
cross-replica context), `_sharded` (`ShardedVariable`, one variable stored as `Variable`
shards along its first axis, and ``Variable(..., partitioner=...)``), `meta` (the
synchronization and aggregation enums, the per-variable metadata and placement),
`_dtype_rules` (TF's dtype rules for initial values), `_ops` (arithmetic that reads the
variable like an array) and `_replica_updates` (updates inside a replica function,
aggregated across replicas).
"""

from __future__ import annotations

from jaxdist.variables._sharded import ShardedVariable, unshard
from jaxdist.variables._variable import Variable, as_distributed, is_distributed
from jaxdist.variables.meta import VariableAggregation, VariableSynchronization

__all__ = [
    "ShardedVariable",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "as_distributed",
    "is_distributed",
    "unshard",
]
