"""Distributed input: contexts, options, datasets and iterators (exported from `jaxdist`)."""

from jaxdist.input.dataset import DistributedDataset, DistributedIterator, OptionalValue
from jaxdist.input.options import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode

__all__ = [
    "AutoShardPolicy",
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "OptionalValue",
]
