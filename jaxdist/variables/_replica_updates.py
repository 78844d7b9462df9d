"""Variable updates inside a replica function: aggregation of ON_WRITE updates.

An ``ON_WRITE`` variable enters the replica function as a per-replica value (so
gradients with respect to it are per-replica) while its replica-invariant
value is kept in the context's ``mirrors`` table. An update aggregates the
per-replica values or deltas across replicas and applies them to the
invariant value, so the result is invariant again and `run` returns it as
one mirrored variable.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from jaxdist._jax_compat import varies
from jaxdist._protocols import ReplicaContextLike
from jaxdist.errors import ReplicaDivergenceError
from jaxdist.variables._variable import Variable
from jaxdist.variables.meta import VariableAggregation

Agg = VariableAggregation


def register_mirror(ctx: ReplicaContextLike, invariant: Any) -> Any:
    """Returns the per-replica view of an ON_WRITE input and remembers its invariant value."""
    per_replica = lax.pcast(invariant, ctx.axis_name, to="varying")
    ctx.mirrors[id(per_replica)] = (per_replica, invariant)
    return per_replica


def mirror_of(ctx: ReplicaContextLike, var: Variable, where: str) -> Any:
    """The replica-invariant current value of an ON_WRITE variable."""
    value = var.stored
    if not varies(value, ctx.axis_name):
        return value
    entry = ctx.mirrors.get(id(value))
    if entry is not None and entry[0] is value:
        return entry[1]
    raise varying_variable_error(var.meta, where)


def varying_variable_error(meta: Any, where: str) -> ValueError:
    """The error for a mirrored variable whose value came to differ between replicas."""
    return ValueError(
        f"{where}: mirrored (ON_WRITE) variable {meta.name!r} holds a value that differs "
        "across replicas: it was changed by per-replica arithmetic (for example jax.tree.map "
        "over the variable with this replica's gradient). Update mirrored variables with "
        "ctx.assign / ctx.assign_add / ctx.assign_sub, which aggregate the per-replica "
        "updates, or from values that are the same on every replica (ctx.all_reduce)."
    )


def _aggregate(ctx: ReplicaContextLike, var: Variable, x: Any, where: str) -> Any:
    agg = var.aggregation
    if ctx.single_replica or ctx.num_replicas_in_sync == 1:
        return x  # one replica: nothing can diverge, every aggregation keeps its update
    varying = varies(x, ctx.axis_name)
    if agg is Agg.SUM:
        return lax.psum(x, ctx.axis_name)
    if not varying:
        return x
    if agg is Agg.NONE:
        raise ReplicaDivergenceError(
            f"{where}: variable {var.name!r} is mirrored with aggregation NONE, but the update "
            "differs across replicas (it depends on per-replica data). Create the variable with "
            "aggregation=MEAN/SUM/ONLY_FIRST_REPLICA, or all-reduce the update first "
            "(ctx.all_reduce)."
        )
    if agg is Agg.MEAN:
        if not jnp.issubdtype(var.dtype, jnp.inexact):
            raise ValueError(
                f"{where}: variable {var.name!r} has integer dtype {var.dtype} and aggregation "
                "MEAN, but the update differs across replicas; the mean would not be an "
                "integer. Use SUM or ONLY_FIRST_REPLICA, or a float variable."
            )
        return lax.pmean(x, ctx.axis_name)
    return ctx.broadcast(x, source_replica=0)  # ONLY_FIRST_REPLICA


def replica_update(ctx: ReplicaContextLike, var: Any, kind: str, value: Any) -> Variable:
    """``ctx.assign`` / ``assign_add`` / ``assign_sub`` (``kind``) of ``var`` by ``value``."""
    where = f"ReplicaContext.{kind}"
    if not isinstance(var, Variable):
        raise TypeError(
            f"{where}: expected a jaxdist.Variable, got {type(var).__name__}. Plain arrays are "
            "updated by returning new values from the replica function."
        )
    if not ctx.bound_to_axis:  # the default replica context: plain updates
        return getattr(var, kind)(value)
    value = var.coerce(value, where)
    if var.is_on_read:  # stays on this replica: no communication
        current = var.stored
    else:
        current = mirror_of(ctx, var, where)
        value = _aggregate(ctx, var, value, where)
    if kind == "assign":
        new = value
    elif kind == "assign_add":
        new = current + value
    else:
        new = current - value
    return var.with_stored(new.astype(var.dtype))
