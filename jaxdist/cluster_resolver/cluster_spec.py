"""`ClusterSpec`: the jobs of a cluster and the network address of each task."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ClusterSpec"]


def _task_index(job: str, key: Any) -> int:
    """A task index from a dict key: an int, or a string of digits (as JSON gives)."""
    if isinstance(key, bool):
        raise TypeError(
            f"ClusterSpec(cluster=...): task index {key!r} of job {job!r} must be an integer, "
            "got a bool."
        )
    try:
        index = int(key)
    except (TypeError, ValueError):
        raise TypeError(
            f"ClusterSpec(cluster=...): task index {key!r} of job {job!r} must be an integer "
            f"(or a string of digits, as JSON writes dict keys), got {type(key).__name__}."
        ) from None
    if index < 0:
        raise ValueError(
            f"ClusterSpec(cluster=...): task index {index} of job {job!r} is negative; task "
            "indices count from 0."
        )
    return index


def _address(job: str, index: int, address: Any) -> str:
    if isinstance(address, bytes):
        return address.decode()
    if not isinstance(address, str):
        raise TypeError(
            f"ClusterSpec(cluster=...): the address of task {index} of job {job!r} must be a "
            f"string such as 'host:2222', got {type(address).__name__} {address!r}."
        )
    return address


def _normalize(cluster: Mapping[Any, Any]) -> dict[str, dict[int, str]]:
    jobs: dict[str, dict[int, str]] = {}
    for job, tasks in cluster.items():
        if isinstance(job, bytes):
            job = job.decode()
        if not isinstance(job, str):
            raise TypeError(
                f"ClusterSpec(cluster=...): job names must be strings, got "
                f"{type(job).__name__} {job!r}."
            )
        if isinstance(tasks, Mapping):
            entries: Iterable[tuple[int, Any]] = (
                (_task_index(job, k), v) for k, v in tasks.items()
            )
        elif isinstance(tasks, (list, tuple)):
            entries = enumerate(tasks)
        else:
            raise TypeError(
                f"ClusterSpec(cluster=...): the tasks of job {job!r} must be a list of "
                "addresses or a dict from task index to address, got "
                f"{type(tasks).__name__} {tasks!r}. Example: "
                "{'worker': ['host0:2222', 'host1:2222']} or {'worker': {1: 'host1:2222'}}."
            )
        job_tasks: dict[int, str] = {}
        for index, address in entries:
            if index in job_tasks:
                raise ValueError(
                    f"ClusterSpec(cluster=...): job {job!r} lists task {index} twice "
                    f"({job_tasks[index]!r} and {address!r}); give each task index one address."
                )
            job_tasks[index] = _address(job, index, address)
        jobs[job] = dict(sorted(job_tasks.items()))
    return jobs


class ClusterSpec:
    """A cluster as a set of jobs, each a set of tasks with a network address.

    The same value as ``tf.train.ClusterSpec``: a job name (``"chief"``,
    ``"worker"``, ``"ps"``, ``"evaluator"``, ...) maps to the ``"host:port"``
    addresses of its tasks, given as a list (task ``i`` is entry ``i``) or as a
    sparse dict from task index to address. A `ClusterSpec` is immutable,
    hashable and compares equal to another describing the same tasks. There is
    no ``as_cluster_def()``: jaxdist uses no protocol buffers.

    Args:
        cluster: a dict from job name to a list of addresses or to a dict from
            task index to address; or another `ClusterSpec` (copied).

    Raises:
        TypeError: if ``cluster`` is not such a mapping, or a job name, task
            index or address has the wrong type.
        ValueError: if a task index is negative.

    Example:
        >>> from jaxdist.cluster_resolver import ClusterSpec
        >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "ps": {1: "ps1:2222"}})
        >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
        (2, 'w1:2222')
        >>> spec.job_tasks("ps")
        [None, 'ps1:2222']
        >>> spec
        ClusterSpec({'ps': {1: 'ps1:2222'}, 'worker': ['w0:2222', 'w1:2222']})
    """

    __slots__ = ("_jobs",)
    _jobs: dict[str, dict[int, str]]

    def __init__(self, cluster: ClusterSpec | Mapping[str, Any]) -> None:
        if isinstance(cluster, ClusterSpec):
            jobs = _normalize(cluster.as_dict())
        elif isinstance(cluster, Mapping):
            jobs = _normalize(cluster)
        else:
            raise TypeError(
                "ClusterSpec(cluster=...): expected a dict mapping job names to lists of "
                "network addresses (or to dicts from task index to address), or a ClusterSpec; "
                f"got {type(cluster).__name__}. Example: "
                "ClusterSpec({'worker': ['host0:2222', 'host1:2222']})."
            )
        object.__setattr__(self, "_jobs", jobs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"ClusterSpec is immutable; build a new one instead of setting {name}."
        )

    def _job(self, job_name: str, method: str) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except (KeyError, TypeError):
            raise ValueError(
                f"ClusterSpec.{method}(job_name={job_name!r}): no such job in cluster; its jobs "
                f"are {sorted(self._jobs)}."
            ) from None

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order the cluster was given."""
        return list(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        """The number of tasks in job ``job_name`` (raises `ValueError` if it has no such job)."""
        return len(self._job(job_name, "num_tasks"))

    def task_indices(self, job_name: str) -> list[int]:
        """The sorted task indices of job ``job_name``."""
        return list(self._job(job_name, "task_indices"))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of job ``job_name``.

        Raises:
            ValueError: if there is no such job, or no such task in it.
        """
        tasks = self._job(job_name, "task_address")
        try:
            return tasks[task_index]
        except (KeyError, TypeError):
            raise ValueError(
                f"ClusterSpec.task_address(job_name={job_name!r}, task_index={task_index!r}): "
                f"no task with index {task_index!r} in job {job_name!r}; its task indices are "
                f"{list(tasks)}."
            ) from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The addresses of job ``job_name`` as a list indexed by task index.

        A sparse job has ``None`` at the indices it does not define, so the
        length of this list is not always the number of tasks: use
        `num_tasks` for that.
        """
        tasks = self._job(job_name, "job_tasks")
        out: list[str | None] = [None] * (max(tasks) + 1 if tasks else 0)
        for index, address in tasks.items():
            out[index] = address
        return out

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """The cluster as a dict: a list of addresses per dense job, a dict per sparse one.

        A job whose task indices are exactly ``0..n-1`` comes back as a list;
        any other job (and an empty one) as a dict from index to address. The
        result builds an equal `ClusterSpec`.
        """
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            if tasks and max(tasks) + 1 == len(tasks):
                out[job] = list(tasks.values())
            else:
                out[job] = dict(tasks)
        return out

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self.as_dict() == other.as_dict()
        if isinstance(other, Mapping):
            try:
                return self.as_dict() == ClusterSpec(other).as_dict()
            except (TypeError, ValueError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset((job, tuple(tasks.items())) for job, tasks in self._jobs.items()))

    def __repr__(self) -> str:
        as_dict = self.as_dict()
        items = ", ".join(f"{job!r}: {as_dict[job]!r}" for job in sorted(as_dict))
        return f"ClusterSpec({{{items}}})"
