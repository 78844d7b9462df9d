"""`TPUClusterResolver`: the hosts of a Cloud TPU VM slice, found as JAX finds them.

On a multi-host TPU slice every host (TPU VM) runs one JAX process. The hosts
and this host's index come from the TPU environment variables that GKE sets
(``TPU_WORKER_HOSTNAMES`` or ``TPU_PROCESS_ADDRESSES``, and ``TPU_WORKER_ID``
or ``CLOUD_TPU_TASK_ID``), else, on a Google Compute Engine VM, from the
instance metadata server (``worker-network-endpoints``,
``agent-worker-number``), the sources JAX's own TPU cluster detection reads.
The Cloud TPU API (resolving a TPU *name* from another machine) is not used.
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from typing import Any

from jaxdist.cluster_resolver.base import ClusterResolver, split_host_port
from jaxdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["TPUClusterResolver"]

#: The port TF's TPU resolvers give each TPU worker in the cluster spec.
TPU_WORKER_PORT = 8470
#: The port JAX's TPU cluster detection uses for the coordinator on worker 0.
JAX_TPU_COORDINATOR_PORT = 8482

_DMI_PRODUCT = "/sys/class/dmi/id/product_name"
_SETUP_HINT = (
    "On a multi-host Cloud TPU slice, run the program on every TPU VM (e.g. gcloud ... ssh "
    "--worker=all) and set TPU_WORKER_HOSTNAMES (the hosts, comma-separated, in worker order) "
    "and TPU_WORKER_ID (this host's index) if the platform does not; on a single TPU VM pass "
    "tpu='local'."
)


def _on_gce() -> bool:
    """True on a Google Compute Engine VM (read locally from DMI; no network)."""
    try:
        with open(_DMI_PRODUCT) as f:
            return "Google" in f.read()
    except OSError:
        return False


def _gce_metadata(key: str) -> str | None:
    """The instance metadata attribute ``key``, or ``None`` off GCE or when it is not set."""
    if not _on_gce():
        return None
    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(
        f"http://{host}/computeMetadata/v1/instance/attributes/{key}",
        headers={"Metadata-Flavor": "Google"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return str(response.read().decode())
    except (urllib.error.URLError, OSError):
        return None


def _worker_hosts(raw: str) -> list[str]:
    """Host names from a comma list of ``host``, ``host:port`` or ``name:id:ip`` entries."""
    hosts = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) == 3:  # the metadata server's old name:id:ip form
            hosts.append(parts[2])
        elif len(parts) == 2:
            hosts.append(parts[0])
        elif len(parts) == 1:
            hosts.append(entry)
        else:
            raise ValueError(
                f"TPUClusterResolver: cannot read the TPU worker entry {entry!r}; expected "
                "'host', 'host:port' or 'name:id:ip'."
            )
    return hosts


def _discover() -> tuple[list[str], int]:
    """The slice's worker hosts and this host's index."""
    num_slices = os.environ.get("MEGASCALE_NUM_SLICES", "1").strip() or "1"
    if num_slices != "1":
        raise ValueError(
            f"TPUClusterResolver: MEGASCALE_NUM_SLICES={num_slices}: a multislice job spans "
            "slices whose hosts this resolver cannot list. Call jax.distributed.initialize() "
            "with no arguments before creating the strategy (JAX detects multislice itself)."
        )
    raw = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES")
    if raw is None:
        raw = _gce_metadata("worker-network-endpoints")
    if not raw:
        raise RuntimeError(
            "TPUClusterResolver(tpu=None): cannot find the TPU workers: TPU_WORKER_HOSTNAMES "
            "(or TPU_PROCESS_ADDRESSES) is not set and no GCE metadata server answered. "
            + _SETUP_HINT
        )
    hosts = _worker_hosts(raw)
    raw_id = os.environ.get("TPU_WORKER_ID") or os.environ.get("CLOUD_TPU_TASK_ID")
    if raw_id is None:
        raw_id = "0" if len(hosts) == 1 else _gce_metadata("agent-worker-number")
    if raw_id is None or not raw_id.strip().isdigit():
        raise RuntimeError(
            f"TPUClusterResolver(tpu=None): this host's worker index is unknown "
            f"(TPU_WORKER_ID={raw_id!r}) in a slice of {len(hosts)} hosts {hosts}. " + _SETUP_HINT
        )
    worker_id = int(raw_id)
    if not 0 <= worker_id < len(hosts):
        raise RuntimeError(
            f"TPUClusterResolver(tpu=None): this host's worker index {worker_id} is outside the "
            f"{len(hosts)} TPU workers {hosts}; TPU_WORKER_ID must count from 0."
        )
    return hosts, worker_id


class TPUClusterResolver(ClusterResolver):
    """The hosts of a Cloud TPU VM slice; each host is one JAX process.

    ``tpu`` selects the mode:

    * ``None`` or ``""``: this program runs on every TPU VM of a slice; the
      hosts and this host's index are read from the TPU environment
      variables, else from the GCE metadata server (see the module
      docstring). The cluster is ``{job_name: ["host0:8470", ...]}`` and
      ``task_id`` is this host's index (TF, a single-client system, always
      says 0). `jax_initialize_kwargs` puts the coordinator on worker 0 at
      JAX's TPU coordinator port 8482 (``JAX_COORDINATOR_PORT`` overrides).
    * ``"local"``: one TPU VM with its chips attached: an empty cluster, a
      one-process job.
    * ``"grpc://host:port"``: one TPU worker at that address.

    A TPU *name* (as used from a separate VM with TPU Nodes) would need the
    Cloud TPU API, which jaxdist does not call: it raises, saying what to set.
    ``zone``, ``project``, ``credentials``, ``service`` and ``discovery_url``
    only serve that API and are accepted for TF compatibility.

    Args:
        tpu: ``None``/``""``, ``"local"`` or ``"grpc://host:port"`` (see above).
        zone: unused (Cloud TPU API).
        project: unused (Cloud TPU API).
        job_name: the job of the TPU workers.
        coordinator_name: a job to add for a coordinator task (TF); needs
            ``coordinator_address``.
        coordinator_address: the address of that coordinator task.
        credentials: unused (Cloud TPU API).
        service: unused (Cloud TPU API).
        discovery_url: unused (Cloud TPU API).

    Raises:
        ValueError: for a TPU name, a multislice job, or a coordinator name
            without address.
        RuntimeError: if the TPU workers cannot be found.

    Example:
        >>> import os
        >>> from jaxdist.cluster_resolver import TPUClusterResolver
        >>> os.environ.update(TPU_WORKER_HOSTNAMES="t1v-0,t1v-1", TPU_WORKER_ID="1")
        >>> r = TPUClusterResolver()
        >>> r.cluster_spec(), r.task_id
        (ClusterSpec({'worker': ['t1v-0:8470', 't1v-1:8470']}), 1)
        >>> r.jax_initialize_kwargs()
        {'coordinator_address': 't1v-0:8482', 'num_processes': 2, 'process_id': 1}
        >>> del os.environ["TPU_WORKER_HOSTNAMES"], os.environ["TPU_WORKER_ID"]
    """

    def __init__(
        self,
        tpu: str | None = None,
        zone: str | None = None,
        project: str | None = None,
        job_name: str = "worker",
        coordinator_name: str | None = None,
        coordinator_address: str | None = None,
        credentials: Any = "default",
        service: Any = None,
        discovery_url: str | None = None,
    ) -> None:
        del zone, project, credentials, service, discovery_url  # Cloud TPU API only
        if tpu is not None and not isinstance(tpu, str):
            raise TypeError(
                f"TPUClusterResolver(tpu=...): expected None, 'local' or 'grpc://host:port', got "
                f"{type(tpu).__name__} {tpu!r}."
            )
        if coordinator_name and not coordinator_address:
            raise ValueError(
                f"TPUClusterResolver(coordinator_name={coordinator_name!r}): jaxdist starts no "
                "TF server for a coordinator, so give its address too (coordinator_address="
                "'host:port'), or leave coordinator_name unset."
            )
        if coordinator_name == job_name:
            raise ValueError(
                f"TPUClusterResolver: coordinator_name and job_name are both {job_name!r}; the "
                "coordinator needs a job of its own (e.g. 'coordinator')."
            )
        self._tpu = tpu or ""
        self._hosts: list[str] | None
        if self._tpu == "local":
            self._hosts, worker_id = None, 0
        elif self._tpu.startswith("grpc://"):
            host, port = split_host_port(self._tpu, f"TPUClusterResolver(tpu={tpu!r})")
            self._hosts, worker_id = [f"{host}:{port}"], 0
        elif not self._tpu:
            hosts, worker_id = _discover()
            self._hosts = [f"{h}:{TPU_WORKER_PORT}" for h in hosts]
        else:
            raise ValueError(
                f"TPUClusterResolver(tpu={tpu!r}): resolving a TPU by name needs the Cloud TPU "
                "API, which jaxdist does not call. Run the program on the TPU VMs themselves "
                "with tpu=None (or tpu='local' on a single TPU VM), or pass the worker address "
                "as tpu='grpc://host:port'. " + _SETUP_HINT
            )
        self._coordinator_name = coordinator_name
        self._coordinator_address = coordinator_address
        self._task_type = job_name
        self._task_id = worker_id
        self._rpc_layer = "grpc"

    def cluster_spec(self) -> ClusterSpec:
        """The TPU workers (and the coordinator job, if any); empty for ``tpu="local"``."""
        if self._hosts is None:
            return ClusterSpec({})
        cluster: dict[str, list[str]] = {str(self._task_type): list(self._hosts)}
        if self._coordinator_name and self._coordinator_address:
            cluster[self._coordinator_name] = [self._coordinator_address]
        return ClusterSpec(cluster)

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """``grpc://`` and the address of a TPU worker (by default this host); ``""`` if local.

        Args:
            task_type: overrides the job.
            task_id: overrides the worker index.
            rpc_layer: overrides the protocol prefix.

        Returns:
            The worker's address with its protocol prefix, or ``""`` for
            ``tpu="local"``.
        """
        if self._hosts is None:
            return ""
        return self._task_master(task_type, task_id, rpc_layer)

    def get_master(self) -> str:
        """`master` for this task."""
        return self.master()

    def get_job_name(self) -> str | None:
        """The job of the TPU workers (``task_type``)."""
        return self.task_type

    def _jax_coordinator_address(self, address: str, where: str) -> str:
        host, _ = split_host_port(address, where)
        port = os.environ.get("JAX_COORDINATOR_PORT", "").strip()
        if port and not re.fullmatch(r"\d{1,5}", port):
            raise ValueError(f"{where}: JAX_COORDINATOR_PORT={port!r} is not a port number.")
        return f"{host}:{port or JAX_TPU_COORDINATOR_PORT}"

    def __repr__(self) -> str:
        hosts = "local" if self._hosts is None else self._hosts
        return (
            f"TPUClusterResolver(hosts={hosts}, task_type={self.task_type!r}, "
            f"task_id={self.task_id!r})"
        )
