"""The cluster of a parameter-server job: TF's checks and task names.

A cluster has ``worker`` and ``ps`` jobs, at most one ``chief`` (the coordinator, this
process) and an optional ``evaluator``; addresses are labels (Ray places the tasks). The
checks run before any actor starts and raise ``ValueError`` in TF's words.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ALLOWED_TASK_TYPES", "task_counts", "task_device"]

ALLOWED_TASK_TYPES = ("chief", "worker", "evaluator", "ps")

_WHERE = "ParameterServerStrategy(cluster_resolver=...)"


def task_device(job: str, index: int) -> str:
    """TF's device string of a task, e.g. ``/job:ps/replica:0/task:1``."""
    return f"/job:{job}/replica:0/task:{index}"


def task_counts(cluster_resolver: Any) -> tuple[int, int]:
    """The numbers of worker and ps tasks of a valid cluster; raises ``ValueError`` otherwise."""
    get_spec = getattr(cluster_resolver, "cluster_spec", None)
    if not callable(get_spec):
        raise TypeError(
            f"{_WHERE}: expected a jaxdist.cluster_resolver.ClusterResolver, got "
            f"{type(cluster_resolver).__name__}. Describe the cluster with "
            "jd.cluster_resolver.SimpleClusterResolver(jd.cluster_resolver.ClusterSpec("
            '{"worker": [...], "ps": [...]}), rpc_layer="ray").'
        )
    spec = get_spec()
    jobs = list(spec.jobs)
    bad = [job for job in jobs if job not in ALLOWED_TASK_TYPES]
    if bad:
        raise ValueError(
            f"{_WHERE}: Disallowed task type found in cluster spec: {bad}. Allowed types are "
            f"{ALLOWED_TASK_TYPES} and the cluster spec is {spec.as_dict()}."
        )
    task_type = getattr(cluster_resolver, "task_type", None)
    if task_type is not None and task_type not in ALLOWED_TASK_TYPES:
        raise ValueError(
            f"{_WHERE}: Unrecognized task_type: {task_type!r}, valid task types are: "
            f"{(*ALLOWED_TASK_TYPES, None)}. The coordinator is the 'chief' (or no task type)."
        )

    def count(job: str) -> int:
        return spec.num_tasks(job) if job in jobs else 0

    if count("chief") > 1:
        raise ValueError(
            f"{_WHERE}: There must be at most one 'chief' job (the coordinator); the cluster "
            f"spec has {count('chief')}: {spec.as_dict()}."
        )
    if count("ps") < 1:
        raise ValueError(
            f"{_WHERE}: There must be at least one ps (parameter server) task to hold the "
            f"variables; the cluster spec is {spec.as_dict()}. Add a 'ps' job."
        )
    if count("worker") < 1:
        raise ValueError(
            f"{_WHERE}: There must be at least one worker task to run closures; the cluster "
            f"spec is {spec.as_dict()}. Add a 'worker' job."
        )
    return count("worker"), count("ps")
