"""Reduction operators and the cross-device ops that carry them out.

`ReduceOp` names what a cross-replica reduction computes; a `CrossDeviceOps`
names *how*: which XLA collectives an all-reduce inside a replica function
lowers to. Every implementation gives the same numbers; they differ in the
communication pattern XLA is asked to run.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist._jax_compat import all_gather_invariant

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReduceOp",
    "ReductionToOneDevice",
]


class ReduceOp(enum.Enum):
    """How values from several replicas combine into one.

    ``SUM`` and ``MEAN`` are tf.distribute's; ``MAX`` and ``MIN`` are the other
    reductions XLA offers. Anywhere an op is taken, a string such as ``"mean"``
    (any case) is accepted too.

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


def _mean_of_sum(total: jax.Array, count: int) -> jax.Array:
    """Divides a sum by ``count`` (true division: integer inputs give floats, as jnp.mean)."""
    return total / count


def _axis_size(axis_name: str) -> int:
    return lax.axis_size(axis_name)


@dataclasses.dataclass(frozen=True)
class CrossDeviceOps:
    """Base class: how an all-reduce across replicas is lowered.

    Subclasses override `_all_reduce_leaf`. ``num_packs > 0`` concatenates
    same-dtype leaves into that many buffers before reducing, as tf.distribute
    does. The default is 0 (no packing): XLA's all-reduce combiner already
    fuses the per-leaf all-reduces, and packing by hand only adds copies (it
    cost a third of the MLP step's throughput on CPU; see benchmarks/README.md).
    All of this runs inside the replica function, on traced values.
    """

    num_packs: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_packs, int) or self.num_packs < 0:
            raise ValueError(
                f"{type(self).__name__}(num_packs={self.num_packs!r}): num_packs must be a "
                "non-negative int (0 disables packing, 1 packs all leaves into one buffer)."
            )

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, axis_name: str) -> Any:
        """All-reduces every leaf of the pytree ``value`` over ``axis_name``."""
        op = ReduceOp.from_any(reduce_op, where=f"{type(self).__name__}.all_reduce")
        leaves, treedef = jax.tree.flatten(value)
        if not leaves:
            return value
        leaves = [jnp.asarray(x) for x in leaves]
        if op in (ReduceOp.SUM, ReduceOp.MEAN) and self.num_packs > 0 and len(leaves) > 1:
            reduced = self._packed(op, leaves, axis_name)
        else:
            reduced = [self._reduce(op, x, axis_name) for x in leaves]
        return jax.tree.unflatten(treedef, reduced)

    def _reduce(self, op: ReduceOp, x: jax.Array, axis_name: str) -> jax.Array:
        if op is ReduceOp.MAX:
            return lax.pmax(x, axis_name)
        if op is ReduceOp.MIN:
            return lax.pmin(x, axis_name)
        total = self._all_reduce_leaf(x, axis_name)
        return _mean_of_sum(total, _axis_size(axis_name)) if op is ReduceOp.MEAN else total

    def _packed(self, op: ReduceOp, leaves: list[jax.Array], axis_name: str) -> list[jax.Array]:
        """Sums same-dtype leaves as a few concatenated buffers, then splits them."""
        out: list[jax.Array | None] = [None] * len(leaves)
        by_dtype: dict[Any, list[int]] = {}
        for i, x in enumerate(leaves):
            by_dtype.setdefault(x.dtype, []).append(i)
        for idxs in by_dtype.values():
            packs = [idxs[k :: self.num_packs] for k in range(min(self.num_packs, len(idxs)))]
            for pack in packs:
                flat = jnp.concatenate([leaves[i].reshape(-1) for i in pack])
                total = self._all_reduce_leaf(flat, axis_name)
                if op is ReduceOp.MEAN:
                    total = _mean_of_sum(total, _axis_size(axis_name))
                offset = 0
                for i in pack:
                    size = leaves[i].size
                    out[i] = total[offset : offset + size].reshape(leaves[i].shape)
                    offset += size
        return [x for x in out if x is not None]

    def _all_reduce_leaf(self, x: jax.Array, axis_name: str) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} must implement _all_reduce_leaf")


@dataclasses.dataclass(frozen=True)
class NcclAllReduce(CrossDeviceOps):
    """One XLA all-reduce per buffer (NCCL on GPUs, the ICI all-reduce on TPUs).

    The default for `MirroredStrategy`.
    """

    def _all_reduce_leaf(self, x: jax.Array, axis_name: str) -> jax.Array:
        return lax.psum(x, axis_name)


@dataclasses.dataclass(frozen=True)
class HierarchicalCopyAllReduce(CrossDeviceOps):
    """A reduce-scatter followed by an all-gather (the two halves of a ring all-reduce).

    Each replica reduces one slice, then the slices are shared. Leaves whose
    size does not divide by the replica count are padded for the exchange.
    """

    def _all_reduce_leaf(self, x: jax.Array, axis_name: str) -> jax.Array:
        n = _axis_size(axis_name)
        flat = x.reshape(-1)
        pad = (-flat.size) % n
        if pad:
            flat = jnp.pad(flat, (0, pad))
        part = lax.psum_scatter(flat, axis_name, scatter_dimension=0, tiled=True)
        whole = all_gather_invariant(part, axis_name).reshape(-1)
        return whole[: x.size].reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class ReductionToOneDevice(CrossDeviceOps):
    """Gathers every replica's value, then reduces the stack locally.

    tf.distribute's fallback: simple and correct everywhere, but it moves N
    times the data an all-reduce moves.
    """

    def _all_reduce_leaf(self, x: jax.Array, axis_name: str) -> jax.Array:
        return jnp.sum(all_gather_invariant(x, axis_name), axis=0)
