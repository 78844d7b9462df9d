"""jaxdist: tf.distribute's programming model for JAX.

Only the names re-exported here (and the ``jaxdist.experimental`` module) are
public; every other module is internal.
"""

from jaxdist import checkpoint, cluster_resolver, data, experimental, training
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
    fit,
    scale_regularization_loss,
    train_step,
)
from jaxdist.values import DistributedValues, Mirrored, PerReplica
from jaxdist.variables import Variable, VariableAggregation, VariableSynchronization

__version__ = "0.1.0"

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
    "train_step",
    "training",
]
