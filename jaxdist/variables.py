"""Distributed variables: tf.distribute's variable model as immutable pytree nodes.

A `Variable` holds one stored array plus static metadata (synchronization,
aggregation, trainable, name, the strategy whose scope created it). Updates
return a new `Variable`; nothing is mutated.

- ``ON_WRITE`` (mirrored, the default): one logical value, replicated on every
  replica's device (on the parameter device for `CentralStorageStrategy`).
  Updates made inside a replica function are aggregated across replicas as the
  variable's aggregation says, so the value stays identical everywhere.
- ``ON_READ`` (sync-on-read): one copy per replica, stored as a global array
  with a leading replica axis. Updates inside a replica function stay local
  (no communication); reading in cross-replica context aggregates the copies.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._cross_replica import reduce_leaf
from jaxdist.context import current_state, get_replica_context, get_strategy
from jaxdist.reduce import ReduceOp
from jaxdist.values import DistributedValues, Mirrored, PerReplica

if TYPE_CHECKING:
    from jaxdist.strategy import Strategy

__all__ = ["Variable", "VariableAggregation", "VariableSynchronization"]


class _NamedEnum(enum.Enum):
    @classmethod
    def from_any(cls, value: Any, *, where: str) -> Any:
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        names = ", ".join(cls.__members__)
        raise ValueError(f"{where}: unknown {cls.__name__} {value!r}; use one of {names}.")


class VariableSynchronization(_NamedEnum):
    """When a distributed variable's copies are made consistent."""

    AUTO = "AUTO"
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"


class VariableAggregation(_NamedEnum):
    """How per-replica updates (``ON_WRITE``) or copies (``ON_READ``) combine."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


Sync = VariableSynchronization
Agg = VariableAggregation


@dataclasses.dataclass(frozen=True)
class _Meta:
    synchronization: VariableSynchronization
    aggregation: VariableAggregation
    trainable: bool
    name: str | None
    strategy: Strategy  # the strategy that placed it
    created_in_scope: bool
    local: bool = False  # True for the per-replica view inside a replica function


_COLOCATE: contextvars.ContextVar[Variable | None] = contextvars.ContextVar(
    "jaxdist_colocate", default=None
)


@contextlib.contextmanager
def colocate_with(var: Variable) -> Iterator[None]:
    """Variables created in the block are placed on ``var``'s devices (private)."""
    token = _COLOCATE.set(var)
    try:
        yield
    finally:
        _COLOCATE.reset(token)


def _mirrored_sharding(strategy: Strategy) -> jax.sharding.Sharding:
    param = getattr(strategy, "parameter_device", None)
    if param is not None:
        return jax.sharding.SingleDeviceSharding(param)
    return NamedSharding(strategy.mesh, P())


def _replica_sharding(strategy: Strategy) -> jax.sharding.Sharding:
    return NamedSharding(strategy.mesh, P(strategy.axis_name))


class Variable:
    """A distributed variable: an array with synchronization and aggregation rules.

    Args:
        initial_value: an array-like (or a zero-argument callable returning one).
        synchronization: `VariableSynchronization` (``AUTO`` means ``ON_WRITE``).
        aggregation: `VariableAggregation` used for replica-context updates
            (``ON_WRITE``) and cross-replica reads (``ON_READ``).
        trainable: defaults to True, and to False for ``ON_READ``.
        name: an optional name, kept as metadata.

    Created inside ``strategy.scope()``, it is placed by that strategy.

    Example:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> v = jd.Variable(jnp.ones(2), aggregation="mean")
        >>> [float(x) for x in v.assign_add(1.0).read_value()]
        [2.0, 2.0]
    """

    __slots__ = ("_meta", "_stored")
    _stored: Any
    _meta: _Meta

    def __init__(
        self,
        initial_value: Any,
        *,
        synchronization: VariableSynchronization | str = Sync.AUTO,
        aggregation: VariableAggregation | str = Agg.NONE,
        trainable: bool | None = None,
        name: str | None = None,
    ) -> None:
        where = f"jaxdist.Variable(name={name!r})"
        sync = Sync.from_any(synchronization, where=where)
        agg = Agg.from_any(aggregation, where=where)
        if sync is Sync.AUTO:
            sync = Sync.ON_WRITE
        state = current_state()
        if state.replica is not None and not state.merging:
            raise RuntimeError(
                f"{where}: variables cannot be created inside a replica function; create them "
                "in cross-replica context (inside strategy.scope()) and pass them to run."
            )
        strategy = get_strategy()
        n = strategy.num_replicas_in_sync
        if sync is Sync.NONE and n > 1:
            raise ValueError(
                f"{where}: synchronization NONE is not supported under {strategy!r}, which has "
                f"{n} replicas; use ON_WRITE (mirrored) or ON_READ."
            )
        if sync is Sync.ON_READ and trainable:
            raise ValueError(
                f"{where}: synchronization ON_READ is only for non-trainable variables (such "
                "as metrics); pass trainable=False or use ON_WRITE."
            )
        if callable(initial_value):
            initial_value = initial_value()
        value = jnp.asarray(initial_value)
        trainable = (sync is not Sync.ON_READ) if trainable is None else bool(trainable)
        meta = _Meta(sync, agg, trainable, name, strategy, state.strategy is not None)
        colocated = _COLOCATE.get()
        if sync is Sync.ON_READ:
            stored = jax.device_put(
                jnp.broadcast_to(value, (n, *value.shape)), _replica_sharding(strategy)
            )
        elif colocated is not None and colocated.synchronization is not Sync.ON_READ:
            stored = jax.device_put(value, colocated._stored.sharding)
        else:
            stored = jax.device_put(value, _mirrored_sharding(strategy))
        object.__setattr__(self, "_stored", stored)
        object.__setattr__(self, "_meta", meta)

    @classmethod
    def _make(cls, stored: Any, meta: _Meta) -> Variable:
        v = object.__new__(cls)
        object.__setattr__(v, "_stored", stored)
        object.__setattr__(v, "_meta", meta)
        return v

    def _with(self, stored: Any, **meta_changes: Any) -> Variable:
        meta = dataclasses.replace(self._meta, **meta_changes) if meta_changes else self._meta
        return Variable._make(stored, meta)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(
            "jaxdist.Variable is immutable: assign/assign_add/assign_sub return a new variable."
        )

    # Metadata -----------------------------------------------------------------------

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._meta.synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._meta.aggregation

    @property
    def trainable(self) -> bool:
        return self._meta.trainable

    @property
    def name(self) -> str | None:
        return self._meta.name

    @property
    def strategy(self) -> Strategy:
        """The strategy that placed this variable."""
        return self._meta.strategy

    @property
    def is_on_read(self) -> bool:
        return self._meta.synchronization is Sync.ON_READ

    @property
    def _per_replica_storage(self) -> bool:
        return self.is_on_read and not self._meta.local

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self._stored.shape)
        return shape[1:] if self._per_replica_storage else shape

    @property
    def dtype(self) -> Any:
        return self._stored.dtype

    @property
    def device_values(self) -> Any:
        """The stored array: for ``ON_READ`` outside run, one row per replica."""
        return self._stored

    def __repr__(self) -> str:
        return (
            f"Variable(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"synchronization={self.synchronization.name}, aggregation={self.aggregation.name})"
        )

    # Reading ------------------------------------------------------------------------

    def read_value(self) -> Any:
        """The variable's value.

        Inside a replica function: this replica's value (its own copy for
        ``ON_READ``). In cross-replica context, an ``ON_READ`` variable's copies
        are aggregated (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``).

        Raises:
            ValueError: reading an ``ON_READ`` variable with aggregation ``NONE``
                in cross-replica context.
        """
        if not self._per_replica_storage:
            return self._stored
        agg = self.aggregation
        if agg is Agg.NONE:
            raise ValueError(
                f"Variable.read_value: {self!r} is ON_READ with aggregation NONE, so its "
                f"{self._stored.shape[0]} per-replica copies have no single value in "
                "cross-replica context. Give it an aggregation (SUM, MEAN, ONLY_FIRST_REPLICA) "
                "or read its copies with strategy.experimental_local_results(v.device_values)."
            )
        if agg is Agg.ONLY_FIRST_REPLICA:
            return self._stored[0]
        strategy = self._meta.strategy
        op = ReduceOp.SUM if agg is Agg.SUM else ReduceOp.MEAN
        out = strategy._gated(
            lambda: reduce_leaf(
                "Variable.read_value", op, PerReplica(self._stored), None, self._stored.shape[0]
            )
        )
        return out if out.dtype == self.dtype else out.astype(self.dtype)

    def value(self) -> Any:
        """Same as `read_value` (tf.Variable's name)."""
        return self.read_value()

    def numpy(self) -> np.ndarray:
        return np.asarray(self.read_value())

    def __jax_array__(self) -> Any:
        return self.read_value()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self.read_value(), dtype=dtype)

    # Cross-replica updates ------------------------------------------------------------

    def _in_replica_fn(self) -> bool:
        state = current_state()
        return self._meta.local or (state.replica is not None and not state.merging)

    def _coerce(self, value: Any, where: str) -> Any:
        value = value.read_value() if isinstance(value, Variable) else value
        value = jnp.asarray(value, dtype=self.dtype)
        if value.shape != self.shape:
            try:
                value = jnp.broadcast_to(value, self.shape)
            except ValueError:
                raise ValueError(
                    f"{where}: value of shape {value.shape} does not fit variable "
                    f"{self.name!r} of shape {self.shape}."
                ) from None
        return value

    def _store(self, value: Any) -> Variable:
        if self._per_replica_storage:
            n = self._stored.shape[0]
            value = jnp.broadcast_to(value, (n, *value.shape))
        return self._with(jax.device_put(value, self._stored.sharding))

    def assign(self, value: Any) -> Variable:
        """Returns the variable with ``value`` (``ON_READ`` + ``SUM``: each copy holds
        ``value / N``, so reading gives ``value``). In a replica function, same as
        ``ctx.assign(v, value)``."""
        if self._in_replica_fn():
            return _replica_ctx("assign").assign(self, value)
        value = self._coerce(value, "Variable.assign")
        if self._per_replica_storage and self.aggregation is Agg.SUM:
            value = value / self._stored.shape[0]
            value = value.astype(self.dtype)
        return self._store(value)

    def _add(self, delta: Any, sign: int, method: str) -> Variable:
        if self._in_replica_fn():
            ctx = _replica_ctx(method)
            return getattr(ctx, method)(self, delta)
        where = f"Variable.{method}"
        if self._per_replica_storage and self.aggregation is Agg.SUM:
            raise ValueError(
                f"{where}: {self!r} is ON_READ with aggregation SUM; adding to it in "
                "cross-replica context would add to every copy, changing the sum N times. "
                "Use assign(v.read_value() + delta), or update it inside strategy.run."
            )
        delta = self._coerce(delta, where)
        stored = self._stored
        return self._with(stored + delta if sign > 0 else stored - delta)

    def assign_add(self, delta: Any) -> Variable:
        """Returns the variable plus ``delta``."""
        return self._add(delta, +1, "assign_add")

    def assign_sub(self, delta: Any) -> Variable:
        """Returns the variable minus ``delta``."""
        return self._add(delta, -1, "assign_sub")

    # Arithmetic reads the value, as tf.Variable does -------------------------------

    def __add__(self, o: Any) -> Any:
        return self.read_value() + o

    def __radd__(self, o: Any) -> Any:
        return o + self.read_value()

    def __sub__(self, o: Any) -> Any:
        return self.read_value() - o

    def __rsub__(self, o: Any) -> Any:
        return o - self.read_value()

    def __mul__(self, o: Any) -> Any:
        return self.read_value() * o

    def __rmul__(self, o: Any) -> Any:
        return o * self.read_value()

    def __truediv__(self, o: Any) -> Any:
        return self.read_value() / o

    def __rtruediv__(self, o: Any) -> Any:
        return o / self.read_value()

    def __matmul__(self, o: Any) -> Any:
        return self.read_value() @ o

    def __rmatmul__(self, o: Any) -> Any:
        return o @ self.read_value()

    def __pow__(self, o: Any) -> Any:
        return self.read_value() ** o

    def __neg__(self) -> Any:
        return -self.read_value()

    def __getitem__(self, idx: Any) -> Any:
        return self.read_value()[idx]

    def __float__(self) -> float:
        return float(self.read_value())

    def __int__(self) -> int:
        return int(self.read_value())


jax.tree_util.register_pytree_with_keys(
    Variable,
    lambda v: (((jax.tree_util.GetAttrKey("value"), v._stored),), v._meta),
    lambda meta, children: Variable._make(next(iter(children)), meta),
    lambda v: ((v._stored,), v._meta),
)


def _replica_ctx(method: str) -> Any:
    ctx = get_replica_context()
    if ctx is None:
        raise RuntimeError(f"Variable.{method}: no replica context is active.")
    return ctx


def is_distributed(x: Any) -> bool:
    """True for the leaves jaxdist treats as one distributed value: variables and
    `DistributedValues` (use as ``is_leaf`` in tree maps)."""
    return isinstance(x, (DistributedValues, Variable))


def as_distributed(x: Any) -> Any:
    """A variable seen as a distributed value: ``ON_READ`` copies are `PerReplica`,
    a mirrored variable is `Mirrored`; anything else is returned as is."""
    if isinstance(x, Variable):
        return PerReplica(x._stored) if x._per_replica_storage else Mirrored(x._stored)
    return x
