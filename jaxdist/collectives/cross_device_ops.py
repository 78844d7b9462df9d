"""Reduction operators and the cross-device ops that carry them out.

`ReduceOp` names what a cross-replica reduction computes; a `CrossDeviceOps`
names *how*. Inside a replica function, `CrossDeviceOps.all_reduce` chooses the
XLA collectives an all-reduce lowers to; in cross-replica context, ``reduce``,
``batch_reduce`` and ``broadcast`` (tf.distribute's methods) work on the
global arrays of `PerReplica` and `Mirrored` values and place the results on
the requested destination devices. Every implementation gives the same numbers;
they differ in the communication pattern:

- `NcclAllReduce`: one all-reduce over every replica axis.
- `HierarchicalCopyAllReduce`: reduce-scatter then all-gather. Over a tuple of
  mesh axes such as ``("host", "local")`` it is two-level: reduce-scatter
  inside each process, all-reduce of the scattered shards across processes,
  all-gather inside each process, so only ``1/L`` of the data (``L`` local
  devices) crosses the network.
- `ReductionToOneDevice`: every value gathered, then accumulated (in
  cross-replica context, on one device, as in TF).

A replica axis (``axis_name``) is one mesh axis name or a tuple of them,
outermost first; replica ``r`` is the row-major index over those axes.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist import _cpu_gate
from jaxdist._jax_compat import all_gather_invariant, is_tracer
from jaxdist._placement.results import (
    broadcast_to,
    check_pairs,
    destination_sharding,
    device_count,
    first_device,
    gate_for,
    place,
    replica_count,
)
from jaxdist.collectives.communication import (
    CommunicationImplementation,
    CommunicationOptions,
    group_by_size,
    resolve_options,
)
from jaxdist.devices import resolve_device
from jaxdist.values.cross_replica import reduce_distributed, reduce_leaf
from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica
from jaxdist.values.reduce_op import (
    ReduceOp,
    check_bound,
    nan_propagating_extremum,
    replica_axes,
)
from jaxdist.variables import as_distributed, is_distributed

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReduceOp",
    "ReductionToOneDevice",
]


# Cross-device ops -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CrossDeviceOps(abc.ABC):
    """Base class: how cross-replica reductions are carried out.

    Subclasses choose the collectives of an all-reduce (`_all_reduce_leaf`);
    ``reduce``, ``batch_reduce`` and ``broadcast`` are tf.distribute's
    cross-replica methods. ``options`` (keyword-only) are the defaults of
    every call (`jaxdist.experimental.CommunicationOptions`); per-call options
    override them field by field.
    """

    options: CommunicationOptions | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.options is not None and not isinstance(self.options, CommunicationOptions):
            raise TypeError(
                f"{type(self).__name__}(options=...): expected a jaxdist.experimental."
                f"CommunicationOptions or None, got {type(self.options).__name__}."
            )

    def merged_options(self, options: Any, where: str) -> CommunicationOptions:
        """A call's ``options`` (checked; ``where`` names the caller in errors) over these
        ops' own defaults."""
        base = self.options if self.options is not None else CommunicationOptions()
        return base.merge(resolve_options(options, where))

    def _num_packs(self) -> int:
        return 0

    # Replica context --------------------------------------------------------------

    def all_reduce(
        self,
        reduce_op: ReduceOp | str,
        value: Any,
        axis_name: str | tuple[str, ...],
        options: CommunicationOptions | None = None,
    ) -> Any:
        """All-reduces every leaf of the pytree ``value`` over ``axis_name``.

        Called inside a replica function (``ctx.all_reduce`` calls it) or any
        `jax.shard_map` body with those mesh axes.

        Args:
            reduce_op: a `ReduceOp` or its name.
            value: a pytree of arrays (traced, per replica).
            axis_name: a mesh axis name or a tuple of them, outermost first.
            options: per-call `CommunicationOptions`; ``bytes_per_pack > 0``
                packs same-dtype leaves into buffers of at least that many bytes
                and reduces one buffer per collective (SUM and MEAN).

        Returns:
            ``value``'s structure with every leaf reduced (invariant across the axes).
        """
        where = f"{type(self).__name__}.all_reduce"
        op = ReduceOp.from_any(reduce_op, where=where)
        axes = replica_axes(axis_name, where=where)
        opts = self.merged_options(options, where)
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(value)
        if not with_paths:
            return value
        check_bound(axes, where)
        leaves = [jnp.asarray(x) for _, x in with_paths]
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            for (path, _), x in zip(with_paths, leaves, strict=True):
                if jnp.issubdtype(x.dtype, jnp.complexfloating):
                    raise TypeError(
                        f"{where}: {op.name} of leaf {jax.tree_util.keystr(path) or '<root>'} "
                        f"(shape {x.shape}, dtype {x.dtype}) is undefined: complex numbers "
                        "have no order. Reduce jnp.abs(x) or the real part, or use SUM/MEAN."
                    )
        packs = opts.bytes_per_pack or self._num_packs()
        if op in (ReduceOp.SUM, ReduceOp.MEAN) and packs and len(leaves) > 1:
            reduced = self._packed(op, leaves, axes, opts.bytes_per_pack)
        else:
            reduced = [self._reduce(op, x, axes) for x in leaves]
        return jax.tree.unflatten(treedef, reduced)

    def _reduce(self, op: ReduceOp, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            return self._extremum(op, x, axes)
        total = self._all_reduce_leaf(x, axes)
        return total / lax.axis_size(axes) if op is ReduceOp.MEAN else total

    def _extremum(self, op: ReduceOp, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        return nan_propagating_extremum(op, x, axes)

    def _packed(
        self, op: ReduceOp, leaves: list[jax.Array], axes: tuple[str, ...], bytes_per_pack: int
    ) -> list[jax.Array]:
        """Sums same-dtype leaves as a few concatenated buffers, then splits them.

        With ``bytes_per_pack``: consecutive leaves of one dtype fill buffers of at
        least that many bytes (`jaxdist.collectives.communication.group_by_size`); else
        ``num_packs`` buffers per dtype, leaves dealt round-robin.
        """
        out: list[Any] = [None] * len(leaves)
        by_dtype: dict[Any, list[int]] = {}
        for i, x in enumerate(leaves):
            by_dtype.setdefault(x.dtype, []).append(i)
        for idxs in by_dtype.values():
            if bytes_per_pack:
                sizes = [leaves[i].size * leaves[i].dtype.itemsize for i in idxs]
                packs = [[idxs[j] for j in p] for p in group_by_size(sizes, bytes_per_pack)]
            else:
                k = min(self._num_packs(), len(idxs))
                packs = [idxs[j::k] for j in range(k)]
            for pack in packs:
                if len(pack) == 1:
                    out[pack[0]] = self._reduce(op, leaves[pack[0]], axes)
                    continue
                flat = jnp.concatenate([leaves[i].reshape(-1) for i in pack])
                total = self._reduce(op, flat, axes)
                offset = 0
                for i in pack:
                    size = leaves[i].size
                    out[i] = total[offset : offset + size].reshape(leaves[i].shape)
                    offset += size
        return out

    @abc.abstractmethod
    def _all_reduce_leaf(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """The sum of ``x`` over the replica axes, invariant across them."""

    # Cross-replica context ----------------------------------------------------------

    def reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_value: Any,
        destinations: Any,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Reduces a distributed value across replicas and places it on ``destinations``.

        Args:
            reduce_op: a `ReduceOp` or its name.
            per_replica_value: a `PerReplica` (one row per replica), a `Mirrored`
                or variable (its copies), or a pytree of them. A plain array is
                one replica's value, reduced to itself (as in TF).
            destinations: a device (``jax.Device``, ``"/cpu:0"``, an index), a
                list of devices, or a distributed value, variable or array whose
                devices receive the result.
            options: `CommunicationOptions` (checked; the reduction is one XLA
                program whose collectives XLA batches).

        Returns:
            A `Mirrored` over the destination devices, or a plain array when
            there is one destination device.

        Example:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> s = jd.MirroredStrategy(jax.devices()[:2])
            >>> x = s.run(lambda ctx: 1.0 + ctx.replica_id_in_sync_group)
            >>> out = jd.NcclAllReduce().reduce("sum", x, destinations=x)
            >>> type(out).__name__, float(out)
            ('Mirrored', 3.0)
        """
        where = f"{type(self).__name__}.reduce"
        op = ReduceOp.from_any(reduce_op, where=where)
        self.merged_options(options, where)
        return self.reduce_pairs(where, op, [(per_replica_value, destinations)])[0]

    def batch_reduce(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """`reduce` of many ``(value, destinations)`` pairs in one go.

        Returns:
            One result per pair, in order.
        """
        where = f"{type(self).__name__}.batch_reduce"
        op = ReduceOp.from_any(reduce_op, where=where)
        self.merged_options(options, where)
        return self.reduce_pairs(where, op, check_pairs(value_destination_pairs, where))

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` (a pytree of arrays or `Mirrored` values) to ``destinations``.

        Returns:
            A `Mirrored` over the destination devices, or a plain array on one.
        """
        where = f"{type(self).__name__}.broadcast"
        return broadcast_to(where, tensor, destination_sharding(destinations, where=where))

    def reduce_pairs(
        self,
        where: str,
        op: ReduceOp,
        pairs: Sequence[tuple[Any, Any]],
        *,
        num_replicas: int | None = None,
        default: Any = None,
    ) -> list[Any]:
        """Reduces every leaf of every pair's value, then places it on its destinations
        (what ``reduce``, ``batch_reduce`` and `StrategyExtended.batch_reduce_to` run).

        ``num_replicas`` is the strategy's replica count (``None``: called on the
        ops directly, where a plain value is one replica's and a `Mirrored` has
        one copy per device); ``default`` the strategy's replicated sharding.
        """
        leaves: list[Any] = []
        targets: list[Any] = []
        structure = []
        for value, destinations in pairs:
            flat, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
            target = destination_sharding(destinations, where=where, default=default)
            leaves.extend(as_distributed(x) for x in flat)
            targets.extend([target] * len(flat))
            structure.append((treedef, len(flat)))

        def compute() -> list[Any]:
            reduced = self._reduce_leaves(where, op, leaves, targets, num_replicas)
            return [place(x, t) for x, t in zip(reduced, targets, strict=True)]

        done = iter(_cpu_gate.gated(compute) if gate_for(leaves) else compute())
        return [jax.tree.unflatten(td, [next(done) for _ in range(k)]) for td, k in structure]

    def _reduce_leaves(
        self,
        where: str,
        op: ReduceOp,
        leaves: list[Any],
        targets: list[Any],
        num_replicas: int | None,
    ) -> list[Any]:
        """Every distributed leaf reduced in one XLA program over the sharded global arrays
        (XLA's partitioner emits the collectives)."""
        n = num_replicas if num_replicas is not None else replica_count(where, leaves)
        spread = [x for x in leaves if isinstance(x, DistributedValues)]
        done = iter(reduce_distributed(spread, where, op, None, n) if spread else [])
        out = []
        for x in leaves:
            if isinstance(x, DistributedValues):
                out.append(next(done))
            elif num_replicas is None:
                out.append(jnp.asarray(x))  # one replica's value: its own reduction
            else:
                out.append(reduce_leaf(where, op, x, None, num_replicas))
        return out


@dataclasses.dataclass(frozen=True)
class _PackingOps(CrossDeviceOps):
    """Shared by the all-reduce implementations that take TF's ``num_packs``."""

    num_packs: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.num_packs, bool)
            or not isinstance(self.num_packs, int)
            or self.num_packs < 0
        ):
            raise ValueError(
                f"{type(self).__name__}(num_packs={self.num_packs!r}): num_packs must be a "
                "non-negative int (0 disables packing, 1 packs all leaves into one buffer)."
            )

    def _num_packs(self) -> int:
        return self.num_packs


@dataclasses.dataclass(frozen=True)
class NcclAllReduce(_PackingOps):
    """One XLA all-reduce per buffer over every replica axis (NCCL on GPUs, the ICI
    all-reduce on TPUs, gloo on CPUs).

    The default of `MirroredStrategy`. ``num_packs > 0`` concatenates same-dtype
    leaves into that many buffers (TF's packing). The default is 0: XLA's
    all-reduce combiner already merges the per-leaf all-reduces into one, and
    packing by hand only adds copies (it cost a third of the MLP step's
    throughput on CPU; see benchmarks/README.md).
    """

    def _all_reduce_leaf(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        return lax.psum(x, axes)


@dataclasses.dataclass(frozen=True)
class HierarchicalCopyAllReduce(_PackingOps):
    """A reduce-scatter followed by an all-gather (the two halves of a ring all-reduce).

    Over one axis, each replica reduces one slice and the slices are shared.
    Over a tuple of axes, outermost first (e.g. ``("host", "local")``), it is
    hierarchical: reduce-scatter over the innermost axis (inside a process),
    all-reduce of each shard over the outer axes (across processes, ``1/L`` of
    the data), then all-gather over the innermost axis. Leaves whose size does
    not divide by the innermost axis size are padded for the exchange. MAX and
    MIN, which XLA cannot reduce-scatter, are one all-reduce over every axis.

    Axes of size 1 take no part: on one host (``("host", "local")`` with one
    ``host``) it is a reduce-scatter and an all-gather over ``local``, with no
    all-reduce between them, whose every group would be one device (no sum, yet
    XLA's CPU backend runs it as a collective); with one device per host it is
    the ring over ``host``.
    """

    def _all_reduce_leaf(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        *outer, inner = [a for a in axes if lax.axis_size(a) > 1] or [axes[-1]]
        n = lax.axis_size(inner)
        flat = x.reshape(-1)
        pad = (-flat.size) % n
        if pad:
            flat = jnp.pad(flat, (0, pad))
        part = lax.psum_scatter(flat, inner, scatter_dimension=0, tiled=True)
        if outer:
            part = lax.psum(part, tuple(outer))
        # Gathered over the axes of size 1 too: the same groups as over ``inner`` alone,
        # and the result is typed invariant over every replica axis.
        gather = tuple(a for a in axes if a == inner or lax.axis_size(a) == 1)
        whole = all_gather_invariant(part, gather).reshape(-1)
        return whole[: x.size].reshape(x.shape)


def _add_n(rows: list[Any]) -> Any:
    """The default accumulation: ``rows[0] + rows[1] + ...`` (keeps the dtype, as TF's add_n)."""
    return functools.reduce(operator.add, rows)


@dataclasses.dataclass(frozen=True)
class ReductionToOneDevice(CrossDeviceOps):
    """Gathers every replica's value, then accumulates the stack (tf.distribute's fallback).

    In cross-replica context (``reduce``, ``extended.reduce_to``) the values are
    copied to one device, ``reduce_to_device`` (default: the first destination
    device), accumulated there with ``accumulation_fn`` and the result copied
    to the destinations, as in TF. Inside a replica function every replica
    gathers the values and accumulates them itself. Simple and correct
    everywhere, but it moves N times the data an all-reduce moves, and it cannot
    gather values that span several processes.

    Args:
        reduce_to_device: where to reduce (a `jax.Device`, ``"/cpu:0"``, an
            index); ``None``: the first destination device.
        accumulation_fn: ``fn(list_of_arrays) -> array`` used for SUM and MEAN;
            ``None``: add them in order (TF's ``add_n``). MAX/MIN take the
            element-wise extremum.

    Example:
        >>> import jax, jaxdist as jd
        >>> ops = jd.ReductionToOneDevice(reduce_to_device="/cpu:1")
        >>> ops.reduce_to_device == jax.devices()[1]
        True
    """

    reduce_to_device: Any = None
    accumulation_fn: Callable[[list[Any]], Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.reduce_to_device is not None:
            device = resolve_device(self.reduce_to_device, where=f"{name}(reduce_to_device=...)")
            object.__setattr__(self, "reduce_to_device", device)
        if self.accumulation_fn is not None and not callable(self.accumulation_fn):
            raise TypeError(
                f"{name}(accumulation_fn=...): expected a function of a list of arrays (e.g. "
                f"lambda xs: functools.reduce(jnp.add, xs)) or None, got "
                f"{type(self.accumulation_fn).__name__}."
            )

    def _accumulate(self, rows: list[Any]) -> Any:
        fn = self.accumulation_fn if self.accumulation_fn is not None else _add_n
        return fn(rows)

    def _all_reduce_leaf(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        stacked = all_gather_invariant(x, axes)
        return self._accumulate([stacked[i] for i in range(stacked.shape[0])])

    def _extremum(self, op: ReduceOp, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        stacked = all_gather_invariant(x, axes)
        return jnp.max(stacked, axis=0) if op is ReduceOp.MAX else jnp.min(stacked, axis=0)

    def _reduce_leaves(
        self,
        where: str,
        op: ReduceOp,
        leaves: list[Any],
        targets: list[Any],
        num_replicas: int | None,
    ) -> list[Any]:
        return [
            self._reduce_on_device(where, op, x, self._device_for(t), num_replicas)
            for x, t in zip(leaves, targets, strict=True)
        ]

    def _device_for(self, target: Any) -> jax.Device | None:
        if self.reduce_to_device is not None:
            return self.reduce_to_device
        return None if target is None else first_device(target)

    def _reduce_on_device(
        self, where: str, op: ReduceOp, x: Any, device: jax.Device | None, num_replicas: int | None
    ) -> Any:
        """Gathers ``x``'s per-replica values onto ``device`` and reduces them there."""

        def to_device(a: Any) -> Any:
            return a if device is None or is_tracer(a) else jax.device_put(a, device)

        if isinstance(x, PerReplica):
            arr = x.array
            if isinstance(arr, jax.Array) and not is_tracer(arr) and not arr.is_fully_addressable:
                raise ValueError(
                    f"{where}: ReductionToOneDevice gathers every replica's value onto one "
                    f"device, but this PerReplica (shape {x.shape}) spans devices of several "
                    "processes, and no device can receive them all. Use NcclAllReduce or "
                    "HierarchicalCopyAllReduce for multi-process strategies."
                )
            stacked = to_device(jnp.asarray(arr) if not isinstance(arr, jax.Array) else arr)
            rows = [stacked[i] for i in range(stacked.shape[0])]
        elif isinstance(x, Mirrored):
            copies = num_replicas if num_replicas is not None else device_count(x.array)
            rows = [to_device(x.array)] * copies
        else:
            if num_replicas is not None and num_replicas > 1 and op is ReduceOp.SUM:
                return to_device(reduce_leaf(where, op, x, None, num_replicas))
            return to_device(jnp.asarray(x))  # the same on every replica: its own reduction
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            stacked = jnp.stack(rows)
            return jnp.max(stacked, axis=0) if op is ReduceOp.MAX else jnp.min(stacked, axis=0)
        total = self._accumulate(rows)
        return total / len(rows) if op is ReduceOp.MEAN else total


def cross_device_ops_for(
    options: CommunicationOptions | None, axis_name: str | Sequence[str]
) -> CrossDeviceOps:
    """The `CrossDeviceOps` a multi-worker strategy uses for ``options``.

    ``AUTO`` and ``NCCL`` give `NcclAllReduce` (one all-reduce over every
    replica axis); ``RING`` gives `HierarchicalCopyAllReduce` (reduce-scatter,
    then all-gather; over a tuple of axes such as ``("host", "local")`` it
    reduces within each process first). The options travel with the ops, so
    their ``bytes_per_pack`` applies to every all-reduce. What this chooses is
    the collective structure; XLA picks the wire algorithm.

    Args:
        options: the strategy's `CommunicationOptions` (``None``: defaults).
        axis_name: the replica axis the ops will reduce over (a mesh axis name,
            or a tuple of them, outermost first); checked here.

    Returns:
        A `CrossDeviceOps` carrying ``options``.

    Example:
        >>> import jaxdist as jd
        >>> from jaxdist.collectives.cross_device_ops import cross_device_ops_for
        >>> opts = jd.experimental.CommunicationOptions(implementation="ring")
        >>> type(cross_device_ops_for(opts, ("host", "local"))).__name__
        'HierarchicalCopyAllReduce'
    """
    where = "cross_device_ops_for"
    replica_axes(axis_name, where=where)
    opts = resolve_options(options, where)
    if opts is None:
        opts = CommunicationOptions()
    if opts.implementation is CommunicationImplementation.RING:
        return HierarchicalCopyAllReduce(options=opts)
    return NcclAllReduce(options=opts)
