"""`UnionResolver`: several resolvers merged into one cluster."""

from __future__ import annotations

from typing import Any

from jaxdist.cluster_resolver.base import ClusterResolver, format_master_url
from jaxdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["UnionClusterResolver", "UnionResolver"]

_OVERRIDES = ("rpc_layer", "task_type", "task_id")


class UnionResolver(ClusterResolver):
    """The union of several resolvers: their cluster specs merged, the rest from the first.

    Merging, job by job: when every resolver gives a job as a list, the lists
    are concatenated in resolver order (so task indices shift); when any gives
    it as a sparse dict, all are treated as dicts (a list's entries keep their
    indices) and merged, and a task index given twice is an error. Task type,
    task index, RPC layer, environment, accelerators and `master` come from
    the first resolver, unless overridden by keyword or by the setters.

    Args:
        *resolvers: the `ClusterResolver` objects to merge (at least one).
        **kwargs: ``task_type``, ``task_id`` and ``rpc_layer`` overrides.

    Raises:
        ValueError: without resolvers, or with another keyword.
        TypeError: if an argument is not a `ClusterResolver`.

    Example:
        >>> from jaxdist.cluster_resolver import ClusterSpec, SimpleClusterResolver, UnionResolver
        >>> a = SimpleClusterResolver(ClusterSpec({"worker": ["w0:2222"]}), task_type="worker",
        ...                           task_id=0)
        >>> b = SimpleClusterResolver(ClusterSpec({"worker": ["w1:2222"], "ps": ["p0:2222"]}))
        >>> u = UnionResolver(a, b)
        >>> u.cluster_spec(), u.task_type
        (ClusterSpec({'ps': ['p0:2222'], 'worker': ['w0:2222', 'w1:2222']}), 'worker')
    """

    def __init__(self, *resolvers: ClusterResolver, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(_OVERRIDES))
        if unknown:
            raise ValueError(
                f"UnionResolver: unexpected keyword arguments {unknown}; the overrides are "
                f"{list(_OVERRIDES)}."
            )
        if not resolvers:
            raise ValueError(
                "UnionResolver: at least one ClusterResolver is required, e.g. "
                "UnionResolver(TFConfigClusterResolver(), SimpleClusterResolver(...))."
            )
        for i, resolver in enumerate(resolvers):
            if not isinstance(resolver, ClusterResolver):
                raise TypeError(
                    f"UnionResolver: argument {i} must be a ClusterResolver, got "
                    f"{type(resolver).__name__} {resolver!r}."
                )
        self._resolvers = resolvers
        self._task_type = kwargs.get("task_type")
        self._task_id = kwargs.get("task_id")
        self._rpc_layer = kwargs.get("rpc_layer")

    def cluster_spec(self) -> ClusterSpec:
        """The merged cluster spec (see the class docstring).

        Raises:
            KeyError: if two resolvers give the same task index of a job that
                one of them gives as a sparse dict.
        """
        specs = [(r, r.cluster_spec().as_dict()) for r in self._resolvers]
        sparse = {
            job for _, spec in specs for job, tasks in spec.items() if isinstance(tasks, dict)
        }
        merged: dict[str, Any] = {}
        origin: dict[tuple[str, int], ClusterResolver] = {}
        for resolver, spec in specs:
            for job, tasks in spec.items():
                if job not in sparse:
                    merged.setdefault(job, []).extend(tasks)
                    continue
                entries = tasks.items() if isinstance(tasks, dict) else enumerate(tasks)
                job_tasks = merged.setdefault(job, {})
                for index, address in entries:
                    if index in job_tasks:
                        raise KeyError(
                            f"UnionResolver.cluster_spec(): duplicate keys detected when merging "
                            f"two ClusterSpecs: task {index} of job {job!r} is "
                            f"{job_tasks[index]!r} in {origin[job, index]!r} and {address!r} "
                            f"in {resolver!r}. Give the resolvers disjoint task indices."
                        )
                    job_tasks[index] = address
                    origin[job, index] = resolver
        return ClusterSpec(merged)

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The named task's address in the merged cluster, else the first resolver's master.

        Args:
            task_type: with ``task_id``, names the task whose address to return.
            task_id: with ``task_type``, names the task whose address to return.
            rpc_layer: the protocol prefix; ``None`` means `rpc_layer`.

        Returns:
            The address, prefixed with ``rpc_layer://`` when there is one.
        """
        if task_type is not None and task_id is not None:
            address = self.cluster_spec().task_address(task_type, task_id)
            return format_master_url(address, rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer)

    @property
    def task_type(self) -> str | None:
        return self._task_type if self._task_type is not None else self._resolvers[0].task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        return self._task_id if self._task_id is not None else self._resolvers[0].task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer if self._rpc_layer is not None else self._resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        return self._resolvers[0].environment

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """The first resolver's `ClusterResolver.num_accelerators`."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)


#: TF's class name (``tf.distribute.cluster_resolver.UnionResolver`` is an alias of it).
UnionClusterResolver = UnionResolver
