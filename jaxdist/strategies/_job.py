"""The devices of the whole job, for strategies whose default is every device.

`FSDPStrategy` and `MeshStrategy` span every device of every process by default,
as `MultiWorkerMirroredStrategy` does: in a job of several processes (started by
``python -m jaxdist.launch``, or described by ``TF_CONFIG`` / SLURM), the
processes are connected through `jax.distributed` first, exactly as that
strategy connects them (a script that called `jaxdist.initialize` already is
connected, and nothing happens again).
"""

from __future__ import annotations

import jax

from jaxdist.cluster_resolver import initialize, resolve_default

__all__ = ["job_devices"]


def job_devices() -> tuple[jax.Device, ...]:
    """Every device of the job (``jax.devices()``), the processes connected first."""
    resolver = resolve_default()
    if resolver is not None:
        initialize(resolver)
    return tuple(jax.devices())
