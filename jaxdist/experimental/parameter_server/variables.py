"""Variables on parameter servers: handles the coordinator and the workers share.

A `ParameterServerVariable` names one array held by a ``ps`` task (its id, that task's
actor, shape, dtype and TF's synchronization and aggregation); reading it asks the task.
`ShardedParameterServerVariable` is a variable split along its first axis by the
strategy's ``variable_partitioner``, one shard per handle in ``.variables``, placed
round-robin like whole variables. Handles are small and picklable: closures carry them
to workers, which read the current values, run, and send the changes back as deltas.

Both are jaxdist's own types (`ParameterServerVariable` is a `jaxdist.Variable`,
`ShardedParameterServerVariable` a `jaxdist.experimental.ShardedVariable`) with TF's
metadata, so code written for them (``isinstance``, ``.synchronization``, reading, saving)
takes them. Unlike a `jaxdist.Variable` (a value), a handle names remote state: ``assign*``
in the coordinator changes the variable on its parameter server and returns the same
handle, and copying or pickling a handle copies the name, not the value. A handle's
strategy is the `ParameterServerStrategy` that made it in the coordinator's process, and
that worker's view of it in a worker's.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxdist.experimental.parameter_server._cluster import task_device
from jaxdist.experimental.parameter_server._ray import RayActorError, ray
from jaxdist.experimental.parameter_server.coordinator_context import strategy_for
from jaxdist.variables import ShardedVariable, Variable
from jaxdist.variables.meta import Meta

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


class ParameterServerVariable(Variable):
    """A variable held by a parameter server task (created in the strategy's scope); a
    `jaxdist.Variable`."""

    __slots__ = ("_actor", "_dtype", "_id", "_shape", "_task", "_uid")
    _actor: Any
    _dtype: np.dtype[Any]
    _id: int
    _shape: tuple[int, ...]
    _task: int
    _uid: int

    def __new__(cls, *args: Any, **kwargs: Any) -> ParameterServerVariable:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Built by `handle`; Python calls __init__ again with jaxdist.Variable's arguments
        # when ``jd.Variable(...)`` in the strategy's scope returns one: nothing to do.
        pass

    @classmethod
    def handle(
        cls,
        var_id: int,
        actor: Any,
        task: int,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        meta: Meta,
        strategy_uid: int,
    ) -> ParameterServerVariable:
        """The handle of variable ``var_id`` on ps task ``task`` (served by ``actor``)."""
        v = cls()
        for field, value in (
            ("_id", var_id),
            ("_actor", actor),
            ("_task", task),
            ("_shape", tuple(shape)),
            ("_dtype", np.dtype(dtype)),
            ("_uid", strategy_uid),
            ("meta", meta),
        ):
            object.__setattr__(v, field, value)
        return v

    @property
    def stored(self) -> Any:
        """The current value (read from the parameter server), as a JAX array."""
        return jnp.asarray(self.read_value())

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def per_replica_storage(self) -> bool:
        """False: a parameter server holds one value, even for ``ON_READ``."""
        return False

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
            f"ParameterServerVariable(name={self.name!r}, shape={self._shape}, "
            f"dtype={self._dtype}, device={self.device!r})"
        )

    def __copy__(self) -> ParameterServerVariable:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ParameterServerVariable:
        return self  # a handle: the value stays on its parameter server

    def __reduce__(self) -> tuple[Any, ...]:
        meta = self.meta
        fields = (meta.synchronization, meta.aggregation, meta.trainable, meta.name)
        return (
            _rebuild_handle,
            (self._id, self._actor, self._task, self._shape, self._dtype, fields, self._uid),
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

    def checkpoint_value(self) -> np.ndarray:
        """What a checkpoint stores: the value on the parameter server."""
        return self.read_value()

    @property
    def device_values(self) -> np.ndarray:
        return self.read_value()

    def restored(self, value: Any) -> ParameterServerVariable:
        """Sets the parameter server's value from a checked checkpoint value (private)."""
        return self.assign(value)

    def _apply(self, kind: str, value: Any) -> ParameterServerVariable:
        x = np.asarray(value)
        try:
            x = np.broadcast_to(x, self._shape)
        except ValueError:
            raise ValueError(
                f"ParameterServerVariable.{'assign' if kind == 'set' else 'assign_add'}: "
                f"value of shape {x.shape} does not broadcast to variable {self.name!r} of "
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


def _rebuild_handle(
    var_id: int,
    actor: Any,
    task: int,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    fields: tuple[Any, ...],
    uid: int,
) -> ParameterServerVariable:
    sync, agg, trainable, name = fields
    meta = Meta(sync, agg, trainable, name, strategy_for(uid), created_in_scope=True)
    return ParameterServerVariable.handle(var_id, actor, task, shape, dtype, meta, uid)


class ShardedParameterServerVariable(ShardedVariable):
    """A variable split along its first axis into shards held by parameter servers; a
    `jaxdist.experimental.ShardedVariable` whose shards are `ParameterServerVariable`\\ s."""

    __slots__ = ()

    def __init__(self, variables: tuple[ParameterServerVariable, ...], name: str) -> None:
        super().__init__(list(variables), name=name)

    @property
    def variables(self) -> tuple[ParameterServerVariable, ...]:
        """The shards, in order along the first axis."""
        return self._variables

    def __repr__(self) -> str:
        devices = [v.device for v in self._variables]
        return (
            f"ShardedParameterServerVariable(name={self.name!r}, shape={self.shape}, "
            f"dtype={self.dtype}, shards={len(self._variables)}, devices={devices})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardedParameterServerVariable, (self._variables, self.name))

    def __copy__(self) -> ShardedParameterServerVariable:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedParameterServerVariable:
        return self

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

    def numpy(self) -> np.ndarray:
        return self.read_value()

    def checkpoint_value(self) -> np.ndarray:
        return self.read_value()

    def _update(self, kind: str, value: Any) -> ShardedParameterServerVariable:
        """Each shard updated on its parameter server; this handle."""
        self.updated_by(kind, value, lambda v, k, part: getattr(v, k)(part))
        return self

    def restored(self, value: Any) -> ShardedParameterServerVariable:
        return self.assign(value)  # type: ignore[return-value]
