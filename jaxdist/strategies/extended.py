"""`StrategyExtended`: the lower-level API of a strategy (``strategy.extended``).

Cross-replica reductions here (``reduce_to``, ``batch_reduce_to``,
``broadcast_to``) go through the strategy's `CrossDeviceOps`, so a strategy
built with `ReductionToOneDevice` really reduces on one device, and place
their results on every destination device. ``update`` runs a function on each
copy of a variable, as TF's does, with a view of the copy that has
``assign``/``assign_add``/``assign_sub``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._jax_compat import is_tracer, varies
from jaxdist._placement.results import broadcast_to, check_pairs, destination_sharding, place
from jaxdist._protocols import ReplicaContextLike, StrategyLike
from jaxdist._scope import check_cross_replica, current_replica_context
from jaxdist.collectives.communication import CommunicationOptions, resolve_options
from jaxdist.errors import ReplicaDivergenceError
from jaxdist.strategies.checks import check_counts
from jaxdist.values.array_like import ReadsLikeAnArray
from jaxdist.values.distributed import Mirrored, PerReplica
from jaxdist.values.reduce_op import ReduceOp
from jaxdist.variables import (
    ShardedVariable,
    Variable,
    VariableAggregation,
    as_distributed,
    is_distributed,
)
from jaxdist.variables._replica_updates import mirror_of
from jaxdist.variables.meta import colocate_with

__all__ = ["StrategyExtended"]

_FIRST = "ONLY_FIRST_REPLICA"


def _reduce_op(reduce_op: Any, where: str) -> ReduceOp | None:
    """A `ReduceOp`, or ``None`` for ``ONLY_FIRST_REPLICA`` (replica 0's value)."""
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    name = reduce_op.name if isinstance(reduce_op, VariableAggregation) else reduce_op
    if isinstance(name, str):
        key = name.strip().upper()
        if key == _FIRST:
            return None
        if key in ReduceOp.__members__:
            return ReduceOp[key]
        if key == "NONE":
            raise ValueError(
                f"{where}: reduce_op VariableAggregation.NONE does not say how to combine the "
                "replicas' values. Use SUM, MEAN or ONLY_FIRST_REPLICA (or jaxdist.ReduceOp "
                "MAX/MIN)."
            )
    raise ValueError(
        f"{where}: unknown reduce op {reduce_op!r}. Use a jaxdist.ReduceOp (SUM, MEAN, MAX, MIN), "
        "a jaxdist.VariableAggregation (SUM, MEAN, ONLY_FIRST_REPLICA), or their names as "
        "strings (case-insensitive), e.g. 'sum'."
    )


def _first_replica(x: Any) -> Any:
    """Replica 0's value of one leaf (a distributed value's first row or copy)."""
    if isinstance(x, PerReplica):
        return x.array[0]
    if isinstance(x, Mirrored):
        return x.array
    return jnp.asarray(x)


class _CopyView(ReadsLikeAnArray):
    """One copy of a variable, as `StrategyExtended.update` hands it to ``fn``.

    Reads like an array (``read_value``, ``value``, operators, ``jnp``
    functions); ``assign``, ``assign_add`` and ``assign_sub`` set the value that
    ``update`` stores and return the view, as a TF variable's do. It is a pytree
    (its value the one leaf), which is how ``jnp`` functions, jitted inside,
    accept it.
    """

    __slots__ = ("_value", "_var", "assigned")

    def __init__(self, value: Any, var: Variable) -> None:
        self._value = value
        self._var = var
        #: whether ``assign`` set the copy (not only ``assign_add`` / ``assign_sub``)
        self.assigned = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._value.shape)

    @property
    def dtype(self) -> Any:
        return self._value.dtype

    @property
    def ndim(self) -> int:
        return len(self._value.shape)

    @property
    def variable(self) -> Variable:
        """The variable this is a copy of."""
        return self._var

    @property
    def name(self) -> str | None:
        return self._var.name

    @property
    def synchronization(self) -> Any:
        return self._var.synchronization

    @property
    def aggregation(self) -> Any:
        return self._var.aggregation

    def __repr__(self) -> str:
        return f"<copy of {self._var!r} in StrategyExtended.update>"

    def read_value(self) -> Any:
        """The copy's current value."""
        return self._value

    def value(self) -> Any:
        """Same as `read_value`."""
        return self._value

    def _coerce(self, value: Any, method: str) -> Any:
        where = f"StrategyExtended.update: {method} on the copy of variable {self._var.name!r}"
        if isinstance(value, (_CopyView, Variable)):
            value = value.read_value()
        elif isinstance(value, Mirrored):
            value = value.array
        elif isinstance(value, PerReplica):
            raise TypeError(
                f"{where}: got a PerReplica value; reduce it first "
                "(strategy.extended.reduce_to) so every copy gets the same value."
            )
        elif not hasattr(value, "dtype"):
            value = np.asarray(value)
        self._var.check_fits(jnp.result_type(value), tuple(np.shape(value)), where)
        return jnp.broadcast_to(jnp.asarray(value, dtype=self.dtype), self.shape)

    def assign(self, value: Any) -> _CopyView:
        """Sets the copy to ``value``; returns the copy."""
        self._value = self._coerce(value, "assign")
        self.assigned = True
        return self

    def assign_add(self, delta: Any) -> _CopyView:
        """Adds ``delta`` to the copy; returns the copy."""
        self._value = (self._value + self._coerce(delta, "assign_add")).astype(self.dtype)
        return self

    def assign_sub(self, delta: Any) -> _CopyView:
        """Subtracts ``delta`` from the copy; returns the copy."""
        self._value = (self._value - self._coerce(delta, "assign_sub")).astype(self.dtype)
        return self

    def __len__(self) -> int:
        return len(self._value)


class _Copied:
    """A view's variable, as pytree metadata: equal for variables of the same metadata,
    shape and dtype, so a jitted ``jnp`` function called on views compiles once."""

    __slots__ = ("key", "var")

    def __init__(self, var: Variable) -> None:
        self.var = var
        self.key = (var.meta, var.shape, str(var.dtype))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Copied) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


jax.tree_util.register_pytree_node(
    _CopyView,
    lambda view: ((view.read_value(),), _Copied(view.variable)),
    lambda info, children: _CopyView(children[0], info.var),
)


def _sharding(stored: Any) -> Any:
    """The sharding of a variable's storage (``None`` inside a trace: placement is jit's)."""
    return None if is_tracer(stored) else stored.sharding


def _shardings_of(stored: Any) -> tuple[Any, Any]:
    """For ``ON_READ`` storage: where per-replica rows go, and where whole values go."""
    rows = _sharding(stored)
    if isinstance(rows, NamedSharding):
        return rows, NamedSharding(rows.mesh, P())
    return rows, rows


def _onto(x: Any, sharding: Any) -> Any:
    """``x`` on ``sharding``'s devices when it is a concrete array committed elsewhere (TF
    copies ``update``'s arguments to the variable's devices)."""
    if (
        sharding is None
        or not isinstance(x, jax.Array)
        or is_tracer(x)
        or x.sharding.device_set == sharding.device_set
    ):
        return x
    return jax.device_put(x, sharding)


def _applied(fn: Callable[..., Any], view: _CopyView, args: Any, kwargs: Any) -> tuple[Any, str]:
    """Calls ``fn(view, ...)``; its result, or the view's value, is the copy's new value.
    Also returns ``"assign_add"`` when ``fn`` only added to or subtracted from ``view`` (a
    parameter server adds such a change), else ``"assign"``."""
    result = fn(view, *args, **kwargs)
    if result is None or result is view:
        return view.read_value(), "assign" if view.assigned else "assign_add"
    if isinstance(result, _CopyView):
        return result.read_value(), "assign"
    if isinstance(result, Mirrored):
        return result.array, "assign"
    if isinstance(result, (jax.Array, np.ndarray, np.generic, int, float, bool)) or is_tracer(
        result
    ):
        return result, "assign"
    raise TypeError(
        f"StrategyExtended.update: fn returned {type(result).__name__} ({result!r:.60}) for a "
        f"copy of {view.variable!r}. Return the new value (an array), or the copy it was given "
        "after v.assign / v.assign_add / v.assign_sub (or nothing)."
    )


def _check_copy(
    var: Variable, dtype: Any, shape: tuple[int, ...], want: tuple[int, ...], whose: str
) -> None:
    """Raises unless ``fn``'s new value (``dtype``, ``shape``) fits ``var``'s copy (``want``)."""
    where = "StrategyExtended.update"
    if shape != want:
        raise ValueError(
            f"{where}: fn returned shape {shape} for {whose} of {var!r}, whose shape is "
            f"{want}. Return a value of the variable's shape."
        )
    var.check_fits(dtype, shape, where)


class StrategyExtended:
    """The lower-level API of a strategy (``strategy.extended``)."""

    __slots__ = ("_strategy",)

    def __init__(self, strategy: StrategyLike) -> None:
        self._strategy = strategy

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StrategyExtended) and other._strategy == self._strategy

    def __hash__(self) -> int:
        return hash((StrategyExtended, self._strategy))

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """This process's devices that run replicas."""
        me = jax.process_index()
        return tuple(d for d in self._strategy.replica_devices if d.process_index == me)

    @property
    def parameter_devices(self) -> tuple[jax.Device, ...]:
        """The devices that hold mirrored variables (every replica's device, or the one
        parameter device of `CentralStorageStrategy`)."""
        param = self._strategy.parameter_device
        return (param,) if param is not None else self.worker_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """False: input pipelines need not drop a partial last batch to keep shapes static.

        TF's meaning: whether datasets fed to the strategy must have static
        shapes, so that code building them (Keras's numpy input) sets
        ``drop_remainder=True``. TF says ``True`` only for TPU strategies. XLA
        compiles every jaxdist program for fixed shapes too, but jaxdist's
        distributed datasets pad a partial last batch to the full shape and mask
        the padding, so no strategy here needs the remainder dropped, and a
        program given new shapes is simply compiled again.

        Example:
            >>> import jaxdist as jd
            >>> jd.OneDeviceStrategy().extended.experimental_require_static_shapes
            False
        """
        return False

    def variable_created_in_scope(self, v: Any) -> bool:
        """True if ``v`` is a `Variable` created inside this strategy's ``scope()``."""
        return isinstance(v, Variable) and v.meta.created_in_scope and v.strategy == self._strategy

    def colocate_vars_with(self, colocate_with_variable: Variable) -> Any:
        """Context manager: variables created inside are placed like the given one."""
        if not isinstance(colocate_with_variable, Variable):
            raise TypeError(
                "StrategyExtended.colocate_vars_with: expected a jaxdist.Variable, got "
                f"{type(colocate_with_variable).__name__}."
            )
        return colocate_with(colocate_with_variable)

    def value_container(self, value: Any) -> Any:
        """The distributed container of ``value``: variables and distributed values
        are their own containers in jaxdist."""
        return value

    # update -------------------------------------------------------------------------

    def update(
        self,
        var: Variable,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(copy, *args, **kwargs)`` on each copy of ``var``; returns the new variable.

        ``copy`` is a view of the variable's copy: it reads like an array and has
        ``assign``/``assign_add``/``assign_sub``/``read_value``/``value``, so TF's
        ``lambda v, x: v.assign_add(x)`` works, as do plain functions such as
        ``lambda v, x: v + x``. The copy's new value is what ``fn`` returns; when
        it returns the view (or nothing), the view's value after its assigns.
        `Mirrored` arguments are unwrapped; `PerReplica` ones are unwrapped per
        copy for ``ON_READ`` variables (copy ``r`` sees row ``r``) and refused for
        mirrored ones, which have one logical copy.

        Inside a replica function (TF's replica-context ``update``), ``fn`` runs on
        this replica's copy with this replica's arguments, without aggregation, and
        the new variable is returned (``group`` does not apply): return it from the
        function as any updated variable. An ``ON_READ`` copy takes this replica's
        arguments; a mirrored variable's new value must be the same on every
        replica, or `ReplicaDivergenceError` says how to aggregate it (TF would let
        the copies drift apart). Under a parameter-server strategy the update
        reaches the parameter server as ``ctx.assign`` does.

        Args:
            var: a `jaxdist.Variable`.
            fn: the update function.
            args: positional arguments after the copy.
            kwargs: keyword arguments.
            group: ``False`` returns this process's per-replica values instead.

        Returns:
            The updated variable (variables are immutable), or with
            ``group=False`` its local per-replica values.

        Example:
            >>> import jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> with s.scope():
            ...     v = jd.Variable(1.0)
            >>> float(s.extended.update(v, lambda v, x: v.assign_add(x), args=(2.0,)))
            3.0
        """
        where = "StrategyExtended.update"
        if isinstance(var, ShardedVariable):
            return self._update_sharded(var, fn, args, kwargs, group)
        if not isinstance(var, Variable):
            raise TypeError(
                f"{where}: var must be a jaxdist.Variable, got {type(var).__name__}; to compute "
                "with a plain array, call fn yourself."
            )
        if not callable(fn):
            raise TypeError(f"{where}: fn must be callable, got {type(fn).__name__}.")
        kwargs = {} if kwargs is None else kwargs
        args = tuple(args)
        ctx = current_replica_context()
        if ctx is not None:
            return self._update_in_replica(ctx, var, fn, args, kwargs)
        stored = var.stored

        def compute() -> Any:
            if var.per_replica_storage:
                axes = jax.tree.map(
                    lambda x: 0 if isinstance(x, PerReplica) else None,
                    (args, kwargs),
                    is_leaf=is_distributed,
                )
                rows, whole = _shardings_of(stored)
                unwrapped = jax.tree.map(
                    lambda x: (
                        _onto(x.array, rows)
                        if isinstance(x, PerReplica)
                        else _onto(x.array if isinstance(x, Mirrored) else x, whole)
                    ),
                    (args, kwargs),
                    is_leaf=is_distributed,
                )
                new = jax.vmap(
                    lambda c, a, k: jnp.asarray(_applied(fn, _CopyView(c, var), a, k)[0]),
                    in_axes=(0, *axes),
                )(stored, *unwrapped)
                copy_shape = tuple(stored.shape[1:])
            else:
                leaves = jax.tree.leaves((args, kwargs), is_leaf=is_distributed)
                if any(isinstance(x, PerReplica) for x in leaves):
                    raise ValueError(
                        f"{where}: {var!r} is mirrored (one logical copy) but got PerReplica "
                        "arguments; reduce them first (strategy.extended.reduce_to or "
                        "strategy.reduce) or update inside run with ctx.assign."
                    )
                a, k = jax.tree.map(
                    lambda x: _onto(x.array if isinstance(x, Mirrored) else x, _sharding(stored)),
                    (args, kwargs),
                    is_leaf=is_distributed,
                )
                new = jnp.asarray(_applied(fn, _CopyView(stored, var), a, k)[0])
                copy_shape = tuple(stored.shape)
            per_copy = tuple(new.shape[1:]) if var.per_replica_storage else tuple(new.shape)
            _check_copy(var, new.dtype, per_copy, copy_shape, "a copy")
            return var.with_stored(var.placed(new.astype(var.dtype)))

        result = self._strategy.gated(compute)
        return result if group else self._strategy.experimental_local_results(result)

    def _update_in_replica(
        self,
        ctx: ReplicaContextLike,
        var: Variable,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Variable:
        """`update` inside a replica function (TF's replica-context ``update``): ``fn`` runs
        once, on this replica's copy, with this replica's arguments, and no aggregation.

        An ``ON_READ`` variable's copy is this replica's own, so each replica's arguments
        reach its copy (as in TF). A mirrored (``ON_WRITE``) variable has one value, so its
        new value must be the same on every replica: where TF would let the copies drift
        apart, this raises `ReplicaDivergenceError`. Under a parameter-server strategy the
        update reaches the parameter server as a ``ctx.assign`` would (an add when ``fn``
        only added or subtracted)."""
        where = "StrategyExtended.update"
        bound = ctx.bound_to_axis
        a, k = jax.tree.map(
            lambda x: x.array if isinstance(x, Mirrored) else x,
            (args, kwargs),
            is_leaf=is_distributed,
        )
        current = var.stored if var.is_on_read or not bound else mirror_of(ctx, var, where)
        value, kind = _applied(fn, _CopyView(current, var), a, k)
        new = jnp.asarray(value)
        _check_copy(var, new.dtype, tuple(new.shape), tuple(current.shape), "this replica's copy")
        if (
            bound
            and not var.is_on_read
            and ctx.num_replicas_in_sync > 1
            and not ctx.single_replica
            and varies(new, ctx.axis_name)
        ):
            raise ReplicaDivergenceError(
                f"{where}: inside a replica function, fn's new value for the mirrored "
                f"(ON_WRITE) variable {var.name!r} differs across replicas: it reads "
                "per-replica data. TF would let the variable's copies drift apart; a jaxdist "
                "mirrored variable has one value. All-reduce the argument first "
                "(ctx.all_reduce), or use ctx.assign / ctx.assign_add / ctx.assign_sub, which "
                f"aggregate the replicas' values as the variable's aggregation "
                f"({var.aggregation.name}) says."
            )
        result = var.with_stored(new.astype(var.dtype))
        if bound:
            ctx.updates.append((kind, var, result))
        return result

    def _update_sharded(
        self,
        var: ShardedVariable,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        group: bool,
    ) -> Any:
        """`update` of a `ShardedVariable`: shard ``i`` runs ``fn`` with its rows of every
        argument of the variable's full shape (others as they are), in a replica function
        as `_update_in_replica` does for one variable (no aggregation)."""
        where = "StrategyExtended.update"
        if not callable(fn):
            raise TypeError(f"{where}: fn must be callable, got {type(fn).__name__}.")
        n = len(var.variables)
        leaves, treedef = jax.tree.flatten((tuple(args), kwargs or {}), is_leaf=is_distributed)
        cut = [var.split(x, where) for x in leaves]
        shard_args = [jax.tree.unflatten(treedef, [c[i] for c in cut]) for i in range(n)]
        ctx = current_replica_context()
        if ctx is not None:
            shards = [
                self._update_in_replica(ctx, v, fn, *shard_args[i])
                for i, v in enumerate(var.variables)
            ]
            return ShardedVariable(shards, name=var.name)
        shards = [self.update(v, fn, *shard_args[i]) for i, v in enumerate(var.variables)]
        result = ShardedVariable(shards, name=var.name)
        return result if group else self._strategy.experimental_local_results(result)

    # Reductions -----------------------------------------------------------------------

    def _default_sharding(self) -> NamedSharding:
        return self._strategy.replicated_sharding

    def _reduce_pairs(
        self,
        method: str,
        reduce_op: Any,
        pairs: list[tuple[Any, Any]],
        options: Any,
        experimental_hints: Any,
    ) -> list[Any]:
        strategy = self._strategy
        where = f"StrategyExtended.{method}"
        check_cross_replica(strategy, f"extended.{method}")
        op = _reduce_op(reduce_op, where)
        opts = resolve_options(options, where, experimental_hints=experimental_hints)
        ops = strategy.cross_device_ops
        ops.merged_options(opts, where)  # checked against the ops' defaults
        for value, _ in pairs:
            check_counts(
                strategy,
                where,
                [as_distributed(x) for x in jax.tree.leaves(value, is_leaf=is_distributed)],
            )
        default = self._default_sharding()
        if op is None:  # ONLY_FIRST_REPLICA: no reduction, replica 0's value copied out
            targets = [destination_sharding(d, where=where, default=default) for _, d in pairs]
            return strategy.gated(
                lambda: [
                    jax.tree.map(
                        lambda x, t=t: place(_first_replica(as_distributed(x)), t),
                        v,
                        is_leaf=is_distributed,
                    )
                    for (v, _), t in zip(pairs, targets, strict=True)
                ]
            )
        n = strategy.num_replicas_in_sync
        return strategy.gated(
            lambda: ops.reduce_pairs(where, op, pairs, num_replicas=n, default=default)
        )

    def reduce_to(
        self,
        reduce_op: ReduceOp | VariableAggregation | str,
        value: Any,
        destinations: Any,
        options: CommunicationOptions | None = None,
        experimental_hints: CommunicationOptions | None = None,
    ) -> Any:
        """Reduces ``value`` across replicas and places the result on ``destinations``.

        The reduction is the strategy's `CrossDeviceOps` (``reduce``), so with
        `ReductionToOneDevice` it happens on one device.

        Args:
            reduce_op: a `ReduceOp`, a `VariableAggregation` (``SUM``, ``MEAN``,
                ``ONLY_FIRST_REPLICA``: replica 0's value) or a name of either.
            value: a `PerReplica`, `Mirrored` or variable (or a pytree of them);
                a plain value counts as the same on every replica.
            destinations: a device (``"/cpu:0"``, a `jax.Device`), a list of
                devices, a distributed value or variable (its devices), or
                ``None`` (the strategy's devices). To all-reduce, pass ``value``.
            options: `jaxdist.experimental.CommunicationOptions`.
            experimental_hints: deprecated name of ``options`` (TF's).

        Returns:
            A `Mirrored` over the destination devices, or a plain array on one.

        Example:
            >>> import jax, jaxdist as jd
            >>> s = jd.MirroredStrategy(jax.devices()[:2])
            >>> x = jd.PerReplica([1.0, 2.0])
            >>> float(s.extended.reduce_to("sum", x, destinations="/cpu:0"))
            3.0
            >>> float(s.extended.reduce_to(jd.VariableAggregation.ONLY_FIRST_REPLICA, x, x))
            1.0
        """
        pairs = [(value, destinations)]
        return self._reduce_pairs("reduce_to", reduce_op, pairs, options, experimental_hints)[0]

    def batch_reduce_to(
        self,
        reduce_op: ReduceOp | VariableAggregation | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: CommunicationOptions | None = None,
        experimental_hints: CommunicationOptions | None = None,
    ) -> list[Any]:
        """`reduce_to` for many ``(value, destinations)`` pairs, reduced together
        (one XLA program for the all-reduce implementations).

        Returns:
            One result per pair, in order.
        """
        pairs = check_pairs(value_destination_pairs, "StrategyExtended.batch_reduce_to")
        return self._reduce_pairs("batch_reduce_to", reduce_op, pairs, options, experimental_hints)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to every destination device (`Mirrored`), or to one device.

        Example:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> s = jd.MirroredStrategy(jax.devices()[:2])
            >>> m = s.extended.broadcast_to(jnp.ones(2), destinations=None)
            >>> type(m).__name__, len(m.array.devices())
            ('Mirrored', 2)
        """
        where = "StrategyExtended.broadcast_to"
        check_cross_replica(self._strategy, "extended.broadcast_to")
        target = destination_sharding(destinations, where=where, default=self._default_sharding())
        return broadcast_to(where, tensor, target)

    def call_for_each_replica(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """tf.distribute's name for `Strategy.run`."""
        return self._strategy.run(fn, args, kwargs)
