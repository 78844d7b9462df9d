"""`ReduceOp` and the reductions every layer shares (the reduce-op layer: it imports nothing
of jaxdist but the JAX compatibility module).

`ReduceOp` names what a cross-replica reduction computes; `jaxdist.collectives.cross_device_ops`'s
`CrossDeviceOps` name how it is carried out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "ReduceOp",
    "check_bound",
    "nan_propagating_extremum",
    "ordered_extremum",
    "replica_axes",
]


class ReduceOp(enum.Enum):
    """How values from several replicas combine into one.

    ``SUM`` and ``MEAN`` are tf.distribute's; ``MAX`` and ``MIN`` are the other
    reductions XLA offers (NaN on any replica gives NaN, as ``np.max``).
    Anywhere an op is taken, a string such as ``"mean"`` (any case) is
    accepted too.

    Example:
        >>> import jaxdist as jd
        >>> jd.ReduceOp.from_any("Mean") is jd.ReduceOp.MEAN
        True
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MAX = "MAX"
    MIN = "MIN"

    @classmethod
    def from_any(cls, op: ReduceOp | str, *, where: str = "jaxdist") -> ReduceOp:
        """Returns ``op`` as a `ReduceOp`; raises ``ValueError`` for anything else."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls[op.strip().upper()]
            except KeyError:
                pass
        raise ValueError(
            f"{where}: unknown reduce op {op!r}. Use one of jaxdist.ReduceOp.SUM, MEAN, "
            "MAX, MIN or their names as strings (case-insensitive), e.g. 'sum'."
        )


def replica_axes(axis_name: Any, *, where: str) -> tuple[str, ...]:
    """``axis_name`` (a mesh axis name or a tuple of them) as a tuple of names (private)."""
    if isinstance(axis_name, str) and axis_name:
        return (axis_name,)
    if (
        isinstance(axis_name, (tuple, list))
        and axis_name
        and all(isinstance(a, str) and a for a in axis_name)
        and len(set(axis_name)) == len(axis_name)
    ):
        return tuple(axis_name)
    raise TypeError(
        f"{where}: axis_name must be a mesh axis name or a non-empty tuple of distinct names, "
        f"outermost first (e.g. 'replica' or ('host', 'local')), got {axis_name!r}. Pass the "
        "strategy's axis: strategy.axis_name."
    )


def check_bound(axes: tuple[str, ...], where: str) -> None:
    for a in axes:
        try:
            lax.axis_size(a)
        except NameError:
            raise NameError(
                f"{where}: mesh axis {a!r} (of axis_name {axes if len(axes) > 1 else a!r}) is "
                "not bound here. Call all_reduce inside strategy.run (ctx.all_reduce) or inside "
                "jax.shard_map over a mesh with that axis; in cross-replica context use "
                "reduce / batch_reduce."
            ) from None


# MAX/MIN that propagate NaN ---------------------------------------------------------

_INT_OF_WIDTH = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _order_key(bits: jax.Array, top: int) -> jax.Array:
    """Float bits (as signed ints) -> ints in the same order as the floats; an involution."""
    return jnp.where(bits < 0, bits ^ top, bits)


def ordered_extremum(
    op: ReduceOp, x: jax.Array, reduce_keys: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """The MAX or MIN of ``x`` computed by ``reduce_keys``, with NaN winning (private).

    ``reduce_keys`` is the integer reduction to apply (``lax.pmax`` over mesh
    axes, or ``jnp.max`` along array axes of a sharded global array). XLA's CPU
    all-reduce drops NaN from float max/min (checked with jax 0.10.2: a NaN on
    one of 8 replicas came back as the max of the others), and so does the
    all-reduce XLA's partitioner emits for ``jnp.max`` across devices. So
    floats are reduced as integers of the same width whose order is the float
    order (negative floats have their magnitude bits flipped), with NaN mapped
    to the largest integer for MAX (smallest for MIN): the same bytes cross the
    wire as for the float reduction, and mapping back is a few elementwise ops.
    A second reduction of an ``isnan`` flag would double the collectives.
    Non-float dtypes are reduced as they are.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return reduce_keys(x)
    itype = _INT_OF_WIDTH[x.dtype.itemsize]
    info = jnp.iinfo(itype)
    key = _order_key(lax.bitcast_convert_type(x, itype), int(info.max))
    nan_key = int(info.max) if op is ReduceOp.MAX else int(info.min)
    key = jnp.where(jnp.isnan(x), jnp.asarray(nan_key, itype), key)
    out = lax.bitcast_convert_type(_order_key(reduce_keys(key), int(info.max)), x.dtype)
    return jnp.where(jnp.isnan(out), jnp.asarray(jnp.nan, x.dtype), out)


def nan_propagating_extremum(op: ReduceOp, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``lax.pmax``/``pmin`` over mesh ``axes`` that return NaN where any replica has NaN."""
    combine = lax.pmax if op is ReduceOp.MAX else lax.pmin
    return ordered_extremum(op, x, lambda k: combine(k, axes))
