"""Gradient accumulation: one replica's batch in micro-batches, reduced across replicas once.

`accumulate_gradients` splits this replica's batch into ``steps`` equal
micro-batches along the leading axis, runs ``jax.value_and_grad(loss_fn)`` on
each inside one `jax.lax.scan` (so activations of only one micro-batch are
alive at a time) and returns the loss and gradients *summed* over the
micro-batches, with no communication. The caller then all-reduces once::

    loss, grads = jd.accumulate_gradients(loss_fn, params, batch, steps=4)
    grads = ctx.all_reduce("sum", grads)      # one all-reduce per 4 micro-batches

With losses from `jaxdist.compute_average_loss` the sum is exactly the loss
and gradient of the whole batch: while ``loss_fn`` is traced for a
micro-batch, `compute_average_loss` still divides by the whole global batch
(``ctx.global_num_valid`` of a padded batch, else this replica's full batch
rows times the replicas) and masks padding at the micro-batch's own rows;
`scale_regularization_loss` divides by the micro-batch count too. A loss
written by hand must do the same: divide by the global batch size, not by the
micro-batch's.

Flax NNX modules work as ``params``: the module is split into its
differentiable state (``nnx.Param`` by default) and the rest, the gradients
come back as the ``nnx.State`` that ``nnx.value_and_grad`` returns, and state
the loss updates (batch statistics, RNG counters) is carried from one
micro-batch to the next and written back into the module at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist._jax_compat import aval_varying_axes, varying_axes
from jaxdist.context import get_replica_context
from jaxdist.training.step.losses import MicroBatch, current_micro_batch, micro_batch_scope
from jaxdist.training.step.nnx import nnx_module

__all__ = ["accumulate_gradients"]

_WHERE = "jaxdist.accumulate_gradients"


def _split_batch(batch: Any, steps: int) -> tuple[Any, int]:
    """Every leaf of ``batch`` reshaped to ``(steps, rows // steps, ...)``; and the
    micro-batch rows."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(batch)
    if not with_path:
        raise ValueError(
            f"{_WHERE}: batch has no array leaves; pass this replica's batch (an array or a "
            "pytree of arrays sharing their leading axis)."
        )
    rows: dict[str, int] = {}
    leaves = []
    for path, leaf in with_path:
        x = jnp.asarray(leaf)
        name = "batch" + jax.tree_util.keystr(path)
        if x.ndim == 0:
            raise ValueError(
                f"{_WHERE}: {name} is a scalar; every leaf of batch needs a leading (example) "
                "axis to split into micro-batches. Close over per-step constants in loss_fn "
                "instead of passing them in batch."
            )
        rows[name] = x.shape[0]
        leaves.append(x)
    if len(set(rows.values())) != 1:
        raise ValueError(
            f"{_WHERE}: the leaves of batch have different leading (example) axes {rows}; "
            "every leaf must have one row per example."
        )
    n = next(iter(rows.values()))
    if n % steps:
        name, shape = next(("batch" + jax.tree_util.keystr(p), jnp.shape(x)) for p, x in with_path)
        fits = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"{_WHERE}: {name} of shape {shape} has {n} rows, which do not split into "
            f"steps={steps} equal micro-batches. Use steps in {fits}, or a per-replica batch "
            f"that is a multiple of {steps} (a global batch that is a multiple of {steps} "
            "times the number of replicas)."
        )
    m = n // steps
    split = [x.reshape(steps, m, *x.shape[1:]) for x in leaves]
    return jax.tree.unflatten(treedef, split), m


def _sum_dtype(dtype: Any) -> Any:
    """Accumulate floats in at least float32 (half-precision sums lose small terms)."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.promote_types(dtype, jnp.float32)
    return dtype


def _to_axes(x: Any, axes: frozenset[str]) -> Any:
    """``x`` typed as varying over ``axes`` (a no-op when it already is)."""
    missing = axes - varying_axes(x)
    return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def _check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"{_WHERE}: steps must be an int >= 1 (the number of micro-batches), got {steps!r}."
        )
    return steps


def accumulate_gradients(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    steps: int,
    *,
    has_aux: bool = False,
    wrt: Any = None,
) -> tuple[Any, Any]:
    """Loss and gradients of ``loss_fn`` summed over ``steps`` micro-batches of ``batch``.

    Splits the leading axis of every leaf of ``batch`` (this replica's batch)
    into ``steps`` equal, contiguous micro-batches and runs
    ``jax.value_and_grad(loss_fn)(params, micro_batch)`` on each inside one
    `jax.lax.scan`. Nothing is communicated: all-reduce the returned gradients
    once afterwards (``ctx.all_reduce("sum", grads)``). Use it inside the
    replica function of `jaxdist.train_step` or `Strategy.run`, or on its own
    without a strategy.

    With ``loss_fn`` built on `jaxdist.compute_average_loss`, the sum over
    micro-batches equals the whole batch's loss and gradient: while a
    micro-batch is traced, `compute_average_loss` divides by the whole global
    batch and masks padded rows at the micro-batch's rows. A loss averaged by
    hand must divide by the global batch size too, not by the micro-batch's
    rows. Sums are carried in at least float32 and cast back to the dtypes of
    the loss and gradients.

    Args:
        loss_fn: ``loss_fn(params, micro_batch)`` returning a scalar loss, or
            ``(loss, aux)`` with ``has_aux``.
        params: the pytree to differentiate, or a Flax NNX module (graph node):
            then ``loss_fn`` receives the module, the gradients are the
            ``nnx.State`` of its ``wrt`` variables (as ``nnx.value_and_grad``
            returns them), and other state the loss updates (batch statistics,
            RNG counts) carries over from one micro-batch to the next and is
            written back into the module.
        batch: this replica's batch: an array or a pytree of arrays sharing
            their leading (example) axis, which must divide by ``steps``.
        steps: the number of micro-batches (an int >= 1).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back
            stacked along a new leading axis of size ``steps`` (reshape to
            ``(-1, ...)`` for per-example values).
        wrt: NNX only: the filter of the variables to differentiate
            (default ``nnx.Param``).

    Returns:
        ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``, like
        ``jax.value_and_grad``; ``loss`` and ``grads`` are sums over the
        micro-batches.

    Raises:
        ValueError: for ``steps`` that is not a positive int, or a batch leaf
            whose leading axis does not divide into ``steps`` micro-batches.
        TypeError: for ``wrt`` given with ``params`` that are not an NNX module.

    Example:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> x = jnp.arange(8.0)
        >>> def loss_fn(w, xb):
        ...     return jd.compute_average_loss((w * xb - 1.0) ** 2)
        >>> loss, grad = jd.accumulate_gradients(loss_fn, 0.5, x, steps=4)
        >>> whole, whole_grad = jax.value_and_grad(loss_fn)(0.5, x)
        >>> bool(jnp.allclose(loss, whole)), bool(jnp.allclose(grad, whole_grad))
        (True, True)
    """
    if not callable(loss_fn):
        raise TypeError(f"{_WHERE}: loss_fn must be callable, got {type(loss_fn).__name__}.")
    steps = _check_steps(steps)
    micro_batches, m = _split_batch(batch, steps)

    nnx = nnx_module()
    module = params if nnx is not None and isinstance(params, nnx.Pytree) else None
    if module is not None:
        assert nnx is not None
        wrt = nnx.Param if wrt is None else wrt
        graphdef, diff, rest = nnx.split(module, wrt, ...)

        def pure(diff: Any, rest: Any, micro: Any) -> tuple[Any, tuple[Any, Any]]:
            # Fresh Variable objects, owned by the trace running now: nnx.merge reuses the
            # ones it is given, and NNX refuses updates to Variables of an outer trace.
            diff, rest = jax.tree.map(lambda x: x, (diff, rest))
            model = nnx.merge(graphdef, diff, rest)
            out = loss_fn(model, micro)
            loss, aux = out if has_aux else (out, None)
            _, _, new_rest = nnx.split(model, wrt, ...)
            return loss, (aux, new_rest)
    else:
        if wrt is not None:
            raise TypeError(
                f"{_WHERE}: wrt= filters the variables of a Flax NNX module; params is a "
                f"{type(params).__name__}. Leave wrt unset, or pass only the leaves to "
                "differentiate as params."
            )
        diff, rest = params, None

        def pure(diff: Any, rest: Any, micro: Any) -> tuple[Any, tuple[Any, Any]]:
            out = loss_fn(diff, micro)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, rest)

    outer = current_micro_batch()
    if outer is not None:  # nested accumulation: micro-batches of a micro-batch
        base, total_steps = outer.offset, outer.steps * steps
        num_valid, global_valid = outer.num_valid, outer.global_num_valid
    else:
        ctx = get_replica_context()
        base, total_steps = 0, steps
        num_valid = global_valid = None
        if ctx is not None and ctx.bound_to_axis:
            # Read outside the loop, so no collective (for counts that are not
            # replicated) runs once per micro-batch.
            num_valid = ctx.num_valid
            global_valid = ctx.global_num_valid if num_valid is not None else None

    grad_fn = jax.value_and_grad(pure, has_aux=True)

    def micro_step(diff: Any, rest: Any, index: Any, micro: Any) -> Any:
        scope = MicroBatch(
            offset=base + index * m,
            rows=m,
            steps=total_steps,
            num_valid=num_valid,
            global_num_valid=global_valid,
        )
        with micro_batch_scope(scope):
            (loss, (aux, new_rest)), grads = grad_fn(diff, rest, micro)
        return loss, grads, aux, new_rest

    # The loop carry must keep one type: the sums (zeros at first) and the carried NNX
    # state are typed as varying over the replica axes whenever a micro-batch's results
    # are. Carried state typed invariant that comes out varying (statistics of
    # per-replica data) is widened before the loop, and the types settle again.
    first = jax.tree.map(lambda x: x[0], micro_batches)
    index0 = jnp.int32(0)
    rest_leaves, rest_def = jax.tree.flatten(rest)
    while True:
        shapes = jax.eval_shape(micro_step, diff, rest, index0, first)
        rest_axes = [
            varying_axes(x) | aval_varying_axes(s)
            for x, s in zip(rest_leaves, jax.tree.leaves(shapes[3]), strict=True)
        ]
        if all(axes == varying_axes(x) for x, axes in zip(rest_leaves, rest_axes, strict=True)):
            break
        rest_leaves = [_to_axes(x, axes) for x, axes in zip(rest_leaves, rest_axes, strict=True)]
        rest = jax.tree.unflatten(rest_def, rest_leaves)
    loss_shape, grad_shapes = shapes[0], shapes[1]

    def zeros(s: Any) -> Any:
        return _to_axes(jnp.zeros(s.shape, _sum_dtype(s.dtype)), aval_varying_axes(s))

    carry0 = (zeros(loss_shape), jax.tree.map(zeros, grad_shapes), rest)

    def body(carry: Any, xs: Any) -> Any:
        acc_loss, acc_grads, rest = carry
        index, micro = xs
        loss, grads, aux, new_rest = micro_step(diff, rest, index, micro)
        acc_loss = acc_loss + loss.astype(acc_loss.dtype)
        acc_grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc_grads, grads)
        new_leaves = jax.tree.leaves(new_rest)
        new_rest = jax.tree.unflatten(
            rest_def, [_to_axes(x, a) for x, a in zip(new_leaves, rest_axes, strict=True)]
        )
        return (acc_loss, acc_grads, new_rest), aux

    (loss, grads, rest), aux = lax.scan(
        body, carry0, (jnp.arange(steps, dtype=jnp.int32), micro_batches)
    )
    loss = loss.astype(loss_shape.dtype)
    grads = jax.tree.map(lambda g, s: g.astype(s.dtype), grads, grad_shapes)
    if module is not None:
        assert nnx is not None
        nnx.update(module, rest)
    return ((loss, aux), grads) if has_aux else (loss, grads)
