"""`StepOptions`: a train step's options as one frozen record, and `TrainStep.replace`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd


def _step(strategy: jd.Strategy) -> jd.TrainStep:
    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, ctx.all_reduce("mean", grads))
        return ctx.all_reduce("mean", loss)

    return step


def test_options_are_a_frozen_checked_record() -> None:
    step = _step(jd.MirroredStrategy())
    assert step.options == jd.training.StepOptions(strategy=step.strategy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.options.donate = False  # type: ignore[misc]
    assert jd.training.StepOptions(donate_argnums=2).donate_argnums == (2,)
    with pytest.raises(ValueError, match=r"steps_per_execution must be an int >= 1"):
        jd.training.StepOptions(steps_per_execution=0)
    with pytest.raises(ValueError, match=r"update_state=False .* steps_per_execution > 1"):
        step.replace(update_state=False, steps_per_execution=2)


def test_replace_makes_an_evaluation_step_of_a_training_step() -> None:
    """The replaced step runs the same function with its own options: the training step
    trains (as plain NumPy gradient descent does), the evaluation form writes nothing."""
    strategy = jd.MirroredStrategy()
    with strategy.scope():
        model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = _step(strategy)
    evaluate = step.replace(update_state=False, donate=False)
    assert evaluate.fn is step.fn and evaluate.options.update_state is False
    assert step.options.update_state is None  # the original is unchanged
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2) / 16
    y = x @ np.array([[1.0], [-1.0]], np.float32)
    w = np.asarray(model.kernel[...]).copy()
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    with pytest.raises(ValueError, match=r"update_state=False"):
        evaluate(model, opt, *batch)  # it would train: refused, nothing written
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), w)
    step(model, opt, *batch)
    expected = w - 0.1 * (2 * x.T @ (x @ w - y) / len(x))
    np.testing.assert_allclose(np.asarray(model.kernel[...]), expected, rtol=1e-5, atol=1e-6)
