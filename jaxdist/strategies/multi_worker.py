"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over every device of every process.

The processes of a job form one JAX program through `jax.distributed` (its
coordination service, and XLA's collectives: gloo on CPU, NCCL on GPU, the
ICI/DCN fabric on TPU). The strategy's mesh has two axes, ``("host",
"local")``: one row per process, one column per local device, so replica
``r`` is local device ``r % L`` of process ``r // L``, every process owns a
contiguous block of replicas, and a hierarchical reduction can reduce inside
a process before crossing the network.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.reduce import CrossDeviceOps
from jaxdist.strategy import Strategy

__all__ = ["MultiWorkerMirroredStrategy"]

AXES = ("host", "local")


def _grid() -> tuple[list[jax.Device], int, int]:
    """Every device of every process, grouped by process, and the grid shape."""
    by_process: dict[int, list[jax.Device]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    counts = {p: len(ds) for p, ds in by_process.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(
            "MultiWorkerMirroredStrategy: every process must have the same number of devices, "
            f"got {dict(sorted(counts.items()))} (process: devices). Start every process with "
            "the same device count (for simulated CPU devices, the same "
            "JAX_NUM_CPU_DEVICES / --devices-per-proc)."
        )
    processes = sorted(by_process)
    devices = [d for p in processes for d in sorted(by_process[p], key=lambda d: d.id)]
    return devices, len(processes), counts[processes[0]]


class MultiWorkerMirroredStrategy(Strategy):
    """One replica per device of every process; variables mirrored, gradients all-reduced.

    Args:
        cluster_resolver: where the processes are (a
            `jaxdist.cluster_resolver.ClusterResolver`). ``None`` resolves the
            cluster from the environment: the local launcher
            (``python -m jaxdist.launch``), ``TF_CONFIG``, Slurm, Kubernetes or a
            Cloud TPU VM; without any, a one-process cluster over the local
            devices (as in TF), so a script runs unchanged on a laptop.
        communication_options: a `jaxdist.experimental.CommunicationOptions`
            choosing the collective structure (``implementation``: ``AUTO``/``NCCL``
            one all-reduce, ``RING`` reduce-scatter + all-gather) and packing
            (``bytes_per_pack``).

    Creating it starts `jax.distributed` (once per process, before anything
    else touches the devices) when the cluster has several processes.

    Example:
        >>> import jaxdist as jd
        >>> s = jd.MultiWorkerMirroredStrategy()   # no cluster: this process alone
        >>> s.num_replicas_in_sync == len(s.extended.worker_devices)
        True
    """

    __slots__ = ("_cluster_resolver", "_communication_options")
    _cluster_resolver: Any
    _communication_options: Any

    def __init__(self, cluster_resolver: Any = None, communication_options: Any = None) -> None:
        from jaxdist.cluster_resolver import ClusterResolver, initialize, resolve_default
        from jaxdist.communication import CommunicationOptions, cross_device_ops_for

        where = "MultiWorkerMirroredStrategy"
        if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(
                f"{where}(cluster_resolver=...): expected a jaxdist.cluster_resolver."
                f"ClusterResolver (e.g. TFConfigClusterResolver()), got "
                f"{type(cluster_resolver).__name__}."
            )
        if communication_options is None:
            communication_options = CommunicationOptions()
        elif not isinstance(communication_options, CommunicationOptions):
            raise TypeError(
                f"{where}(communication_options=...): expected a jaxdist.experimental."
                f"CommunicationOptions, got {type(communication_options).__name__}."
            )
        resolver = cluster_resolver if cluster_resolver is not None else resolve_default()
        if resolver is not None:
            initialize(resolver)
        devices, processes, local = _grid()
        ops: CrossDeviceOps = cross_device_ops_for(communication_options, AXES)
        object.__setattr__(self, "_cluster_resolver", resolver)
        object.__setattr__(self, "_communication_options", communication_options)
        super().__init__(devices, ops, mesh_shape=(processes, local), axis_names=AXES)

    def _extra_key(self) -> tuple[Any, ...]:
        return (self._communication_options,)

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver the strategy was built from (``None``: one process)."""
        return self._cluster_resolver

    @property
    def communication_options(self) -> Any:
        """The `jaxdist.experimental.CommunicationOptions` in effect."""
        return self._communication_options

    def __repr__(self) -> str:
        host, local = self.mesh.devices.shape
        return (
            f"MultiWorkerMirroredStrategy(processes={host}, devices_per_process={local}, "
            f"platform={self._devices[0].platform})"
        )
