"""`LauncherClusterResolver`: the cluster started by ``python -m jaxdist.launch``.

jaxdist's local launcher starts N processes on one machine and gives each
these environment variables:

=================================  ===============================================
``JAXDIST_COORDINATOR_ADDRESS``    ``host:port`` of the coordinator (process 0)
``JAXDIST_NUM_PROCESSES``          the number of processes ``N``
``JAXDIST_PROCESS_ID``             this process's index, ``0..N-1``
``JAXDIST_LOCAL_DEVICE_COUNT``     devices per process (optional)
``JAXDIST_RESTART_COUNT``          restarts of the group so far (optional, 0)
``JAX_NUM_CPU_DEVICES``            on CPU: simulated devices per process
=================================  ===============================================

``JAX_NUM_CPU_DEVICES`` is read by JAX itself when its backend starts; the
resolver does not need it.
"""

from __future__ import annotations

import os

from jaxdist.cluster_resolver.base import ClusterResolver, split_host_port
from jaxdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = [
    "ENV_COORDINATOR_ADDRESS",
    "ENV_LOCAL_DEVICE_COUNT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_RESTART_COUNT",
    "LauncherClusterResolver",
]

ENV_COORDINATOR_ADDRESS = "JAXDIST_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "JAXDIST_LOCAL_DEVICE_COUNT"
ENV_RESTART_COUNT = "JAXDIST_RESTART_COUNT"

_WHERE = "LauncherClusterResolver()"


def _env_int(name: str, minimum: int) -> int | None:
    """The integer in variable ``name`` (``None`` if unset or blank), at least ``minimum``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.lstrip("-").isdigit() or int(raw) < minimum:
        raise ValueError(f"{_WHERE}: {name}={raw!r} must be an integer >= {minimum}.")
    return int(raw)


def _required_int(name: str, minimum: int) -> int:
    value = _env_int(name, minimum)
    if value is None:
        raise ValueError(
            f"{_WHERE}: {name} is not set but {ENV_COORDINATOR_ADDRESS} is; the launcher "
            f"sets {ENV_COORDINATOR_ADDRESS}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} "
            "together. Start the program with 'python -m jaxdist.launch --nprocs N "
            "script.py', or set all three."
        )
    return value


class LauncherClusterResolver(ClusterResolver):
    """The processes started by jaxdist's launcher (``python -m jaxdist.launch``).

    Reads the launcher's environment variables (see the module docstring)
    when created. All processes are workers on the launcher's host: worker 0
    is at ``JAXDIST_COORDINATOR_ADDRESS`` and hosts JAX's coordinator; the
    other workers listen on no fixed port, so their addresses carry port 0.

    Raises:
        ValueError: if ``JAXDIST_COORDINATOR_ADDRESS`` is missing or not
            ``host:port``, or the process count or id is missing or out of
            range.

    Example:
        >>> import os
        >>> from jaxdist.cluster_resolver import LauncherClusterResolver
        >>> os.environ.update(JAXDIST_COORDINATOR_ADDRESS="127.0.0.1:7001",
        ...                   JAXDIST_NUM_PROCESSES="2", JAXDIST_PROCESS_ID="1")
        >>> r = LauncherClusterResolver()
        >>> r.cluster_spec()
        ClusterSpec({'worker': ['127.0.0.1:7001', '127.0.0.1:0']})
        >>> r.jax_initialize_kwargs()
        {'coordinator_address': '127.0.0.1:7001', 'num_processes': 2, 'process_id': 1}
        >>> for k in ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID"):
        ...     del os.environ["JAXDIST_" + k]
    """

    def __init__(self) -> None:
        address = os.environ.get(ENV_COORDINATOR_ADDRESS, "").strip()
        if not address:
            raise ValueError(
                f"{_WHERE}: {ENV_COORDINATOR_ADDRESS} is not set: this process was not started "
                "by jaxdist's launcher. Start it with 'python -m jaxdist.launch --nprocs N "
                "script.py', or use another resolver."
            )
        self._host, self._port = split_host_port(address, f"{_WHERE} ({ENV_COORDINATOR_ADDRESS})")
        num_processes = _required_int(ENV_NUM_PROCESSES, minimum=1)
        process_id = _required_int(ENV_PROCESS_ID, minimum=0)
        if process_id >= num_processes:
            raise ValueError(
                f"{_WHERE}: {ENV_PROCESS_ID}={process_id} is not below "
                f"{ENV_NUM_PROCESSES}={num_processes}; process ids count 0..N-1."
            )
        self._num_processes = num_processes
        self._local_device_count = _env_int(ENV_LOCAL_DEVICE_COUNT, minimum=1)
        self._restart_count = _env_int(ENV_RESTART_COUNT, minimum=0) or 0
        self._task_type = "worker"
        self._task_id = process_id

    @staticmethod
    def is_present() -> bool:
        """True when this process was started by the launcher (its address variable is set)."""
        return bool(os.environ.get(ENV_COORDINATOR_ADDRESS, "").strip())

    @property
    def coordinator_address(self) -> str:
        """``host:port`` of the coordinator (``JAXDIST_COORDINATOR_ADDRESS``)."""
        return f"{self._host}:{self._port}"

    @property
    def num_processes(self) -> int:
        """The number of processes (``JAXDIST_NUM_PROCESSES``)."""
        return self._num_processes

    @property
    def local_device_count(self) -> int | None:
        """Devices per process (``JAXDIST_LOCAL_DEVICE_COUNT``), ``None`` if not set."""
        return self._local_device_count

    @property
    def restart_count(self) -> int:
        """How many times the launcher restarted the group (``JAXDIST_RESTART_COUNT``)."""
        return self._restart_count

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": [coordinator address, "host:0", ...]}``, one entry per process."""
        others = [f"{self._host}:0"] * (self._num_processes - 1)
        return ClusterSpec({"worker": [self.coordinator_address, *others]})

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task (by default this one), with the RPC layer if any.

        Args:
            task_type: overrides this task's type.
            task_id: overrides this task's index.
            rpc_layer: the protocol prefix.

        Returns:
            The address.
        """
        return self._task_master(task_type, task_id, rpc_layer)

    def __repr__(self) -> str:
        return (
            f"LauncherClusterResolver(coordinator_address={self.coordinator_address!r}, "
            f"num_processes={self._num_processes}, process_id={self.task_id!r})"
        )
