"""TF's ``tf.distribute.experimental.coordinator``: `ClusterCoordinator`, `RemoteValue`,
`PerWorkerValues`, `experimental_get_current_worker_index` (parameter-server training on
Ray; needs the ``[ps]`` extra)."""

from jaxdist.experimental.parameter_server.coordinator import ClusterCoordinator
from jaxdist.experimental.parameter_server.coordinator_context import (
    experimental_get_current_worker_index,
)
from jaxdist.experimental.parameter_server.values import PerWorkerValues, RemoteValue

__all__ = [
    "ClusterCoordinator",
    "PerWorkerValues",
    "RemoteValue",
    "experimental_get_current_worker_index",
]
