"""Distributed values and the low operations every layer shares.

`distributed` defines `DistributedValues`, `PerReplica` and `Mirrored` (one global
array per value), `reduce_op` defines `ReduceOp`, and `cross_replica` reduces and
gathers those global arrays across replicas. Internal: the public names are
exported from `jaxdist`.
"""

from __future__ import annotations

from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica
from jaxdist.values.reduce_op import ReduceOp

__all__ = ["DistributedValues", "Mirrored", "PerReplica", "ReduceOp"]
