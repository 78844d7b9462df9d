"""tf.distribute's loss scaling: per-replica losses whose sum over replicas is the global mean.

In synchronous data-parallel training every replica computes a loss on its
share of the global batch, and the gradients are summed across replicas
(``ctx.all_reduce("sum", grads)``). For the sum to be the gradient of the mean
loss over the *global* batch, each replica divides its summed per-example
losses by the global batch size, not by its own batch size:
`compute_average_loss` does exactly that, and `scale_regularization_loss`
divides a model-wide term (weight decay, ...) by the number of replicas so it
is counted once in the sum.

jaxdist adds two things to TF's semantics:

- **Padded partial batches.** Batches from
  ``strategy.experimental_distribute_dataset`` carry each replica's count of
  data rows (the last batch of a dataset is padded to the full shape). Inside
  a replica function, rows past this replica's count are masked out (they add
  zero loss and zero gradient) and, with ``global_batch_size=None``, the
  divisor is the number of data rows over all replicas
  (``ctx.global_num_valid``). Training on a partial last batch then equals
  single-device training on that smaller batch. The per-example loss's leading
  axis must be the batch axis (one loss per example, as TF assumes); reduce
  per-token losses to one value per example first.
- **Micro-batches.** Inside `jaxdist.accumulate_gradients`, the loss of each
  micro-batch is still divided by the whole global batch (and padding is
  masked at the micro-batch's rows), so the sum over micro-batches equals the
  loss of the whole batch. `scale_regularization_loss` likewise divides by the
  number of micro-batches. The accumulation loop tells these functions where
  the micro-batch sits through a private context (set while ``loss_fn`` is
  traced); nothing needs to be passed by hand.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist._jax_compat import is_tracer
from jaxdist._scope import has_strategy, in_cross_replica_context
from jaxdist.context import get_replica_context

__all__ = ["compute_average_loss", "scale_regularization_loss"]


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Where the micro-batch being traced sits in this replica's batch (private).

    Set by `jaxdist.accumulate_gradients` around each trace of the user's loss.

    Attributes:
        offset: the micro-batch's first row within this replica's batch (traced int).
        rows: rows per micro-batch.
        steps: micro-batches per replica batch (a product when accumulations nest).
        num_valid: data rows of this replica's batch, or ``None`` (no padding info).
        global_num_valid: data rows of the global batch, or ``None``.
    """

    offset: Any
    rows: int
    steps: int
    num_valid: Any
    global_num_valid: Any


_MICRO: contextvars.ContextVar[MicroBatch | None] = contextvars.ContextVar(
    "jaxdist_micro_batch", default=None
)


def current_micro_batch() -> MicroBatch | None:
    """The micro-batch being traced, or ``None`` outside `accumulate_gradients` (private)."""
    return _MICRO.get()


@contextlib.contextmanager
def micro_batch_scope(micro: MicroBatch) -> Iterator[None]:
    """Marks the tracing of one micro-batch's loss (private; used by accumulate_gradients)."""
    token = _MICRO.set(micro)
    try:
        yield
    finally:
        _MICRO.reset(token)


def _cross_replica_error(name: str, fix: str) -> RuntimeError:
    # The first sentence is TF's, so code written against tf.nn keeps matching.
    return RuntimeError(
        f"You are calling `{name}` in cross replica context, while it was expected to be "
        f"called in replica context. jaxdist.{name} must be called inside the replica "
        f"function given to strategy.run or jaxdist.train_step{fix}."
    )


def _dtypes(dtype: Any) -> tuple[Any, Any]:
    """(the result dtype, the dtype to sum in): floats keep their dtype and are summed in
    at least float32; integers and booleans give the default float dtype."""
    out = dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.result_type(float)
    return out, jnp.promote_types(out, jnp.float32)


def _check_global_batch_size(value: Any) -> Any:
    """``global_batch_size`` as a non-negative int (or a traced integer scalar).

    TF's order and error types: a non-scalar is a ``ValueError``, a scalar that is
    not an integer (a float, a bool, a string) a ``TypeError`` (``assert_integer``),
    a negative integer a ``ValueError``.
    """
    where = "jaxdist.compute_average_loss"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{where}: global_batch_size must be an integer, got {value!r} (bool). Pass the "
            "number of examples in the global batch, e.g. global_batch_size=64."
        )
    if isinstance(value, (int, np.integer)):
        size = int(value)
    else:
        arr = value if is_tracer(value) else np.asarray(value)
        if np.ndim(arr) != 0:
            raise ValueError(
                f"{where}: global_batch_size must be scalar, got a value of shape "
                f"{np.shape(arr)}. Pass one integer, the number of examples in the global "
                "batch."
            )
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(
                f"{where}: global_batch_size must be an integer, got {value!r} (dtype "
                f"{arr.dtype}). Pass the number of examples as an int, e.g. "
                "global_batch_size=64."
            )
        if is_tracer(arr):
            return arr  # not checked: a traced size of zero gives a zero loss
        size = int(arr)
    if size < 0:
        raise ValueError(
            f"{where}: global_batch_size must be non-negative, got {size}. Pass the number of "
            "examples in the global batch (over all replicas), or leave it None to use the "
            "batch's own size."
        )
    return size  # 0 (an empty global batch) gives a zero loss, as TF's div_no_nan does


def _weighted(loss: jax.Array, sample_weight: Any, dtype: Any) -> jax.Array:
    """``loss * sample_weight``, the weights squeezed, expanded and broadcast as TF does."""
    w = jnp.asarray(sample_weight)
    given = w.shape
    if w.ndim and w.ndim == loss.ndim + 1 and w.shape[-1] == 1:
        w = w[..., 0]
    elif w.ndim and w.ndim == loss.ndim - 1:
        w = w[..., None]
    try:
        fits = np.broadcast_shapes(w.shape, loss.shape) == loss.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"jaxdist.compute_average_loss: sample_weight of shape {given} does not broadcast "
            f"to per_example_loss of shape {loss.shape} (Incompatible shapes: "
            f"{list(loss.shape)} vs. {list(given)}). Give a scalar, one weight per example "
            f"(shape {loss.shape[:1]}), or a shape that broadcasts to {loss.shape}."
        )
    return loss.astype(dtype) * w.astype(dtype)


def _divide(total: jax.Array, divisor: Any) -> jax.Array:
    """``total / divisor``, and 0 where the divisor is 0 (an empty batch), as TF's
    ``div_no_nan``."""
    if isinstance(divisor, int):
        return total / divisor if divisor else jnp.zeros_like(total)
    d = jnp.asarray(divisor).astype(total.dtype)
    return jnp.where(d > 0, total / jnp.where(d > 0, d, 1), jnp.zeros_like(total))


def compute_average_loss(
    per_example_loss: Any, sample_weight: Any = None, global_batch_size: Any = None
) -> jax.Array:
    """Sums per-example losses and divides by the global batch size (tf.nn's semantics).

    Call it in the replica function of `Strategy.run` or `jaxdist.train_step`
    on this replica's per-example losses; summing the results over replicas
    (``ctx.all_reduce("sum", loss)``, or summing the gradients) gives the mean
    over the global batch. Outside any strategy it acts as one replica (a plain
    mean).

    ``sample_weight`` scales the losses (a scalar, one weight per example, or
    any shape that broadcasts to the losses' shape; a weight with one extra
    trailing axis of size 1 or one axis fewer is squeezed or expanded first).
    Weights do not renormalise: the divisor stays the batch size.

    When the replica function's arguments are a padded partial batch (from
    ``strategy.experimental_distribute_dataset``), rows past this replica's data
    rows count zero, and the default divisor is the global number of data rows,
    so a partial last batch trains exactly like a smaller batch on one device.
    Inside `jaxdist.accumulate_gradients` the divisor is the whole global batch
    (not the micro-batch) and padding is masked at the micro-batch's rows.

    Args:
        per_example_loss: losses of rank at least 1, the leading axis over this
            replica's examples.
        sample_weight: optional weights, see above.
        global_batch_size: the number of examples in the global batch (an
            int >= 0; 0, an empty global batch, gives a zero loss as TF's
            ``div_no_nan`` does). ``None`` means this replica's rows times the
            number of replicas (times the micro-batches of an accumulation), or
            the global number of data rows of a padded batch.

    Returns:
        A scalar: the weighted losses summed and divided by the global batch
        size (0 for an empty batch), with the dtype of ``per_example_loss``
        (summed in at least float32; integer losses give a float).

    Raises:
        ValueError: for a scalar ``per_example_loss``, a ``global_batch_size``
            that is not a scalar or is negative, or weights that do not
            broadcast to the losses.
        TypeError: for a scalar ``global_batch_size`` that is not an integer
            (a float such as ``10.0``, a bool, a string), as TF's
            ``assert_integer``.
        RuntimeError: in cross-replica context inside a strategy's scope
            (outside the replica function) when ``global_batch_size`` is
            ``None``.

    Example:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> float(jd.compute_average_loss(jnp.array([1.0, 2.0, 3.0, 4.0, 5.0]),
        ...                               global_batch_size=10))
        1.5
        >>> s = jd.MirroredStrategy(jax.devices()[:2])
        >>> per_replica = s.run(lambda ctx: jd.compute_average_loss(jnp.array([2.0, 4.0])))
        >>> float(s.reduce("sum", per_replica))  # the mean over 2 replicas x 2 examples
        3.0
    """
    loss = jnp.asarray(per_example_loss)
    if loss.ndim == 0:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at least "
            f"rank 1. jaxdist.compute_average_loss got a scalar ({loss.dtype}); pass one loss "
            "per example (shape (batch,) or (batch, ...)), not an already averaged loss."
        )
    out_dtype, sum_dtype = _dtypes(loss.dtype)
    if sample_weight is not None:
        loss = _weighted(loss, sample_weight, sum_dtype)
    else:
        loss = loss.astype(sum_dtype)
    divisor = None if global_batch_size is None else _check_global_batch_size(global_batch_size)
    if has_strategy() and in_cross_replica_context():
        if divisor is None:
            raise _cross_replica_error(
                "compute_average_loss", ", or be given global_batch_size= explicitly"
            )
        return _divide(jnp.sum(loss), divisor).astype(out_dtype)
    ctx = get_replica_context()
    micro = current_micro_batch()
    if micro is not None:
        num_valid, global_valid, offset = micro.num_valid, micro.global_num_valid, micro.offset
        steps = micro.steps
        if num_valid is not None and loss.shape[0] != micro.rows:
            raise ValueError(
                f"jaxdist.compute_average_loss: per_example_loss of shape {loss.shape} has "
                f"{loss.shape[0]} rows, but the micro-batch of jaxdist.accumulate_gradients "
                f"has {micro.rows}; padded rows are masked by row, so the leading axis must be "
                "the micro-batch's examples. Reduce per-token or per-pixel losses to one value "
                "per example first."
            )
    elif ctx is not None and ctx.bound_to_axis:
        num_valid, global_valid, offset, steps = ctx.num_valid, None, 0, 1
        if num_valid is not None and divisor is None:
            global_valid = ctx.global_num_valid
    else:
        num_valid, global_valid, offset, steps = None, None, 0, 1
    if num_valid is not None:
        rows = loss.shape[0]
        mask = jnp.arange(rows) < jnp.clip(num_valid - offset, 0, rows)
        loss = jnp.where(mask.reshape((rows,) + (1,) * (loss.ndim - 1)), loss, 0)
    if divisor is None:
        if global_valid is not None:
            divisor = global_valid
        else:
            replicas = ctx.num_replicas_in_sync if ctx is not None else 1
            divisor = loss.shape[0] * steps * replicas
    return _divide(jnp.sum(loss), divisor).astype(out_dtype)


def scale_regularization_loss(regularization_loss: Any) -> jax.Array:
    """Sums regularization losses and divides by the number of replicas (tf.nn's semantics).

    A model-wide term (an L2 penalty on the weights, ...) computed identically
    on every replica would be counted once per replica when the replicas'
    losses or gradients are summed; dividing by the replica count counts it
    once. Inside `jaxdist.accumulate_gradients`, where the loss of every
    micro-batch is summed, it also divides by the number of micro-batches.
    Outside any strategy it is the plain sum.

    Args:
        regularization_loss: a scalar, an array, or a pytree (e.g. a list) of
            them; every element is summed.

    Returns:
        A scalar with the dtype of the losses (integers give a float).

    Raises:
        RuntimeError: in cross-replica context inside a strategy's scope.

    Example:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> s = jd.MirroredStrategy(jax.devices()[:2])
        >>> per_replica = s.run(lambda ctx: jd.scale_regularization_loss([1.5, 2.5]))
        >>> float(s.reduce("sum", per_replica))  # counted once over the 2 replicas
        4.0
    """
    if has_strategy() and in_cross_replica_context():
        raise _cross_replica_error("scale_regularization_loss", "")
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(regularization_loss)]
    if leaves:
        out_dtype, sum_dtype = _dtypes(jnp.result_type(*leaves))
        total = sum(jnp.sum(x.astype(sum_dtype)) for x in leaves)
    else:
        out_dtype = sum_dtype = jnp.result_type(float)
        total = jnp.zeros((), sum_dtype)
    ctx = get_replica_context()
    micro = current_micro_batch()
    replicas = ctx.num_replicas_in_sync if ctx is not None else 1
    steps = micro.steps if micro is not None else 1
    return (jnp.asarray(total) / (replicas * steps)).astype(out_dtype)
