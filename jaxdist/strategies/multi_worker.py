"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over every device of every process.

The processes of a job form one JAX program through `jax.distributed` (its
coordination service, and XLA's collectives: gloo on CPU, NCCL on GPU, the
ICI/DCN fabric on TPU). The strategy's mesh has two axes, ``("host",
"local")``: one row per process, one column per local device, so replica
``r`` is local device ``r % L`` of process ``r // L``, every process owns a
contiguous block of replicas, and a hierarchical reduction can reduce inside
a process before crossing the network.

Failures: a job that cannot make progress fails instead of hanging. What
bounds each wait (measured with 2 CPU processes x 4 devices on localhost,
gloo collectives, the survivor waiting in an all-reduce):

======================================  ==================================================
what happens                            what the other processes do
======================================  ==================================================
start-up: a process never connects      each process prints "waiting for k of n
                                        processes to connect to ADDRESS (missing: ...)"
                                        every 30 s; `jaxdist.initialize` raises, naming
                                        the missing ids, after ``initialization_timeout``
                                        (300 s; ``JAXDIST_INITIALIZATION_TIMEOUT``)
a worker process dies (crash, OOM,      JAX's coordination service misses its heartbeats
SIGKILL)                                and, ``heartbeat_timeout_seconds`` later (jaxdist:
                                        20 s, ``JAXDIST_HEARTBEAT_TIMEOUT``; JAX's own:
                                        100 s), ends every other process (SIGABRT,
                                        "Terminating process because the JAX distributed
                                        service detected fatal errors ... The following
                                        tasks are unhealthy (stopped sending heartbeats):
                                        1"). Measured: 20.5 s with 20 s, 10.7 s with 10 s
process 0 dies (it hosts the            the others end at once (measured: 0.1 s): their
coordination service)                   connection to the service breaks
an uncaught exception in a process, or  that process exits at once, code 1 (the code
``sys.exit(code)`` with a failing code  given to ``sys.exit``; see `jaxdist.initialize`);
                                        the others as for a dead process (under the
                                        launcher: measured 5.2 s, ``--kill-timeout``)
a process is alive but stuck (a hang,   its heartbeat goes on, so the others wait in their
a skipped step, a long pause)           collective; the watchdog (below, on by default)
                                        makes each waiting process print, every 60 s,
                                        the step it waits in and who has not arrived,
                                        and ends the job after the timeout (default
                                        1200 s), naming the step and the stuck process
                                        (measured: 10.7 s with T = 10, 2 processes
                                        through the launcher)
======================================  ==================================================

Every process of a multi-process job runs a watchdog
(`jaxdist.strategies._watchdog`; a one-process job runs none): the strategy
counts its steps (every program it dispatches: ``run`` / ``function`` /
training-step calls and the cross-replica operations that dispatch one,
``reduce``, ``gather``, ``extended.reduce_to`` / ``batch_reduce_to`` /
``update``, an ``ON_READ`` variable's aggregate; ``experimental_local_results``
dispatches nothing), and each process publishes its count in
`jax.distributed`'s key-value store. Every ``S`` seconds that a step stays in
flight (``JAXDIST_WATCHDOG_LOG_INTERVAL`` or the launcher's
``--watchdog-log-interval``; default 60, ``0``: no lines) each waiting process
prints which step it waits in, what that step is and which processes have not
arrived; when a step has been in flight for ``T`` seconds without completing,
it prints one line, e.g. "jaxdist: MultiWorkerMirroredStrategy: step 20 did not
complete within 10 s (CommunicationOptions(timeout_seconds=10)): process 1 (its
last step: 19) did not arrive; ending process 0 with exit code 1.", and exits
with code 1; the launcher (or the heartbeat) ends the others. ``T`` is
``CommunicationOptions(timeout_seconds=T)``, else ``JAXDIST_COLLECTIVE_TIMEOUT``
(the launcher's ``--collective-timeout T``), else 1200 s (20 min: below XLA's
own CPU collective timeout of 30 min, far above a first compile); ``0`` turns
the ending off and keeps the lines. A stall shorter than ``T`` passes, and
compiling a step does not count (a step counts from its dispatch), but waiting
for a peer that is still compiling does. As in TF it must exceed the longest
legitimate step. On CPU, XLA's collective timeout
(``--xla_cpu_collective_timeout_seconds``, a process-wide flag read when JAX's
backend starts, so the strategy sets it as it starts `jax.distributed`) is set
to ``T + 10`` s as a backstop; for the built-in default, only when neither
``XLA_FLAGS`` nor a started backend has fixed it already (an explicit ``T``
then raises).

SIGTERM does not stop a process of a `jax.distributed` job: JAX's
preemption service takes it as a preemption notice
(`jax.experimental.multihost_utils.reached_preemption_sync_point`) and
training goes on; SIGINT (a ``KeyboardInterrupt``: exit code 130) and
SIGKILL stop it. Under ``python -m jaxdist.launch`` the first process to
fail stops the whole job (SIGTERM, then SIGKILL after ``--kill-timeout``,
default 5 s: measured, the launcher exited 5.4 s after one of its processes
was killed), names that process and exits with its code; ``--max-restarts
K`` starts the group again (``JAXDIST_RESTART_COUNT`` tells the script to
resume from its checkpoint). A normal exit waits for the other processes at
most ``shutdown_timeout_seconds`` (300 s; ``JAXDIST_SHUTDOWN_TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import jax

from jaxdist._jax_compat import CPU_COLLECTIVE_TIMEOUT_FLAG, distributed_client
from jaxdist.cluster_resolver import ClusterResolver, initialize, resolve_default
from jaxdist.cluster_resolver.base import COLLECTIVE_JOBS
from jaxdist.cluster_resolver.initialize import backends_initialized, multi_process_kwargs
from jaxdist.collectives.communication import CommunicationOptions
from jaxdist.collectives.cross_device_ops import CrossDeviceOps, cross_device_ops_for
from jaxdist.launch import config
from jaxdist.strategies._watchdog import DEFAULT_LOG_INTERVAL, DEFAULT_TIMEOUT, Watchdog
from jaxdist.strategies.base import Strategy

__all__ = ["MultiWorkerMirroredStrategy"]

AXES = ("host", "local")
_CPU_TIMEOUT_FLAG = CPU_COLLECTIVE_TIMEOUT_FLAG
_FLAG_PATTERN = re.compile(rf"(?:^|\s){re.escape(_CPU_TIMEOUT_FLAG)}=(\S*)")


ENV_COLLECTIVE_TIMEOUT = config.ENV_COLLECTIVE_TIMEOUT  # --collective-timeout
ENV_LOG_INTERVAL = config.ENV_WATCHDOG_LOG_INTERVAL  # --watchdog-log-interval
_XLA_BACKSTOP = 10  # XLA's CPU collective timeout is the watchdog's plus this
_DEFAULT_SOURCE = (
    "the default timeout of a multi-process job; CommunicationOptions(timeout_seconds=T), "
    f"the launcher's --collective-timeout T or {ENV_COLLECTIVE_TIMEOUT}=T change it, 0 turns "
    "it off"
)
# What a program dispatched by a cross-replica operation is, by the name of the Strategy /
# StrategyExtended / variable method that dispatches it (through `Strategy.gated`).
_CROSS_REPLICA = {
    "reduce": "strategy.reduce",
    "gather": "strategy.gather",
    "_reduce_pairs": "strategy.extended.reduce_to / batch_reduce_to",
    "update": "strategy.extended.update",
    "_aggregate": "reading an ON_READ variable",
}


def _env_seconds(name: str, flag: str, off: str, where: str) -> float | None:
    """The seconds the environment variable ``name`` gives (``None``: not set; 0: off)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise ValueError(
            f"{where}: the environment variable {name} (the launcher's {flag}) must be a "
            f"number of seconds >= 0 (0: {off}), got {raw!r}."
        )
    return value


def _default_timeout(where: str) -> float | None:
    """``JAXDIST_COLLECTIVE_TIMEOUT``: the timeout when the options give none (``None``:
    not set; 0: no timeout)."""
    return _env_seconds(ENV_COLLECTIVE_TIMEOUT, "--collective-timeout", "no timeout", where)


def _watchdog_settings(options: CommunicationOptions, where: str) -> tuple[float, str, float]:
    """The watchdog's timeout (0: none), where it comes from, and its log interval (0: no
    lines) for a multi-process job: ``options.timeout_seconds``, else
    ``JAXDIST_COLLECTIVE_TIMEOUT``, else `DEFAULT_TIMEOUT`; ``JAXDIST_WATCHDOG_LOG_INTERVAL``,
    else `DEFAULT_LOG_INTERVAL`."""
    if options.timeout_seconds is not None:
        timeout = float(options.timeout_seconds)
        source = f"CommunicationOptions(timeout_seconds={timeout:g})"
    else:
        env = _default_timeout(where)
        if env is None:
            timeout, source = DEFAULT_TIMEOUT, _DEFAULT_SOURCE
        else:
            timeout = env
            source = f"{ENV_COLLECTIVE_TIMEOUT}={env:g}, the launcher's --collective-timeout"
    interval = _env_seconds(ENV_LOG_INTERVAL, "--watchdog-log-interval", "no lines", where)
    return timeout, source, DEFAULT_LOG_INTERVAL if interval is None else interval


def _program_name(call: Callable[..., Any]) -> str:
    """What a compiled program is, for the watchdog's lines: ``strategy.run(fn)`` for
    `Program`'s ``jaxdist_<fn>``, ``train_step(fn)`` for ``jaxdist_train_step_<fn>``."""
    candidates = [call, getattr(call, "jitted", None)]  # a train step's `StepProgram`
    for cell in getattr(call, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            candidates.append(cell.cell_contents)
    for candidate in candidates:
        name = getattr(candidate, "__name__", None)
        if isinstance(name, str) and name.startswith("jaxdist_"):
            name = name.removeprefix("jaxdist_")
            if name.startswith("train_step_"):
                return f"train_step({name.removeprefix('train_step_')})"
            return f"strategy.run({name})"
    return "a compiled step"


def _flag_value(xla_flags: str) -> str | None:
    """The last value XLA_FLAGS gives the CPU collective timeout (``None``: not set)."""
    found = _FLAG_PATTERN.findall(xla_flags)
    return found[-1] if found else None


def _with_flag(xla_flags: str, seconds: int) -> str:
    """``xla_flags`` with the CPU collective timeout set to ``seconds`` (replaced, or added)."""
    kept = [f for f in xla_flags.split() if not f.startswith(_CPU_TIMEOUT_FLAG + "=")]
    return " ".join([*kept, f"{_CPU_TIMEOUT_FLAG}={seconds}"])


def _set_collective_timeout(
    timeout_seconds: float | None, where: str, *, default: bool = False
) -> None:
    """Makes XLA's CPU collectives fail ``_XLA_BACKSTOP`` seconds after the watchdog's
    ``timeout_seconds`` (a backstop: the watchdog's line comes first).

    The limit is a process-wide XLA flag read when JAX's backend starts, so it
    is set in ``XLA_FLAGS`` before that; ``None`` or ``0`` leaves XLA's default.
    Once the backend runs, the same limit is accepted and another one raises;
    for the built-in default (``default``), a limit the user set in ``XLA_FLAGS``
    or a started backend leaves XLA's limit as it is.

    Raises:
        RuntimeError: JAX's backend already started with another limit.
    """
    if not timeout_seconds:
        return
    seconds = math.ceil(timeout_seconds) + _XLA_BACKSTOP
    flags = os.environ.get("XLA_FLAGS", "")
    if _flag_value(flags) == str(seconds):
        return
    if default and (_flag_value(flags) is not None or backends_initialized()):
        return
    if backends_initialized():
        current = _flag_value(flags)
        now = "XLA's default (1800 s)" if current is None else f"{current} s"
        raise RuntimeError(
            f"{where}: CommunicationOptions(timeout_seconds={timeout_seconds!r}) sets XLA's "
            f"CPU collective timeout ({_CPU_TIMEOUT_FLAG}) to {seconds} s, which is read once, "
            f"when JAX's backend starts; it has started with {now}. Create the strategy "
            "before anything touches devices (jax.devices(), an array, a computation), or "
            f"start the program with XLA_FLAGS='{_CPU_TIMEOUT_FLAG}={seconds}'."
        )
    os.environ["XLA_FLAGS"] = _with_flag(flags, seconds)


def _grid() -> tuple[list[jax.Device], int, int]:
    """Every device of every process, grouped by process, and the grid shape."""
    by_process: dict[int, list[jax.Device]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    counts = {p: len(ds) for p, ds in by_process.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(
            "MultiWorkerMirroredStrategy: every process must have the same number of devices, "
            f"got {dict(sorted(counts.items()))} (process: devices). Start every process with "
            "the same device count (for simulated CPU devices, the same "
            "JAX_NUM_CPU_DEVICES / --devices-per-proc)."
        )
    processes = sorted(by_process)
    devices = [d for p in processes for d in sorted(by_process[p], key=lambda d: d.id)]
    return devices, len(processes), counts[processes[0]]


class MultiWorkerMirroredStrategy(Strategy):
    """One replica per device of every process; variables mirrored, gradients all-reduced.

    Args:
        cluster_resolver: where the processes are (a
            `jaxdist.cluster_resolver.ClusterResolver`). ``None`` resolves the
            cluster from the environment: the local launcher
            (``python -m jaxdist.launch``), ``TF_CONFIG``, Slurm, Kubernetes or a
            Cloud TPU VM; without any, a one-process cluster over the local
            devices (as in TF), so a script runs unchanged on a laptop.
        communication_options: a `jaxdist.experimental.CommunicationOptions`
            choosing the collective structure (``implementation``: ``AUTO``/``NCCL``
            one all-reduce, ``RING`` reduce-scatter + all-gather), packing
            (``bytes_per_pack``) and, on CPU, how long a collective may wait for
            the other processes (``timeout_seconds``; see the module docstring).

    Creating it starts `jax.distributed` (once per process, before anything
    else touches the devices) when the cluster has several processes; see
    the module docstring for how a failed or stuck process ends the job.

    Raises:
        TypeError: ``cluster_resolver`` or ``communication_options`` has the wrong type.
        ValueError: the processes have different device counts, or the
            resolver's cluster is inconsistent.
        RuntimeError: JAX's backend started before a multi-process job could
            join its cluster or set ``timeout_seconds``.

    Example:
        >>> import jaxdist as jd
        >>> s = jd.MultiWorkerMirroredStrategy()   # no cluster: this process alone
        >>> s.num_replicas_in_sync == len(s.extended.worker_devices)
        True
    """

    __slots__ = ("_cluster_resolver", "_communication_options", "_watchdog")
    _cluster_resolver: Any
    _communication_options: Any
    _watchdog: Watchdog | None

    def __init__(self, cluster_resolver: Any = None, communication_options: Any = None) -> None:
        where = "MultiWorkerMirroredStrategy"
        if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(
                f"{where}(cluster_resolver=...): expected a jaxdist.cluster_resolver."
                f"ClusterResolver (e.g. TFConfigClusterResolver()), got "
                f"{type(cluster_resolver).__name__}."
            )
        if communication_options is None:
            communication_options = CommunicationOptions()
        elif not isinstance(communication_options, CommunicationOptions):
            raise TypeError(
                f"{where}(communication_options=...): expected a jaxdist.experimental."
                f"CommunicationOptions, got {type(communication_options).__name__}."
            )
        resolver = cluster_resolver if cluster_resolver is not None else resolve_default()
        if resolver is not None and resolver.task_type not in (*COLLECTIVE_JOBS, "evaluator", None):
            # A ps (or other) task is no worker of this strategy: the resolver's error, not a
            # silent one-process strategy. An evaluator runs alone beside the job, as in TF.
            try:
                resolver.jax_initialize_kwargs()
            except ValueError as e:
                raise ValueError(
                    f"{where}: {e} This strategy runs on the chief and the workers only; "
                    "parameter servers belong to jd.experimental.ParameterServerStrategy."
                ) from e
        multi_process = resolver is not None and multi_process_kwargs(resolver) is not None
        timeout, source, interval = 0.0, "", 0.0
        if multi_process:  # cross-process collectives: watched
            timeout, source, interval = _watchdog_settings(communication_options, where)
            default = source == _DEFAULT_SOURCE
            _set_collective_timeout(timeout, where, default=default)
        if resolver is not None:
            initialize(resolver)
        devices, processes, local = _grid()
        ops: CrossDeviceOps = cross_device_ops_for(communication_options, AXES)
        watchdog = None
        client = distributed_client() if multi_process and (timeout or interval) else None
        if client is not None:
            watchdog = Watchdog(
                timeout or None,
                client,
                jax.process_index(),
                jax.process_count(),
                log_interval=interval or None,
                source=source,
            )
        object.__setattr__(self, "_watchdog", watchdog)
        object.__setattr__(self, "_cluster_resolver", resolver)
        object.__setattr__(self, "_communication_options", communication_options)
        super().__init__(devices, ops, mesh_shape=(processes, local), axis_names=AXES)

    def program_caller(
        self, call: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    ) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
        """The base per-call path; with a watchdog, each call counts as a step it watches."""
        caller = super().program_caller(call)
        if self._watchdog is None:
            return caller
        return self._watchdog.wrap(caller, _program_name(call))

    def gated(self, thunk: Callable[[], Any]) -> Any:
        """The base path of cross-replica operations; with a watchdog, one that dispatches
        a program (its output holds a concrete array) counts as a step it watches."""
        out = super().gated(thunk)
        if self._watchdog is not None:
            caller = sys._getframe(1).f_code.co_name
            what = _CROSS_REPLICA.get(caller, f"cross-replica {caller}")
            self._watchdog.dispatched_if_any(out, what)
        return out

    def extra_key(self) -> tuple[Any, ...]:
        return (self._communication_options,)

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver the strategy was built from (``None``: one process)."""
        return self._cluster_resolver

    @property
    def communication_options(self) -> Any:
        """The `jaxdist.experimental.CommunicationOptions` in effect."""
        return self._communication_options

    def __repr__(self) -> str:
        host, local = self.mesh.devices.shape
        return (
            f"MultiWorkerMirroredStrategy(processes={host}, devices_per_process={local}, "
            f"platform={self._devices[0].platform})"
        )
