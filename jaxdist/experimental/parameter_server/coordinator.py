"""`ClusterCoordinator`: schedules closures on the workers of a `ParameterServerStrategy`.

TF's ``tf.distribute.experimental.coordinator.ClusterCoordinator``: ``schedule`` queues a
compiled function with its arguments and returns a `RemoteValue` at once; one dispatcher
thread per worker sends queued closures to its worker actor and waits for the result.
Closures are pickled with cloudpickle (the function once, into Ray's object store) and
compiled on the worker. A worker that dies (preempted, killed, out of memory, a native
crash) has its running closure put back in the queue for any worker (at least once), and
Ray restarts it; each death and each rescheduling is logged (logger
``jaxdist.parameter_server``, level WARNING). A closure whose workers died
``MAX_WORKER_LOSSES + 1`` times (it kills them itself, most likely) is not retried again:
it fails with `WorkerLossError` naming it and what happened to each worker, which `join`
raises as any closure's error. A closure's error is logged (level ERROR) when it happens,
as TF does, and raised later by the rules of `closures`. While `join` waits, the closures
that have run for ``log_interval`` seconds (60 by default) are logged every
``log_interval`` seconds with their workers. A parameter server that dies is fatal (see
`jaxdist.experimental.parameter_server.closures` for the error rules).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxdist.experimental.parameter_server._cluster import task_device
from jaxdist.experimental.parameter_server._ray import (
    ActorDiedError,
    RayActorError,
    RayTaskError,
    cloudpickle,
    ray,
)
from jaxdist.experimental.parameter_server.closures import Closure, ClosureQueue
from jaxdist.experimental.parameter_server.strategy import (
    ParameterServerStrategy,
    ScheduledFunction,
)
from jaxdist.experimental.parameter_server.values import (
    PerWorkerDataset,
    PerWorkerValues,
    RemoteValue,
    WorkerLossError,
)
from jaxdist.experimental.parameter_server.variables import ParameterServerUnavailableError

__all__ = ["MAX_WORKER_LOSSES", "ClusterCoordinator"]

# How many times one closure is rescheduled after the worker running it died; one more death
# fails it with WorkerLossError (TF retries without bound, waiting up to an hour for each
# worker: a closure that crashes its worker would loop forever).
MAX_WORKER_LOSSES = 3

_log = logging.getLogger("jaxdist.parameter_server")

# How long a dispatcher waits for Ray to restart its dead worker before giving it up.
_RESTART_TIMEOUT_S = 300.0

# join()'s default period for its lines about long-running closures (the multi-worker
# watchdog's); ``coordinator.log_interval`` or JAXDIST_PS_LOG_INTERVAL change it.
_LOG_INTERVAL_S = 60.0

# Modules whose functions workers import by name; a function from any other module (a
# script, a test file, a notebook) travels by value.
_BY_REFERENCE = ("jax", "jaxlib", "jaxdist", "numpy", "optax", "flax", "ray")


def _by_value(fn: Any) -> list[Any]:
    """The modules of ``fn`` (and of the function a jit or a ScheduledFunction wraps) that
    workers may not be able to import, so cloudpickle should pickle by value."""
    out = []
    for f in (fn, getattr(fn, "__wrapped__", None), getattr(fn, "fn", None)):
        name = getattr(f, "__module__", None)
        module = sys.modules.get(name) if isinstance(name, str) else None
        if module is None or name == "__main__" or module.__name__.split(".")[0] in _BY_REFERENCE:
            continue
        if module.__name__.split(".")[0] in sys.stdlib_module_names:
            continue
        path = getattr(module, "__file__", None) or ""
        if "site-packages" in path or "dist-packages" in path:
            continue
        if module not in out:
            out.append(module)
    return out


def _registered() -> Any:
    return getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", set())


def _pickled(obj: Any, fn: Any) -> bytes:
    modules = [m for m in _by_value(fn) if m.__name__ not in _registered()]
    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    try:
        return cloudpickle.dumps(obj)
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)


class ClusterCoordinator:
    """Schedules functions on the workers of a `ParameterServerStrategy` (one per strategy).

    Args:
        strategy: the `ParameterServerStrategy`. A second coordinator for the same strategy
            is the first one.

    Example (needs the ``[ps]`` extra; see docs/guides/parameter_servers.md)::

        coordinator = jd.experimental.coordinator.ClusterCoordinator(strategy)
        result = coordinator.schedule(step, args=(w, per_worker_iterator))
        coordinator.join()
        print(result.fetch())
    """

    def __new__(cls, strategy: Any) -> ClusterCoordinator:
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                f"ClusterCoordinator(strategy=...): expected a "
                f"jaxdist.experimental.ParameterServerStrategy, got {type(strategy).__name__}."
            )
        holder = strategy.coordinator_holder
        with holder.lock:
            if holder.coordinator is None:
                self = super().__new__(cls)
                self._start(strategy)
                holder.coordinator, holder.stop = self, self._shutdown
            return holder.coordinator

    def __init__(self, strategy: Any) -> None:  # everything is done once, in __new__
        pass

    def _start(self, strategy: ParameterServerStrategy) -> None:
        self._strategy = strategy
        self._queue = ClosureQueue()
        # id(fn) -> (fn, key, ref, name)
        self._functions: dict[int, tuple[Any, str, Any, str]] = {}
        self._lock = threading.Lock()
        # Seconds between join()'s lines about long-running closures (None: no lines).
        self.log_interval: float | None = float(
            os.environ.get("JAXDIST_PS_LOG_INTERVAL", _LOG_INTERVAL_S)
        )
        self._alive = len(strategy.extended.worker_actors)
        self._threads = [
            threading.Thread(
                target=self._dispatch, args=(i,), name=f"jaxdist-ps-dispatch-{i}", daemon=True
            )
            for i in range(self._alive)
        ]
        for t in self._threads:
            t.start()

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    # Scheduling ---------------------------------------------------------------------

    def schedule(
        self, fn: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns its `RemoteValue`.

        ``fn`` is ``strategy.function(f)`` (called on the worker as ``f(ctx, *args)``) or
        a ``jax.jit`` function. Parameter-server variables in the arguments are read on
        the worker; those the function returns updated are written back as deltas.
        A `PerWorkerValues` argument becomes the running worker's value, a per-worker
        iterator its next element. Raises the error of an earlier closure, once.
        """
        where = "ClusterCoordinator.schedule"
        if isinstance(fn, ScheduledFunction):
            if fn.strategy is not self._strategy:
                raise ValueError(
                    f"{where}: fn was made by the function() of another strategy "
                    f"({fn.strategy!r}); use this coordinator's strategy.function."
                )
        elif not isinstance(fn, jax.stages.Wrapped):
            raise TypeError(
                f"{where}: fn must be compiled with strategy.function(fn) or jax.jit(fn), got "
                f"{type(fn).__name__} ({fn!r:.60}). Decorate it: "
                "coordinator.schedule(strategy.function(step), args=(...))."
            )
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"{where}: args must be a tuple or list, got {type(args).__name__}; for one "
                "argument write args=(x,)."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"{where}: kwargs must be a dict, got {type(kwargs).__name__}.")
        structure = (tuple(args), dict(kwargs or {}))
        bad = [
            label + jax.tree_util.keystr(p)
            for label, tree in zip(("args", "kwargs"), structure, strict=True)
            for p, x in jax.tree_util.tree_flatten_with_path(
                tree, is_leaf=lambda x: isinstance(x, RemoteValue)
            )[0]
            if isinstance(x, RemoteValue)
        ]
        if bad:
            raise ValueError(
                f"{where}: a RemoteValue cannot be an argument (at {', '.join(bad)}): its value "
                "is not known until its closure runs. Pass the result of .fetch() (after "
                "coordinator.join()), or keep the value in a variable on the parameter servers."
            )
        n = len(self._strategy.extended.worker_actors)
        for p, x in jax.tree_util.tree_flatten_with_path(
            structure, is_leaf=lambda x: isinstance(x, PerWorkerValues)
        )[0]:
            if isinstance(x, PerWorkerValues) and len(x.values) != n:
                raise ValueError(
                    f"{where}: PerWorkerValues at {jax.tree_util.keystr(p)} has "
                    f"{len(x.values)} values for {n} workers; give one per worker."
                )
        structure = jax.tree.map(
            lambda x: np.asarray(x) if isinstance(x, jax.Array) else x,
            structure,
            is_leaf=lambda x: isinstance(x, PerWorkerValues),
        )
        key, ref, name = self._function_ref(fn)
        closure = Closure(key, ref, structure[0], structure[1], name=name)
        self._queue.put(closure)
        return closure.remote_value

    def _function_ref(self, fn: Any) -> tuple[str, Any, str]:
        """``fn``'s key, its object-store reference and its name for messages (once per
        function)."""
        with self._lock:
            entry = self._functions.get(id(fn))
            if entry is None or entry[0] is not fn:
                data = _pickled(fn, fn)
                entry = (fn, hashlib.sha1(data).hexdigest(), ray.put(data), _describe(fn))
                self._functions[id(fn)] = entry
            return entry[1], entry[2], entry[3]

    def join(self) -> None:
        """Waits until every scheduled closure has finished; raises the first error of a
        closure since the last raise (once, when no closure runs any more), or the loss of
        a parameter server. Every ``log_interval`` seconds it waits, it logs the closures
        that have run that long and their workers."""
        self._queue.join(self._report, self.log_interval or 3600.0)

    def _report(self, running: list[Closure]) -> None:
        if not self.log_interval:
            return
        now = time.monotonic()
        _log.warning(
            "ClusterCoordinator.join: waiting for %d closure(s) running for %gs or more: %s",
            len(running),
            self.log_interval,
            "; ".join(
                f"{c.name} on {task_device('worker', c.worker)} for {now - c.started:.0f}s"
                for c in running
            ),
        )

    def done(self) -> bool:
        """Whether every scheduled closure has finished (raises like `join`)."""
        return self._queue.done()

    def fetch(self, values: Any) -> Any:
        """``values`` with every `RemoteValue` replaced by its result (waiting for it);
        other leaves pass through and the nesting is kept."""
        return jax.tree.map(
            lambda x: x.fetch() if isinstance(x, RemoteValue) else x,
            values,
            is_leaf=lambda x: isinstance(x, RemoteValue),
        )

    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """A dataset made on every worker by calling ``dataset_fn()`` there (any iterable);
        ``iter()`` of it is a per-worker iterator to pass to `schedule`."""
        if not callable(dataset_fn):
            raise TypeError(
                "ClusterCoordinator.create_per_worker_dataset: dataset_fn must be a callable "
                f"with no arguments returning an iterable, got {type(dataset_fn).__name__}."
            )
        ref = ray.put(_pickled(dataset_fn, dataset_fn))
        return PerWorkerDataset(ref, len(self._strategy.extended.worker_actors))

    # Dispatch -----------------------------------------------------------------------

    def _dispatch(self, index: int) -> None:
        worker = self._strategy.extended.worker_actors[index]
        while True:
            closure = self._queue.get(index)
            if closure is None:
                return
            args, kwargs = jax.tree.map(
                lambda x: x.values[index] if isinstance(x, PerWorkerValues) else x,
                (closure.args, closure.kwargs),
                is_leaf=lambda x: isinstance(x, PerWorkerValues),
            )
            try:
                result = ray.get(worker.run.remote(closure.fn_key, [closure.fn_ref], args, kwargs))
            except RayActorError as e:
                self._lost(closure, index, e)
                if not self._wait_for_restart(worker):
                    self._retire(index)
                    return
            except RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                fatal = isinstance(cause, ParameterServerUnavailableError)
                _log_failure(closure, index, cause)
                self._queue.finished(closure, error=cause, fatal=fatal)
            except Exception as e:
                _log_failure(closure, index, e)
                self._queue.finished(closure, error=e)
            else:
                self._queue.finished(closure, result)

    def _lost(self, closure: Closure, index: int, error: BaseException) -> None:
        """The worker running ``closure`` died: log it, then reschedule the closure or, after
        ``MAX_WORKER_LOSSES`` reschedulings, fail it."""
        device = task_device("worker", index)
        what = _first_line(error)
        closure.losses.append(f"{device} died ({what})")
        losses = len(closure.losses)
        _log.warning(
            "ClusterCoordinator: worker %s died while running closure %s (run %d): %s",
            device,
            closure.name,
            closure.runs,
            what,
        )
        if losses > MAX_WORKER_LOSSES:
            self._queue.finished(
                closure,
                error=WorkerLossError(
                    f"ClusterCoordinator: closure {closure.name} was not retried again: the "
                    f"worker running it died each of the {losses} times it ran "
                    f"(MAX_WORKER_LOSSES = {MAX_WORKER_LOSSES} reschedulings): "
                    + "; ".join(closure.losses)
                    + ". A closure that kills its worker every time (a native crash, "
                    "os._exit, running out of memory) cannot succeed by retrying: look at the "
                    "workers' logs (Ray's log directory, or the output above)."
                ),
            )
            return
        _log.warning(
            "ClusterCoordinator: rescheduling closure %s (reschedule %d of at most %d)",
            closure.name,
            losses,
            MAX_WORKER_LOSSES,
        )
        self._queue.put_back(closure)

    def _wait_for_restart(self, worker: Any) -> bool:
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get(worker.ping.remote(), timeout=10)
                return True
            except ActorDiedError:
                return False
            except Exception:
                time.sleep(0.2)
        return False

    def _retire(self, index: int) -> None:
        with self._lock:
            self._alive -= 1
            alive = self._alive
        if alive == 0:
            self._queue.fail_all(
                RuntimeError(
                    "ClusterCoordinator: every worker task (/job:worker) is gone and Ray did "
                    "not restart them; no closure can run. Create the strategy again."
                )
            )

    def _shutdown(self) -> None:
        """Stops the dispatcher threads (the strategy's `CoordinatorHolder.stop`, called by its
        ``_shutdown`` in tests and benchmarks)."""
        self._queue.close()
        for t in self._threads:
            t.join(timeout=30)


def _log_failure(closure: Closure, index: int, error: BaseException) -> None:
    """TF's line for a closure's error (logged as it happens; raised later, once)."""
    _log.error(
        "ClusterCoordinator: %s failed running closure %s: %s: %s",
        task_device("worker", index),
        closure.name,
        type(error).__name__,
        _first_line(error),
    )


def _first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message (at most 300 characters)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text[:300]


def _describe(fn: Any) -> str:
    """``fn``'s name and where it is defined, e.g. ``'step' (train.py:12)``."""
    inner = getattr(fn, "fn", None) or getattr(fn, "__wrapped__", None) or fn
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    try:
        path = inspect.getsourcefile(inner) or "?"
        line = inspect.getsourcelines(inner)[1]
    except (TypeError, OSError):
        return repr(name)
    return f"{name!r} ({os.path.basename(path)}:{line})"
