"""`initialize`: start `jax.distributed` for this process's cluster, once, with failure detection.

Timeouts (seconds); each is the keyword argument if given, else the
environment variable, else the default:

===============================  ==================================  =======
argument                         environment variable                default
===============================  ==================================  =======
``initialization_timeout``       ``JAXDIST_INITIALIZATION_TIMEOUT``      300
``heartbeat_timeout_seconds``    ``JAXDIST_HEARTBEAT_TIMEOUT``            20
``shutdown_timeout_seconds``     ``JAXDIST_SHUTDOWN_TIMEOUT``            300
===============================  ==================================  =======

``initialization_timeout`` bounds how long a process waits for all the others
to connect. While it waits, each process prints every 30 s
(``JAXDIST_STARTUP_REPORT_INTERVAL``) "waiting for k of n processes to connect
to ADDRESS (missing: process ...)", and on timeout `initialize` raises
`RuntimeError` naming the missing process ids and the address (a rendezvous
of jaxdist's own on the coordinator's port, before `jax.distributed` starts
there; ``JAXDIST_STARTUP_REPORT_INTERVAL=0`` leaves start-up to JAX alone,
which waits silently and then aborts every process).

``heartbeat_timeout_seconds`` is how long a process may go silent
before the coordination service declares it dead and terminates every other
process: measured on localhost (2 CPU processes, one killed with SIGKILL),
the survivor stopped 19.7 s after its peer died with 20 s, and 10.0 s with
10 s, even while blocked in a collective; when the coordinator (process 0)
dies the others stop at once. JAX's own default, 100 s, would leave such a
job hanging for minutes. ``shutdown_timeout_seconds`` bounds the wait for the
other processes at exit (JAX's default: a chief still writing a checkpoint
must not make the workers fail).

A process of a multi-process job that fails ends at once, with its own exit
code, instead of in the shutdown barrier at exit, where it would wait for
peers blocked in a collective that waits for it: an uncaught exception (exit
code 1 after the traceback; 130 for ``KeyboardInterrupt``), and
``sys.exit(code)`` with a failing code (that code; a message: 1). The
launcher (or the heartbeat) then stops the others and names this process.
A successful exit (``sys.exit(0)``, the end of the script) still waits for
the others at the barrier. Set ``JAXDIST_EXIT_ON_ERROR=0`` to keep Python's
normal exit. Details in `jaxdist.cluster_resolver._fail_fast`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

import jax

from jaxdist._jax_compat import backends_initialized as backends_initialized
from jaxdist._jax_compat import distributed_cluster
from jaxdist.cluster_resolver import _fail_fast, _rendezvous
from jaxdist.cluster_resolver.base import COLLECTIVE_JOBS, ClusterResolver
from jaxdist.cluster_resolver.default import resolve_default

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_INITIALIZATION_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "ENV_HEARTBEAT_TIMEOUT",
    "ENV_INITIALIZATION_TIMEOUT",
    "ENV_SHUTDOWN_TIMEOUT",
    "initialize",
    "is_initialized",
    "shutdown",
]

ENV_INITIALIZATION_TIMEOUT = "JAXDIST_INITIALIZATION_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "JAXDIST_HEARTBEAT_TIMEOUT"
ENV_EXIT_ON_ERROR = "JAXDIST_EXIT_ON_ERROR"
ENV_SHUTDOWN_TIMEOUT = "JAXDIST_SHUTDOWN_TIMEOUT"
DEFAULT_INITIALIZATION_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 20
DEFAULT_SHUTDOWN_TIMEOUT = 300


# The seam to JAX (tests replace these three functions with fakes).
def _distributed_initialize(**kwargs: Any) -> None:
    jax.distributed.initialize(**kwargs)


def _distributed_shutdown() -> None:
    jax.distributed.shutdown()


def _check_in(**kwargs: Any) -> None:
    _rendezvous.rendezvous(**kwargs)


def _external_cluster() -> tuple[str | None, int, int] | None:
    """``(coordinator, processes, id)`` of a `jax.distributed` started outside jaxdist."""
    if not jax.distributed.is_initialized():
        return None
    return distributed_cluster()


@dataclasses.dataclass(frozen=True)
class _Started:
    cluster: tuple[str | None, int, int]
    source: str
    ours: bool


_lock = threading.Lock()
_started: _Started | None = None


def _describe(cluster: tuple[str | None, int, int], source: str) -> str:
    address, processes, process_id = cluster
    return (
        f"coordinator_address={address!r}, num_processes={processes}, process_id={process_id} "
        f"(from {source})"
    )


def _timeout(value: int | None, env: str, default: int, argument: str) -> int:
    source = f"initialize({argument}=...)"
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        source = f"the environment variable {env}"
        try:
            value = int(raw)
        except ValueError:
            value = 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"jaxdist.initialize(): {source} must be a positive whole number of seconds, got "
            f"{value!r}."
        )
    return value


def _report_interval() -> float:
    """Seconds between start-up reports (0: no rendezvous), from the environment."""
    env = _rendezvous.ENV_REPORT_INTERVAL
    raw = os.environ.get(env, "").strip()
    if not raw:
        return _rendezvous.DEFAULT_REPORT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"jaxdist.initialize(): the environment variable {env} must be a number of seconds "
            f">= 0 (0 turns the start-up rendezvous off), got {raw!r}."
        )
    return value


def _supported(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the keywords ``fn`` does not take (older JAX releases)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


def multi_process_kwargs(resolver: ClusterResolver | None) -> dict[str, Any] | None:
    """The resolver's `jax.distributed` arguments if this task joins a job of several JAX
    processes, else ``None``: no cluster, one process, or a task outside the collective
    group (private; `MultiWorkerMirroredStrategy` asks it too)."""
    if resolver is None or not resolver.cluster_spec():
        return None
    if resolver.task_type is not None and resolver.task_type not in COLLECTIVE_JOBS:
        return None
    kwargs = resolver.jax_initialize_kwargs()
    return None if kwargs["num_processes"] == 1 else kwargs


def initialize(
    cluster_resolver: ClusterResolver | None = None,
    *,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int | None = None,
) -> ClusterResolver | None:
    """Starts `jax.distributed` for this process's cluster; a no-op for one process.

    Resolves the cluster (``cluster_resolver``, else `resolve_default`) and,
    when it has several JAX processes, calls `jax.distributed.initialize` with
    the resolver's `ClusterResolver.jax_initialize_kwargs` and the timeouts
    (see the module docstring), with JAX's own cluster auto-detection off so
    the resolver decides. It must run before JAX's backend starts (before
    anything calls ``jax.devices()``, creates an array or computes): call it
    first thing, or create ``MultiWorkerMirroredStrategy`` first, which calls
    it.

    Calling it again for the same cluster does nothing; for another cluster it
    raises. A one-process cluster (nothing found, an empty cluster, one
    task) starts nothing, and so does a task outside the collective group
    (``ps``, ``evaluator``): it runs alone, as in TF.

    Args:
        cluster_resolver: the `ClusterResolver` of the job; ``None`` means
            `resolve_default`.
        initialization_timeout: seconds to wait for every process to connect.
        heartbeat_timeout_seconds: seconds without heartbeat after which a
            process counts as dead and the job fails.
        shutdown_timeout_seconds: seconds to wait for the others at shutdown.

    Returns:
        The resolver in effect, or ``None`` when no cluster was found.

    Raises:
        TypeError: if ``cluster_resolver`` is not a `ClusterResolver`.
        ValueError: if the resolver's cluster or task is inconsistent, or a
            timeout is not a positive integer.
        RuntimeError: if `jax.distributed` already runs for another cluster,
            or JAX's backend started before a multi-process start was needed.

    Example:
        >>> from jaxdist.cluster_resolver import SimpleClusterResolver, initialize
        >>> one = SimpleClusterResolver({"worker": ["localhost:2222"]}, task_type="worker",
        ...                             task_id=0)
        >>> initialize(one) is one  # one process: nothing to start
        True
    """
    if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
        raise TypeError(
            "jaxdist.initialize(cluster_resolver=...): expected a jaxdist.cluster_resolver."
            f"ClusterResolver (e.g. TFConfigClusterResolver()), got "
            f"{type(cluster_resolver).__name__}."
        )
    resolver = cluster_resolver if cluster_resolver is not None else resolve_default()
    timeouts = {
        "initialization_timeout": _timeout(
            initialization_timeout,
            ENV_INITIALIZATION_TIMEOUT,
            DEFAULT_INITIALIZATION_TIMEOUT,
            "initialization_timeout",
        ),
        "heartbeat_timeout_seconds": _timeout(
            heartbeat_timeout_seconds,
            ENV_HEARTBEAT_TIMEOUT,
            DEFAULT_HEARTBEAT_TIMEOUT,
            "heartbeat_timeout_seconds",
        ),
        "shutdown_timeout_seconds": _timeout(
            shutdown_timeout_seconds,
            ENV_SHUTDOWN_TIMEOUT,
            DEFAULT_SHUTDOWN_TIMEOUT,
            "shutdown_timeout_seconds",
        ),
    }
    kwargs = multi_process_kwargs(resolver)
    if kwargs is None:
        return resolver
    cluster = (kwargs["coordinator_address"], kwargs["num_processes"], kwargs["process_id"])
    source = repr(resolver)
    global _started
    with _lock:
        if _started is not None:
            if _started.cluster == cluster:
                return resolver
            raise RuntimeError(
                "jaxdist.initialize(): jax.distributed already runs for another cluster in this "
                f"process: {_describe(_started.cluster, _started.source)}; now asked for "
                f"{_describe(cluster, source)}. A process joins one cluster: create every "
                "strategy from the same resolver, or call jaxdist.shutdown() first."
            )
        external = _external_cluster()
        if external is not None:
            if external == cluster:
                _started = _Started(cluster, "jax.distributed.initialize", ours=False)
                return resolver
            raise RuntimeError(
                "jaxdist.initialize(): jax.distributed was already initialized in this process "
                f"(not by jaxdist) with {_describe(external, 'jax.distributed.initialize')}; "
                f"now asked for {_describe(cluster, source)}. Pass the matching resolver, or "
                "let jaxdist.initialize() start jax.distributed."
            )
        if backends_initialized():
            raise RuntimeError(
                "jaxdist.initialize(): JAX's backend has already started in this process "
                "(something called jax.devices(), created an array or ran a computation), so "
                f"jax.distributed can no longer join the cluster {_describe(cluster, source)}. "
                "Call jaxdist.initialize() (or create the MultiWorkerMirroredStrategy) at the "
                "start of the program, before anything touches devices."
            )
        interval = _report_interval()
        if interval:
            _check_in(
                address=cluster[0],
                num_processes=cluster[1],
                process_id=cluster[2],
                timeout=timeouts["initialization_timeout"],
                report_interval=interval,
            )
        call = {**kwargs, **timeouts, "cluster_detection_method": "deactivate"}
        _distributed_initialize(**_supported(jax.distributed.initialize, call))
        _started = _Started(cluster, source, ours=True)
        if os.environ.get(ENV_EXIT_ON_ERROR, "1") != "0":
            _exit_on_uncaught_exception()
    return resolver


def _exit_on_uncaught_exception() -> None:
    """Makes a failing process end at once with its own code (see `_fail_fast`)."""
    _fail_fast.install(lambda code: os._exit(code))


def is_initialized() -> bool:
    """True when `jax.distributed` runs in this process (started by `initialize` or directly).

    Example:
        >>> from jaxdist.cluster_resolver import is_initialized
        >>> is_initialized()  # a one-process run starts nothing
        False
    """
    return _started is not None or jax.distributed.is_initialized()


def shutdown() -> None:
    """Stops `jax.distributed` if `initialize` started it; otherwise does nothing.

    After it, `initialize` may start a new cluster (JAX's backend, once
    started, keeps its devices, so that is for tests and tools more than for
    training scripts).
    """
    global _started
    with _lock:
        if _started is not None and _started.ours:
            _distributed_shutdown()
        _started = None
        _fail_fast.uninstall()
