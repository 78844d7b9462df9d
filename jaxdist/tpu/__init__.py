"""TPU names of ``tf.tpu``, on any backend: ``jaxdist.tpu.experimental``.

``jaxdist.tpu.experimental.DeviceAssignment`` and ``Topology`` place the
replicas and logical devices of a computation on the devices of a TPU slice,
or of a CPU/GPU machine laid out as one (see `Topology.from_devices`).
"""

from __future__ import annotations

from jaxdist.tpu import experimental

__all__ = ["experimental"]
