"""compute_average_loss and scale_regularization_loss: TF's semantics, plus padded batches.

The TF cases are those of tf.nn's loss-scaling tests, restated; the padded-batch
cases check that a partial last batch trains exactly like a smaller batch on
one device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.training.step.losses import compute_average_loss, scale_regularization_loss

from _helpers import regression_data, value

RTOL = 1e-5


def _mirrored2() -> jd.Strategy:
    return jd.MirroredStrategy(jax.devices()[:2])


def _sum_over_replicas(strategy: jd.Strategy, fn: Any, *args: Any, **kwargs: Any) -> np.ndarray:
    """Runs ``fn(*args, **kwargs)`` on every replica and sums the results (TF's test form)."""
    out = strategy.run(lambda ctx, *a, **k: fn(*a, **k), args=args, kwargs=kwargs)
    return np.asarray(strategy.reduce("sum", out, axis=None))


# TF: global batch size ------------------------------------------------------------


def test_global_batch_size_divides_the_sum() -> None:
    loss = compute_average_loss(jnp.array([1.0, 2.0, 3.0, 4.0, 5.0]), global_batch_size=10)
    assert float(loss) == 1.5


def test_integer_losses_give_a_float() -> None:
    loss = compute_average_loss([1, 2, 3, 4, 5], global_batch_size=10)
    assert loss.dtype == jnp.float32
    assert float(loss) == 1.5


def test_global_batch_size_may_be_a_numpy_or_jax_integer() -> None:
    losses = jnp.array([1.0, 2.0, 3.0])
    assert float(compute_average_loss(losses, global_batch_size=np.int64(6))) == 1.0
    assert float(compute_average_loss(losses, global_batch_size=jnp.int32(6))) == 1.0


def test_traced_global_batch_size_is_used_as_is() -> None:
    f = jax.jit(lambda n: compute_average_loss(jnp.array([2.0, 4.0]), global_batch_size=n))
    assert float(f(jnp.int32(3))) == 2.0
    assert float(f(jnp.int32(0))) == 0.0  # a zero divisor at run time gives zero, as TF


@pytest.mark.parametrize(
    ("size", "match"),
    [
        ([10], r"compute_average_loss: global_batch_size must be scalar, got .*shape \(1,\)"),
        (np.array([2, 3]), r"global_batch_size must be scalar"),
        ([10.0], r"global_batch_size must be scalar"),  # the shape is checked first, as TF
        (-1, r"compute_average_loss: global_batch_size must be non-negative, got -1\. Pass"),
        (np.int64(-3), r"global_batch_size must be non-negative, got -3"),
        (jnp.int32(-2), r"global_batch_size must be non-negative, got -2"),
    ],
)
def test_invalid_global_batch_size(size: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_average_loss([1.0, 2.0, 3.0, 4.0, 5.0], global_batch_size=size)


@pytest.mark.parametrize(
    ("size", "match"),
    [
        (10.0, r"compute_average_loss: global_batch_size must be an integer, got 10\.0 "),
        (np.float32(8), r"global_batch_size must be an integer, got .*8\.0\)? \(dtype float32\)"),
        (jnp.float32(8), r"global_batch_size must be an integer, .*\(dtype float32\)"),
        (True, r"global_batch_size must be an integer, got True \(bool\)\. Pass"),
        (np.bool_(True), r"global_batch_size must be an integer, got .*True_? \(bool\)"),
        ("10", r"global_batch_size must be an integer, got '10' \(dtype <U2\)"),
    ],
)
def test_non_integer_global_batch_size_is_a_type_error(size: Any, match: str) -> None:
    # TF's assert_integer raises TypeError (tf.nn's test passes 10.0); negatives stay ValueError.
    with pytest.raises(TypeError, match=match):
        compute_average_loss([1.0, 2.0, 3.0, 4.0, 5.0], global_batch_size=size)


def test_traced_float_global_batch_size_is_a_type_error() -> None:
    f = jax.jit(lambda n: compute_average_loss(jnp.array([2.0, 4.0]), global_batch_size=n))
    with pytest.raises(TypeError, match=r"global_batch_size must be an integer, .*float32"):
        f(jnp.float32(3))


@pytest.mark.parametrize("size", [0, np.int32(0), jnp.int32(0)])
def test_zero_global_batch_size_gives_zero(size: Any) -> None:
    # TF divides with div_no_nan: an empty global batch has a zero loss, not NaN.
    loss = compute_average_loss(jnp.array([1.0, 2.0, 3.0, 4.0, 5.0]), global_batch_size=size)
    assert float(loss) == 0.0


def test_empty_batch_gives_zero(strategy: jd.Strategy) -> None:
    empty = jnp.zeros((0,), jnp.float32)
    assert float(compute_average_loss(empty)) == 0.0
    assert float(_sum_over_replicas(strategy, compute_average_loss, empty)) == 0.0
    with strategy.scope():
        for weight in (2.0, empty):
            total = _sum_over_replicas(strategy, compute_average_loss, empty, sample_weight=weight)
            assert float(total) == 0.0
    grad = jax.grad(lambda w: compute_average_loss(w * empty))(1.0)
    assert float(grad) == 0.0  # finite: no 0/0 in the backward pass either


def test_rank_0_loss_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"Invalid value passed for `per_example_loss`\. Expected a tensor with at least "
        r"rank 1\. jaxdist\.compute_average_loss got a scalar \(float32\)",
    ):
        compute_average_loss(jnp.float32(2.0))


# TF: default global batch size ----------------------------------------------------


def test_default_without_strategy_is_the_mean() -> None:
    losses = jnp.array([2.5, 6.2, 5.0])
    np.testing.assert_allclose(compute_average_loss(losses), (2.5 + 6.2 + 5.0) / 3, rtol=RTOL)


def test_default_sums_to_the_mean_over_replicas(strategy: jd.Strategy) -> None:
    losses = jnp.array([2.5, 6.2, 5.0])
    total = _sum_over_replicas(strategy, compute_average_loss, losses)
    np.testing.assert_allclose(total, (2.5 + 6.2 + 5.0) / 3, rtol=RTOL)


def test_default_divides_by_rows_times_replicas(strategy: jd.Strategy) -> None:
    n = strategy.num_replicas_in_sync
    per_replica = jd.PerReplica(jnp.arange(n * 4, dtype=jnp.float32).reshape(n, 4))
    out = strategy.run(lambda ctx, x: compute_average_loss(x), args=(per_replica,))
    np.testing.assert_allclose(
        value(out).reshape(n), np.arange(n * 4).reshape(n, 4).sum(1) / (4 * n), rtol=RTOL
    )


# TF: sample weights ---------------------------------------------------------------


@pytest.mark.parametrize("make", [_mirrored2, jd.MirroredStrategy, jd.OneDeviceStrategy])
def test_sample_weights_scale_and_do_not_renormalise(make: Any) -> None:
    strategy = make()
    with strategy.scope():
        total = _sum_over_replicas(
            strategy, compute_average_loss, jnp.array([2.0, 4.0, 6.0]), sample_weight=2.0
        )
        np.testing.assert_allclose(total, (2.0 + 4.0 + 6.0) * 2.0 / 3, rtol=RTOL)
        total = _sum_over_replicas(
            strategy,
            compute_average_loss,
            jnp.array([2.0, 4.0, 6.0]),
            sample_weight=jnp.array([0.3, 0.5, 0.2]),
        )
        np.testing.assert_allclose(total, (2.0 * 0.3 + 4.0 * 0.5 + 6.0 * 0.2) / 3, rtol=RTOL)
        # Time-step weights: one per element of a (batch, time) loss.
        total = _sum_over_replicas(
            strategy,
            compute_average_loss,
            jnp.array([[2.0, 0.5], [4.0, 1.0]]),
            sample_weight=jnp.array([[0.3, 0.7], [0.2, 0.8]]),
        )
        np.testing.assert_allclose(
            total, (2.0 * 0.3 + 0.5 * 0.7 + 4.0 * 0.2 + 1.0 * 0.8) / 2, rtol=RTOL
        )


def test_sample_weights_are_squeezed_or_expanded_by_one_axis() -> None:
    loss = jnp.array([[2.0, 0.5], [4.0, 1.0]])
    per_example = jnp.array([0.5, 2.0])  # (2,) on a (2, 2) loss: one weight per row
    expected = ((2.0 + 0.5) * 0.5 + (4.0 + 1.0) * 2.0) / 2
    np.testing.assert_allclose(compute_average_loss(loss, per_example), expected, rtol=RTOL)
    column = jnp.array([[0.5], [2.0]])  # (2, 1) on a (2,) loss: squeezed
    np.testing.assert_allclose(
        compute_average_loss(jnp.array([2.0, 4.0]), column), (1.0 + 8.0) / 2, rtol=RTOL
    )


@pytest.mark.parametrize(
    ("loss", "weights", "shapes"),
    [
        (
            [2.5, 6.2, 5.0],
            [0.2, 0.8],
            r"\(2,\) does not broadcast to per_example_loss of shape "
            r"\(3,\) \(Incompatible shapes: \[3\] vs\. \[2\]\)",
        ),
        ([[1.0, 2.0]], np.ones((1, 2, 3)), r"\(1, 2, 3\) does not broadcast .* shape \(1, 2\)"),
        ([1.0, 2.0], [[1.0, 2.0], [3.0, 4.0]], r"\(2, 2\) does not broadcast"),
    ],
)
def test_mismatched_sample_weights(loss: Any, weights: Any, shapes: str) -> None:
    with pytest.raises(ValueError, match=r"compute_average_loss: sample_weight of shape " + shapes):
        compute_average_loss(loss, sample_weight=weights, global_batch_size=10)


# TF: dtypes ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_output_dtype_follows_the_input(strategy: jd.Strategy, dtype: Any) -> None:
    losses = jnp.array([2.0, 4.0, 6.0], dtype)
    out = strategy.run(lambda ctx, x: compute_average_loss(x, sample_weight=2), args=(losses,))
    total = strategy.reduce("sum", out, axis=None)
    assert total.dtype == dtype
    np.testing.assert_allclose(np.asarray(total, np.float32), 8.0, rtol=1e-2)


def test_half_precision_sums_in_float32() -> None:
    # 4096 ones in float16: a float16 running sum stalls at 2048; float32 does not.
    losses = jnp.ones((4096,), jnp.float16)
    loss = compute_average_loss(losses, global_batch_size=4096)
    assert loss.dtype == jnp.float16
    assert float(loss) == 1.0


# TF: cross-replica context --------------------------------------------------------


@pytest.mark.parametrize("make", [_mirrored2, jd.OneDeviceStrategy])
def test_cross_replica_context_is_refused(make: Any) -> None:
    strategy = make()
    with (
        strategy.scope(),
        pytest.raises(
            RuntimeError,
            match=r"You are calling `compute_average_loss` in cross replica context, while it "
            r"was expected to be called in replica context\. jaxdist\.compute_average_loss must "
            r"be called inside the replica function .* or be given global_batch_size=",
        ),
    ):
        compute_average_loss([2.0, 3.0])


def test_cross_replica_context_with_global_batch_size_computes() -> None:
    with _mirrored2().scope():  # as in TF: an explicit size needs no replica context
        assert float(compute_average_loss([2.0, 4.0], global_batch_size=4)) == 1.5


def test_merge_fn_is_cross_replica_context() -> None:
    strategy = _mirrored2()

    def fn(ctx: jd.ReplicaContext) -> Any:
        return ctx.merge_call(lambda s: compute_average_loss(jnp.array([1.0])))

    with pytest.raises(RuntimeError, match="You are calling `compute_average_loss` in cross"):
        strategy.run(fn)


# TF: scale_regularization_loss ----------------------------------------------------


def test_scale_regularization_loss_without_strategy_is_the_sum() -> None:
    reg = jnp.array([2.5, 6.2, 5.0])
    np.testing.assert_allclose(scale_regularization_loss(reg), 2.5 + 6.2 + 5.0, rtol=RTOL)


def test_scale_regularization_loss_sums_to_the_loss_over_replicas(strategy: jd.Strategy) -> None:
    reg = jnp.array([2.5, 6.2, 5.0])
    with strategy.scope():
        total = _sum_over_replicas(strategy, scale_regularization_loss, reg)
    np.testing.assert_allclose(total, 2.5 + 6.2 + 5.0, rtol=RTOL)
    n = strategy.num_replicas_in_sync
    out = strategy.run(lambda ctx: scale_regularization_loss(reg))
    np.testing.assert_allclose(value(out).reshape(-1)[0], (2.5 + 6.2 + 5.0) / n, rtol=RTOL)


def test_scale_regularization_loss_takes_a_list_of_terms() -> None:
    terms = [jnp.float32(1.0), jnp.ones((2, 2)), 3]
    assert float(scale_regularization_loss(terms)) == 8.0
    assert scale_regularization_loss([jnp.bfloat16(1.0)]).dtype == jnp.bfloat16
    assert scale_regularization_loss([1, 2]).dtype == jnp.float32
    assert float(scale_regularization_loss([])) == 0.0


def test_scale_regularization_loss_in_cross_replica_context() -> None:
    with (
        _mirrored2().scope(),
        pytest.raises(
            RuntimeError,
            match=r"You are calling `scale_regularization_loss` in cross replica context, "
            r"while it was expected to be called in replica context\.",
        ),
    ):
        scale_regularization_loss([2.0, 3.0])


# jaxdist: padded partial batches -------------------------------------------------

_ROWS, _BATCH = 100, 32


def _data() -> tuple[np.ndarray, np.ndarray]:
    return regression_data(_ROWS, 3)


_W = {"w": jnp.array([0.3, -0.2, 0.5]), "b": jnp.array(0.7)}


def _per_example(params: Any, x: Any, y: Any) -> Any:
    # The bias makes the loss of a padded (all-zero) row nonzero, so unmasked padding shows.
    return (x @ params["w"] + params["b"] - y) ** 2


def _batches(rows: int, batch: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + batch, rows)) for lo in range(0, rows, batch)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [jd.MirroredStrategy, _mirrored2, jd.OneDeviceStrategy])
def test_partial_batch_equals_single_device_training(make: Any) -> None:
    strategy = make()
    x, y = _data()
    dataset = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=_BATCH))

    def step(ctx: jd.ReplicaContext, params: Any, batch: Any) -> Any:
        xb, yb = batch
        loss_fn = lambda p: compute_average_loss(_per_example(p, xb, yb))  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return ctx.all_reduce("sum", loss), ctx.all_reduce("sum", grads)

    run = strategy.function(step)
    seen = 0
    for (lo, hi), batch in zip(_batches(_ROWS, _BATCH), dataset, strict=True):
        loss, grads = run(_W, batch)
        np.testing.assert_allclose(
            value(loss), np.mean(np.asarray(_per_example(_W, x[lo:hi], y[lo:hi]))), rtol=RTOL
        )
        ref = jax.grad(lambda p: jnp.mean(_per_example(p, x[lo:hi], y[lo:hi])))(_W)  # noqa: B023
        for key in ref:
            np.testing.assert_allclose(value(grads[key]), ref[key], rtol=RTOL, atol=1e-7)
        seen += hi - lo
    assert seen == _ROWS  # the partial last batch (4 rows) was trained on


@pytest.mark.parametrize("make", [jd.MirroredStrategy, jd.OneDeviceStrategy])
def test_partial_batch_with_global_batch_size_masks_and_divides_by_it(make: Any) -> None:
    strategy = make()
    x, y = _data()
    batches = list(
        strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=_BATCH))
    )

    def step(ctx: jd.ReplicaContext, batch: Any) -> Any:
        xb, yb = batch
        per_example = _per_example(_W, xb, yb)
        weights = jnp.full(per_example.shape, 0.5)
        return ctx.all_reduce(
            "sum",
            (
                compute_average_loss(per_example, global_batch_size=_BATCH),
                compute_average_loss(per_example, weights, global_batch_size=_BATCH),
            ),
        )

    plain, weighted = strategy.run(step, args=(batches[-1],))
    real = np.asarray(_per_example(_W, x[96:], y[96:]))  # 4 data rows, the rest padding
    np.testing.assert_allclose(value(plain), real.sum() / _BATCH, rtol=RTOL)
    np.testing.assert_allclose(value(weighted), 0.5 * real.sum() / _BATCH, rtol=RTOL)


def test_padded_rows_weigh_nothing_per_replica() -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data()
    last = list(
        strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=_BATCH))
    )[-1]
    # 4 rows over 8 replicas: one row each on replicas 0-3, none on 4-7.
    out = strategy.run(lambda ctx, b: compute_average_loss(_per_example(_W, *b)), args=(last,))
    real = np.asarray(_per_example(_W, x[96:], y[96:]))
    np.testing.assert_allclose(value(out), np.r_[real / 4, np.zeros(4)], rtol=RTOL)
