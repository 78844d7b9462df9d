"""The worker task: a Ray actor that runs closures.

A closure arrives as a reference to its pickled function plus its arguments, in which
parameter-server variable handles, per-worker iterators and per-worker values are still
markers. The worker reads the variables it needs (one call per parameter server), makes
them local `jaxdist.Variable`\\ s under a one-device strategy on this machine's CPU, takes
the next element of its own iterators, and calls the function, compiled here once per
function. The updates a ``strategy.function`` made with ``ctx.assign*`` (see `updates`),
and the change of every other variable in the result that differs from what was read
(``new - old``; a plain value for booleans), go back to the parameter servers, one atomic
call per server, before the closure counts as done. The result comes back as host arrays, with
updated variables replaced by their handles. While it runs a closure, the worker's task
index is the current worker index (`coordinator_context`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxdist.experimental.parameter_server._ray import RayActorError, cloudpickle, ray
from jaxdist.experimental.parameter_server.coordinator_context import dispatch, set_worker_view
from jaxdist.experimental.parameter_server.updates import ClosureUpdates
from jaxdist.experimental.parameter_server.values import PerWorkerIterator
from jaxdist.experimental.parameter_server.variables import (
    ParameterServerVariable,
    ShardedParameterServerVariable,
    unavailable,
)
from jaxdist.strategies.one_device import OneDeviceStrategy
from jaxdist.variables import ShardedVariable, Variable

__all__ = ["Worker"]

_HANDLES = (ParameterServerVariable, ShardedParameterServerVariable)


def _is_marker(x: Any) -> bool:
    return isinstance(x, (*_HANDLES, PerWorkerIterator))


class Worker:
    """One ``worker`` task."""

    def __init__(self, task_index: int, strategy_view: Callable[[], Any]) -> None:
        self._task_index = task_index
        # A ParameterServerStrategy pickled into a closure is this worker's view of it.
        set_worker_view(strategy_view())
        self._strategy = OneDeviceStrategy(jax.devices("cpu")[0])
        # function key -> (callable compiled here, whether it returns recorded updates)
        self._functions: dict[str, tuple[Any, bool]] = {}
        self._iterators: dict[int, Any] = {}  # PerWorkerIterator id -> this worker's iterator

    def ping(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this task runs on."""
        return str(ray.get_runtime_context().get_node_id())

    def run(self, fn_key: str, fn_ref: list[Any], args: Any, kwargs: Any) -> Any:
        with dispatch(self._task_index):  # experimental_get_current_worker_index()
            return self._run(fn_key, fn_ref, args, kwargs)

    def _run(self, fn_key: str, fn_ref: list[Any], args: Any, kwargs: Any) -> Any:
        entry = self._functions.get(fn_key)
        if entry is None:
            fn = cloudpickle.loads(ray.get(fn_ref[0]))
            records = hasattr(fn, "compile_for")  # a strategy.function: ctx.assign* recorded
            entry = self._functions[fn_key] = (
                fn.compile_for(self._strategy) if records else fn,
                records,
            )
        fn, records = entry
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_marker)
        handles = [x for x in leaves if isinstance(x, _HANDLES)]
        values = self._read(handles)
        local: dict[int, Any] = {}  # id(handle) -> local variable
        old: dict[str, tuple[ParameterServerVariable, np.ndarray]] = {}  # name -> (handle, old)
        with self._strategy.scope():
            for h in handles:
                if id(h) not in local:
                    local[id(h)] = self._local(h, values, old)
        leaves = [
            local[id(x)]
            if isinstance(x, _HANDLES)
            else self._next(x)
            if isinstance(x, PerWorkerIterator)
            else x
            for x in leaves
        ]
        call_args, call_kwargs = jax.tree.unflatten(treedef, leaves)
        out = fn(*call_args, **call_kwargs)
        if records:
            out, recorded = out
            return self._finish(out, old, recorded)
        return self._finish(out, old, ClosureUpdates({}, {}))

    def _read(self, handles: list[Any]) -> dict[int, np.ndarray]:
        """Every shard's current value, by variable id: one read per parameter server."""
        by_task: dict[int, tuple[Any, list[int]]] = {}
        for h in handles:
            for v in h.variables if isinstance(h, ShardedParameterServerVariable) else (h,):
                by_task.setdefault(v.task_index, (v.actor, []))[1].append(v.var_id)
        refs = {t: actor.read.remote(ids) for t, (actor, ids) in by_task.items()}
        values: dict[int, np.ndarray] = {}
        for task, ref in refs.items():
            try:
                got = ray.get(ref)
            except RayActorError as e:
                raise unavailable(task, e) from e
            values.update(zip(by_task[task][1], got, strict=True))
        return values

    def _local(self, h: Any, values: dict[int, np.ndarray], old: dict[str, Any]) -> Any:
        def one(v: ParameterServerVariable) -> Variable:
            value = values[v.var_id]
            old[str(v.name)] = (v, value)
            return Variable(
                value,
                synchronization=v.synchronization,
                aggregation=v.aggregation,
                trainable=v.trainable,
                name=v.name,
                dtype=v.dtype,
            )

        if isinstance(h, ShardedParameterServerVariable):
            return ShardedVariable([one(v) for v in h.variables], name=h.name)
        return one(h)

    def _next(self, marker: PerWorkerIterator) -> Any:
        it = self._iterators.get(marker.iterator_id)
        if it is None:
            dataset_fn = cloudpickle.loads(ray.get(marker.dataset.fn_ref))
            it = self._iterators[marker.iterator_id] = iter(dataset_fn())
        return next(it)

    def _finish(
        self,
        out: Any,
        old: dict[str, tuple[ParameterServerVariable, np.ndarray]],
        recorded: ClosureUpdates,
    ) -> Any:
        """Sends the closure's updates to the parameter servers (one atomic call per
        server); the host result.

        The updates are those ``ctx.assign*`` recorded, and for every other variable the
        closure returns, its change (``new - old``; the value for booleans).
        """
        updates: dict[int, tuple[Any, dict[int, tuple[str, Any]]]] = {}

        def updates_of(handle: ParameterServerVariable) -> dict[int, tuple[str, Any]]:
            """The updates for the parameter server holding ``handle``, by variable id."""
            return updates.setdefault(handle.task_index, (handle.actor, {}))[1]

        for kind, table in (("set", recorded.sets), ("add", recorded.adds)):
            for name, x in table.items():
                if name not in old:
                    continue
                handle = old[name][0]
                x = np.asarray(x)
                if kind == "set" or np.any(x):
                    updates_of(handle)[handle.var_id] = (kind, x)
        logged = recorded.sets.keys() | recorded.adds.keys()

        def back(x: Any) -> Any:
            if isinstance(x, _HANDLES):  # a handle the closure captured: as it is
                return x
            if isinstance(x, ShardedVariable):
                return ShardedParameterServerVariable(
                    tuple(back(v) for v in x.variables), name=x.name or ""
                )
            if isinstance(x, Variable):
                entry = old.get(x.name) if x.name is not None else None
                if entry is None:
                    return np.asarray(x)
                handle, before = entry
                if x.name in logged:  # its ctx.assign* updates are sent already
                    return handle
                new = np.asarray(x.read_value())
                if new.dtype == np.bool_:
                    if not np.array_equal(new, before):
                        updates_of(handle)[handle.var_id] = ("set", new)
                else:
                    delta = new - before
                    if np.any(delta):
                        updates_of(handle)[handle.var_id] = ("add", delta)
                return handle
            if isinstance(x, jax.Array):
                return np.asarray(x)
            return x

        result = jax.tree.map(
            back, out, is_leaf=lambda x: isinstance(x, (Variable, ShardedVariable))
        )
        refs = {task: actor.apply.remote(u) for task, (actor, u) in updates.items()}
        for task, ref in refs.items():
            try:
                ray.get(ref)
            except RayActorError as e:
                raise unavailable(task, e) from e
        return result
