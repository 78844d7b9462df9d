"""`TFConfigClusterResolver`: the cluster described by the ``TF_CONFIG`` environment variable."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxdist.cluster_resolver.base import ClusterResolver, format_master_url
from jaxdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["TF_CONFIG", "TFConfigClusterResolver"]

#: The environment variable holding the JSON cluster description.
TF_CONFIG = "TF_CONFIG"


def load_tf_config() -> dict[str, Any]:
    """``TF_CONFIG`` parsed; ``{}`` when it is unset or blank.

    Raises:
        ValueError: if it is not a JSON object.
    """
    raw = os.environ.get(TF_CONFIG, "")
    if not raw.strip():
        return {}
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"TFConfigClusterResolver: the {TF_CONFIG} environment variable is not valid JSON "
            f"({e}): {raw!r}. Set it with json.dumps, e.g. "
            '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
            '"task": {"type": "worker", "index": 0}}.'
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"TFConfigClusterResolver: the {TF_CONFIG} environment variable must hold a JSON "
            f"object with 'cluster' and 'task' entries, got a {type(config).__name__}: {raw!r}."
        )
    return config


def _task_entry() -> dict[str, Any]:
    task = load_tf_config().get("task", {})
    if not isinstance(task, dict):
        raise ValueError(
            f"TFConfigClusterResolver: {TF_CONFIG}'s 'task' entry must be an object such as "
            f'{{"type": "worker", "index": 0}}, got {task!r}.'
        )
    return task


def _as_index(value: Any, source: str) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"TFConfigClusterResolver: {source} must be an integer task index (or a string of "
            f"digits), got {type(value).__name__} {value!r}."
        ) from None


class TFConfigClusterResolver(ClusterResolver):
    """The cluster described by the ``TF_CONFIG`` environment variable.

    ``TF_CONFIG`` is the JSON object TensorFlow's multi-worker jobs read,
    set by the job's launcher (Kubeflow's TFJob, Vertex AI, or by hand)::

        {"cluster": {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"]},
         "task": {"type": "worker", "index": 0},
         "rpc_layer": "grpc", "environment": "cloud", "session_master": "..."}

    Every property re-reads the variable, so a change is seen at once, as in
    TF; `environment` alone is the constructor's value (``None`` by default),
    as TF's resolver never reads ``TF_CONFIG``'s ``"environment"``.
    ``task.type`` is returned as a string and ``task.index`` as an int (JSON
    may give ``"1"``); a missing ``cluster`` means an empty cluster (a
    one-process job); a missing, blank or ``{}`` ``TF_CONFIG`` means no
    cluster and no task. Constructor arguments and the setters override the
    values in ``TF_CONFIG``.

    Args:
        task_type: overrides ``task.type``.
        task_id: overrides ``task.index``.
        rpc_layer: overrides ``rpc_layer``.
        environment: what `environment` returns (``None`` when not given).

    Raises:
        ValueError: (when read) if ``TF_CONFIG`` is not a JSON object or its
            task index is not an integer.

    Example:
        >>> import json, os
        >>> from jaxdist.cluster_resolver import TFConfigClusterResolver
        >>> os.environ["TF_CONFIG"] = json.dumps({
        ...     "cluster": {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"]},
        ...     "task": {"type": "worker", "index": 1}})
        >>> r = TFConfigClusterResolver()
        >>> r.task_type, r.task_id, r.master()
        ('worker', 1, 'w1:2222')
        >>> r.jax_initialize_kwargs()
        {'coordinator_address': 'c0:2222', 'num_processes': 3, 'process_id': 2}
        >>> del os.environ["TF_CONFIG"]
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
    ) -> None:
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def task_type(self) -> str | None:
        if self._task_type is not None:
            return str(self._task_type)
        task = _task_entry()
        return str(task["type"]) if "type" in task else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        if self._task_id is not None:
            return _as_index(self._task_id, "task_id")
        task = _task_entry()
        return _as_index(task["index"], f"{TF_CONFIG}'s task.index") if "index" in task else None

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        if self._rpc_layer is not None:
            return self._rpc_layer
        layer = load_tf_config().get("rpc_layer")
        return None if layer is None else str(layer)

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        """The constructor's ``environment``; ``None`` when it was not given.

        As in TF, ``TF_CONFIG``'s own ``"environment"`` entry is not read here
        (TF's estimator-era tools read it, not the resolver).
        """
        return self._environment

    def cluster_spec(self) -> ClusterSpec:
        """``TF_CONFIG``'s ``cluster`` as a `ClusterSpec` (empty when there is none)."""
        cluster = load_tf_config().get("cluster", {})
        if not isinstance(cluster, dict):
            raise ValueError(
                f"TFConfigClusterResolver: {TF_CONFIG}'s 'cluster' entry must be an object from "
                f'job name to addresses, such as {{"worker": ["host0:2222"]}}, got {cluster!r}.'
            )
        return ClusterSpec(cluster)

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task (by default this one), as TF computes it.

        ``TF_CONFIG``'s ``session_master``, when set, is returned as is. A
        cluster that is empty or has a single task has no master: ``""``.

        Args:
            task_type: overrides this task's type.
            task_id: overrides this task's index.
            rpc_layer: overrides the protocol prefix (``""``: none).

        Returns:
            The address, prefixed with ``rpc_layer://`` when there is one.

        Raises:
            ValueError: if the task is unknown or not in the cluster.
        """
        session_master = load_tf_config().get("session_master")
        if session_master is not None:
            return str(session_master)
        spec = self.cluster_spec()
        # TF counts the task list's length, so a sparse job's one task at index > 0 has one.
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            raise ValueError(
                "TFConfigClusterResolver.master(): this task is unknown (task_type="
                f"{task_type!r}, task_id={task_id!r}); pass task_type and task_id, or add "
                f'"task": {{"type": ..., "index": ...}} to {TF_CONFIG}.'
            )
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer  # "" means none
        return format_master_url(spec.task_address(task_type, task_id), rpc_layer)
