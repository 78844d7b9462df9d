"""The replica context a replicated function receives as its first argument.

Every collective it offers lowers to a `jax.lax` collective over the strategy's
mesh axis. The scope state and the shims over it (`get_strategy`, ...) live in
`jaxdist._scope`; `get_replica_context` lives here because outside every
strategy it returns the default strategy's (one replica) context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist._jax_compat import all_gather_invariant, is_tracer, varies
from jaxdist._protocols import StrategyLike
from jaxdist._scope import STATE, default_strategy, entered
from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica
from jaxdist.values.reduce_op import ReduceOp
from jaxdist.variables import ShardedVariable, Variable
from jaxdist.variables._replica_updates import mirror_of, register_mirror, replica_update

__all__ = ["ReplicaContext", "get_replica_context"]


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    """The context a replica function receives as its first argument.

    Inside `Strategy.run`, every method lowers to a `jax.lax` collective over
    ``axis_name``. Gradients flow through all of them with the right
    transpose (an all-reduce transposes to a broadcast, a tiled all-gather to
    a reduce-scatter).

    Attributes:
        strategy: the strategy running the function.
        bound_to_axis: False only for the default replica context (outside any
            replica function), whose collectives and updates are plain.
        single_replica: one replica on a mesh of several devices (`TPUStrategy`
            with one replica of several logical devices): every collective is an
            identity and emits none.
        mirrors: what the variables layer records while a replica function is
            traced: ``id(per-replica view) -> (view, invariant value)`` of each
            ``ON_WRITE`` variable input.
        updates: what ``assign`` / ``assign_add`` / ``assign_sub`` (and
            ``strategy.extended.update``) did while the function was traced, in
            order: ``(kind, variable before, variable after)`` per variable (per
            shard of a `ShardedVariable`). A caller that applies updates the
            function does not return (the parameter-server worker) reads it after
            the function returned.
    """

    strategy: StrategyLike
    bound_to_axis: bool = True
    single_replica: bool = False
    mirrors: dict[int, tuple[Any, Any]] = dataclasses.field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
    updates: list[tuple[str, Any, Any]] = dataclasses.field(
        default_factory=list, compare=False, hash=False, repr=False
    )
    # The valid-row counts of the padded batches among the arguments, one entry per
    # batch: (counts, replicated) where counts is every replica's (replicated) or this
    # replica's (not replicated) count.
    _valid: list[tuple[Any, bool]] = dataclasses.field(
        default_factory=list, compare=False, hash=False, repr=False
    )
    # [True] while the replica function is being traced; [False] once run returned.
    _live: list[bool] = dataclasses.field(
        default_factory=lambda: [True], compare=False, hash=False, repr=False
    )

    def add_valid_counts(self, counts: Any, replicated: bool) -> None:
        """Called by the run path for each padded batch among the arguments: its valid-row
        counts, every replica's (``replicated``) or this replica's."""
        self._valid.append((counts, replicated))

    def end_trace(self) -> None:
        """Called by the run path when the replica function returned: the context is no
        longer usable (collectives on it then raise)."""
        self._live[0] = False

    def _used_as_value(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a ReplicaContext was used as a value. jaxdist passes the ReplicaContext as the "
            "first argument of the replica function, so `def step(x, y)` called as "
            "strategy.run(step, args=(x,)) receives (ctx, x). Declare the context first: "
            "`def step(ctx, x, y): ...`."
        )

    __array__ = __jax_array__ = __float__ = __int__ = __getitem__ = _used_as_value
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _used_as_value
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = _used_as_value

    def _check_live(self, method: str, collective: bool = True) -> None:
        if collective and STATE.get().merging:  # TF: "Need to be inside call_for_each_replica()"
            raise RuntimeError(
                f"ReplicaContext.{method}: called inside a merge_fn, which runs in "
                "cross-replica context (as in TF, replica-context methods are refused there). "
                "In merge_fn use the strategy it receives: strategy.reduce, strategy.gather, "
                "strategy.extended.reduce_to / batch_reduce_to; or call it before merge_call."
            )
        if not self._live[0]:
            name = type(self.strategy).__name__
            raise RuntimeError(
                f"ReplicaContext.{method}: this context belongs to a call of {name}.run that "
                "has already returned. A ReplicaContext is only valid inside the replica "
                "function it was passed to, while that function runs; do not keep it (or "
                "closures over it) for later. After run, reduce its outputs with "
                f"{name}.reduce / experimental_local_results."
            )

    @property
    def axis_name(self) -> str | tuple[str, ...]:
        """The mesh axis name (or tuple of names) that collectives reduce over."""
        return self.strategy.axis_name

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> jax.Array:
        """This replica's index in ``[0, num_replicas_in_sync)`` (a traced int32)."""
        self._check_live("replica_id_in_sync_group", collective=False)
        if not self.bound_to_axis:
            return jnp.int32(0)
        return lax.axis_index(self.axis_name)

    @property
    def num_valid(self) -> jax.Array | None:
        """Rows of this replica's batch that are data, not padding (traced int32).

        Set when an argument is a batch from a distributed dataset (a `PerReplica`
        with ``valid`` counts; the first such batch if there are several);
        ``None`` otherwise. Only the last, partial batch of a dataset has padding.
        """
        self._check_live("num_valid", collective=False)
        if not self._valid:
            return None
        counts, replicated = self._valid[0]
        return counts[lax.axis_index(self.axis_name)] if replicated else counts[0]

    @property
    def global_num_valid(self) -> jax.Array | None:
        """Data rows of the whole global batch, over all replicas (traced int32).

        ``None`` when no argument carries valid counts. Batches from
        `experimental_distribute_dataset` carry every replica's count, so this
        costs no communication; otherwise it is one small all-reduce.
        """
        self._check_live("global_num_valid", collective=False)
        if not self._valid:
            return None
        counts, replicated = self._valid[0]
        if replicated:
            return jnp.sum(counts)
        if self.single_replica:
            return counts[0]
        return lax.psum(counts[0], self.axis_name)

    def valid_mask(self, rows: int) -> jax.Array:
        """A boolean mask of shape ``(rows,)``: True for data rows of this replica's batch.

        All True when no argument carries valid counts. Use it to weight
        per-example losses and metrics so padded rows count for nothing.
        """
        idx = jnp.arange(rows)
        valid = self.num_valid
        return idx < valid if valid is not None else idx >= 0

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self.strategy.extended.worker_devices

    # Collectives -----------------------------------------------------------------

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Reduces every leaf of ``value`` across replicas; the result is the same on each.

        The collectives used are those of the strategy's `CrossDeviceOps`;
        ``options`` (a `jaxdist.experimental.CommunicationOptions`) override its
        defaults for this call (``bytes_per_pack`` packs small leaves together).

        Example:
            >>> import jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> float(s.run(lambda ctx: ctx.all_reduce("sum", 2.0)))  # one replica: plain
            2.0
        """
        op = ReduceOp.from_any(reduce_op, where="ReplicaContext.all_reduce")
        self._check_live("all_reduce")
        if not self.bound_to_axis or self.single_replica:
            return value
        axis: Any = self.axis_name  # a mesh axis name or a tuple of them
        return self.strategy.cross_device_ops.all_reduce(op, value, axis, options)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates every replica's ``value`` along ``axis`` (tiled), on every replica."""
        self._check_live("all_gather")
        if not self.bound_to_axis or self.single_replica:
            return value
        return jax.tree.map(
            lambda x: lax.all_gather(x, self.axis_name, axis=axis, tiled=True), value
        )

    def reduce_scatter(self, reduce_op: ReduceOp | str, value: Any, axis: int = 0) -> Any:
        """Reduces across replicas, leaving replica ``r`` the ``r``-th slice along ``axis``.

        The size of ``axis`` must divide by the replica count. ``SUM`` and
        ``MEAN`` only (XLA's reduce-scatter adds).
        """
        op = ReduceOp.from_any(reduce_op, where="ReplicaContext.reduce_scatter")
        if op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise ValueError(
                f"ReplicaContext.reduce_scatter: reduce op {op.name} is not supported; XLA's "
                "reduce-scatter sums. Use SUM or MEAN, or all_reduce then slice for MAX/MIN."
            )
        self._check_live("reduce_scatter")
        n = self.num_replicas_in_sync

        def one(x: Any) -> Any:
            x = jnp.asarray(x)
            if x.ndim == 0 or x.shape[axis] % n:
                raise ValueError(
                    f"ReplicaContext.reduce_scatter: value of shape {x.shape} cannot be split "
                    f"into {n} equal slices along axis {axis}; pad that axis to a multiple "
                    f"of {n}."
                )
            if not self.bound_to_axis or self.single_replica:
                return x
            out = lax.psum_scatter(x, self.axis_name, scatter_dimension=axis, tiled=True)
            return out / n if op is ReduceOp.MEAN else out

        return jax.tree.map(one, value)

    def broadcast(self, value: Any, source_replica: int = 0) -> Any:
        """Every replica receives replica ``source_replica``'s ``value`` (a mirrored result)."""
        self._check_live("broadcast")
        n = self.num_replicas_in_sync
        if not 0 <= source_replica < n:
            raise ValueError(
                f"ReplicaContext.broadcast: source_replica={source_replica} is outside "
                f"[0, {n}) for {n} replicas."
            )
        if not self.bound_to_axis or self.single_replica:
            return value
        mine = lax.axis_index(self.axis_name) == source_replica

        def one(x: Any) -> Any:
            x = jnp.asarray(x)
            kept = jnp.where(mine, x, jnp.zeros_like(x))
            if x.dtype == jnp.bool_:
                return lax.psum(kept.astype(jnp.int32), self.axis_name).astype(jnp.bool_)
            return lax.psum(kept, self.axis_name)

        return jax.tree.map(one, value)

    def all_to_all(self, value: Any, split_axis: int, concat_axis: int) -> Any:
        """Splits ``split_axis`` into N chunks, sends chunk ``r`` to replica ``r``,
        and concatenates the received chunks along ``concat_axis``."""
        self._check_live("all_to_all")
        if not self.bound_to_axis or self.single_replica:
            return value
        return jax.tree.map(
            lambda x: lax.all_to_all(x, self.axis_name, split_axis, concat_axis, tiled=True),
            value,
        )

    def ppermute(self, value: Any, perm: list[tuple[int, int]]) -> Any:
        """Sends replica ``src``'s value to replica ``dst`` for each ``(src, dst)`` in ``perm``;
        replicas that receive nothing get zeros (`jax.lax.ppermute`)."""
        self._check_live("ppermute")
        pairs = self._check_permutation(perm)
        if not self.bound_to_axis:
            return value
        if self.single_replica:  # one replica: (0, 0) keeps the value, no pair gives zeros
            return value if pairs else jax.tree.map(jnp.zeros_like, value)
        return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, pairs), value)

    def _check_permutation(self, perm: Any) -> list[tuple[int, int]]:
        n = self.num_replicas_in_sync
        where = "ReplicaContext.ppermute"
        try:
            pairs = [(int(src), int(dst)) for src, dst in perm]
        except (TypeError, ValueError):
            raise TypeError(
                f"{where}: perm must be a list of (source, destination) replica pairs such as "
                f"[(0, 1), (1, 2)], got {perm!r}."
            ) from None
        bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
        if bad:
            raise ValueError(
                f"{where}: pairs {bad} name replicas outside [0, {n}) for {n} replicas of "
                f"{type(self.strategy).__name__}; every source and destination must be a "
                "replica id."
            )
        for k, label in ((0, "source"), (1, "destination")):
            seen = [p[k] for p in pairs]
            dup = sorted({r for r in seen if seen.count(r) > 1})
            if dup:
                raise ValueError(
                    f"{where}: replica(s) {dup} appear more than once as a {label} in {pairs}; "
                    "a permutation sends from and to each replica at most once."
                )
        return pairs

    # Variable updates --------------------------------------------------------------

    def assign(self, variable: Any, value: Any) -> Any:
        """Returns ``variable`` set to ``value``.

        ``ON_WRITE``: the per-replica values are aggregated as the variable's
        aggregation says (``MEAN`` averages, ``SUM`` adds, ``ONLY_FIRST_REPLICA``
        takes replica 0's, ``NONE`` requires a value identical on every replica),
        so the variable stays mirrored. ``ON_READ``: this replica's copy only.
        A `jaxdist.experimental.ShardedVariable` is updated shard by shard (each
        shard takes its rows of ``value``, aggregated as that shard says).
        """
        return self._update(variable, "assign", value)

    def assign_add(self, variable: Any, delta: Any) -> Any:
        """Returns ``variable + delta``, with ``delta`` aggregated as in `assign`."""
        return self._update(variable, "assign_add", delta)

    def assign_sub(self, variable: Any, delta: Any) -> Any:
        """Returns ``variable - delta``, with ``delta`` aggregated as in `assign`."""
        return self._update(variable, "assign_sub", delta)

    def _update(self, variable: Any, kind: str, value: Any) -> Any:
        if isinstance(variable, ShardedVariable):
            return variable.updated_by(kind, value, lambda v, k, x: self._update(v, k, x))
        new = replica_update(self, variable, kind, value)
        if self.bound_to_axis:
            self.updates.append((kind, variable, new))
        return new

    # merge_call ------------------------------------------------------------------

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Arguments that differ between replicas reach ``merge_fn`` as `PerReplica`
        values (gathered from every replica), the others as `Mirrored`.
        Whatever ``merge_fn`` returns reaches every replica; a `PerReplica` it
        returns gives each replica its own row.
        """
        if not callable(merge_fn):
            raise TypeError(
                f"ReplicaContext.merge_call: merge_fn must be callable, got "
                f"{type(merge_fn).__name__}."
            )
        self._check_live("merge_call")
        kwargs = {} if kwargs is None else kwargs
        state = STATE.get()
        # merge_fn runs in the cross-replica context of this context's strategy (for the
        # default strategy too, as in TF).
        merged = dataclasses.replace(state, strategy=self.strategy, merging=True)
        if not self.bound_to_axis:
            with entered(merged):
                return merge_fn(self.strategy, *args, **kwargs)
        g_args, g_kwargs = jax.tree.map(
            self._gather_for_merge, (tuple(args), kwargs), is_leaf=_is_variable
        )
        with entered(merged):
            result = merge_fn(self.strategy, *g_args, **g_kwargs)
        return jax.tree.map(
            self._scatter_from_merge,
            result,
            is_leaf=lambda x: isinstance(x, DistributedValues) or _is_variable(x),
        )

    def _gather_for_merge(self, x: Any) -> Any:
        if _is_variable(x):
            return self._variable_for_merge(x)
        if not (is_tracer(x) or isinstance(x, jax.Array)):
            return x
        if varies(x, self.axis_name):
            return PerReplica(self._stack(x))
        return Mirrored(x)

    def _stack(self, x: Any) -> Any:
        """Every replica's ``x`` stacked on a new leading axis (invariant)."""
        if self.single_replica:
            return x[None]
        return all_gather_invariant(x, self.axis_name)

    def _variable_for_merge(self, var: Any) -> Any:
        """A variable as ``merge_fn`` sees it: the cross-replica variable (TF's
        ``MirroredVariable``), mirrored value or every replica's copy."""
        meta = var.meta
        if not meta.local:
            return var
        if var.is_on_read:
            stored = self._stack(var.stored)
        else:
            stored = mirror_of(self, var, "ReplicaContext.merge_call")
        return var.from_stored(stored, dataclasses.replace(meta, local=False))

    def _scatter_from_merge(self, x: Any) -> Any:
        if _is_variable(x):
            return self._variable_from_merge(x)
        if isinstance(x, PerReplica):
            return lax.dynamic_index_in_dim(
                x.array, lax.axis_index(self.axis_name), axis=0, keepdims=False
            )
        if isinstance(x, Mirrored):
            return x.array
        return x

    def _variable_from_merge(self, var: Any) -> Any:
        """A variable ``merge_fn`` returned, as each replica sees it again."""
        meta = var.meta
        if meta.local:
            return var
        if var.is_on_read:
            stored = lax.dynamic_index_in_dim(
                var.stored, lax.axis_index(self.axis_name), axis=0, keepdims=False
            )
        else:
            stored = register_mirror(self, var.stored)
        return var.from_stored(stored, dataclasses.replace(meta, local=True))


def _is_variable(x: Any) -> bool:
    return isinstance(x, Variable)


def get_replica_context() -> ReplicaContext | None:
    """The replica context while a replica function is traced; ``None`` in cross-replica
    context; outside any strategy, the default strategy's (one replica) context."""
    state = STATE.get()
    if state.replica is not None and not state.merging:
        return state.replica  # type: ignore[return-value]  # always a ReplicaContext
    if state.strategy is None:
        return ReplicaContext(default_strategy(), bound_to_axis=False)
    return None
