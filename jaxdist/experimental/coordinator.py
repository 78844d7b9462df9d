"""TF's ``tf.distribute.experimental.coordinator``: `ClusterCoordinator`, `RemoteValue`,
`PerWorkerValues` (parameter-server training on Ray; needs the ``[ps]`` extra)."""

from jaxdist.experimental.parameter_server.coordinator import ClusterCoordinator
from jaxdist.experimental.parameter_server.values import PerWorkerValues, RemoteValue

__all__ = ["ClusterCoordinator", "PerWorkerValues", "RemoteValue"]
