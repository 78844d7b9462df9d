"""The variable updates a scheduled closure makes: TF's rule that ``ctx.assign*`` on a
parameter-server variable inside a scheduled function changes the variable on its parameter
server, whether or not the function returns it.

A worker compiles ``strategy.function(fn)`` as `RecordingUpdates(fn)`: it calls ``fn`` and,
from the replica context's record of ``ctx.assign`` / ``assign_add`` / ``assign_sub``
(``ReplicaContext.updates``; ``v.assign*`` on a variable inside the function goes through the
same context), returns what each variable's updates amount to, by variable name (per shard
of a sharded variable), as `ClosureUpdates`:

- ``adds``: the total change of a variable only added to or subtracted from. The parameter
  server adds it atomically when the closure ends, so closures running at once on several
  workers all count (asynchronous SGD).
- ``sets``: the final value of a variable that was assigned (then possibly added to). The
  parameter server takes it as it is (the last closure to finish wins, as in TF).

Updates of one closure combine in program order: ``assign_sub(w, a)`` then
``assign_sub(w, b)`` subtract ``a + b`` whether or not the second call was given the first
call's result. Across the replicas of one closure, an ``ON_WRITE`` update is already
aggregated by ``ctx.assign*`` (``SUM`` adds, ``MEAN`` averages, ``ONLY_FIRST_REPLICA``
keeps replica 0's); an ``ON_READ`` variable's per-replica changes are combined here the same
way (``NONE``: replica 0's), so an ``ON_READ`` ``SUM`` counter on the parameter server reads
as the total over every replica of every closure. A change is computed as ``after - before``
of the variable's value in the closure, so a float update is exact up to one rounding of the
variable's value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxdist.variables.meta import VariableAggregation

__all__ = ["ClosureUpdates", "RecordingUpdates", "closure_updates"]

Agg = VariableAggregation


class ClosureUpdates(NamedTuple):
    """What a closure's updates amount to, by variable (shard) name."""

    sets: dict[str, Any]
    adds: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RecordingUpdates:
    """``fn(ctx, *args, **kwargs)`` returning ``(its result, ClosureUpdates)``."""

    fn: Callable[..., Any]

    def __call__(self, ctx: Any, *args: Any, **kwargs: Any) -> tuple[Any, ClosureUpdates]:
        out = self.fn(ctx, *args, **kwargs)
        return out, closure_updates(ctx, ctx.updates)


def closure_updates(ctx: Any, log: list[tuple[str, Any, Any]]) -> ClosureUpdates:
    """Combines the ``(kind, before, after)`` records of ``log`` per variable name."""
    sets: dict[str, Any] = {}
    adds: dict[str, Any] = {}
    variables: dict[str, Any] = {}
    for kind, before, after in log:
        name = before.name
        if name is None:  # not a parameter-server variable's local copy
            continue
        variables[name] = before
        new = after.read_value()
        if kind == "assign" or new.dtype == jnp.bool_:
            sets[name] = new
            adds.pop(name, None)
            continue
        change = new - before.read_value()
        if name in sets:
            sets[name] = sets[name] + change
        else:
            adds[name] = adds[name] + change if name in adds else change
    return ClosureUpdates(
        {k: _across_replicas(ctx, variables[k], v, adding=False) for k, v in sets.items()},
        {k: _across_replicas(ctx, variables[k], v, adding=True) for k, v in adds.items()},
    )


def _across_replicas(ctx: Any, var: Any, value: Any, adding: bool) -> Any:
    """An ``ON_READ`` variable's per-replica change (or value) combined over the replicas
    of the closure as its aggregation says; an ``ON_WRITE`` one is already combined."""
    if not var.is_on_read:
        return value
    agg = var.aggregation
    if agg is Agg.SUM:
        return ctx.all_reduce("sum", value)
    if agg is Agg.MEAN and jnp.issubdtype(value.dtype, jnp.inexact):
        return ctx.all_reduce("mean", value)
    if agg is Agg.MEAN and adding:
        # An integer mean: the total over the replicas divided by their count, rounded down.
        return ctx.all_reduce("sum", value) // ctx.num_replicas_in_sync
    return ctx.broadcast(value, source_replica=0)  # ONLY_FIRST_REPLICA, NONE
