"""Typed errors (`jaxdist.errors`): each is raised where its cause is found, and is still the
builtin it was before, so ``except ValueError`` / ``except RuntimeError`` keep working."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist import errors


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (errors.DonatedArgumentError, RuntimeError),
        (errors.CheckpointVerificationError, ValueError),
        (errors.StrategyMixingError, RuntimeError),
        (errors.ReplicaDivergenceError, ValueError),
    ],
)
def test_each_typed_error_is_its_builtin(error: type, builtin: type) -> None:
    assert issubclass(error, builtin)
    assert error.__module__ == "jaxdist.errors" and error.__doc__


def test_a_donated_train_state_passed_again() -> None:
    strategy = jd.MirroredStrategy()
    with strategy.scope():  # placed on the strategy's devices: the first step donates it
        state = jd.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))

    @jd.train_step(strategy)
    def step(ctx, state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(state.params)
        return state.apply_gradients(grads=ctx.all_reduce("mean", grads))

    new = step(state, jnp.ones((3,)))
    with pytest.raises(errors.DonatedArgumentError, match=r"`state` .* was donated"):
        step(state, jnp.ones((3,)))
    np.testing.assert_allclose(np.asarray(new.params["w"]), 0.9, rtol=1e-6)  # vs NumPy


def test_mixing_two_strategies() -> None:
    with (
        jd.MirroredStrategy(jax.devices()[:2]).scope(),
        pytest.raises(errors.StrategyMixingError, match="mixing different strategies"),
        jd.OneDeviceStrategy().scope(),
    ):
        pass


def test_parameters_that_differ_between_replicas() -> None:
    from flax import nnx

    strategy = jd.MirroredStrategy()
    with strategy.scope():
        model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @jd.train_step(strategy)
    def step(ctx, model, opt, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)  # no all-reduce: per-replica parameters

    x = jd.PerReplica(jnp.arange(16.0).reshape(8, 1, 2))
    with pytest.raises(errors.ReplicaDivergenceError, match="differs between replicas"):
        step(model, opt, x)


def test_a_mirrored_none_variable_updated_per_replica() -> None:
    strategy = jd.MirroredStrategy()
    with strategy.scope():
        v = jd.Variable(0.0, aggregation="none")
    x = jd.PerReplica(jnp.arange(8.0))
    with pytest.raises(errors.ReplicaDivergenceError, match="aggregation NONE"):
        strategy.run(lambda ctx, v, x: ctx.assign(v, x), args=(v, x))


def test_a_checkpoint_without_its_manifest(tmp_path: Path) -> None:
    pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "ckpt"
    jd.checkpoint.save(path, {"w": jnp.arange(4.0)})
    (path / jd.checkpoint.MANIFEST).unlink()
    with pytest.raises(errors.CheckpointVerificationError, match="no checksum manifest"):
        jd.checkpoint.restore(path, {"w": jnp.zeros(4)})
