"""Moving a strategy's arguments onto its mesh: arrays committed outside it, and
central storage's variables between the parameter device and the compute devices."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxdist._jax_compat import is_tracer
from jaxdist._protocols import StrategyLike
from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica
from jaxdist.variables import Variable, is_distributed


def onto_mesh(strategy: StrategyLike, tree: Any) -> Any:
    """Re-places committed arrays of ``tree`` that live outside ``strategy``'s mesh."""
    mesh = strategy.mesh
    devices = set(mesh.devices.flat)
    replicated = strategy.replicated_sharding
    per_replica = strategy.per_replica_sharding

    def place(x: Any, sharding: NamedSharding) -> Any:
        if isinstance(x, jax.Array) and not is_tracer(x) and x.sharding.device_set != devices:
            return jax.device_put(x, sharding)
        return x

    def leaf(x: Any) -> Any:
        if isinstance(x, Variable):
            sharding = per_replica if x.per_replica_storage else replicated
            return x.with_stored(place(x.stored, sharding))
        if isinstance(x, PerReplica):
            return PerReplica(place(x.array, per_replica))
        if isinstance(x, Mirrored):
            return Mirrored(place(x.array, replicated))
        return place(x, replicated)

    return jax.tree.map(leaf, tree, is_leaf=is_distributed)


def variables_to(sharding: jax.sharding.Sharding, tree: Any) -> Any:
    """Moves the ON_WRITE variables of ``tree`` to ``sharding`` (central storage)."""

    def move(v: Any) -> Any:
        if isinstance(v, Variable) and not v.is_on_read and not is_tracer(v.stored):
            return v.with_stored(jax.device_put(v.stored, sharding))
        return v

    return jax.tree.map(move, tree, is_leaf=is_distributed)


def replica_values(x: DistributedValues, workers: tuple[jax.Device, ...]) -> tuple[Any, ...]:
    """``x.values``, one per local replica: of a `Mirrored` on several devices per replica
    (logical devices), the copies on the replicas' first devices."""
    if isinstance(x, PerReplica) or len(x.values) == len(workers):
        return x.values
    copies = {s.device: s.data for s in getattr(x.array, "addressable_shards", ())}
    return tuple(copies[d] for d in workers) if set(workers) <= set(copies) else x.values
