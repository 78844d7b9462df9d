"""The worker task: a Ray actor that runs closures.

A closure arrives as a reference to its pickled function plus its arguments, in which
parameter-server variable handles, per-worker iterators and per-worker values are still
markers. The worker reads the variables it needs (one call per parameter server), makes
them local `jaxdist.Variable`\\ s under a one-device strategy on this machine's CPU, takes
the next element of its own iterators, and calls the function, compiled here once per
function. Every variable in the result that differs from what was read goes back to its
parameter server as a delta (``new - old``; a plain value for booleans), one atomic call
per server, before the closure counts as done. The result comes back as host arrays, with
updated variables replaced by their handles. While it runs a closure, the worker's task
index is the current worker index (`coordinator_context`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jaxdist.experimental.parameter_server._ray import RayActorError, cloudpickle, ray
from jaxdist.experimental.parameter_server.coordinator_context import dispatch
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

    def __init__(self, task_index: int) -> None:
        self._task_index = task_index
        self._strategy = OneDeviceStrategy(jax.devices("cpu")[0])
        self._functions: dict[str, Any] = {}  # function key -> callable (compiled here)
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
        fn = self._functions.get(fn_key)
        if fn is None:
            fn = cloudpickle.loads(ray.get(fn_ref[0]))
            fn = fn.compile_for(self._strategy) if hasattr(fn, "compile_for") else fn
            self._functions[fn_key] = fn
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
        return self._finish(out, old)

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
            old[v.name] = (v, value)
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

    def _finish(self, out: Any, old: dict[str, tuple[ParameterServerVariable, np.ndarray]]) -> Any:
        """Sends the changes of the returned variables to their servers; the host result."""
        updates: dict[int, tuple[Any, dict[int, tuple[str, Any]]]] = {}

        def updates_of(handle: ParameterServerVariable) -> dict[int, tuple[str, Any]]:
            """The updates for the parameter server holding ``handle``, by variable id."""
            return updates.setdefault(handle.task_index, (handle.actor, {}))[1]

        def back(x: Any) -> Any:
            if isinstance(x, ShardedVariable):
                return ShardedParameterServerVariable(
                    tuple(back(v) for v in x.variables), name=x.name or ""
                )
            if isinstance(x, Variable):
                entry = old.get(x.name) if x.name is not None else None
                if entry is None:
                    return np.asarray(x)
                handle, before = entry
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
