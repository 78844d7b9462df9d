"""`KubernetesClusterResolver`: the cluster made of the running pods that match label selectors."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdist.cluster_resolver.base import ClusterResolver
from jaxdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["KubernetesClusterResolver"]

_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_INSTALL_HINT = (
    "KubernetesClusterResolver needs the Kubernetes Python client: pip install "
    "'jaxdist[kubernetes]' (or pip install kubernetes), or pass override_client= a client "
    "object with list_pod_for_all_namespaces(label_selector=...)."
)


def _kubernetes_client() -> Any:
    """A ``CoreV1Api`` configured from inside the cluster, else from ``~/.kube/config``."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ImportError(_INSTALL_HINT) from None
    if "KUBERNETES_SERVICE_HOST" in os.environ:
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.CoreV1Api()


def _pod_order(pods: Sequence[Any]) -> list[Any]:
    """Pods in task order: by an Indexed Job's completion index when all have one, else by name."""
    indices = []
    for pod in pods:
        annotations = getattr(pod.metadata, "annotations", None) or {}
        index = annotations.get(_COMPLETION_INDEX) if isinstance(annotations, Mapping) else None
        if index is None or not str(index).isdigit():
            return sorted(pods, key=lambda p: p.metadata.name)
        indices.append(int(index))
    return [pod for _, pod in sorted(zip(indices, pods, strict=True), key=lambda t: t[0])]


class KubernetesClusterResolver(ClusterResolver):
    """The cluster made of the running Kubernetes pods that match label selectors.

    Each call of `cluster_spec` lists the pods of every selector through the
    Kubernetes API (``list_pod_for_all_namespaces``); a job's tasks are the
    pods of its selectors in order, each selector's pods sorted by name (by
    their completion index when they belong to an Indexed Job), at
    ``<pod host IP>:<tf_server_port>`` as in TF (the port must be reachable
    on the node: ``hostPort`` or ``hostNetwork``), or at the pod IP with
    ``use_pod_ip=True``. A pod that is not ``Running`` is an error.

    Kubernetes does not tell a pod which task it is: set ``task_type`` and
    ``task_id`` (for an Indexed Job, ``task_id`` is ``JOB_COMPLETION_INDEX``).

    The ``kubernetes`` package is optional (``pip install
    'jaxdist[kubernetes]'``) and imported only when no ``override_client`` is
    given.

    Args:
        job_to_label_mapping: job name to a list of label selectors, e.g.
            ``{"worker": ["job-name=worker"], "ps": ["job-name=ps"]}``;
            defaults to ``{"worker": ["job-name=tensorflow"]}``.
        tf_server_port: the port of every task.
        rpc_layer: the protocol prefix of `master`.
        override_client: an object with the ``list_pod_for_all_namespaces``
            method of ``kubernetes.client.CoreV1Api`` to use instead of
            building one (you then handle credentials).
        use_pod_ip: address pods by pod IP instead of host IP.

    Raises:
        ImportError: if ``kubernetes`` is not installed and no
            ``override_client`` is given.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> from jaxdist.cluster_resolver import KubernetesClusterResolver
        >>> pods = [NS(metadata=NS(name=f"w-{i}"),
        ...            status=NS(phase="Running", host_ip=f"10.0.0.{i}")) for i in range(2)]
        >>> client = NS(list_pod_for_all_namespaces=lambda label_selector: NS(items=pods))
        >>> r = KubernetesClusterResolver({"worker": ["job-name=w"]}, override_client=client)
        >>> r.task_type, r.task_id = "worker", 1
        >>> r.cluster_spec(), r.master()
        (ClusterSpec({'worker': ['10.0.0.0:8470', '10.0.0.1:8470']}), 'grpc://10.0.0.1:8470')
    """

    def __init__(
        self,
        job_to_label_mapping: Mapping[str, Sequence[str]] | None = None,
        tf_server_port: int = 8470,
        rpc_layer: str | None = "grpc",
        override_client: Any = None,
        *,
        use_pod_ip: bool = False,
    ) -> None:
        if override_client is None:
            try:
                import kubernetes  # noqa: F401
            except ImportError:
                raise ImportError(_INSTALL_HINT) from None
        mapping = dict(job_to_label_mapping or {"worker": ["job-name=tensorflow"]})
        for job, selectors in mapping.items():
            if isinstance(selectors, str) or not isinstance(selectors, Sequence):
                raise TypeError(
                    f"KubernetesClusterResolver(job_to_label_mapping=...): job {job!r} must map "
                    f"to a list of label selectors such as ['job-name=worker'], got {selectors!r}."
                )
        self._job_to_label_mapping = {job: list(sel) for job, sel in mapping.items()}
        self._tf_server_port = tf_server_port
        self._client = override_client
        self._use_pod_ip = use_pod_ip
        self._task_type = None
        self._task_id = None
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The running pods of each job, listed afresh from the Kubernetes API.

        Raises:
            RuntimeError: if a matching pod is not in the ``Running`` phase.
        """
        if self._client is None:
            self._client = _kubernetes_client()
        cluster: dict[str, list[str]] = {}
        for job, selectors in self._job_to_label_mapping.items():
            addresses: list[str] = []
            for selector in selectors:
                pods = self._client.list_pod_for_all_namespaces(label_selector=selector).items
                for pod in _pod_order(list(pods)):
                    if pod.status.phase != "Running":
                        raise RuntimeError(
                            f'Pod "{pod.metadata.name}" is not running; phase: '
                            f'"{pod.status.phase}". KubernetesClusterResolver.cluster_spec() '
                            f"needs every pod of job {job!r} (selector {selector!r}) running; "
                            "retry once the pods are up, or fix the failed pod."
                        )
                    ip = pod.status.pod_ip if self._use_pod_ip else pod.status.host_ip
                    addresses.append(f"{ip}:{self._tf_server_port}")
            cluster[job] = addresses
        return ClusterSpec(cluster)

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task (by default this one) with the RPC layer.

        Args:
            task_type: overrides this task's type.
            task_id: overrides this task's index.
            rpc_layer: overrides the protocol prefix.

        Returns:
            The address, or ``""`` while this task is unknown.
        """
        return self._task_master(task_type, task_id, rpc_layer)
