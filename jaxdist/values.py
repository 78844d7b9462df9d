"""Distributed values: one global array per value, never a list of per-device arrays.

A `PerReplica` holds a global `jax.Array` whose leading axis is the replica
axis (replica ``r`` owns row ``r``); a `Mirrored` holds one array replicated on
every replica's device. Both are pytree nodes with that single array as their
only leaf, so they pass through `jax.jit`, `jax.tree.map` and checkpointing
like any other pytree, in one process or many.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxdist._jax_compat import is_tracer

__all__ = ["DistributedValues", "Mirrored", "PerReplica", "ValueContext"]


class DistributedValues:
    """Base class of values that live on every replica of a strategy.

    Attributes:
        array: the global array (a `jax.Array`, or a tracer inside a trace).
    """

    __slots__ = ("array",)
    array: Any

    def __init__(self, array: Any) -> None:
        object.__setattr__(self, "array", array)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"{type(self).__name__} is immutable")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> Any:
        return self.array.dtype

    @property
    def values(self) -> tuple[Any, ...]:
        """This process's per-replica components, in replica order (as in TF)."""
        return self._local_components()

    def _local_components(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.array!r})"


def _addressable_shards(array: Any) -> list[Any] | None:
    if isinstance(array, jax.Array) and not is_tracer(array):
        return list(array.addressable_shards)
    return None


class PerReplica(DistributedValues):
    """A value that differs between replicas: row ``r`` of ``array`` is replica ``r``'s.

    `Strategy.run` unwraps it, so replica ``r`` sees ``array[r]``; `run`
    returns one for every output that varies across replicas.

    ``valid`` (optional, an int array of shape ``(N,)``) marks a padded batch:
    replica ``r``'s first ``valid[r]`` rows are data, the rest padding. The
    distributed datasets attach it to every batch; inside `Strategy.run` it is
    ``ctx.num_valid`` / ``ctx.valid_mask(rows)``, `Strategy.reduce` with
    ``axis=0`` counts only valid rows, and `values` leaves the padding out.

    Example:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> v = jd.PerReplica(jnp.array([1.0, 2.0]))
        >>> [float(x) for x in v.values]
        [1.0, 2.0]
    """

    __slots__ = ("valid",)
    valid: Any

    def __init__(self, array: Any, valid: Any = None) -> None:
        super().__init__(array)
        object.__setattr__(self, "valid", valid)

    def __repr__(self) -> str:
        if self.valid is None:
            return f"PerReplica({self.array!r})"
        return f"PerReplica({self.array!r}, valid={self.valid!r})"

    def _local_components(self) -> tuple[Any, ...]:
        rows = self._local_rows()
        if self.valid is None or is_tracer(self.valid):
            return tuple(row for _, row in rows)
        valid = np.asarray(self.valid)
        return tuple(row[: int(valid[r])] for r, row in rows)

    def _local_rows(self) -> list[tuple[int, Any]]:
        """``(replica, padded row)`` for each replica of this process, in replica order."""
        shards = _addressable_shards(self.array)
        if shards is None or self.array.ndim == 0:
            arr = self.array if is_tracer(self.array) else np.asarray(self.array)
            return [(r, arr[r]) for r in range(arr.shape[0])]
        n = self.array.shape[0]
        spans = [s.index[0].indices(n)[:2] for s in shards]
        if all(stop - start == 1 for start, stop in spans) and len(set(spans)) == len(shards):
            return sorted(
                ((start, s.data[0]) for (start, _), s in zip(spans, shards, strict=True)),
                key=lambda pair: pair[0],
            )
        if self.array.is_fully_addressable:
            return [(r, self.array[r]) for r in range(n)]
        raise ValueError(
            "PerReplica.values: the array is split across processes in a layout that is "
            f"not one row per device (shape {self.shape}, sharding "
            f"{self.array.sharding}); use Strategy.experimental_local_results instead."
        )


class Mirrored(DistributedValues):
    """A value identical on every replica (for example the result of an all-reduce).

    ``array`` is the value itself (no replica axis), replicated on each
    replica's device.
    """

    __slots__ = ()

    def _local_components(self) -> tuple[Any, ...]:
        shards = _addressable_shards(self.array)
        if shards is None:
            return (self.array,)
        return tuple(s.data for s in shards)


jax.tree_util.register_pytree_with_keys(
    PerReplica,
    lambda v: (
        (
            (jax.tree_util.GetAttrKey("array"), v.array),
            (jax.tree_util.GetAttrKey("valid"), v.valid),
        ),
        None,
    ),
    lambda _, children: PerReplica(*children),
    lambda v: ((v.array, v.valid), None),
)
jax.tree_util.register_pytree_with_keys(
    Mirrored,
    lambda v: (((jax.tree_util.GetAttrKey("array"), v.array),), None),
    lambda _, children: Mirrored(*children),
    lambda v: ((v.array,), None),
)


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What `experimental_distribute_values_from_function` tells ``value_fn``."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1
