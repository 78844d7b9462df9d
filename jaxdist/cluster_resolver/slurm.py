"""`SlurmClusterResolver`: the cluster of a Slurm job step, from Slurm's environment variables.

Node lists (``t02n[13-16],t03n1``) and task counts (``2(x3),1``) are expanded
here; nothing shells out to ``scontrol``.
"""

from __future__ import annotations

import itertools
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from jaxdist._jax_compat import backends_initialized as backends_initialized
from jaxdist.cluster_resolver.base import ClusterResolver
from jaxdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]

_NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"
# CUDA_VISIBLE_DEVICES as it was before a resolver of this process first changed it.
_original_visible_devices: list[str | None] = []


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas that are outside brackets."""
    parts: list[str] = []
    depth, current = 0, ""
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif char == "," and depth == 0:
            if not current:
                raise ValueError("empty host name")
            parts.append(current)
            current = ""
            continue
        current += char
    if depth:
        raise ValueError("'[' without ']'")
    if not current:
        raise ValueError("empty host name")
    parts.append(current)
    return parts


def _expand_range(body: str) -> list[str]:
    """``"01-03,7"`` as ``["01", "02", "03", "7"]``: each range keeps its start's zero padding."""
    values: list[str] = []
    for part in body.split(","):
        start, sep, end = part.partition("-")
        end = end if sep else start
        if not (start.isdigit() and end.isdigit()) or int(end) < int(start):
            raise ValueError(f"bad range {part!r}")
        values.extend(str(i).zfill(len(start)) for i in range(int(start), int(end) + 1))
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a Slurm host list, in order, duplicates kept.

    Supports ranges with zero padding and several bracket groups per name, as
    Slurm writes them (``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``).

    Args:
        hostlist: a host list such as ``"t02n[13-16],t03n1,t04n[01-02,5]"``.

    Returns:
        The expanded list of host names.

    Raises:
        ValueError: if ``hostlist`` is malformed.

    Example:
        >>> from jaxdist.cluster_resolver.slurm import expand_hostlist
        >>> expand_hostlist("t02n[13-14],t03n1,t04n[01-02,5]")
        ['t02n13', 't02n14', 't03n1', 't04n01', 't04n02', 't04n5']
        >>> expand_hostlist("rack[1-2]-n[1-2]")
        ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
    """
    hosts: list[str] = []
    try:
        for name in _split_top_level(hostlist.strip()):
            pieces = re.split(r"\[([^\]]*)\]", name)
            # pieces alternates literal text and bracket contents: [lit, range, lit, ...]
            choices = [
                [piece] if i % 2 == 0 else _expand_range(piece) for i, piece in enumerate(pieces)
            ]
            hosts.extend("".join(combo) for combo in itertools.product(*choices))
    except ValueError as e:
        raise ValueError(
            f"expand_hostlist: invalid Slurm host list {hostlist!r} ({e}); expected names and "
            "bracketed ranges such as 'node[01-04,07],gpu5'."
        ) from None
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """The number of tasks on each node of a Slurm step, in node order.

    Args:
        tasks_per_node: Slurm's compressed list, e.g. ``"2(x3),1"``
            (``SLURM_STEP_TASKS_PER_NODE``).

    Returns:
        One count per node.

    Raises:
        ValueError: if ``tasks_per_node`` is malformed.

    Example:
        >>> from jaxdist.cluster_resolver.slurm import expand_tasks_per_node
        >>> expand_tasks_per_node("3(x2),2,1")
        [3, 3, 2, 1]
    """
    counts: list[int] = []
    for part in tasks_per_node.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(
                f"expand_tasks_per_node: invalid Slurm tasks-per-node list {tasks_per_node!r} "
                f"(at {part!r}); expected counts with optional repeats such as '2(x3),1'."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _slurm_var(*names: str) -> str:
    """The first of ``SLURM_<name>`` that is set."""
    for name in names:
        value = os.environ.get(f"SLURM_{name}")
        if value is not None:
            return value
    listed = " or ".join(f"SLURM_{n}" for n in names)
    raise RuntimeError(
        f"SlurmClusterResolver: {listed} is not set: this process is not running inside a Slurm "
        "job step. Start it with srun (e.g. 'srun --ntasks=4 python train.py'), or pass the "
        "missing value to SlurmClusterResolver(...)."
    )


def _int_var(*names: str) -> int:
    value = _slurm_var(*names)
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(
            f"SlurmClusterResolver: SLURM_{names[0]}={value!r} is not an integer."
        ) from None


def _visible_devices_before_us() -> str | None:
    """CUDA_VISIBLE_DEVICES as the job set it, before any resolver here changed it."""
    if _original_visible_devices:
        return _original_visible_devices[0]
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def num_gpus_on_node() -> int:
    """The GPUs this node gives the job, without running any program.

    In order: the entries of ``CUDA_VISIBLE_DEVICES`` (as TF counts them;
    ``""`` means none), Slurm's ``SLURM_GPUS_ON_NODE``, the NVIDIA driver's
    ``/proc/driver/nvidia/gpus`` entries; else 0.
    """
    visible = _visible_devices_before_us()
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    on_node = os.environ.get("SLURM_GPUS_ON_NODE")
    if on_node is not None and on_node.strip().isdigit():
        return int(on_node)
    try:
        return len(os.listdir(_NVIDIA_GPUS_DIR))
    except OSError:
        return 0


class SlurmClusterResolver(ClusterResolver):
    """The cluster of the Slurm job step this process runs in.

    Reads what ``srun`` sets for every task: ``SLURM_PROCID`` (this task's
    rank), ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
    ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``)
    and ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``). Tasks
    are packed onto the nodes in node-list order (Slurm's block
    distribution); the ``k``-th task of a node listens on ``port_base + k``.
    Ranks are handed to the jobs in sorted job-name order (so a ``chief`` gets
    rank 0), and this task's ``task_type``/``task_id`` follow from its rank.

    GPUs: a node's ``gpus_per_node`` GPUs are split into consecutive groups of
    ``gpus_per_task``, one per task of the node. With ``auto_set_gpu``,
    `cluster_spec` sets ``CUDA_VISIBLE_DEVICES`` to this task's group (mapped
    through the job's own ``CUDA_VISIBLE_DEVICES`` when Slurm set one), as TF
    does. That only takes effect if JAX has not started its backend yet:
    create the resolver (or call ``jaxdist.initialize()``) before touching
    devices. Once the backend runs the variable is left alone and a
    `RuntimeWarning` says so. On a node without GPUs nothing is set.

    Args:
        jobs: job name to number of tasks, e.g. ``{"chief": 1, "worker": 3}``;
            defaults to every task of the step as a ``worker``.
        port_base: the port of the first task on each node.
        gpus_per_node: GPUs per node; detected by default (see
            `num_gpus_on_node`).
        gpus_per_task: GPUs per task; defaults to ``gpus_per_node`` divided by
            the largest number of tasks on a node.
        tasks_per_node: an int for the same count on every node, or a dict
            from host name to count; read from Slurm by default.
        auto_set_gpu: set ``CUDA_VISIBLE_DEVICES`` for this task (see above).
        rpc_layer: the protocol prefix of `master`.

    Raises:
        RuntimeError: outside a Slurm step (a variable is missing), if the
            jobs ask for a different number of tasks than Slurm assigned, or
            for more GPUs per node than there are.
        ValueError: if a Slurm variable is malformed.

    Example:
        >>> from jaxdist.cluster_resolver import SlurmClusterResolver
        >>> import os
        >>> os.environ.update(SLURM_PROCID="2", SLURM_STEP_NUM_TASKS="4",
        ...                   SLURM_STEP_NODELIST="n[01-02]", SLURM_STEP_TASKS_PER_NODE="2(x2)")
        >>> r = SlurmClusterResolver(gpus_per_node=0)
        >>> r.cluster_spec()
        ClusterSpec({'worker': ['n01:8888', 'n01:8889', 'n02:8888', 'n02:8889']})
        >>> r.task_type, r.task_id, r.jax_initialize_kwargs()["process_id"]
        ('worker', 2, 2)
        >>> for k in ("PROCID", "STEP_NUM_TASKS", "STEP_NODELIST", "STEP_TASKS_PER_NODE"):
        ...     del os.environ["SLURM_" + k]
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str | None = "grpc",
    ) -> None:
        self._rank = _int_var("PROCID")
        self._jobs = (
            dict(jobs) if jobs is not None else {"worker": _int_var("STEP_NUM_TASKS", "NTASKS")}
        )
        self._port_base = int(port_base)
        if tasks_per_node is None:
            hosts = expand_hostlist(_slurm_var("STEP_NODELIST", "JOB_NODELIST", "NODELIST"))
            counts = expand_tasks_per_node(_slurm_var("STEP_TASKS_PER_NODE", "TASKS_PER_NODE"))
            if len(counts) != len(hosts):
                raise ValueError(
                    f"SlurmClusterResolver: the node list names {len(hosts)} nodes {hosts} but "
                    f"the tasks-per-node list gives {len(counts)} counts {counts}; pass "
                    "tasks_per_node= explicitly."
                )
            self._task_configuration = dict(zip(hosts, counts, strict=True))
        elif isinstance(tasks_per_node, Mapping):
            self._task_configuration = {str(h): int(n) for h, n in tasks_per_node.items()}
        else:
            hosts = expand_hostlist(_slurm_var("STEP_NODELIST", "JOB_NODELIST", "NODELIST"))
            self._task_configuration = {host: int(tasks_per_node) for host in hosts}
        if not self._task_configuration:
            raise RuntimeError("SlurmClusterResolver: the Slurm step has no nodes.")

        max_tasks = max(self._task_configuration.values())
        num_tasks = sum(self._task_configuration.values())
        self._gpus_per_node = num_gpus_on_node() if gpus_per_node is None else int(gpus_per_node)
        self._gpus_per_task = (
            self._gpus_per_node // max_tasks if gpus_per_task is None else int(gpus_per_task)
        )
        if max_tasks * self._gpus_per_task > self._gpus_per_node:
            raise RuntimeError(
                f"SlurmClusterResolver: requested more GPUs per node than available: up to "
                f"{max_tasks} tasks on a node x gpus_per_task={self._gpus_per_task} > "
                f"gpus_per_node={self._gpus_per_node}. Lower gpus_per_task or tasks per node."
            )
        if sum(self._jobs.values()) != num_tasks:
            raise RuntimeError(
                f"SlurmClusterResolver(jobs={self._jobs}): requested "
                f"{sum(self._jobs.values())} tasks but Slurm assigned {num_tasks} "
                f"({self._task_configuration}); make the job sizes add up to the step's task "
                "count (srun --ntasks)."
            )
        if not 0 <= self._rank < num_tasks:
            raise RuntimeError(
                f"SlurmClusterResolver: SLURM_PROCID={self._rank} is outside the step's "
                f"{num_tasks} tasks."
            )
        self._auto_set_gpu = auto_set_gpu
        self._rpc_layer = rpc_layer
        self._task_type, self._task_id = self._own_task()

    def _own_task(self) -> tuple[str, int]:
        offset = 0
        for job, count in sorted(self._jobs.items()):
            if offset <= self._rank < offset + count:
                return job, self._rank - offset
            offset += count
        raise AssertionError("rank checked against the task count above")

    def _allocation(self) -> tuple[list[str], list[list[int]]]:
        """Every task's address and GPU indices, in rank order."""
        addresses, gpus = [], []
        for host, count in self._task_configuration.items():
            for k in range(count):
                addresses.append(f"{host}:{self._port_base + k}")
                first = k * self._gpus_per_task
                gpus.append(list(range(first, first + self._gpus_per_task)))
        return addresses, gpus

    def cluster_spec(self) -> ClusterSpec:
        """The step's tasks by job; with ``auto_set_gpu``, also selects this task's GPUs."""
        addresses, gpus = self._allocation()
        cluster: dict[str, list[str]] = {}
        offset = 0
        for job, count in sorted(self._jobs.items()):
            cluster[job] = addresses[offset : offset + count]
            offset += count
        if self._auto_set_gpu and self._gpus_per_task > 0:
            self._set_visible_devices(gpus[self._rank])
        return ClusterSpec(cluster)

    def _set_visible_devices(self, indices: list[int]) -> None:
        job_visible = _visible_devices_before_us()
        ids = [d.strip() for d in (job_visible or "").split(",") if d.strip()]
        value = ",".join(ids[i] if len(ids) > max(indices) else str(i) for i in indices)
        current = os.environ.get("CUDA_VISIBLE_DEVICES")
        if current == value:
            return
        if backends_initialized():
            warnings.warn(
                f"SlurmClusterResolver: did not set CUDA_VISIBLE_DEVICES={value!r} for task "
                f"{self._rank} because JAX's backend has already started in this process, so it "
                "would have no effect. Create the resolver (or call jaxdist.initialize()) before "
                "anything touches devices, or pass auto_set_gpu=False.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        if not _original_visible_devices:
            _original_visible_devices.append(current)
        os.environ["CUDA_VISIBLE_DEVICES"] = value

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this process."""
        return self.task_type, self.task_id

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task (by default this one) with the RPC layer, e.g. ``grpc://n01:8888``.

        Args:
            task_type: overrides this task's type.
            task_id: overrides this task's index.
            rpc_layer: overrides the protocol prefix.

        Returns:
            The address, or ``""`` if the task is unknown.
        """
        return self._task_master(task_type, task_id, rpc_layer)

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """``{"GPU": gpus_per_task}`` (``{}`` without GPUs); the arguments are unused."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}

    def __repr__(self) -> str:
        return (
            f"SlurmClusterResolver(jobs={self._jobs}, rank={self._rank}, "
            f"task_type={self.task_type!r}, task_id={self.task_id!r})"
        )
