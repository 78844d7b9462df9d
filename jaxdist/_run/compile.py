"""The run path: a replica function traced once into `jax.shard_map`.

`replicated(fn, strategy, args, kwargs)` is traced under `jax.jit` (see
`jaxdist._run.programs` for the cache of jitted programs). It flattens the
arguments (distributed values and variables at the leaves), maps `PerReplica`
leaves over the replica axis and broadcasts the rest, and traces ``fn`` once
inside `jax.shard_map`.

The replica function is first traced to a jaxpr, which `jaxdist._run.invariance`
reads to learn which outputs are the same on every replica; the jaxpr is then
evaluated inside the ``shard_map`` body. An output that is the same on every
replica leaves the body with a replicated spec (one copy, no collective) and
comes back `Mirrored` (a plain array with one replica, or when the caller asks
for plain arrays); any other comes back `PerReplica`, carrying the valid-row
counts of the padded batch it was computed from, if any.

Training state stored sharded (`jaxdist.experimental.FSDPStrategy`,
`MeshStrategy`) enters as `Sharded` leaves, all-gathered over the replica axes
on entry, and leaves as `Synced` leaves with a `Stored` layout: each device's
block, computed as a block where the jaxpr allows (`jaxdist._run.sliced_eval`);
the layout's other (automatic) mesh axes are sharding constraints
(`jaxdist._run.stored`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist._jax_compat import axis_names, varies, varying_axes
from jaxdist._protocols import StrategyLike
from jaxdist._run.invariance import analyze, assume_invariant
from jaxdist._run.sliced_eval import eval_sliced
from jaxdist._run.stored import Stored, constrain, gather, local_block, to_varying
from jaxdist._scope import replica_scope
from jaxdist.context import ReplicaContext
from jaxdist.values.distributed import DistributedValues, Mirrored, PerReplica
from jaxdist.variables import Variable, is_distributed
from jaxdist.variables._replica_updates import register_mirror, varying_variable_error


class _Static:
    """A non-array output leaf carried through jit as pytree metadata.

    Unflattening yields the bare value, so callers never see this wrapper.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: value)


class Synced:
    """An output leaf that must come back as one replicated copy (private).

    Used for state updated in place by `jaxdist.train_step` (NNX variables). A
    value that differs between replicas is averaged across them when it is a
    float (like tf.distribute's ``ON_READ`` ``MEAN`` statistics); otherwise it
    is an error naming ``what``. With a ``layout`` (sharded state, `Sharded`), each
    device keeps only its block of that one copy.
    """

    __slots__ = ("layout", "value", "what")

    def __init__(self, value: Any, what: str, layout: Stored | None = None) -> None:
        self.value = value
        self.what = what
        self.layout = layout


class Sharded:
    """An input leaf stored sharded on the mesh as ``layout`` says (private).

    Made by `jaxdist.train_step` inside its jitted program for state stored
    sharded (`FSDPStrategy`, `MeshStrategy`); the replica function sees the whole
    array over the replica axes, all-gathered on entry, and constrained to the
    layout's other axes.
    """

    __slots__ = ("layout", "value")

    def __init__(self, value: Any, layout: Stored) -> None:
        self.value = value
        self.layout = layout


def dim_spec(axis: str | tuple[str, ...], dim: int | None, ndim: int) -> P:
    """The spec of an array of rank ``ndim`` split over ``axis`` along ``dim`` (``None``:
    replicated)."""
    if dim is None:
        return P()
    return P(*([None] * dim), axis)


def path_str(path: Sequence[Any]) -> str:
    """``args[0]['x']`` / ``kwargs['lr']`` for a key path into ``(args, kwargs)``."""
    if not path:
        return "args"
    head, rest = path[0], path[1:]
    root = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
    return root + jax.tree_util.keystr(tuple(rest))


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)

# How an input leaf enters the replica function.
_PER_REPLICA, _BROADCAST, _ON_READ, _ON_WRITE, _SHARDED = range(5)


def describe_bad_leaf(strategy: StrategyLike, args: Any, kwargs: Any) -> TypeError | None:
    """Every argument leaf that is not an array of numbers, in one readable TypeError."""
    flat = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_distributed)[0]
    found = []
    for path, leaf in flat:
        bad = not isinstance(leaf, (*_ARRAY_TYPES, DistributedValues, Variable))
        if not bad and isinstance(leaf, (np.ndarray, np.generic)):
            bad = leaf.dtype.kind in "USOV"  # strings, objects, raw bytes
        if bad:
            what = (
                f"an array of dtype {leaf.dtype}"
                if isinstance(leaf, (np.ndarray, np.generic))
                else f"a {type(leaf).__name__} ({leaf!r:.60})"
            )
            found.append(f"{path_str(path)} is {what}")
    if not found:
        return None
    return TypeError(
        f"{type(strategy).__name__}.run: {'; '.join(found)}, not "
        f"{'an array' if len(found) == 1 else 'arrays'} of numbers. Arguments of run must be "
        "pytrees of numeric arrays or Python numbers. Close over other objects (or bind them "
        "with functools.partial outside the training loop, so the function keeps its "
        "identity)."
    )


def _replica_axis_error(strategy: StrategyLike, path: Any, what: str, shape: Any) -> ValueError:
    n = strategy.num_replicas_in_sync
    return ValueError(
        f"{type(strategy).__name__}.run: {path_str(path)} is {what} of shape {tuple(shape)}, "
        f"but its leading (replica) axis must have size {n}, one row per replica of mesh "
        f"{dict(strategy.mesh.shape)}. Build it with "
        "strategy.experimental_distribute_values_from_function, from this strategy's run "
        "outputs, or (for variables) inside this strategy's scope."
    )


def _foreign_variable_error(strategy: StrategyLike, path: Any, var: Variable) -> ValueError:
    return ValueError(
        f"{type(strategy).__name__}.run: {path_str(path)} is variable {var.name!r}, created in "
        f"the scope of {var.strategy!r}, but it is being run by {strategy!r}. A variable is "
        "placed by the strategy whose scope created it; create it inside this strategy's "
        "scope(), or move its value over with jd.checkpoint.to_saveable / from_saveable."
    )


@dataclasses.dataclass
class _Inputs:
    flat: list[Any]
    specs: list[P]
    kinds: list[tuple[int, Any]]
    treedef: Any
    valid: list[Any]  # the distinct valid-count arrays of padded batches
    valid_replicated: list[bool]
    valid_rows: list[int]  # per-replica rows of the batch each belongs to
    batch_leaves: list[tuple[int, int]]  # (input position, valid group) of padded leaves


def _flatten_inputs(
    strategy: StrategyLike, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _Inputs:
    n = strategy.num_replicas_in_sync
    axis = strategy.axis_name
    with_path, treedef = jax.tree_util.tree_flatten_with_path(
        (args, kwargs), is_leaf=is_distributed
    )
    flat: list[Any] = []
    specs: list[P] = []
    kinds: list[tuple[int, Any]] = []
    valid: dict[int, tuple[Any, int]] = {}
    batch_leaves: list[tuple[int, int]] = []
    for path, leaf in with_path:
        if isinstance(leaf, Variable):
            meta = leaf.meta
            if meta.created_in_scope and meta.strategy != strategy:
                raise _foreign_variable_error(strategy, path, leaf)
            arr = leaf.stored
            if leaf.is_on_read:
                if arr.ndim == 0 or arr.shape[0] != n:
                    raise _replica_axis_error(strategy, path, "an ON_READ Variable", arr.shape)
                flat.append(arr)
                specs.append(P(axis))
                kinds.append((_ON_READ, meta))
            else:
                flat.append(arr)
                specs.append(P())
                kinds.append((_ON_WRITE, meta))
        elif isinstance(leaf, PerReplica):
            arr = leaf.array
            if arr.ndim == 0 or arr.shape[0] != n:
                raise _replica_axis_error(strategy, path, "a PerReplica", arr.shape)
            flat.append(arr)
            specs.append(P(axis))
            kinds.append((_PER_REPLICA, None))
            if leaf.valid is not None:
                if id(leaf.valid) not in valid:
                    valid[id(leaf.valid)] = (leaf.valid, arr.shape[1] if arr.ndim > 1 else -1)
                group = list(valid).index(id(leaf.valid))
                batch_leaves.append((len(flat) - 1, group))
        elif isinstance(leaf, Sharded):
            flat.append(leaf.value)
            specs.append(leaf.layout.manual)
            kinds.append((_SHARDED, leaf.layout))
        else:
            flat.append(leaf.array if isinstance(leaf, Mirrored) else leaf)
            specs.append(P())
            kinds.append((_BROADCAST, None))
    # The valid-row counts of padded batches ride along as extra inputs, one per batch:
    # replicated (every replica sees all counts) unless they arrive split by replica.
    groups = list(valid.values())
    replicated = [_is_replicated(v) for v, _ in groups]
    flat.extend(v for v, _ in groups)
    specs.extend(P() if rep else P(axis) for rep in replicated)
    return _Inputs(
        flat,
        specs,
        kinds,
        treedef,
        [v for v, _ in groups],
        replicated,
        [b for _, b in groups],
        batch_leaves,
    )


def _is_replicated(x: Any) -> bool:
    sharding = getattr(x, "sharding", None)
    if sharding is None:  # a tracer or a host array: jit places it as asked
        return True
    return bool(sharding.is_fully_replicated)


def _enter(ctx: ReplicaContext, kind: int, meta: Any, x: Any) -> Any:
    axis = ctx.axis_name
    if kind == _PER_REPLICA:
        return x[0]
    if kind == _ON_READ:
        return Variable.from_stored(x[0], dataclasses.replace(meta, local=True))
    if kind == _ON_WRITE:
        return Variable.from_stored(register_mirror(ctx, x), dataclasses.replace(meta, local=True))
    if kind == _SHARDED:  # the whole array, varying-typed like a broadcast input
        return constrain(to_varying(gather(x, meta), axis), meta)
    if set(axis_names(axis)) <= varying_axes(x):
        return x
    # Broadcast inputs become per-replica values, so jax.grad inside fn gives each
    # replica its own gradient (as tf.distribute does) instead of one already summed
    # over replicas. Whatever is computed from them alone is still recognised as the
    # same on every replica when the function returns (jaxdist._run.invariance).
    return lax.pcast(x, axis, to="varying")


# Output leaf kinds, recorded while fn is traced.
_OUT_ARRAY, _OUT_ON_WRITE, _OUT_ON_READ, _OUT_SYNCED, _OUT_SHARDED = range(5)


@dataclasses.dataclass
class _Trace:
    """What one trace of the replica function found (filled during tracing)."""

    out_tree: Any = None
    leaves: list[Any] = dataclasses.field(default_factory=list)  # _Static or (kind, meta)
    specs: list[P] = dataclasses.field(default_factory=list)
    makers: list[Any] = dataclasses.field(default_factory=list)


def _check_signature(
    strategy: StrategyLike, fn: Callable[..., Any], args: Any, kwargs: Any
) -> None:
    """Explains a replica function that does not take the context first."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, *args, **kwargs)
    except TypeError as e:
        try:
            sig.bind(*args, **kwargs)
        except TypeError:
            raise TypeError(
                f"{type(strategy).__name__}.run: cannot call {getattr(fn, '__name__', fn)!r}"
                f"{sig} with the ReplicaContext and {len(args)} positional argument(s) and "
                f"keywords {sorted(kwargs)}: {e}."
            ) from None
        name = getattr(fn, "__name__", "fn")
        params = ", ".join(["ctx", *list(sig.parameters)])
        raise TypeError(
            f"{type(strategy).__name__}.run: {name}{sig} does not take the replica context. "
            "jaxdist passes the ReplicaContext as the first argument (TF's "
            "get_replica_context() made explicit); write it as "
            f"`def {name}({params}): ...` and use ctx.all_reduce / "
            "ctx.replica_id_in_sync_group inside."
        ) from None


def _call(
    strategy: StrategyLike, fn: Callable[..., Any], ctx: ReplicaContext, a: Any, k: Any
) -> Any:
    try:
        return fn(ctx, *a, **k)
    except jax.errors.ConcretizationTypeError as e:
        e.add_note(
            f"jaxdist: {type(strategy).__name__}.run traces the replica function once for "
            "all replicas, so Python control flow cannot depend on per-replica values "
            "(such as ctx.replica_id_in_sync_group); every replica must return the same "
            "structure. Use jnp.where or jax.lax.cond instead."
        )
        raise
    except TypeError:
        _check_signature(strategy, fn, a, k)
        raise


def _out_leaf(leaf: Any, trace: _Trace, strategy: StrategyLike) -> Any:
    """The array to hand out for one output leaf (None for a static leaf)."""
    if isinstance(leaf, Variable):
        if leaf.is_on_read:
            trace.leaves.append((_OUT_ON_READ, leaf.meta))
        else:
            trace.leaves.append((_OUT_ON_WRITE, leaf.meta))
        return leaf.stored
    if isinstance(leaf, Synced):
        if leaf.layout is None:
            trace.leaves.append((_OUT_SYNCED, leaf.what))
        else:
            trace.leaves.append((_OUT_SHARDED, (leaf.what, leaf.layout)))
        return jax.numpy.asarray(leaf.value)
    if isinstance(leaf, DistributedValues):
        raise TypeError(
            f"{type(strategy).__name__}.run: the replica function returned a "
            f"{type(leaf).__name__}; return plain arrays, run wraps them."
        )
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        trace.leaves.append((_OUT_ARRAY, None))
        return jax.numpy.asarray(leaf)
    trace.leaves.append(_Static(leaf))
    return None


def _is_out_leaf(x: Any) -> bool:
    return isinstance(x, (DistributedValues, Variable, Synced))


def replicated(
    fn: Callable[..., Any],
    strategy: StrategyLike,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    plain: bool = False,
) -> Any:
    """Traces ``fn(ctx, *args, **kwargs)`` over the strategy's replicas (under jit).

    With ``plain``, outputs that are the same on every replica come back as
    plain replicated arrays rather than `Mirrored`.
    """
    inputs = _flatten_inputs(strategy, args, kwargs)
    axis = strategy.axis_name
    n = strategy.num_replicas_in_sync
    n_args = len(inputs.kinds)
    n_valid = len(inputs.valid)
    trace = _Trace()

    def traced(*local: Any) -> list[Any]:
        trace.leaves.clear()
        # One replica of several logical devices: XLA cannot compile a collective over
        # a manual axis of size 1 beside automatic ones, and each is an identity there.
        ctx = ReplicaContext(strategy, single_replica=n == 1 and strategy.mesh.size > 1)
        for j in range(n_valid):
            ctx.add_valid_counts(local[n_args + j], inputs.valid_replicated[j])
        vals = [_enter(ctx, k, m, x) for (k, m), x in zip(inputs.kinds, local, strict=False)]
        a, k = jax.tree.unflatten(inputs.treedef, vals)
        try:
            with replica_scope(ctx):
                out = _call(strategy, fn, ctx, a, k)
                leaves, trace.out_tree = jax.tree.flatten(out, is_leaf=_is_out_leaf)
                arrays = [_out_leaf(leaf, trace, strategy) for leaf in leaves]
        finally:
            ctx.end_trace()
        return [a for a in arrays if a is not None]

    def body(*local: Any) -> list[Any]:
        closed = jax.make_jaxpr(traced)(*local)
        tracked = [pos for pos, _ in inputs.batch_leaves]
        blocks = [i for i, (kind, _) in enumerate(inputs.kinds) if kind == _SHARDED]
        infos = analyze(closed.jaxpr, axis, tracked, blocks)
        trace.specs.clear()
        trace.makers.clear()
        kinds = [leaf for leaf in trace.leaves if not isinstance(leaf, _Static)]
        # Sharded state the same on every replica: computed as each device's slice.
        sliced = {
            i: kind[1][1]
            for i, (kind, info) in enumerate(zip(kinds, infos, strict=True))
            if kind[0] == _OUT_SHARDED and not info.varying and kind[1][1].cut
        }
        outs = eval_sliced(closed.jaxpr, closed.consts, local, sliced, axis)
        return [
            _finish(strategy, x, info, kind, inputs, trace, plain or n == 1, i in sliced)
            for i, (x, info, kind) in enumerate(zip(outs, infos, kinds, strict=True))
        ]

    # Manual over the replica axes only: other mesh axes (a `TPUStrategy`'s logical
    # devices) stay automatic, so XLA's partitioner lays values out along them.
    outs = jax.shard_map(
        body,
        mesh=strategy.mesh,
        in_specs=tuple(inputs.specs),
        out_specs=trace.specs,
        axis_names=frozenset(axis_names(axis)),
    )(*inputs.flat)
    it = iter(zip(outs, trace.makers, strict=True))
    wrapped = []
    for leaf in trace.leaves:
        if isinstance(leaf, _Static):
            wrapped.append(leaf.value)
        else:
            x, maker = next(it)
            wrapped.append(maker(x))
    return jax.tree.unflatten(trace.out_tree, wrapped)


def _identity(x: Any) -> Any:
    return x


def _finish(
    strategy: StrategyLike,
    x: Any,
    info: Any,
    kind: tuple[int, Any],
    inputs: _Inputs,
    trace: _Trace,
    plain: bool,
    presliced: bool = False,
) -> Any:
    """One output of the body: its spec and maker go to ``trace``; returns the array
    (``presliced``: a sharded output already computed as this replica's slice)."""
    axis = strategy.axis_name
    out_kind, meta = kind
    layout = None
    if out_kind == _OUT_SHARDED:  # synced state, then each device's slice of it
        out_kind, (meta, layout) = _OUT_SYNCED, meta
    typed_varying = varies(x, axis)
    if info.varying and not typed_varying:
        # Typed invariant, yet replicas reached it through different control flow (a
        # while loop with a per-replica trip count): it is per-replica data.
        x = lax.pcast(x, axis, to="varying")
        typed_varying = True
    same_everywhere = not info.varying
    n = strategy.num_replicas_in_sync
    if out_kind == _OUT_ON_READ:
        if not typed_varying:
            x = lax.pcast(x, axis, to="varying")
        trace.specs.append(P(axis))
        trace.makers.append(
            functools.partial(Variable.from_stored, meta=dataclasses.replace(meta, local=False))
        )
        return x[None]
    if out_kind in (_OUT_ON_WRITE, _OUT_SYNCED) and not same_everywhere:
        if n == 1:
            same_everywhere = True
        elif out_kind == _OUT_SYNCED and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
            x = lax.pmean(x, axis)  # per-replica statistics: averaged, as ON_READ MEAN
            typed_varying = False
            same_everywhere = True
        elif out_kind == _OUT_SYNCED:
            raise ValueError(
                f"jaxdist.train_step: {meta} differs between replicas after the step and is "
                "not a float, so it cannot be averaged back into one copy. Update it from "
                "values that are the same on every replica (for example results of "
                "ctx.all_reduce), or keep per-replica state out of the model."
            )
        else:
            raise varying_variable_error(meta, f"{type(strategy).__name__}.run")
    group = None if same_everywhere else _valid_group(x, info, inputs)
    if same_everywhere or (n == 1 and group is None):
        if layout is not None:
            trace.specs.append(layout.manual)
            trace.makers.append(_identity)
            block = x if presliced else local_block(x, layout.cut)
            # The same block on every device of the other replica axes: typed so.
            split = {a for _, axes, _ in layout.cut for a in axes}
            block = assume_invariant(block, [a for a in axis_names(axis) if a not in split])
            return constrain(block, layout)
        if typed_varying:
            x = assume_invariant(x, axis)
        trace.specs.append(P())
        if out_kind == _OUT_ON_WRITE:
            trace.makers.append(
                functools.partial(Variable.from_stored, meta=dataclasses.replace(meta, local=False))
            )
        elif out_kind == _OUT_SYNCED or plain or n == 1:
            trace.makers.append(_identity)
        else:
            trace.makers.append(Mirrored)
        return x
    trace.specs.append(P(axis))
    if group is None:
        trace.makers.append(PerReplica)
    else:
        trace.makers.append(functools.partial(PerReplica, valid=inputs.valid[group]))
    return x[None]


def _valid_group(x: Any, info: Any, inputs: _Inputs) -> int | None:
    """The padded batch whose valid counts a per-replica output inherits, if any: the
    output depends on it and has its per-replica row count as leading dimension."""
    if not info.deps or not np.ndim(x):
        return None
    rows = x.shape[0]
    for k, (_, group) in enumerate(inputs.batch_leaves):
        if info.deps >> k & 1 and rows == inputs.valid_rows[group]:
            return group
    return None
