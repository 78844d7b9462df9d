"""Variables on parameter servers: handles the coordinator and the workers share.

A `ParameterServerVariable` names one array held by a ``ps`` task (its id, that task's
actor, shape, dtype and TF's synchronization and aggregation); reading it asks the task.
`ShardedParameterServerVariable` is a variable split along its first axis by the
strategy's ``variable_partitioner``, one shard per handle in ``.variables``, placed
round-robin like whole variables. Handles are small and picklable: closures carry them
to workers, which read the current values, run, and send the changes back as deltas.

Unlike a `jaxdist.Variable` (a value), a handle names remote state: ``assign*`` in the
coordinator changes the variable on its parameter server and returns the same handle.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxdist.experimental.parameter_server._cluster import task_device
from jaxdist.experimental.parameter_server._ray import RayActorError, ray
from jaxdist.variables._ops import ReadsLikeAnArray
from jaxdist.variables.meta import VariableAggregation, VariableSynchronization

__all__ = [
    "ParameterServerUnavailableError",
    "ParameterServerVariable",
    "ShardedParameterServerVariable",
]


class ParameterServerUnavailableError(RuntimeError):
    """A parameter server task is gone: its variables are lost (not retried, as in TF)."""


def unavailable(task_index: int, error: BaseException) -> ParameterServerUnavailableError:
    return ParameterServerUnavailableError(
        f"parameter server {task_device('ps', task_index)} is unavailable ({type(error).__name__}"
        f": {str(error).splitlines()[0] if str(error) else ''}). Its variables are lost; "
        "parameter servers are not restarted. Create the strategy again and restore the "
        "variables from a checkpoint."
    )


class ParameterServerVariable(ReadsLikeAnArray):
    """A variable held by a parameter server task (created in the strategy's scope)."""

    __slots__ = (
        "_actor",
        "_aggregation",
        "_dtype",
        "_id",
        "_name",
        "_shape",
        "_synchronization",
        "_task",
        "_trainable",
    )

    def __init__(
        self,
        var_id: int,
        actor: Any,
        task: int,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        trainable: bool,
        name: str,
    ) -> None:
        self._id = var_id
        self._actor = actor
        self._task = task
        self._shape = shape
        self._dtype = dtype
        self._synchronization = synchronization
        self._aggregation = aggregation
        self._trainable = trainable
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def device(self) -> str:
        """The parameter server holding it, e.g. ``/job:ps/replica:0/task:1``."""
        return task_device("ps", self._task)

    @property
    def var_id(self) -> int:
        """Its id on its parameter server (workers read and update it by this id)."""
        return self._id

    @property
    def actor(self) -> Any:
        """The Ray actor handle of the parameter server holding it."""
        return self._actor

    @property
    def task_index(self) -> int:
        """The index of the ``ps`` task holding it."""
        return self._task

    def __repr__(self) -> str:
        return (
            f"ParameterServerVariable(name={self._name!r}, shape={self._shape}, "
            f"dtype={self._dtype}, device={self.device!r})"
        )

    def read_value(self) -> np.ndarray:
        """The current value, read from the parameter server."""
        try:
            return ray.get(self._actor.read.remote([self._id]))[0]
        except RayActorError as e:
            raise unavailable(self._task, e) from e

    def value(self) -> np.ndarray:
        return self.read_value()

    def numpy(self) -> np.ndarray:
        return np.array(self.read_value())

    def _apply(self, kind: str, value: Any) -> ParameterServerVariable:
        x = np.asarray(value)
        try:
            x = np.broadcast_to(x, self._shape)
        except ValueError:
            raise ValueError(
                f"ParameterServerVariable.{'assign' if kind == 'set' else 'assign_add'}: "
                f"value of shape {x.shape} does not broadcast to variable {self._name!r} of "
                f"shape {self._shape}."
            ) from None
        try:
            ray.get(self._actor.apply.remote({self._id: (kind, x)}))
        except RayActorError as e:
            raise unavailable(self._task, e) from e
        return self

    def assign(self, value: Any) -> ParameterServerVariable:
        """Sets the variable on its parameter server; returns this handle."""
        return self._apply("set", value)

    def assign_add(self, delta: Any) -> ParameterServerVariable:
        """Adds ``delta`` on the parameter server (atomically); returns this handle."""
        return self._apply("add", delta)

    def assign_sub(self, delta: Any) -> ParameterServerVariable:
        """Subtracts ``delta`` on the parameter server (atomically); returns this handle."""
        return self._apply("add", -np.asarray(delta))


class ShardedParameterServerVariable(ReadsLikeAnArray):
    """A variable split along its first axis into shards held by parameter servers."""

    __slots__ = ("_name", "_variables")

    def __init__(self, variables: tuple[ParameterServerVariable, ...], name: str) -> None:
        self._variables = variables
        self._name = name

    @property
    def variables(self) -> tuple[ParameterServerVariable, ...]:
        """The shards, in order along the first axis."""
        return self._variables

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        first = self._variables[0].shape
        return (sum(v.shape[0] for v in self._variables), *first[1:])

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._variables[0].dtype

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._variables[0].synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._variables[0].aggregation

    @property
    def trainable(self) -> bool:
        return self._variables[0].trainable

    def __repr__(self) -> str:
        devices = [v.device for v in self._variables]
        return (
            f"ShardedParameterServerVariable(name={self._name!r}, shape={self.shape}, "
            f"dtype={self.dtype}, shards={len(self._variables)}, devices={devices})"
        )

    def read_value(self) -> np.ndarray:
        """The whole value: the shards read (one call per parameter server) and joined."""
        by_actor: dict[int, list[int]] = {}
        for i, v in enumerate(self._variables):
            by_actor.setdefault(v.task_index, []).append(i)
        parts: list[Any] = [None] * len(self._variables)
        for task, idx in by_actor.items():
            shard = self._variables[idx[0]]
            try:
                got = ray.get(shard.actor.read.remote([self._variables[i].var_id for i in idx]))
            except RayActorError as e:
                raise unavailable(task, e) from e
            for i, x in zip(idx, got, strict=True):
                parts[i] = x
        return np.concatenate(parts, axis=0)

    def value(self) -> np.ndarray:
        return self.read_value()

    def numpy(self) -> np.ndarray:
        return self.read_value()

    def _split(self, value: Any) -> list[np.ndarray]:
        x = np.broadcast_to(np.asarray(value), self.shape)
        bounds = np.cumsum([v.shape[0] for v in self._variables])[:-1]
        return np.split(x, bounds, axis=0)

    def assign(self, value: Any) -> ShardedParameterServerVariable:
        for v, part in zip(self._variables, self._split(value), strict=True):
            v.assign(part)
        return self

    def assign_add(self, delta: Any) -> ShardedParameterServerVariable:
        for v, part in zip(self._variables, self._split(delta), strict=True):
            v.assign_add(part)
        return self

    def assign_sub(self, delta: Any) -> ShardedParameterServerVariable:
        return self.assign_add(-np.asarray(delta))
