"""Cross-replica reductions and gathers on global arrays.

Each function takes one leaf (a `PerReplica`, a `Mirrored` or a plain
value) and returns plain arrays; `reduce_distributed` reduces many
distributed leaves as one cached `jax.jit` program over the sharded global
arrays, so XLA moves the data in one go. In a ``merge_fn`` they run on the
gathered tracers with no extra collective.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist._jax_compat import is_tracer
from jaxdist.values.distributed import Mirrored, PerReplica
from jaxdist.values.reduce_op import ReduceOp, ordered_extremum


def _check_axis(where: str, axis: int | None, rank: int, shape: tuple[int, ...]) -> int | None:
    if axis is None:
        return None
    if not isinstance(axis, int) or not -rank <= axis < rank:
        raise ValueError(
            f"{where}: axis={axis!r} is out of range for per-replica values of shape {shape} "
            f"(rank {rank}); use an axis in [{-rank}, {rank}) or axis=None to reduce across "
            "replicas only."
        )
    return axis % rank


def _reduce(x: jax.Array, op: ReduceOp, axes: tuple[int, ...]) -> jax.Array:
    if op is ReduceOp.SUM:
        return jnp.sum(x, axis=axes)
    if op is ReduceOp.MAX:  # NaN wins, as in NumPy, also across devices
        return ordered_extremum(op, x, lambda k: jnp.max(k, axis=axes))
    if op is ReduceOp.MIN:
        return ordered_extremum(op, x, lambda k: jnp.min(k, axis=axes))
    return jnp.mean(x, axis=axes)


def _identity_of(op: ReduceOp, dtype: Any) -> Any:
    """The value that never wins a MAX (MIN): -inf (+inf) for floats, the extreme integer."""
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if op is ReduceOp.MAX else jnp.inf
    if jnp.issubdtype(dtype, jnp.bool_):
        return op is ReduceOp.MIN
    info = jnp.iinfo(dtype)
    return info.min if op is ReduceOp.MAX else info.max


@functools.partial(jax.jit, static_argnames=("op", "axes", "times"))
def _reduce_jit(x: jax.Array, op: ReduceOp, axes: tuple[int, ...], times: int) -> jax.Array:
    out = _reduce(x, op, axes)
    return out * times if times != 1 else out


@functools.partial(jax.jit, static_argnames=("op", "axes"))
def _masked_reduce_jit(
    x: jax.Array, valid: jax.Array, op: ReduceOp, axes: tuple[int, ...]
) -> jax.Array:
    """Reduces ``x`` (replicas, rows, ...) over ``axes`` (the replica axis 0, and maybe one
    more), counting only each replica's first ``valid`` rows: padding never wins a MAX/MIN
    and never counts in a MEAN. A position that is padding on every replica comes back as
    NumPy's reduction of nothing: 0 for SUM, NaN for MEAN, the identity for MAX/MIN."""
    mask = jnp.arange(x.shape[1])[None, :] < valid[:, None]
    mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (x.ndim - 2)), x.shape)
    if op in (ReduceOp.MAX, ReduceOp.MIN):  # padding rows never win
        return _reduce(
            jnp.where(mask, x, jnp.asarray(_identity_of(op, x.dtype), x.dtype)), op, axes
        )
    total = jnp.sum(jnp.where(mask, x, 0), axis=axes)
    if op is ReduceOp.SUM:
        return total
    return total / jnp.sum(mask, axis=axes)


def reduce_leaf(where: str, op: ReduceOp, leaf: Any, axis: int | None, num_replicas: int) -> Any:
    """Reduces one leaf across replicas (and along ``axis`` of each replica's value)."""
    if isinstance(leaf, PerReplica):
        x = leaf.array
        ax = _check_axis(where, axis, x.ndim - 1, tuple(x.shape[1:]))
        axes: tuple[int, ...] = (0,) if ax is None else (0, ax + 1)
        if leaf.valid is not None:  # a padded batch: its padding rows take no part
            return _masked_reduce_jit(x, leaf.valid, op, axes)
        return _reduce_jit(x, op, axes, 1)
    mirrored = isinstance(leaf, Mirrored)
    x = leaf.array if mirrored else leaf
    if not mirrored and op is ReduceOp.SUM and num_replicas > 1:
        if not isinstance(x, jax.Array) and not np.any(np.asarray(x)):
            return jnp.zeros_like(jnp.asarray(x)) if axis is None else jnp.sum(x, axis=axis)
        raise ValueError(
            f"{where}: cannot SUM-reduce a non-distributed value of type {type(x).__name__} "
            f"across {num_replicas} replicas: it is not known to be on every replica. Return "
            "it from strategy.run (a PerReplica or Mirrored value) or use MEAN."
        )
    x = jnp.asarray(x)
    ax = _check_axis(where, axis, x.ndim, tuple(x.shape))
    axes = () if ax is None else (ax,)
    times = num_replicas if (mirrored and op is ReduceOp.SUM) else 1
    return _reduce_jit(x, op, axes, times)


@functools.partial(jax.jit, static_argnames=("where", "op", "axis", "num_replicas"))
def reduce_distributed(
    leaves: list[Any], where: str, op: ReduceOp, axis: int | None, num_replicas: int
) -> list[Any]:
    """`reduce_leaf` of many `PerReplica`/`Mirrored` leaves as a single program."""
    return [reduce_leaf(where, op, x, axis, num_replicas) for x in leaves]


@functools.partial(jax.jit, static_argnames=("axis",))
def _gather_jit(x: jax.Array, axis: int) -> jax.Array:
    moved = jnp.moveaxis(x, 0, axis)
    shape = moved.shape
    return moved.reshape((*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2 :]))


def _replicated(x: Any) -> Any:
    """``x`` readable by every process: an array split across processes is all-gathered
    (a multi-process strategy's gather); anything else is returned as is."""
    if not isinstance(x, jax.Array) or is_tracer(x):  # inside a merge_fn: nothing to move
        return x
    if x.is_fully_addressable or x.is_fully_replicated:
        return x
    mesh = getattr(x.sharding, "mesh", None)
    if mesh is None:  # pragma: no cover - strategies always use named shardings
        return x
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda a: a, out_shardings=sharding)(x)


def gather_leaf(where: str, leaf: Any, axis: int, num_replicas: int) -> Any:
    """Concatenates every replica's value of one leaf along ``axis``."""
    if isinstance(leaf, PerReplica):
        x = leaf.array
        rank = x.ndim - 1
        if rank == 0:
            raise ValueError(
                f"{where}: per-replica values are scalars (shape {tuple(x.shape)}), which have "
                "no axis to concatenate along; use strategy.experimental_local_results or "
                "reduce instead."
            )
        ax = _check_axis(where, axis, rank, tuple(x.shape[1:]))
        assert ax is not None
        out = _replicated(_gather_jit(x, ax))
        if ax == 0 and leaf.valid is not None and not is_tracer(out):  # leave padding out
            valid = np.asarray(_replicated(leaf.valid))
            b = x.shape[1]
            rows = np.concatenate([np.arange(r * b, r * b + int(k)) for r, k in enumerate(valid)])
            return jnp.asarray(np.asarray(out)[rows])
        return out
    x = jnp.asarray(leaf.array if isinstance(leaf, Mirrored) else leaf)
    if x.ndim == 0:
        raise ValueError(f"{where}: cannot gather a scalar along axis {axis}.")
    ax = _check_axis(where, axis, x.ndim, tuple(x.shape))
    return jnp.concatenate([x] * num_replicas, axis=ax)
