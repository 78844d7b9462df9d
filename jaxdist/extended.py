"""`StrategyExtended`: the lower-level API of a strategy (``strategy.extended``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._jax_compat import is_tracer
from jaxdist.context import check_cross_replica
from jaxdist.reduce import ReduceOp
from jaxdist.values import DistributedValues, Mirrored, PerReplica
from jaxdist.variables import Variable, colocate_with, is_distributed

if TYPE_CHECKING:
    from jaxdist.strategy import Strategy

__all__ = ["StrategyExtended"]


class StrategyExtended:
    """The lower-level API of a strategy (``strategy.extended``)."""

    __slots__ = ("_strategy",)

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StrategyExtended) and other._strategy == self._strategy

    def __hash__(self) -> int:
        return hash((StrategyExtended, self._strategy))

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """This process's devices that run replicas."""
        me = jax.process_index()
        return tuple(d for d in self._strategy._devices if d.process_index == me)

    @property
    def parameter_devices(self) -> tuple[jax.Device, ...]:
        """The devices that hold mirrored variables (every replica's device, or the one
        parameter device of `CentralStorageStrategy`)."""
        param = self._strategy.parameter_device
        return (param,) if param is not None else self.worker_devices

    def variable_created_in_scope(self, v: Any) -> bool:
        """True if ``v`` is a `Variable` created inside this strategy's ``scope()``."""
        return isinstance(v, Variable) and v._meta.created_in_scope and v.strategy == self._strategy

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

    def update(
        self,
        var: Variable,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Calls ``fn(copy, *args, **kwargs)`` on each copy of ``var`` and returns the
        updated variable (with ``group=False``, this process's per-replica values).

        `PerReplica` arguments are unwrapped per copy (``ON_READ`` variables only;
        a mirrored variable has one logical copy, so its arguments must agree).
        """
        where = "StrategyExtended.update"
        check_cross_replica(self._strategy, "extended.update")
        if not isinstance(var, Variable):
            raise TypeError(f"{where}: expected a jaxdist.Variable, got {type(var).__name__}.")
        kwargs = kwargs or {}
        leaves = jax.tree.leaves((args, kwargs), is_leaf=is_distributed)
        if var._per_replica_storage:
            axes = jax.tree.map(
                lambda x: 0 if isinstance(x, PerReplica) else None,
                (tuple(args), kwargs),
                is_leaf=is_distributed,
            )
            unwrapped = jax.tree.map(
                lambda x: x.array if isinstance(x, DistributedValues) else x,
                (tuple(args), kwargs),
                is_leaf=is_distributed,
            )
            new = jax.vmap(lambda c, a, k: fn(c, *a, **k), in_axes=(0, *axes))(
                var._stored, *unwrapped
            )
        else:
            if any(isinstance(x, PerReplica) for x in leaves):
                raise ValueError(
                    f"{where}: {var!r} is mirrored (one logical copy) but got PerReplica "
                    "arguments; reduce them first (strategy.reduce) or update inside run "
                    "with ctx.assign."
                )
            a, k = jax.tree.map(
                lambda x: x.array if isinstance(x, Mirrored) else x,
                (tuple(args), kwargs),
                is_leaf=is_distributed,
            )
            new = fn(var._stored, *a, **k)
        new = jax.numpy.asarray(new, dtype=var.dtype)
        if new.shape != var._stored.shape:
            raise ValueError(
                f"{where}: fn returned shape {new.shape} for a copy of shape "
                f"{var._stored.shape[1:] if var._per_replica_storage else var._stored.shape}."
            )
        result = var._with(jax.device_put(new, var._stored.sharding))
        return result if group else self._strategy.experimental_local_results(result)

    def _place(self, value: Any, destinations: Any) -> Any:
        if isinstance(destinations, (jax.Device, str)):
            from jaxdist.devices import resolve_device

            dev = resolve_device(destinations, where="StrategyExtended.reduce_to")
            return value if not isinstance(value, jax.Array) else jax.device_put(value, dev)
        if isinstance(value, jax.Array) and not is_tracer(value) and not value.is_fully_replicated:
            value = jax.device_put(value, NamedSharding(self._strategy.mesh, P()))
        return Mirrored(value)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        """Reduces ``value`` across replicas; the result is `Mirrored` over the strategy's
        devices, or a plain array when ``destinations`` is one device."""
        reduced = self._strategy.reduce(reduce_op, value)
        return jax.tree.map(lambda x: self._place(x, destinations), reduced)

    def batch_reduce_to(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Any]:
        """`reduce_to` for many ``(value, destinations)`` pairs, as one program."""
        pairs = list(value_destination_pairs)
        reduced = self._strategy.reduce(reduce_op, [v for v, _ in pairs])
        return [
            jax.tree.map(lambda x, d=d: self._place(x, d), r)
            for r, (_, d) in zip(reduced, pairs, strict=True)
        ]

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to every replica (`Mirrored`), or to one device."""
        return jax.tree.map(lambda x: self._place(jax.numpy.asarray(x), destinations), tensor)

    def call_for_each_replica(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """tf.distribute's name for `Strategy.run`."""
        return self._strategy.run(fn, args, kwargs)
