"""Mixed precision: half-precision compute with float32 master weights, and loss scaling.

**bfloat16** (TPUs, recent GPUs) needs no library code. Keep the parameters in
float32 and compute in bfloat16 through Flax's own arguments::

    model = nnx.Linear(784, 1024, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)

Layers cast their inputs and (a copy of) their float32 parameters to
bfloat16 for the matmuls; the gradients with respect to the float32
parameters are float32, so the all-reduce and the optimizer update run in
float32 and the parameters stay float32. Cast the logits to float32 before
the loss (``logits.astype(jnp.float32)``) so the softmax and the loss sum are
exact to float32; `jaxdist.compute_average_loss` sums half-precision losses
in float32 anyway. bfloat16 has float32's exponent range, so gradients do not
underflow and no loss scaling is needed.

**float16** (older GPUs) has 5 exponent bits: small gradients flush to zero
in the backward pass. Dynamic loss scaling multiplies the loss by a large
factor before differentiating and divides the gradients by it afterwards; a
step whose gradients overflow is skipped and the factor halved, and after
``period`` finite steps in a row the factor doubles::

    @jd.train_step(strategy)
    def step(ctx, model, opt, loss_scale, batch):
        x, y = batch
        def loss_fn(m):
            logits = m(x).astype(jnp.float32)
            loss = jd.compute_average_loss(per_example_loss(logits, y))
            return loss_scale.scale(loss), loss
        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        grads = ctx.all_reduce("sum", loss_scale.unscale(grads))
        finite = all_finite(grads)  # after the all-reduce: the same on every replica
        old = jax.tree.map(lambda v: v, nnx.state((model, opt)))  # a snapshot (see below)
        opt.update(model, grads)
        nnx.update((model, opt), select_tree(finite, nnx.state((model, opt)), old))
        return loss_scale.update(finite), ctx.all_reduce("sum", loss)

Every replica must take the same decision. Checking the gradients *after*
their all-reduce gives that for free: an overflow on any replica makes the
summed gradient non-finite on all of them, so no extra communication is
needed. `all_finite` on per-replica values (typed as varying across the
replica axis) agrees by itself, with one all-reduce of a single int.

``nnx.state`` returns the model's live ``Variable`` objects, which
``opt.update`` then changes in place; ``jax.tree.map(lambda v: v, ...)``
copies the tree (the arrays themselves are immutable, so this copies no
data), so ``old`` keeps the values from before the update.

Example:
    bfloat16 compute over float32 master weights, on two replicas:

    >>> import jax, jax.numpy as jnp, optax, jaxdist as jd
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 2, dtype=jnp.bfloat16, param_dtype=jnp.float32,
    ...                    rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> strategy = jd.MirroredStrategy(jax.devices()[:2])
    >>> @jd.train_step(strategy)
    ... def step(ctx, model, opt, x, y):
    ...     def loss_fn(m):
    ...         logits = m(x).astype(jnp.float32)  # the loss in float32
    ...         return jd.compute_average_loss(jnp.sum((logits - y) ** 2, axis=-1))
    ...     loss, grads = nnx.value_and_grad(loss_fn)(model)  # float32 gradients
    ...     opt.update(model, ctx.all_reduce("sum", grads))
    ...     return ctx.all_reduce("sum", loss)
    >>> x, y = jnp.ones((8, 4)), jnp.zeros((8, 2))
    >>> xs, ys = jd.PerReplica(x.reshape(2, 4, 4)), jd.PerReplica(y.reshape(2, 4, 2))
    >>> first = float(step(model, opt, xs, ys))  # 4 rows on each replica
    >>> float(step(model, opt, xs, ys)) < first
    True
    >>> model(x).dtype, model.kernel.get_value().dtype  # bfloat16 compute, float32 weights
    (dtype(bfloat16), dtype('float32'))
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist._jax_compat import is_tracer, varies
from jaxdist.context import get_replica_context

__all__ = ["DynamicLossScale", "all_finite", "select_tree"]


def _float_dtype(dtype: Any) -> Any:
    """At least float32 for floats (the scale itself is float32)."""
    return jnp.promote_types(dtype, jnp.float32)


def _check_float(where: str, path: Any, x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"DynamicLossScale.{where}: leaf {jax.tree_util.keystr(path) or '<root>'} has "
            f"dtype {x.dtype}; only floating-point values (a loss, gradients) are scaled. "
            "Pass the loss or the gradient tree alone."
        )
    return x


class DynamicLossScale:
    """A loss scale that halves on overflow and grows after a run of finite steps.

    An immutable pytree: ``loss_scale`` (float32) and ``counter`` (int32, the
    finite steps since the last change) are its array leaves; ``period``,
    ``factor`` and ``min_scale`` are static. Pass it into a train step and
    return the result of `update`, like any other training state; updated
    from a decision that is the same on every replica (see `all_finite`), it
    comes back as one replicated copy.

    Args:
        loss_scale: the initial scale (default ``2**15``).
        period: finite steps in a row after which the scale grows.
        factor: the growth (and shrink) factor, greater than 1.
        min_scale: the scale never shrinks below this.
        counter: finite steps already counted (for a restored state).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist.training import DynamicLossScale
        >>> ls = DynamicLossScale(loss_scale=8.0, period=2)
        >>> float(ls.scale(jnp.float32(0.5)))
        4.0
        >>> float(ls.unscale({"w": jnp.float32(4.0)})["w"])
        0.5
        >>> float(ls.update(jnp.bool_(False)).loss_scale)  # overflow: halved
        4.0
        >>> float(ls.update(True).update(True).loss_scale)  # 2 finite steps: doubled
        16.0
    """

    __slots__ = ("counter", "factor", "loss_scale", "min_scale", "period")

    loss_scale: jax.Array
    counter: jax.Array
    period: int
    factor: float
    min_scale: float

    def __init__(
        self,
        loss_scale: Any = 2.0**15,
        *,
        period: int = 2000,
        factor: float = 2.0,
        min_scale: float = 1.0,
        counter: Any = 0,
    ) -> None:
        where = "DynamicLossScale"
        if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
            raise ValueError(
                f"{where}: period must be an int >= 1 (finite steps before the scale grows), "
                f"got {period!r}."
            )
        if not isinstance(factor, (int, float)) or not factor > 1 or math.isinf(factor):
            raise ValueError(
                f"{where}: factor must be a finite number > 1 (the scale is multiplied or "
                f"divided by it), got {factor!r}; 2 is usual."
            )
        if not isinstance(min_scale, (int, float)) or not 0 < min_scale < math.inf:
            raise ValueError(f"{where}: min_scale must be a finite number > 0, got {min_scale!r}.")
        if not is_tracer(loss_scale):
            value = np.asarray(loss_scale, np.float64)
            if value.shape != () or not min_scale <= float(value) < np.finfo(np.float32).max:
                raise ValueError(
                    f"{where}: loss_scale must be a finite scalar >= min_scale={min_scale}, got "
                    f"{loss_scale!r}. Start at a power of two such as 2**15."
                )
        _set = object.__setattr__
        _set(self, "loss_scale", jnp.asarray(loss_scale, jnp.float32))
        _set(self, "counter", jnp.asarray(counter, jnp.int32))
        _set(self, "period", int(period))
        _set(self, "factor", float(factor))
        _set(self, "min_scale", float(min_scale))

    @classmethod
    def _make(cls, loss_scale: Any, counter: Any, static: tuple[int, float, float]) -> Any:
        obj = object.__new__(cls)
        _set = object.__setattr__
        _set(obj, "loss_scale", loss_scale)
        _set(obj, "counter", counter)
        _set(obj, "period", static[0])
        _set(obj, "factor", static[1])
        _set(obj, "min_scale", static[2])
        return obj

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"DynamicLossScale is immutable; {name} cannot be set. Use the state returned by "
            "update(grads_finite)."
        )

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(loss_scale={self.loss_scale!r}, counter={self.counter!r}, "
            f"period={self.period}, factor={self.factor}, min_scale={self.min_scale})"
        )

    def scale(self, tree: Any) -> Any:
        """Every leaf of ``tree`` (usually the loss) times the loss scale.

        Computed in at least float32, so a half-precision loss cannot overflow
        here; the backward pass through half-precision ops carries the scaled
        cotangents in their own dtype.
        """

        def one(path: Any, x: Any) -> jax.Array:
            x = _check_float("scale", path, x)
            return x.astype(_float_dtype(x.dtype)) * self.loss_scale

        return jax.tree_util.tree_map_with_path(one, tree)

    def unscale(self, tree: Any) -> Any:
        """Every leaf of ``tree`` (usually the gradients) divided by the loss scale, in its
        own dtype (the division itself runs in at least float32)."""

        def one(path: Any, x: Any) -> jax.Array:
            x = _check_float("unscale", path, x)
            return (x.astype(_float_dtype(x.dtype)) / self.loss_scale).astype(x.dtype)

        return jax.tree_util.tree_map_with_path(one, tree)

    def update(self, grads_finite: Any) -> DynamicLossScale:
        """The state after a step: halved (not below ``min_scale``) when ``grads_finite`` is
        false; after ``period`` finite steps in a row, multiplied by ``factor`` (unless
        that would overflow float32).

        Args:
            grads_finite: a boolean scalar, the same on every replica (`all_finite`
                of all-reduced gradients).
        """
        finite = jnp.asarray(grads_finite)
        if finite.shape != () or finite.dtype != jnp.bool_:
            raise ValueError(
                f"DynamicLossScale.update: grads_finite must be a boolean scalar (the result "
                f"of all_finite(grads)), got dtype {finite.dtype} and shape {finite.shape}."
            )
        count = self.counter + 1
        grown = self.loss_scale * self.factor
        grow = (count >= self.period) & jnp.isfinite(grown)
        on_finite = jnp.where(grow, grown, self.loss_scale)
        on_overflow = jnp.maximum(self.loss_scale / self.factor, self.min_scale)
        scale = jnp.where(finite, on_finite, on_overflow).astype(jnp.float32)
        counter = jnp.where(finite & (count < self.period), count, 0).astype(jnp.int32)
        return DynamicLossScale._make(scale, counter, self._static())

    def _static(self) -> tuple[int, float, float]:
        return (self.period, self.factor, self.min_scale)


def _flatten(s: DynamicLossScale) -> tuple[tuple[Any, Any], tuple[int, float, float]]:
    return (s.loss_scale, s.counter), (s.period, s.factor, s.min_scale)


def _flatten_with_keys(s: DynamicLossScale) -> tuple[Any, tuple[int, float, float]]:
    keys = (jax.tree_util.GetAttrKey("loss_scale"), jax.tree_util.GetAttrKey("counter"))
    return tuple(zip(keys, (s.loss_scale, s.counter), strict=True)), (
        s.period,
        s.factor,
        s.min_scale,
    )


def _unflatten(static: tuple[int, float, float], children: Any) -> DynamicLossScale:
    loss_scale, counter = children
    return DynamicLossScale._make(loss_scale, counter, static)


jax.tree_util.register_pytree_with_keys(
    DynamicLossScale, _flatten_with_keys, _unflatten, flatten_func=_flatten
)


def all_finite(tree: Any) -> jax.Array:
    """True when no floating-point leaf of ``tree`` holds an inf or a NaN (a bool scalar).

    In a replica function the answer is the same on every replica: for values
    that are already the same everywhere (gradients after
    ``ctx.all_reduce``, the recommended place to check) it costs no
    communication; for per-replica values it all-reduces one int, so one
    replica's overflow is every replica's.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist.training import all_finite
        >>> bool(all_finite({"w": jnp.ones(3), "b": jnp.float32(jnp.inf)}))
        False
    """
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    checks = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)
    ctx = get_replica_context()
    if ctx is not None and ctx.bound_to_axis and varies(finite, ctx.axis_name):
        agreed = ctx.all_reduce("min", finite.astype(jnp.int32))
        finite = agreed.astype(jnp.bool_)
    return finite


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where the boolean scalar ``pred`` holds, else ``on_false``, leaf by leaf.

    The way to skip an update without Python control flow: compute the new
    state, then keep the old one when the step overflowed,
    ``params = select_tree(finite, new_params, params)``. Works on any pytree
    with array leaves, NNX ``State`` objects and PRNG keys included.

    Raises:
        ValueError: when ``pred`` is not a scalar, or the trees differ in
            structure, shapes or dtypes.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist.training import select_tree
        >>> select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"].tolist()
        [0.0, 0.0]
    """
    p = jnp.asarray(pred)
    if p.shape != ():
        raise ValueError(
            f"select_tree: pred must be a boolean scalar (one decision for the whole tree), "
            f"got shape {p.shape}. Reduce it first, e.g. with all_finite(grads)."
        )
    p = p.astype(jnp.bool_)
    true_leaves = jax.tree_util.tree_flatten_with_path(on_true)[0]
    true_def: Any = jax.tree.structure(on_true)
    false_leaves, false_def = jax.tree.flatten(on_false)
    if true_def != false_def:
        raise ValueError(
            f"select_tree: on_true and on_false must have the same structure; got {true_def} "
            f"and {false_def}. Select between the new and the old value of the same state."
        )
    out = []
    for (path, a), b in zip(true_leaves, false_leaves, strict=True):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"select_tree: leaf {jax.tree_util.keystr(path) or '<root>'} is "
                f"{a.dtype}{list(a.shape)} in on_true but {b.dtype}{list(b.shape)} in "
                "on_false; both trees must hold the same shapes and dtypes."
            )
        out.append(lax.select(jnp.broadcast_to(p, a.shape), a, b))
    return jax.tree.unflatten(true_def, out)
