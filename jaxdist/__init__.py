"""jaxdist: tf.distribute's programming model for JAX.

Only the names re-exported here (and the ``jaxdist.experimental`` module) are
public; every other module is internal.

Names are loaded when first used (PEP 562): ``import jaxdist`` costs nothing
until a name is looked up, so the launcher (``python -m jaxdist.launch``,
which needs only the standard library) starts without importing JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from jaxdist import checkpoint, cluster_resolver, data, experimental, tpu, training
    from jaxdist.cluster_resolver import initialize
    from jaxdist.context import (
        ReplicaContext,
        experimental_set_strategy,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from jaxdist.input import (
        DistributedDataset,
        DistributedIterator,
        InputContext,
        InputOptions,
        InputReplicationMode,
    )
    from jaxdist.options import RunOptions
    from jaxdist.reduce import (
        CrossDeviceOps,
        HierarchicalCopyAllReduce,
        NcclAllReduce,
        ReduceOp,
        ReductionToOneDevice,
    )
    from jaxdist.strategies.central_storage import CentralStorageStrategy
    from jaxdist.strategies.mirrored import MirroredStrategy
    from jaxdist.strategies.multi_worker import MultiWorkerMirroredStrategy
    from jaxdist.strategies.one_device import OneDeviceStrategy
    from jaxdist.strategy import Strategy, StrategyExtended
    from jaxdist.training import (
        TrainState,
        accumulate_gradients,
        compute_average_loss,
        scale_regularization_loss,
        train_step,
    )
    from jaxdist.training.fit import fit
    from jaxdist.values import DistributedValues, Mirrored, PerReplica
    from jaxdist.variables import Variable, VariableAggregation, VariableSynchronization

__version__ = "0.1.0"

# Every public name, and the module that defines it.
_HOMES: dict[str, str] = {
    "CentralStorageStrategy": "jaxdist.strategies.central_storage",
    "CrossDeviceOps": "jaxdist.reduce",
    "DistributedDataset": "jaxdist.input",
    "DistributedIterator": "jaxdist.input",
    "DistributedValues": "jaxdist.values",
    "HierarchicalCopyAllReduce": "jaxdist.reduce",
    "InputContext": "jaxdist.input",
    "InputOptions": "jaxdist.input",
    "InputReplicationMode": "jaxdist.input",
    "Mirrored": "jaxdist.values",
    "MirroredStrategy": "jaxdist.strategies.mirrored",
    "MultiWorkerMirroredStrategy": "jaxdist.strategies.multi_worker",
    "NcclAllReduce": "jaxdist.reduce",
    "OneDeviceStrategy": "jaxdist.strategies.one_device",
    "PerReplica": "jaxdist.values",
    "ReduceOp": "jaxdist.reduce",
    "ReductionToOneDevice": "jaxdist.reduce",
    "ReplicaContext": "jaxdist.context",
    "RunOptions": "jaxdist.options",
    "Strategy": "jaxdist.strategy",
    "StrategyExtended": "jaxdist.strategy",
    "TrainState": "jaxdist.training",
    "Variable": "jaxdist.variables",
    "VariableAggregation": "jaxdist.variables",
    "VariableSynchronization": "jaxdist.variables",
    "accumulate_gradients": "jaxdist.training",
    "compute_average_loss": "jaxdist.training",
    "experimental_set_strategy": "jaxdist.context",
    "fit": "jaxdist.training",
    "get_replica_context": "jaxdist.context",
    "get_strategy": "jaxdist.context",
    "has_strategy": "jaxdist.context",
    "in_cross_replica_context": "jaxdist.context",
    "initialize": "jaxdist.cluster_resolver",
    "scale_regularization_loss": "jaxdist.training",
    "train_step": "jaxdist.training",
}
_SUBMODULES = frozenset(
    {"checkpoint", "cluster_resolver", "data", "experimental", "tpu", "training"}
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxdist.{name}")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CentralStorageStrategy",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "Strategy",
    "StrategyExtended",
    "TrainState",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "accumulate_gradients",
    "compute_average_loss",
    "checkpoint",
    "cluster_resolver",
    "data",
    "experimental",
    "experimental_set_strategy",
    "fit",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize",
    "scale_regularization_loss",
    "tpu",
    "train_step",
    "training",
]
