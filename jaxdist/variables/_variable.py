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

Dtypes follow TF: ``Variable(0.0)`` is float32, ``Variable(1)`` int32,
``Variable(True)`` bool unless ``dtype=`` says otherwise; arrays keep their
(JAX-canonical) dtype. The stored value is never weakly typed, so a step that
updates it compiles once. A value that would lose information (a float into an
integer variable, anything into a bool one, a complex into a real one) raises
`TypeError`: cast it explicitly.

Cross-replica updates take plain, `Mirrored` (its array) and `PerReplica`
values. With a `PerReplica`, an ``ON_READ`` variable's copy ``r`` takes (or
adds) row ``r``; an ``ON_WRITE`` one takes the rows aggregated as updates from
every replica would be (sum, mean, replica 0's), and with aggregation ``NONE``
refuses them, as TF's ``extended.update`` refuses per-replica values for
mirrored variables. Setting an integer ``ON_READ`` ``SUM`` variable splits the
total exactly: the quotient in every copy plus one (towards the total's sign)
in the first ``|remainder|``, so ``assign(100)`` on 8 replicas stores 13, 13,
13, 13, 12, 12, 12, 12. A variable belongs to the strategy whose scope created
it: using it while another strategy is in effect raises `ValueError`.

With ``partitioner=`` (a `jaxdist.experimental.partitioners` partitioner, or any
``partitioner(shape, dtype)`` returning shard counts), a variable of two or more rows
is split along its first axis: ``Variable(...)`` then returns a
`jaxdist.experimental.ShardedVariable` of one `Variable` per shard (see
`jaxdist.variables._sharded`), or a plain `Variable` when there is one shard.

`copy.deepcopy` copies the storage, placed alike. Pickling stores host arrays
and metadata; unpickling creates the variable again under the strategy in
effect then (the default one outside any scope), keeping ``ON_READ`` copies
when the replica count matches and otherwise restoring the saved aggregate as
`jaxdist.checkpoint` does (``colocate_vars_with`` placement is not kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import _cpu_gate
from jaxdist._dtypes import lossy_cast, numeric
from jaxdist._jax_compat import is_tracer
from jaxdist._protocols import StrategyLike
from jaxdist._scope import current_replica_context, current_state, get_strategy
from jaxdist.values.array_like import ReadsLikeAnArray
from jaxdist.values.cross_replica import reduce_leaf
from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica
from jaxdist.values.reduce_op import ReduceOp
from jaxdist.variables._dtype_rules import initial_array, split_sum
from jaxdist.variables.meta import (
    COLOCATE,
    Meta,
    VariableAggregation,
    VariableSynchronization,
    mirrored_sharding,
    replica_sharding,
)

__all__ = ["Variable", "VariableAggregation", "VariableSynchronization"]

Sync = VariableSynchronization
Agg = VariableAggregation

# Builds a variable created with a partitioner (a `ShardedVariable`, or a `Variable` for one
# shard). `_sharded`, the module above this one, fills it in: a low table filled by the high
# module, so that this module never imports the one that builds on it.
_PARTITIONED: list[Callable[..., Any]] = []


def register_partitioned(factory: Callable[..., Any]) -> None:
    """Called by `jaxdist.variables._sharded` when it is imported: what
    ``Variable(..., partitioner=...)`` builds when the partitioner gives several shards."""
    _PARTITIONED[:] = [factory]


class Variable(ReadsLikeAnArray):
    """A distributed variable: an array with synchronization and aggregation rules.

    Args:
        initial_value: an array-like (or a zero-argument callable returning one).
        synchronization: `VariableSynchronization` (``AUTO`` means ``ON_WRITE``).
        aggregation: `VariableAggregation` used for replica-context updates
            (``ON_WRITE``) and cross-replica reads (``ON_READ``).
        trainable: defaults to True, and to False for ``ON_READ``.
        name: an optional name, kept as metadata.
        dtype: the variable's dtype; by default the initial value's (float32,
            int32 or bool for Python numbers, as in TF). A 64-bit dtype needs
            ``jax_enable_x64``; without it JAX warns and uses 32 bits.
        partitioner: an optional ``partitioner(shape, dtype)`` (such as
            `jaxdist.experimental.partitioners.FixedShardsPartitioner`). When it
            gives two or more shards, the result is a
            `jaxdist.experimental.ShardedVariable` split along the first axis.

    Created inside ``strategy.scope()``, it is placed by that strategy.

    Example:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> v = jd.Variable(jnp.ones(2), aggregation="mean")
        >>> [float(x) for x in v.assign_add(1.0).read_value()]
        [2.0, 2.0]
        >>> jd.Variable(0.0).dtype, jd.Variable(3).dtype, float(jd.Variable(2, dtype="float32"))
        (dtype('float32'), dtype('int32'), 2.0)

    The layers above (the replica context, placement, the run path, checkpoints)
    work through this interface, never through private members: ``stored`` (the
    one global array behind the variable: replicated, or ``(N, ...)`` per-replica
    rows when `per_replica_storage`), ``meta`` (its static `Meta`),
    `from_stored` / `with_stored` (a variable over other storage), `coerce`,
    `check_fits` and `checkpoint_value`.
    """

    __slots__ = ("meta", "stored")
    stored: Any
    meta: Meta

    def __new__(cls, *args: Any, partitioner: Any = None, **kwargs: Any) -> Any:
        # A strategy that keeps variables elsewhere (ParameterServerStrategy: on parameter
        # server tasks) creates them itself through its documented `create_variable` hook;
        # the result is not a Variable, so __init__ is skipped.
        creator = getattr(current_state().strategy, "create_variable", None)
        if creator is not None:
            return creator(*args, partitioner=partitioner, **kwargs)
        if partitioner is None:
            return super().__new__(cls)
        # A ShardedVariable (not a Variable: __init__ is then skipped), or a Variable built
        # in full, which __init__ leaves as it is.
        return _PARTITIONED[0](partitioner, *args, **kwargs)

    def __init__(
        self,
        initial_value: Any,
        *,
        synchronization: VariableSynchronization | str = Sync.AUTO,
        aggregation: VariableAggregation | str = Agg.NONE,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        partitioner: Any = None,
    ) -> None:
        if partitioner is not None:
            return  # built by __new__
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
        value = initial_array(initial_value, dtype, where)
        trainable = (sync is not Sync.ON_READ) if trainable is None else bool(trainable)
        meta = Meta(sync, agg, trainable, name, strategy, state.strategy is not None)
        colocated = COLOCATE.get()
        if sync is Sync.ON_READ:
            stored = jax.device_put(
                jnp.broadcast_to(value, (n, *value.shape)), replica_sharding(strategy)
            )
        elif colocated is not None and colocated.synchronization is not Sync.ON_READ:
            stored = jax.device_put(value, colocated.stored.sharding)
        else:
            stored = jax.device_put(value, mirrored_sharding(strategy))
        object.__setattr__(self, "stored", stored)
        object.__setattr__(self, "meta", meta)

    @classmethod
    def from_stored(cls, stored: Any, meta: Meta) -> Variable:
        """A variable over ``stored`` with metadata ``meta`` (no copy, no checks)."""
        v = object.__new__(cls)
        object.__setattr__(v, "stored", stored)
        object.__setattr__(v, "meta", meta)
        return v

    def with_stored(self, stored: Any, **meta_changes: Any) -> Variable:
        """This variable over other storage (and metadata changed by ``meta_changes``)."""
        meta = dataclasses.replace(self.meta, **meta_changes) if meta_changes else self.meta
        return Variable.from_stored(stored, meta)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(
            "jaxdist.Variable is immutable: assign/assign_add/assign_sub return a new variable."
        )

    # Metadata -----------------------------------------------------------------------

    @property
    def synchronization(self) -> VariableSynchronization:
        return self.meta.synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self.meta.aggregation

    @property
    def trainable(self) -> bool:
        return self.meta.trainable

    @property
    def name(self) -> str | None:
        return self.meta.name

    @property
    def strategy(self) -> StrategyLike:
        """The strategy that placed this variable."""
        return self.meta.strategy

    @property
    def is_on_read(self) -> bool:
        return self.meta.synchronization is Sync.ON_READ

    @property
    def per_replica_storage(self) -> bool:
        """True when ``stored`` holds one row per replica (an ``ON_READ`` variable)."""
        return self.is_on_read and not self.meta.local

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.stored.shape)
        return shape[1:] if self.per_replica_storage else shape

    @property
    def dtype(self) -> Any:
        return self.stored.dtype

    @property
    def device_values(self) -> Any:
        """The stored array: for ``ON_READ`` outside run, one row per replica."""
        return self.stored

    def __repr__(self) -> str:
        return (
            f"Variable(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"synchronization={self.synchronization.name}, aggregation={self.aggregation.name})"
        )

    def _check_strategy(self, where: str) -> None:
        """Refuses use while another strategy than the one that created it is in effect."""
        meta = self.meta
        if meta.local or not meta.created_in_scope:
            return
        active = current_state().strategy
        if active is not None and active != meta.strategy:
            raise ValueError(
                f"{where}: variable {meta.name!r} was created in the scope of "
                f"{meta.strategy!r}, but {active!r} is in effect here. A variable belongs "
                "to the strategy whose scope created it: use it in that strategy's scope (or "
                f"outside any scope), or move its value into a variable created in "
                f"{type(active).__name__}'s scope with jd.checkpoint.to_saveable / "
                "from_saveable."
            )

    # Copies and pickling --------------------------------------------------------------

    def __copy__(self) -> Variable:
        return Variable.from_stored(self.stored, self.meta)  # immutable: sharing storage is safe

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        stored = self.stored
        if isinstance(stored, jax.Array) and not is_tracer(stored):
            stored = jax.device_put(stored, stored.sharding, may_alias=False)
        return Variable.from_stored(stored, self.meta)

    def __reduce__(self) -> tuple[Any, ...]:
        stored = self.stored
        if is_tracer(stored):
            raise TypeError(
                f"pickle: variable {self.name!r} holds a traced value (inside jax.jit or "
                "strategy.run); pickle it after the computation returns."
            )
        if isinstance(stored, jax.Array) and not stored.is_fully_addressable:
            raise TypeError(
                f"pickle: variable {self.name!r} spans devices of several processes and no "
                "process holds all of it. Save it with jd.checkpoint.save (every process "
                "writes its part) or jd.checkpoint.to_saveable instead."
            )
        meta = self.meta
        copies = np.asarray(stored) if self.per_replica_storage else None
        fields = (meta.synchronization.name, meta.aggregation.name, meta.trainable, meta.name)
        return (_unpickle, (np.asarray(self.checkpoint_value()), copies, *fields))

    # Reading ------------------------------------------------------------------------

    def read_value(self) -> Any:
        """The variable's value.

        Inside a replica function: this replica's value (its own copy for
        ``ON_READ``). In cross-replica context, an ``ON_READ`` variable's copies
        are aggregated (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``).

        Raises:
            ValueError: reading an ``ON_READ`` variable with aggregation ``NONE``
                and several replicas in cross-replica context (with one replica its
                one copy is the value), or while another strategy is in effect.
        """
        self._check_strategy("Variable.read_value")
        return self._aggregate("Variable.read_value")

    def _aggregate(self, where: str) -> Any:
        if not self.per_replica_storage:
            return self.stored
        agg = self.aggregation
        if agg is Agg.ONLY_FIRST_REPLICA or self.stored.shape[0] == 1:
            return self.stored[0]  # with one replica, its one copy is the value (as TF)
        if agg is Agg.NONE:
            raise ValueError(
                f"{where}: {self!r} is ON_READ with aggregation NONE, so its "
                f"{self.stored.shape[0]} per-replica copies have no single value in "
                "cross-replica context. Give it an aggregation (SUM, MEAN, ONLY_FIRST_REPLICA) "
                "or read its copies with strategy.experimental_local_results(v.device_values)."
            )
        strategy = self.meta.strategy
        op = ReduceOp.SUM if agg is Agg.SUM else ReduceOp.MEAN
        out = strategy.gated(
            lambda: reduce_leaf(where, op, PerReplica(self.stored), None, self.stored.shape[0])
        )
        return out if out.dtype == self.dtype else out.astype(self.dtype)

    def checkpoint_value(self) -> Any:
        """What a checkpoint stores: the aggregate, or replica 0's copy without one (as TF)."""
        if self.per_replica_storage and self.aggregation is Agg.NONE:
            return self.stored[0]
        return self._aggregate("jaxdist.checkpoint.to_saveable")

    def value(self) -> Any:
        """Same as `read_value` (tf.Variable's name)."""
        return self.read_value()

    def numpy(self) -> np.ndarray:
        return np.asarray(self.read_value())

    # Updates ------------------------------------------------------------------------

    def _in_replica_fn(self) -> bool:
        state = current_state()
        return self.meta.local or (state.replica is not None and not state.merging)

    def coerce(self, value: Any, where: str) -> Any:
        """``value`` as an array of this variable's shape and dtype (broadcast if needed)."""
        self._check_strategy(where)
        if isinstance(value, Variable):
            value = value.read_value()
        elif isinstance(value, Mirrored):
            value = value.array
        elif isinstance(value, PerReplica):
            raise TypeError(
                f"{where}: got a PerReplica value for variable {self.name!r} inside a replica "
                "function, where each replica has its own value already. Pass the PerReplica "
                "to strategy.run as an argument (each replica then sees its own row)."
            )
        elif not hasattr(value, "dtype"):
            value = np.asarray(value)  # Python numbers and lists of them
        if not numeric(value.dtype):
            raise TypeError(
                f"{where}: cannot assign an array of dtype {value.dtype} (shape "
                f"{np.shape(value)}) to variable {self.name!r} of dtype {self.dtype}: "
                "variables hold numbers or bools. Encode the values as numbers first."
            )
        self.check_fits(jnp.result_type(value), np.shape(value), where)
        return jnp.broadcast_to(jnp.asarray(value, dtype=self.dtype), self.shape)

    def check_fits(self, dtype: Any, shape: tuple[int, ...], where: str) -> None:
        """Raises if a value of ``dtype`` and ``shape`` cannot be assigned without loss."""
        reason = lossy_cast(dtype, self.dtype)
        if reason is not None:
            raise TypeError(
                f"{where}: cannot assign a value of dtype {np.dtype(dtype)} to variable "
                f"{self.name!r} of dtype {self.dtype}: {reason}. Convert it explicitly first "
                f"(for example jnp.round(x).astype('{self.dtype}')) if that is what you mean."
            )
        try:
            fits = np.broadcast_shapes(tuple(shape), self.shape) == self.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"{where}: value of shape {tuple(shape)} does not fit variable {self.name!r} "
                f"of shape {self.shape}; pass a value of shape {self.shape} (or one that "
                "broadcasts to it)."
            )

    def _rows(self, value: PerReplica, where: str) -> Any:
        """A cross-replica `PerReplica` value as ``(N, *shape)`` rows of this variable's dtype."""
        strategy = self.meta.strategy
        n = strategy.num_replicas_in_sync
        rows = value.array
        count = rows.shape[0] if np.ndim(rows) else 0
        if count != n:
            raise ValueError(
                f"{where}: the PerReplica value has {count} per-replica values (shape "
                f"{tuple(np.shape(rows))}) but variable {self.name!r} belongs to {strategy!r}, "
                f"which has {n} replicas. Build the value for that strategy (from its run "
                "outputs, or with experimental_distribute_values_from_function)."
            )
        if value.valid is not None:
            raise ValueError(
                f"{where}: the PerReplica value for variable {self.name!r} is a padded batch "
                "(it carries valid-row counts), not one value per replica. Reduce it first, "
                "for example strategy.reduce('sum', batch, axis=0)."
            )
        row_shape = tuple(rows.shape[1:])
        self.check_fits(rows.dtype, row_shape, where)
        pad = (1,) * (len(self.shape) - len(row_shape))
        rows = jnp.asarray(rows, dtype=self.dtype).reshape((n, *pad, *row_shape))
        return jnp.broadcast_to(rows, (n, *self.shape))

    def _aggregate_rows(self, value: PerReplica, where: str) -> Any:
        """A `PerReplica` update of a mirrored variable, combined as its aggregation says."""
        rows = self._rows(value, where)
        agg = self.aggregation
        n = rows.shape[0]
        if agg is Agg.SUM:
            return jnp.sum(rows, axis=0, dtype=self.dtype)
        if agg is Agg.ONLY_FIRST_REPLICA:
            return rows[0]
        if agg is Agg.MEAN and jnp.issubdtype(self.dtype, jnp.inexact):
            return jnp.mean(rows, axis=0).astype(self.dtype)
        if agg is Agg.MEAN:
            raise ValueError(
                f"{where}: variable {self.name!r} has integer dtype {self.dtype} and "
                f"aggregation MEAN; the mean of the {n} per-replica values need not be an "
                "integer. Reduce them yourself (strategy.reduce('mean', value)) and assign the "
                "rounded result, or use aggregation SUM / ONLY_FIRST_REPLICA or a float variable."
            )
        raise ValueError(
            f"{where}: variable {self.name!r} is mirrored (ON_WRITE) with aggregation NONE, so "
            f"it cannot combine the {n} values of a PerReplica into its one value. Give it an "
            "aggregation (SUM, MEAN, ONLY_FIRST_REPLICA), reduce the value first "
            "(strategy.reduce), or use an ON_READ variable to keep one copy per replica."
        )

    def _storage_for(self, value: Any) -> Any:
        """The stored array for a new value (``ON_READ`` ``SUM``: split across the copies)."""
        if not self.per_replica_storage:
            return value
        n = self.stored.shape[0]
        if self.aggregation is Agg.SUM:
            return split_sum(value, n)
        return jnp.broadcast_to(value, (n, *value.shape))

    def placed(self, value: Any) -> Any:
        """``value`` (the whole storage) placed like the stored array."""
        stored = self.stored
        if not is_tracer(stored):
            if is_tracer(value):
                return jax.lax.with_sharding_constraint(value, stored.sharding)
            return jax.device_put(value, stored.sharding)
        # Inside the caller's jax.jit: keep the strategy's placement, which jit would
        # otherwise choose from the other operands (one device, for a value computed from
        # an uncommitted array).
        strategy = self.meta.strategy
        if strategy.num_replicas_in_sync == 1 or current_state().merging:
            return value  # (in a merge_fn, inside the replica function's shard_map)
        if self.per_replica_storage:
            return jax.lax.with_sharding_constraint(value, replica_sharding(strategy))
        return jax.lax.with_sharding_constraint(value, mirrored_sharding(strategy))

    def _updated(self, kind: str, value: Any, where: str) -> Any:
        """The new storage after a cross-replica ``assign`` / ``assign_add`` / ``assign_sub``."""
        stored = self.stored
        if self.per_replica_storage and isinstance(value, PerReplica):
            delta = self._rows(value, where)  # copy r takes (or adds) row r
        elif isinstance(value, PerReplica):
            delta = self._aggregate_rows(value, where)
        elif kind == "assign":
            return self._storage_for(self.coerce(value, where))
        elif self.per_replica_storage and self.aggregation is Agg.SUM:
            raise ValueError(
                f"{where}: {self!r} is ON_READ with aggregation SUM; adding to it in "
                "cross-replica context would add to every copy, changing the sum N times. "
                "Use assign(v.read_value() + delta), pass a PerReplica (copy r adds row r), "
                "or update it inside strategy.run."
            )
        else:
            delta = self.coerce(value, where)
        if kind == "assign":
            return jnp.broadcast_to(delta, stored.shape)
        new = stored + delta if kind == "assign_add" else stored - delta
        return new.astype(self.dtype)

    def _cross_replica(self, kind: str, value: Any) -> Variable:
        where = f"Variable.{kind}"
        self._check_strategy(where)
        # Eager work on multi-device arrays: under the CPU gate, one program at a time.
        return _cpu_gate.gated(
            lambda: self.with_stored(self.placed(self._updated(kind, value, where)))
        )

    def restored(self, value: Any) -> Variable:
        """Cross-replica ``assign`` of a checked checkpoint value, in any scope (private)."""
        value = jnp.asarray(value, dtype=self.dtype)
        return _cpu_gate.gated(lambda: self.with_stored(self.placed(self._storage_for(value))))

    def assign(self, value: Any) -> Variable:
        """Returns the variable set to ``value``.

        In a replica function, same as ``ctx.assign(v, value)``. In cross-replica
        context ``value`` may be `Mirrored` or `PerReplica` (see the module
        docstring); an ``ON_READ`` ``SUM`` variable's copies split ``value`` so that
        reading gives ``value`` (exactly, for integers).
        """
        if self._in_replica_fn():
            return _replica_ctx("assign").assign(self, value)
        return self._cross_replica("assign", value)

    def _add(self, delta: Any, method: str) -> Variable:
        if self._in_replica_fn():
            return getattr(_replica_ctx(method), method)(self, delta)
        return self._cross_replica(method, delta)

    def assign_add(self, delta: Any) -> Variable:
        """Returns the variable plus ``delta``."""
        return self._add(delta, "assign_add")

    def assign_sub(self, delta: Any) -> Variable:
        """Returns the variable minus ``delta``."""
        return self._add(delta, "assign_sub")


jax.tree_util.register_pytree_with_keys(
    Variable,
    lambda v: (((jax.tree_util.GetAttrKey("value"), v.stored),), v.meta),
    lambda meta, children: Variable.from_stored(next(iter(children)), meta),
    lambda v: ((v.stored,), v.meta),
)


def _unpickle(
    value: np.ndarray,
    copies: np.ndarray | None,
    synchronization: str,
    aggregation: str,
    trainable: bool,
    name: str | None,
) -> Variable:
    """Creates a pickled variable again under the strategy in effect (private)."""
    v = Variable(
        value,
        synchronization=synchronization,
        aggregation=aggregation,
        trainable=trainable,
        name=name,
        dtype=value.dtype,
    )
    if copies is not None and copies.shape[0] == v.strategy.num_replicas_in_sync:
        return v.with_stored(v.placed(jnp.asarray(copies, dtype=v.dtype)))
    return v.restored(value) if v.per_replica_storage else v


def _replica_ctx(method: str) -> Any:
    ctx = current_replica_context()
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
        return PerReplica(x.stored) if x.per_replica_storage else Mirrored(x.stored)
    return x
