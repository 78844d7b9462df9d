"""The run path: one `jax.jit` of one `jax.shard_map` per function and signature (private).

`replicated_program(options)` returns a jitted callable
``program(fn, strategy, args, kwargs)`` whose first two arguments are static.
Tracing it flattens the arguments (distributed values at the leaves), maps
`PerReplica` leaves over the replica axis and broadcasts the rest, traces
``fn`` once inside `jax.shard_map`, and picks each output's spec from its
varying-axes type: invariant outputs come back `Mirrored`, varying ones
`PerReplica`. jit caches the result, so a second call with the same function
and argument shapes costs one C++ dispatch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist._jax_compat import varying_axes
from jaxdist._replica_updates import mirror_of, register_mirror
from jaxdist.context import ReplicaContext, replica_scope
from jaxdist.options import RunOptions
from jaxdist.values import DistributedValues, Mirrored, PerReplica
from jaxdist.variables import Variable, is_distributed

if TYPE_CHECKING:
    from jaxdist.strategy import Strategy


class _Static:
    """A non-array output leaf carried through jit as pytree metadata.

    Unflattening yields the bare value, so callers never see this wrapper.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: value)


def path_str(path: Sequence[Any]) -> str:
    """``args[0]['x']`` / ``kwargs['lr']`` for a key path into ``(args, kwargs)``."""
    if not path:
        return "args"
    head, rest = path[0], path[1:]
    root = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
    return root + jax.tree_util.keystr(tuple(rest))


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)

# How an input leaf enters the replica function.
_PER_REPLICA, _BROADCAST, _ON_READ, _ON_WRITE = range(4)


def describe_bad_leaf(strategy: Strategy, args: Any, kwargs: Any) -> TypeError | None:
    """Finds the first argument leaf that is not an array (for a readable TypeError)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_distributed)[
        0
    ]:
        if not isinstance(leaf, (*_ARRAY_TYPES, DistributedValues, Variable)):
            return TypeError(
                f"{type(strategy).__name__}.run: {path_str(path)} is a {type(leaf).__name__} "
                f"({leaf!r:.60}), not an array. Arguments of run must be pytrees of arrays or "
                "Python numbers. Close over other objects (or bind them with functools.partial "
                "outside the training loop, so the function keeps its identity)."
            )
    return None


def _replica_axis_error(strategy: Strategy, path: Any, what: str, shape: Any) -> ValueError:
    n = strategy.num_replicas_in_sync
    return ValueError(
        f"{type(strategy).__name__}.run: {path_str(path)} is {what} of shape {tuple(shape)}, "
        f"but its leading (replica) axis must have size {n}, one row per replica of mesh "
        f"{dict(strategy.mesh.shape)}. Build it with "
        "strategy.experimental_distribute_values_from_function, from this strategy's run "
        "outputs, or (for variables) inside this strategy's scope."
    )


def _flatten_inputs(
    strategy: Strategy, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], list[P], list[tuple[int, Any]], Any]:
    n = strategy.num_replicas_in_sync
    axis = strategy.axis_name
    with_path, treedef = jax.tree_util.tree_flatten_with_path(
        (args, kwargs), is_leaf=is_distributed
    )
    flat: list[Any] = []
    specs: list[P] = []
    kinds: list[tuple[int, Any]] = []
    valid: list[Any] = []
    for path, leaf in with_path:
        if isinstance(leaf, Variable):
            arr = leaf._stored
            if leaf.is_on_read:
                if arr.ndim == 0 or arr.shape[0] != n:
                    raise _replica_axis_error(strategy, path, "an ON_READ Variable", arr.shape)
                flat.append(arr)
                specs.append(P(axis))
                kinds.append((_ON_READ, leaf._meta))
            else:
                flat.append(arr)
                specs.append(P())
                kinds.append((_ON_WRITE, leaf._meta))
        elif isinstance(leaf, PerReplica):
            arr = leaf.array
            if arr.ndim == 0 or arr.shape[0] != n:
                raise _replica_axis_error(strategy, path, "a PerReplica", arr.shape)
            flat.append(arr)
            specs.append(P(axis))
            kinds.append((_PER_REPLICA, None))
            if leaf.valid is not None:
                valid.append(leaf.valid)
        else:
            flat.append(leaf.array if isinstance(leaf, Mirrored) else leaf)
            specs.append(P())
            kinds.append((_BROADCAST, None))
    # The valid-row counts of padded batches ride along as extra per-replica inputs;
    # one array shared by a batch's leaves is passed once.
    unique_valid = list({id(v): v for v in valid}.values())
    flat.extend(unique_valid)
    specs.extend([P(axis)] * len(unique_valid))
    return flat, specs, kinds, treedef


def _enter(ctx: ReplicaContext, kind: int, meta: Any, x: Any) -> Any:
    axis = ctx.axis_name
    if kind == _PER_REPLICA:
        return x[0]
    if kind == _ON_READ:
        return Variable._make(x[0], dataclasses.replace(meta, local=True))
    if kind == _ON_WRITE:
        return Variable._make(register_mirror(ctx, x), dataclasses.replace(meta, local=True))
    if axis in varying_axes(x):
        return x
    # Broadcast inputs become per-replica values, so jax.grad inside fn gives each
    # replica its own gradient (as tf.distribute does) instead of one already summed
    # over replicas.
    return lax.pcast(x, axis, to="varying")


def _exit(ctx: ReplicaContext, leaf: Any, specs: list[P], meta: list[Any]) -> Any:
    """Returns the array to hand out of shard_map for one output leaf (or None)."""
    axis = ctx.axis_name
    if isinstance(leaf, Variable):
        out_meta = dataclasses.replace(leaf._meta, local=False)
        if leaf.is_on_read:
            x = leaf._stored
            if axis not in varying_axes(x):
                x = lax.pcast(x, axis, to="varying")
            specs.append(P(axis))
            meta.append(functools.partial(Variable._make, meta=out_meta))
            return x[None]
        specs.append(P())
        meta.append(functools.partial(Variable._make, meta=out_meta))
        return mirror_of(ctx, leaf, f"{type(ctx.strategy).__name__}.run")
    if isinstance(leaf, DistributedValues):
        raise TypeError(
            f"{type(ctx.strategy).__name__}.run: the replica function returned a "
            f"{type(leaf).__name__}; return plain arrays, run wraps them."
        )
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        leaf = jax.numpy.asarray(leaf)
        if axis in varying_axes(leaf):
            specs.append(P(axis))
            meta.append(PerReplica)
            return leaf[None]
        specs.append(P())
        meta.append(Mirrored)
        return leaf
    meta.append(_Static(leaf))
    return None


def _replicated(
    fn: Callable[..., Any], strategy: Strategy, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    flat, in_specs, kinds, treedef = _flatten_inputs(strategy, args, kwargs)
    out_specs: list[P] = []  # filled while fn is traced; shard_map reads it afterwards
    out_meta: list[Any] = []

    def body(*local: Any) -> list[Any]:
        out_specs.clear()  # one entry per output of *this* trace of fn
        out_meta.clear()
        ctx = ReplicaContext(strategy)
        ctx._valid.extend(v[0] for v in local[len(kinds) :])
        vals = [_enter(ctx, k, m, x) for (k, m), x in zip(kinds, local, strict=False)]
        a, k = jax.tree.unflatten(treedef, vals)
        with replica_scope(ctx):
            try:
                out = fn(ctx, *a, **k)
            except jax.errors.ConcretizationTypeError as e:
                e.add_note(
                    f"jaxdist: {type(strategy).__name__}.run traces the replica function once for "
                    "all replicas, so Python control flow cannot depend on per-replica values "
                    "(such as ctx.replica_id_in_sync_group); every replica must return the same "
                    "structure. Use jnp.where or jax.lax.cond instead."
                )
                raise
            leaves, out_tree = jax.tree.flatten(out, is_leaf=is_distributed)
            arrays = [_exit(ctx, leaf, out_specs, out_meta) for leaf in leaves]
        out_meta.append(out_tree)
        return [a for a in arrays if a is not None]

    outs = jax.shard_map(body, mesh=strategy.mesh, in_specs=tuple(in_specs), out_specs=out_specs)(
        *flat
    )
    *makers, out_tree = out_meta
    it = iter(outs)
    wrapped = [m if isinstance(m, _Static) else m(next(it)) for m in makers]
    return jax.tree.unflatten(out_tree, wrapped)


@functools.cache
def replicated_program(options: RunOptions | None) -> Any:
    """The jitted ``program(fn, strategy, args, kwargs)`` for ``options`` (a `jax.jit`
    wrapper: callable, and ``.lower`` for ahead-of-time compilation)."""
    opts = options or RunOptions()
    jit_kwargs: dict[str, Any] = {"static_argnums": (0, 1)}
    if opts.donate_args:
        jit_kwargs["donate_argnums"] = (2, 3)
    if opts.experimental_xla_options:
        jit_kwargs["compiler_options"] = dict(opts.experimental_xla_options)
    return jax.jit(_replicated, **jit_kwargs)


class CompiledStep:
    """A replica function compiled ahead of time; call it with the step's arguments."""

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiled(args, kwargs)

    def as_text(self) -> str:
        return self._compiled.as_text()

    def __getattr__(self, name: str) -> Any:  # cost_analysis, memory_analysis, ...
        return getattr(self._compiled, name)


class LoweredStep:
    """A replica function lowered for given arguments (``strategy.function(f).lower(...)``)."""

    def __init__(self, lowered: Any) -> None:
        self._lowered = lowered

    def compile(self) -> CompiledStep:
        return CompiledStep(self._lowered.compile())

    def as_text(self) -> str:
        return self._lowered.as_text()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)
