"""What lower layers may ask of a strategy and of a replica context.

Low modules (values, input, variables, placement, the compile path) work with
whatever strategy they are handed, yet may not import `jaxdist.strategies.base`,
which sits far above them. They annotate against these protocols instead, as
optax puts its `Protocol`s at the bottom of its stack: `jaxdist.Strategy`
satisfies `StrategyLike` and `jaxdist.ReplicaContext` satisfies
`ReplicaContextLike` structurally, with no import in either direction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
from jax.sharding import Mesh, NamedSharding

__all__ = ["ReplicaContextLike", "StrategyLike"]


class StrategyLike(Protocol):
    """The face of a `jaxdist.Strategy` that the layers below it use."""

    @property
    def mesh(self) -> Mesh: ...

    @property
    def axis_name(self) -> str | tuple[str, ...]: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def replicated_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P())``: one copy on every replica's device."""
        ...

    @property
    def per_replica_sharding(self) -> NamedSharding:
        """``NamedSharding(mesh, P(axis_name))``: row ``r`` on replica ``r``'s device."""
        ...

    @property
    def cross_device_ops(self) -> Any: ...

    @property
    def extended(self) -> Any: ...

    @property
    def parameter_device(self) -> jax.Device | None: ...

    @property
    def replica_devices(self) -> tuple[jax.Device, ...]: ...

    @property
    def cluster_resolver(self) -> Any: ...

    # Methods the lower layers call, typed loosely (their full signatures live on
    # `jaxdist.Strategy`).
    def run(self, *args: Any, **kwargs: Any) -> Any: ...

    def reduce(self, *args: Any, **kwargs: Any) -> Any: ...

    def scope(self, *args: Any, **kwargs: Any) -> Any: ...

    def function(self, *args: Any, **kwargs: Any) -> Any: ...

    def experimental_local_results(self, *args: Any, **kwargs: Any) -> Any: ...

    def experimental_distribute_values_from_function(self, *args: Any, **kwargs: Any) -> Any: ...

    def gated(self, thunk: Callable[[], Any]) -> Any: ...

    def program_caller(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def _devices(self) -> tuple[jax.Device, ...]: ...


class ReplicaContextLike(Protocol):
    """The face of a `jaxdist.ReplicaContext` that the layers below it use."""

    @property
    def strategy(self) -> StrategyLike: ...

    @property
    def axis_name(self) -> str | tuple[str, ...]: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def bound_to_axis(self) -> bool: ...

    @property
    def single_replica(self) -> bool: ...

    @property
    def mirrors(self) -> dict[int, tuple[Any, Any]]: ...

    @property
    def updates(self) -> list[tuple[str, Any, Any]]: ...

    def all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any: ...

    def broadcast(self, value: Any, source_replica: int = 0) -> Any: ...

    def assign(self, variable: Any, value: Any) -> Any: ...

    def assign_add(self, variable: Any, delta: Any) -> Any: ...

    def assign_sub(self, variable: Any, delta: Any) -> Any: ...
