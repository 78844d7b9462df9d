"""Experimental names, as in ``tf.distribute.experimental``."""

from jaxdist._programs import set_program_cache_size
from jaxdist.communication import (
    CollectiveHints,
    CommunicationImplementation,
    CommunicationOptions,
)
from jaxdist.experimental import partitioners
from jaxdist.experimental._preemption import PreemptionCheckpointHandler, TerminationConfig
from jaxdist.input.options import AutoShardPolicy
from jaxdist.strategies.central_storage import CentralStorageStrategy
from jaxdist.strategies.fsdp import FSDPStrategy
from jaxdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from jaxdist.strategies.tpu import TPUStrategy
from jaxdist.values import ValueContext
from jaxdist.variables import ShardedVariable

__all__ = [
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
    "FSDPStrategy",
    "MultiWorkerMirroredStrategy",
    "PreemptionCheckpointHandler",
    "ShardedVariable",
    "TPUStrategy",
    "TerminationConfig",
    "ValueContext",
    "partitioners",
    "set_program_cache_size",
]
