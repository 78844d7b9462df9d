"""Distributed values: one global array per value, never a list of per-device arrays.

A `PerReplica` holds a global `jax.Array` whose leading axis is the replica
axis (replica ``r`` owns row ``r``); a `Mirrored` holds one array replicated on
every replica's device. Both are pytree nodes with that single array as their
only leaf, so they pass through `jax.jit`, `jax.tree.map` and checkpointing
like any other pytree, in one process or many.

A `Mirrored` value is the same everywhere, so it converts like an array
(``float``, ``np.asarray``, ``jnp`` functions). A `PerReplica` value has no
single value: converting it raises a `TypeError` that names
`Strategy.reduce` and `Strategy.experimental_local_results`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._dtypes import numeric
from jaxdist._jax_compat import is_tracer
from jaxdist._scope import get_strategy
from jaxdist.devices import LOGICAL_AXIS_NAME
from jaxdist.values.array_like import ReadsLikeAnArray

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

    def _fields(self) -> tuple[Any, ...]:
        return (self.array,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.array!r})"

    # Copies and pickling: host arrays, placed again where they are used ---------------

    def __copy__(self) -> DistributedValues:
        return _make(type(self), self._fields())

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedValues:
        return _make(type(self), tuple(copy.deepcopy(f, memo) for f in self._fields()))

    def __reduce__(self) -> tuple[Any, ...]:
        host: list[Any] = []
        for f in self._fields():
            if f is None:
                host.append(None)
                continue
            if is_tracer(f):
                raise TypeError(
                    f"pickle: cannot pickle a {type(self).__name__} holding a traced value; "
                    "pickle outputs after the computation returns."
                )
            if isinstance(f, jax.Array) and not f.is_fully_addressable:
                raise TypeError(
                    f"pickle: this {type(self).__name__} spans devices of several processes "
                    "and no process holds all of it. Save distributed state with "
                    "jd.checkpoint.save (orbax, every process writes its part) or "
                    "jd.checkpoint.to_saveable instead."
                )
            host.append(np.asarray(f))
        return (_unpickle, (type(self), tuple(host)))


def _make(cls: type, fields: tuple[Any, ...]) -> Any:
    """Builds a value from its fields without the public constructor's conversions."""
    v: Any = object.__new__(cls)
    for name, f in zip(_FIELD_NAMES[cls], fields, strict=True):
        object.__setattr__(v, name, f)
    return v


def _unpickle(cls: type, fields: tuple[Any, ...]) -> Any:
    """Restores a pickled value; placed on the current strategy's devices when it fits."""
    strategy = get_strategy()
    array = fields[0]
    if cls is PerReplica and np.ndim(array) and array.shape[0] == strategy.num_replicas_in_sync:
        array = jax.device_put(array, strategy.per_replica_sharding)
    elif cls is Mirrored:
        array = jax.device_put(array, strategy.replicated_sharding)
    return _make(cls, (array, *fields[1:]))


def _addressable_shards(array: Any) -> list[Any] | None:
    if isinstance(array, jax.Array) and not is_tracer(array):
        return list(array.addressable_shards)
    return None


def _first_logical_devices(array: jax.Array) -> set[Any] | None:
    """The logical devices 0 of the replicas, when ``array`` lies on a mesh with a
    `LOGICAL_AXIS_NAME` axis (a `TPUStrategy`'s): each replica's component is there."""
    sharding = array.sharding
    mesh = getattr(sharding, "mesh", None)
    names = getattr(mesh, "axis_names", ())
    if mesh is None or LOGICAL_AXIS_NAME not in names:
        return None
    devices = np.moveaxis(np.asarray(mesh.devices), names.index(LOGICAL_AXIS_NAME), -1)
    return set(devices[..., 0].ravel().tolist())


def _no_single_value(kind: str) -> TypeError:
    return TypeError(
        f"a PerReplica value holds one value per replica, so it has no single {kind}. Combine "
        "the replicas with strategy.reduce('sum' | 'mean', value, axis=None), or look at "
        "each one with strategy.experimental_local_results(value)."
    )


def _stack(values: Sequence[Any]) -> Any:
    """TF's ``PerReplica((v0, v1, ...))``: one global array, placed by the current strategy."""
    if not values:
        raise ValueError("PerReplica: got an empty list of per-replica values.")
    leaves = [np.asarray(v) if not isinstance(v, jax.Array) else v for v in values]
    if any(isinstance(v, (dict, list, tuple)) for v in values):
        raise TypeError(
            "PerReplica: a list of per-replica values must hold arrays, not pytrees. For "
            "per-replica pytrees use strategy.experimental_distribute_values_from_function("
            "lambda ctx: tree_for(ctx.replica_id_in_sync_group))."
        )
    shapes = {tuple(np.shape(v)) for v in leaves}
    dtypes = {np.dtype(v.dtype) for v in leaves}
    odd = sorted(str(d) for d in dtypes if not numeric(d))
    if odd:
        raise TypeError(
            f"PerReplica: the per-replica values have dtype {odd[0]}; a list of per-replica "
            "values is stacked into one device array, which holds numbers or bools only. "
            "Encode the values as numbers first."
        )
    if len(shapes) > 1 or len(dtypes) > 1:
        raise ValueError(
            f"PerReplica: the {len(values)} per-replica values must share shape and dtype to "
            f"form one global array; got shapes {sorted(shapes)} and dtypes "
            f"{sorted(map(str, dtypes))}. Pad them to a common shape."
        )
    stacked = jax.numpy.stack([jax.numpy.asarray(v) for v in leaves])
    strategy = get_strategy()
    if strategy.num_replicas_in_sync == len(values):
        stacked = jax.device_put(stacked, strategy.per_replica_sharding)
    return stacked


class PerReplica(DistributedValues):
    """A value that differs between replicas: row ``r`` of ``array`` is replica ``r``'s.

    `Strategy.run` unwraps it, so replica ``r`` sees ``array[r]``; `run`
    returns one for every output that varies across replicas. As in TF, it can
    also be built from a list or tuple of per-replica values, which are stacked
    into one global array (placed on the devices of the strategy in effect when
    the count matches its replicas).

    ``valid`` (optional, an int array of shape ``(N,)``) marks a padded batch:
    replica ``r``'s first ``valid[r]`` rows are data, the rest padding. The
    distributed datasets attach it to every batch, and `run` to every
    per-replica output computed from such a batch; inside `Strategy.run` it is
    ``ctx.num_valid`` / ``ctx.valid_mask(rows)``; `Strategy.reduce` with
    ``axis=0``, `Strategy.gather` along axis 0 and `values` leave the padding out.

    Example:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> v = jd.PerReplica(jnp.array([1.0, 2.0]))
        >>> [float(x) for x in v.values]
        [1.0, 2.0]
        >>> [float(x) for x in jd.PerReplica([3.0, 4.0]).values]
        [3.0, 4.0]
    """

    __slots__ = ("valid",)
    valid: Any

    def __init__(self, array: Any, valid: Any = None) -> None:
        if isinstance(array, (list, tuple)):
            array = _stack(array)
        super().__init__(array)
        object.__setattr__(self, "valid", valid)

    def _fields(self) -> tuple[Any, ...]:
        return (self.array, self.valid)

    def __repr__(self) -> str:
        if self.valid is None:
            return f"PerReplica({self.array!r})"
        return f"PerReplica({self.array!r}, valid={self.valid!r})"

    def __float__(self) -> float:
        raise _no_single_value("float value")

    def __int__(self) -> int:
        raise _no_single_value("int value")

    def __index__(self) -> int:
        raise _no_single_value("index")

    def __bool__(self) -> bool:
        raise _no_single_value("truth value")

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        raise _no_single_value("array value (np.asarray)")

    def __jax_array__(self) -> Any:
        raise _no_single_value("array value (jnp.asarray)")

    def _local_components(self) -> tuple[Any, ...]:
        rows = self._local_rows()
        if self.valid is None or is_tracer(self.valid):
            return tuple(row for _, row in rows)
        valid = _counts_by_replica(self.valid)
        return tuple(row[: valid[r]] for r, row in rows)

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


def _counts_by_replica(valid: Any) -> dict[int, int]:
    """The valid-row counts this process can read, by replica.

    In a job of several processes a batch's counts may be split by replica like
    the batch itself; each process then reads its own replicas' counts only.
    """
    if isinstance(valid, jax.Array) and not (
        valid.is_fully_addressable or valid.is_fully_replicated
    ):
        n = valid.shape[0]
        counts: dict[int, int] = {}
        for shard in valid.addressable_shards:
            start, stop, _ = shard.index[0].indices(n)
            counts.update(zip(range(start, stop), np.asarray(shard.data).tolist(), strict=True))
        return counts
    return dict(enumerate(np.asarray(valid).tolist()))


class Mirrored(DistributedValues, ReadsLikeAnArray):
    """A value identical on every replica (for example the result of an all-reduce).

    ``array`` is the value itself (no replica axis), replicated on each
    replica's device. It converts like that array, and Python's operators,
    comparisons and indexing apply to it (TF's ``Mirrored`` is used directly in
    cross-replica context the same way).

    Example:
        >>> import jax.numpy as jnp, numpy as np, jaxdist as jd
        >>> m = jd.Mirrored(jnp.float32(3.0))
        >>> float(m), np.asarray(m).tolist(), float(jnp.add(m, 1)), float(2 * m + 1)
        (3.0, 3.0, 4.0, 7.0)
    """

    __slots__ = ()

    def _local_components(self) -> tuple[Any, ...]:
        shards = _addressable_shards(self.array)
        if shards is None:
            return (self.array,)
        firsts = _first_logical_devices(self.array)
        if firsts is not None:  # one component per replica, not per logical device
            shards = [s for s in shards if s.device in firsts]
        return tuple(s.data for s in shards)

    def _array_value(self) -> Any:  # what operators and conversions read
        return self.array


_FIELD_NAMES: dict[type, tuple[str, ...]] = {
    PerReplica: ("array", "valid"),
    Mirrored: ("array",),
}

_new = object.__new__
_set = object.__setattr__


# Unflattening runs on every output of every program call: build the value directly.
def unflatten_per_replica(_: None, children: Any) -> PerReplica:
    array, valid = children
    v = _new(PerReplica)
    _set(v, "array", array)
    _set(v, "valid", valid)
    return v


def _unflatten_mirrored(_: None, children: Any) -> Mirrored:
    (array,) = children
    v = _new(Mirrored)
    _set(v, "array", array)
    return v


jax.tree_util.register_pytree_with_keys(
    PerReplica,
    lambda v: (
        (
            (jax.tree_util.GetAttrKey("array"), v.array),
            (jax.tree_util.GetAttrKey("valid"), v.valid),
        ),
        None,
    ),
    unflatten_per_replica,
    lambda v: ((v.array, v.valid), None),
)
jax.tree_util.register_pytree_with_keys(
    Mirrored,
    lambda v: (((jax.tree_util.GetAttrKey("array"), v.array),), None),
    _unflatten_mirrored,
    lambda v: ((v.array,), None),
)


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What `experimental_distribute_values_from_function` tells ``value_fn``."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1
