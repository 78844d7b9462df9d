"""``tf.tpu.experimental`` names: `DeviceAssignment` and `Topology`.

``DeviceAssignment.build(topology=None, computation_shape=None,
computation_stride=None, num_replicas=1)`` places replicas made of several
logical devices (TF's signature and algorithm). ``topology=None`` is this
process's devices: TPU devices at their physical (x, y, z, core) places,
CPU and GPU devices as the cores of one chip, mesh shape ``(1, 1, 1, n)``.

Example:
    >>> import jaxdist as jd
    >>> assignment = jd.tpu.experimental.DeviceAssignment.build(
    ...     computation_shape=[1, 1, 1, 2], num_replicas=4
    ... )
    >>> [[d.id for d in replica] for replica in assignment.devices]
    [[0, 1], [2, 3], [4, 5], [6, 7]]
"""

from __future__ import annotations

from jaxdist.tpu._device_assignment import DeviceAssignment
from jaxdist.tpu._topology import Topology

__all__ = ["DeviceAssignment", "Topology"]
