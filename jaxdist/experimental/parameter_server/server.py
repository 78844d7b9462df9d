"""`Server`: joins this machine to the Ray cluster as one task of a parameter-server job.

TF's ``tf.distribute.Server`` starts an in-process server for a worker or ps task on its
own machine. Here the "server" is a Ray node: `Server.start` runs ``ray start
--address=<head> --block`` as a child process, offering the custom resource
``jaxdist_<job>_<index>``; `ParameterServerStrategy` then places that task's actor on this
node. The head (the coordinator's Ray runtime) is the ``chief`` address of the cluster
spec, as ``host:port`` (``ray.get_runtime_context().gcs_address`` on the coordinator), or
the ``RAY_ADDRESS`` environment variable when the spec has no chief. The coordinator
starts that runtime itself (``ray.init()``): the one jaxdist starts when none is running
listens on loopback only, and ``ray start`` cannot join it (it dials the machine's address
for a loopback one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from jaxdist.cluster_resolver import ClusterSpec
from jaxdist.experimental.parameter_server._ray import actor_env, forget_address
from jaxdist.experimental.parameter_server.strategy import task_resource

__all__ = ["Server"]

_WHERE = "jaxdist.Server"


def _spec(server_or_cluster_def: Any) -> ClusterSpec:
    if isinstance(server_or_cluster_def, ClusterSpec):
        return server_or_cluster_def
    if isinstance(server_or_cluster_def, Mapping):
        return ClusterSpec(server_or_cluster_def)
    get_spec = getattr(server_or_cluster_def, "cluster_spec", None)
    if callable(get_spec):
        return get_spec()
    raise TypeError(
        f"{_WHERE}(server_or_cluster_def=...): expected a ClusterSpec, a dict such as "
        '{"chief": ["head-host:6379"], "worker": [...], "ps": [...]} or a cluster resolver, '
        f"got {type(server_or_cluster_def).__name__}."
    )


class Server:
    """This machine as one task (``job_name``, ``task_index``) of a parameter-server job.

    Args:
        server_or_cluster_def: the cluster (`ClusterSpec`, dict or cluster resolver).
        job_name: ``"worker"`` or ``"ps"``; may be left out when the cluster has one job.
        task_index: this task's index in its job; may be left out when the job has one task.
        protocol: ``None`` or ``"ray"`` (the only transport).
        config: extra ``ray start`` options as a dict, e.g. ``{"num-cpus": 4}``.
        start: start at once.

    Example (on a worker machine; the coordinator runs `ParameterServerStrategy`)::

        server = jd.Server({"chief": ["10.0.0.1:6379"], "worker": ["w0", "w1"], "ps": ["p0"]},
                           job_name="worker", task_index=1)
        server.join()  # serves until the node is stopped
    """

    def __init__(
        self,
        server_or_cluster_def: Any,
        job_name: str | None = None,
        task_index: int | None = None,
        protocol: str | None = None,
        config: Mapping[str, Any] | None = None,
        start: bool = True,
    ) -> None:
        spec = _spec(server_or_cluster_def)
        jobs = [j for j in spec.jobs if j != "chief"]
        if job_name is None:
            if len(jobs) != 1:
                raise ValueError(
                    f"{_WHERE}: job_name must be given when the cluster has several jobs "
                    f"({sorted(jobs)}); pass job_name='worker' or job_name='ps'."
                )
            job_name = jobs[0]
        if job_name not in ("worker", "ps"):
            raise ValueError(
                f"{_WHERE}: job_name={job_name!r}; a Server runs a 'worker' or a 'ps' task "
                "(the coordinator is the chief and needs no Server)."
            )
        if job_name not in spec.jobs:
            raise ValueError(
                f"{_WHERE}: job {job_name!r} is not in the cluster spec {spec.as_dict()}."
            )
        count = spec.num_tasks(job_name)
        if task_index is None:
            if count != 1:
                raise ValueError(
                    f"{_WHERE}: task_index must be given: job {job_name!r} has {count} tasks."
                )
            task_index = 0
        if not 0 <= task_index < count:
            raise ValueError(
                f"{_WHERE}: task_index={task_index} is out of range for job {job_name!r} of "
                f"{count} tasks."
            )
        if protocol not in (None, "ray"):
            raise ValueError(
                f"{_WHERE}: protocol={protocol!r} is not supported; tasks talk through Ray "
                "(protocol='ray' or None)."
            )
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(
                f"{_WHERE}(config=...): expected a dict of extra 'ray start' options, got "
                f"{type(config).__name__}."
            )
        if "chief" in spec.jobs:
            head = spec.task_address("chief", 0)
        elif os.environ.get("RAY_ADDRESS"):
            head = os.environ["RAY_ADDRESS"]
        else:
            raise ValueError(
                f"{_WHERE}: no Ray head to join: give the cluster a 'chief' job whose address "
                "is the coordinator's Ray address (host:port), or set RAY_ADDRESS."
            )
        self._job = job_name
        self._index = task_index
        self._head = head
        self._config = dict(config or {})
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        if start:
            self.start()

    @property
    def target(self) -> str:
        """The Ray address this task joins (what the coordinator passes to ``ray.init``)."""
        return self._head

    @property
    def resource(self) -> str:
        """The custom Ray resource that places this task's actor on this node."""
        return task_resource(self._job, self._index)

    def start(self) -> None:
        """Joins this machine to the Ray cluster (once; later calls do nothing)."""
        with self._lock:
            if self._process is not None:
                return
            command = [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                f"--address={self._head}",
                f"--resources={json.dumps({self.resource: 1})}",
                "--block",
                "--disable-usage-stats",
            ]
            command += [f"--{k}={v}" for k, v in self._config.items()]
            env = {**os.environ, **actor_env()["env_vars"]}
            self._process = subprocess.Popen(command, env=env, text=True)

    def join(self) -> None:
        """Blocks while this task's node runs; raises if it ended with an error."""
        self.start()
        assert self._process is not None
        code = self._process.wait()
        forget_address(self._head)
        if code not in (0, -15):
            raise RuntimeError(
                f"{_WHERE}: the Ray node of /job:{self._job}/replica:0/task:{self._index} "
                f"exited with status {code} (ray start --address={self._head}); see its "
                "output above."
            )

    def stop(self) -> None:
        """Leaves the cluster: stops this task's Ray node, and removes ``ray start``'s record
        of the cluster (``ray_current_cluster`` in Ray's temp directory) if it names this
        head."""
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                self._process.terminate()
                self._process.wait(timeout=60)
            # `ray start` recorded the head's address for this machine; a stopped node
            # leaves no record behind (what `ray stop` does, for this node only).
            forget_address(self._head)
