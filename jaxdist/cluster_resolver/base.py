"""`ClusterResolver`, the interface every resolver implements, and `SimpleClusterResolver`.

A resolver answers two questions: where are the tasks of the cluster
(`ClusterResolver.cluster_spec`), and which task is this process
(``task_type``/``task_id``). jaxdist adds a third: the arguments of
`jax.distributed.initialize` for this process
(`ClusterResolver.jax_initialize_kwargs`).
"""

from __future__ import annotations

import abc
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = [
    "COLLECTIVE_JOBS",
    "ClusterResolver",
    "SimpleClusterResolver",
    "format_master_url",
    "local_accelerators",
]

#: The jobs whose tasks are JAX processes, in process order: the chief (if
#: any) is process 0, then the workers in task order.
COLLECTIVE_JOBS = ("chief", "worker")

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\]")
_GPU_PLATFORMS = {"gpu": "GPU", "cuda": "GPU", "rocm": "GPU"}


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``master`` prefixed with ``rpc_layer://`` when an RPC layer is given.

    Example:
        >>> from jaxdist.cluster_resolver import format_master_url
        >>> format_master_url("w0:2222", "grpc"), format_master_url("w0:2222")
        ('grpc://w0:2222', 'w0:2222')
    """
    return f"{rpc_layer}://{master}" if rpc_layer else master


def strip_rpc_layer(address: str) -> str:
    """``address`` without a leading ``scheme://`` (``grpc://h:1`` becomes ``h:1``)."""
    return _SCHEME.sub("", address, count=1)


def split_host_port(address: str, where: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` address (IPv6 hosts in brackets), validated."""
    bare = strip_rpc_layer(address)
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{where}: the coordinator address {address!r} is not 'host:port' with a port in "
            "1..65535; give the chief (or worker 0) an address such as '10.0.0.1:2222' (IPv6: "
            "'[fe80::1]:2222')."
        )
    if not _HOST.fullmatch(host):
        raise ValueError(
            f"{where}: in the coordinator address {address!r}, {host!r} is not a host name or "
            "an IP address (IPv6 in brackets); give one address such as '10.0.0.1:2222', not "
            "a list."
        )
    return host, int(port)


def local_accelerators(devices: Sequence[Any] | None = None) -> dict[str, int]:
    """Accelerator devices by type, as TF reports them (``{"GPU": 8}``, ``{"TPU": 4}``).

    CPU devices are not accelerators: a CPU-only process gives ``{}``.

    Args:
        devices: the devices to count; ``None`` means ``jax.local_devices()``,
            which starts JAX's backend if it has not started yet.

    Returns:
        A dict from device type (``"GPU"``, ``"TPU"``, or the upper-cased
        platform name of another accelerator) to its number of devices.
    """
    if devices is None:
        devices = jax.local_devices()
    counts: Counter[str] = Counter()
    for device in devices:
        platform = str(device.platform).lower()
        if platform != "cpu":
            counts[_GPU_PLATFORMS.get(platform, platform.upper())] += 1
    return dict(counts)


def _collective_members(spec: ClusterSpec, where: str) -> list[tuple[str, int, str]]:
    """The chief and workers of ``spec`` as ``(job, task_id, address)`` in process order."""
    if not any(job in spec.jobs for job in COLLECTIVE_JOBS):
        raise ValueError(
            f"{where}: the cluster has no 'chief' or 'worker' job (its jobs are {spec.jobs}); "
            "the JAX processes of a job are its chief and workers. Name the training tasks "
            "'worker' (and optionally one 'chief')."
        )
    members: list[tuple[str, int, str]] = []
    for job in COLLECTIVE_JOBS:
        if job not in spec.jobs:
            continue
        indices = spec.task_indices(job)
        if job == "chief" and len(indices) > 1:
            raise ValueError(
                f"{where}: the cluster has {len(indices)} chief tasks {indices}; a cluster has "
                "at most one chief. Make the others workers."
            )
        if indices != list(range(len(indices))):
            raise ValueError(
                f"{where}: job {job!r} has the sparse task indices {indices}; JAX numbers its "
                f"processes 0..n-1 and needs every one of them, so give job {job!r} tasks "
                f"0..{len(indices) - 1} (a list of addresses)."
            )
        members.extend((job, i, spec.task_address(job, i)) for i in indices)
    return members


class ClusterResolver(abc.ABC):
    """Where the tasks of a cluster are, and which one is this process.

    The interface of ``tf.distribute.cluster_resolver.ClusterResolver``.
    ``task_type`` is the job of this process (``"chief"``, ``"worker"``,
    ``"ps"``, ``"evaluator"``), ``task_id`` its index in that job and
    ``rpc_layer`` the protocol prefix of `master` (``"grpc"``); all three are
    settable. Subclasses implement `cluster_spec` and `master`.

    For JAX, the processes of a job are its chief and workers: the chief (if
    there is one) is process 0 and worker ``i`` is process ``i + 1``
    (process ``i`` without a chief). Other jobs (``ps``, ``evaluator``) are
    not part of the collective group; `jax_initialize_kwargs` gives what
    `jax.distributed.initialize` needs for this process.
    """

    _task_type: str | None = None
    _task_id: int | None = None
    _rpc_layer: str | None = None

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The current `ClusterSpec` of the cluster, resolved afresh on each call."""

    @abc.abstractmethod
    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task (by default this one), prefixed with the RPC layer.

        Args:
            task_type: the job of the task; ``None`` means this task's.
            task_id: the index of the task; ``None`` means this task's.
            rpc_layer: the protocol prefix; ``None`` means `rpc_layer`.

        Returns:
            A string such as ``"grpc://10.0.0.1:2222"``, or ``""`` when there is
            no master to name.
        """

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """Accelerators per task by type, e.g. ``{"GPU": 8}``; ``{}`` on a CPU-only machine.

        Counts the local devices JAX sees (starting JAX's backend if needed),
        so it describes this process; like TF's Slurm and TPU resolvers it
        assumes every task has the same accelerators.

        Args:
            task_type: accepted for TF compatibility; unused.
            task_id: accepted for TF compatibility; unused.
            config_proto: accepted for TF compatibility; unused.

        Returns:
            A dict from device type to number of devices.
        """
        del task_type, task_id, config_proto
        return local_accelerators()

    @property
    def environment(self) -> str | None:
        """The environment the job runs in (``""`` outside Google's own clusters).

        `TFConfigClusterResolver` returns its constructor's value, ``None`` when
        not given, as TF does.
        """
        return ""

    @property
    def task_type(self) -> str | None:
        """The job of this process (``"chief"``, ``"worker"``, ...), or ``None`` if unknown."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """The index of this process in its job, or ``None`` if unknown."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol prefix `master` puts before addresses (``"grpc"``), or ``None``."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    def _task_master(
        self, task_type: str | None, task_id: int | None, rpc_layer: str | None
    ) -> str:
        """`master` for resolvers whose tasks all have addresses: the task's, else ``""``."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        return format_master_url(address, rpc_layer or self.rpc_layer)

    def _jax_coordinator_address(self, address: str, where: str) -> str:
        """The coordinator's ``host:port`` from process 0's address (as given, unprefixed)."""
        host, port = split_host_port(address, where)
        return f"{host}:{port}"

    def jax_initialize_kwargs(self) -> dict[str, Any]:
        """The arguments of `jax.distributed.initialize` for this process.

        JAX's processes are the chief and the workers: the chief (if any) is
        process 0 and hosts the coordinator, then the workers follow in task
        order (worker ``i`` is process ``i + 1`` with a chief, ``i`` without).
        Other jobs (``ps``, ``evaluator``, ...) do not take part in the
        collectives of a JAX program: they run their own programs, so a task of
        such a job has no JAX process id.

        Returns:
            ``{"coordinator_address": "host:port", "num_processes": n,
            "process_id": i}``: the address of process 0 (without its
            ``grpc://`` prefix, port as given), the number of chief and worker
            tasks, and this task's place among them.

        Raises:
            ValueError: if the cluster is empty (a one-process job), has no
                chief or worker, has a sparse job or several chiefs, if this task is
                unknown, or is not a chief or worker.

        Example:
            >>> from jaxdist.cluster_resolver import ClusterSpec, SimpleClusterResolver
            >>> spec = ClusterSpec({"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"],
            ...                     "ps": ["p0:2222"]})
            >>> SimpleClusterResolver(spec, task_type="worker", task_id=1).jax_initialize_kwargs()
            {'coordinator_address': 'c0:2222', 'num_processes': 3, 'process_id': 2}
        """
        where = f"{type(self).__name__}.jax_initialize_kwargs()"
        spec = self.cluster_spec()
        if not spec:
            raise ValueError(
                f"{where}: the cluster spec is empty, which describes a one-process job: there "
                "are no peers for jax.distributed to connect. jaxdist.initialize() skips "
                "one-process jobs; for several processes, give the resolver a cluster."
            )
        members = _collective_members(spec, where)
        task_type, task_id = self.task_type, self.task_id
        if task_type is None and task_id is None and len(members) == 1:
            process_id = 0
        elif task_type is None or task_id is None:
            raise ValueError(
                f"{where}: this process's task is unknown (task_type={task_type!r}, "
                f"task_id={task_id!r}) in a cluster of {len(members)} JAX processes; set "
                "resolver.task_type and resolver.task_id (with TF_CONFIG: its 'task' entry)."
            )
        elif task_type not in COLLECTIVE_JOBS:
            raise ValueError(
                f"{where}: task {task_type!r} {task_id} is not part of the JAX collective group, "
                "which is the chief and the workers; a task of job "
                f"{task_type!r} runs its own program (for example an evaluator reading "
                "checkpoints), so do not call jax.distributed.initialize for it."
            )
        else:
            if isinstance(task_id, bool) or not isinstance(task_id, int):
                raise ValueError(
                    f"{where}: task_id must be an integer, got {type(task_id).__name__} "
                    f"{task_id!r}; set resolver.task_id = int(...)."
                )
            tasks = [(job, index) for job, index, _ in members]
            if (task_type, task_id) not in tasks:
                raise ValueError(
                    f"{where}: this process is task {task_type!r} {task_id!r}, which the "
                    f"cluster does not have: {spec!r}. Fix the task index or the cluster."
                )
            process_id = tasks.index((task_type, task_id))
        return {
            "coordinator_address": self._jax_coordinator_address(members[0][2], where),
            "num_processes": len(members),
            "process_id": process_id,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id!r})"


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns exactly what it is given.

    Useful to describe a cluster by hand, or to override one attribute of
    another resolver through `UnionResolver`.

    Args:
        cluster_spec: the `ClusterSpec` (a plain dict is converted).
        master: what `master` returns when no task is named.
        task_type: the job of this process.
        task_id: the index of this process in its job.
        environment: what `environment` returns.
        num_accelerators: what `num_accelerators` returns (``None``: ``{}``),
            e.g. ``{"GPU": 8}``.
        rpc_layer: the protocol prefix of `master`, e.g. ``"grpc"``.

    Example:
        >>> from jaxdist.cluster_resolver import ClusterSpec, SimpleClusterResolver
        >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"]})
        >>> r = SimpleClusterResolver(spec, task_type="worker", task_id=1, rpc_layer="grpc")
        >>> r.master("worker", 0), r.jax_initialize_kwargs()["process_id"]
        ('grpc://w0:2222', 1)
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Any],
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: dict[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        if isinstance(cluster_spec, Mapping):
            cluster_spec = ClusterSpec(cluster_spec)
        if not isinstance(cluster_spec, ClusterSpec):
            raise TypeError(
                "SimpleClusterResolver(cluster_spec=...): expected a jaxdist.cluster_resolver."
                f"ClusterSpec (or a dict to build one from), got {type(cluster_spec).__name__}."
            )
        if not isinstance(master, str):
            raise TypeError(
                f"SimpleClusterResolver(master=...): expected a string such as "
                f"'grpc://10.0.0.1:2222' (or ''), got {type(master).__name__}."
            )
        self._cluster_spec = cluster_spec
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` given to the constructor."""
        return self._cluster_spec

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The named task's address, else the constructor's ``master``, with the RPC layer.

        Args:
            task_type: with ``task_id``, names the task whose address to return.
            task_id: with ``task_type``, names the task whose address to return.
            rpc_layer: the protocol prefix; ``None`` means `rpc_layer`.

        Returns:
            The address, prefixed with ``rpc_layer://`` when there is one.
        """
        if task_type is not None and task_id is not None:
            address = self._cluster_spec.task_address(task_type, task_id)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self._rpc_layer)

    @property
    def environment(self) -> str:
        return self._environment

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """The ``num_accelerators`` given to the constructor (``{}`` if none); no detection."""
        del task_type, task_id, config_proto
        return {} if self._num_accelerators is None else self._num_accelerators
