"""Parameter-server training on Ray (the ``[ps]`` extra): `ParameterServerStrategy`, its
`ClusterCoordinator`, `RemoteValue`, `PerWorkerValues` and `Server`.

One concept per module: ``strategy`` (the strategy and variable placement), ``ps`` (the
parameter-server actor), ``worker`` (the worker actor), ``coordinator`` (scheduling),
``closures`` (the queue and its error rules), ``values`` (remote and per-worker values),
``variables`` (variable handles), ``updates`` (what a closure's ``ctx.assign*`` amount
to), ``coordinator_context`` (the current worker index, and the strategy of this process),
``server`` (`Server`).
"""

from jaxdist.experimental.parameter_server.coordinator import ClusterCoordinator
from jaxdist.experimental.parameter_server.server import Server
from jaxdist.experimental.parameter_server.strategy import ParameterServerStrategy
from jaxdist.experimental.parameter_server.values import (
    ClosureCancelledError,
    PerWorkerValues,
    RemoteValue,
    WorkerLossError,
)
from jaxdist.experimental.parameter_server.variables import (
    ParameterServerUnavailableError,
    ParameterServerVariable,
    ShardedParameterServerVariable,
)

__all__ = [
    "ClosureCancelledError",
    "ClusterCoordinator",
    "ParameterServerStrategy",
    "ParameterServerUnavailableError",
    "ParameterServerVariable",
    "PerWorkerValues",
    "RemoteValue",
    "Server",
    "ShardedParameterServerVariable",
    "WorkerLossError",
]
