"""Experimental names, as in ``tf.distribute.experimental``.

``ParameterServerStrategy`` and the ``coordinator`` module need Ray (the ``[ps]`` extra);
they are imported when first used.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from jaxdist._run.programs import set_program_cache_size
from jaxdist.collectives.communication import (
    CollectiveHints,
    CommunicationImplementation,
    CommunicationOptions,
)
from jaxdist.experimental import partitioners
from jaxdist.experimental.preemption.handler import PreemptionCheckpointHandler, TerminationConfig
from jaxdist.input.options import AutoShardPolicy
from jaxdist.strategies.central_storage import CentralStorageStrategy
from jaxdist.strategies.fsdp import FSDPStrategy
from jaxdist.strategies.mesh import MeshStrategy, logical_constraint
from jaxdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from jaxdist.strategies.tpu import TPUStrategy
from jaxdist.values.distributed import ValueContext
from jaxdist.variables import ShardedVariable

__all__ = [
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
    "FSDPStrategy",
    "MeshStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PreemptionCheckpointHandler",
    "ShardedVariable",
    "TPUStrategy",
    "TerminationConfig",
    "ValueContext",
    "coordinator",
    "logical_constraint",
    "partitioners",
    "set_program_cache_size",
]
if importlib.util.find_spec("ray") is None:  # `import *` works without the [ps] extra
    __all__ = [n for n in __all__ if n not in ("ParameterServerStrategy", "coordinator")]


# Names that need Ray, loaded on first use (PEP 562): importing jaxdist.experimental does not
# import Ray.
_LAZY = {
    "ParameterServerStrategy": "jaxdist.experimental.parameter_server.strategy",
    "coordinator": None,  # the module jaxdist.experimental.coordinator
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxdist.experimental' has no attribute {name!r}")
    home = _LAZY[name]
    if home is None:
        return importlib.import_module(f"jaxdist.experimental.{name}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
