"""`jd.train_step` and `jd.TrainState` against plain single-device Flax/optax training.

Every distributed run is compared with the same optimizer steps on one device
over the same global batches. Tolerance: float32, rtol 1e-5 / atol 1e-6 (the
all-reduce sums per-replica gradients in a different order than one device
sums per-example ones; after 20 adamw steps the difference stays below 1e-6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

import jaxdist as jd

from _helpers import (
    TanhMLP,
    all_reduce_count,
    classification_data,
    hand_written_step_hlo,
    strategy_params,
)

STEPS, BATCH = 20, 32
RTOL, ATOL = 1e-5, 1e-6


def _strategies() -> list:
    return strategy_params("one_device", "mirrored2", "mirrored8", "central8")


MLP = functools.partial(TanhMLP, (12, 16, 4))


class CNN(nnx.Module):
    """The digits demo's network, smaller: 8x8x1 images, 10 classes."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.dense = nnx.Linear(8 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.relu(self.conv(x))
        h = nnx.avg_pool(h, window_shape=(2, 2), strides=(2, 2))
        return self.dense(h.reshape(h.shape[0], -1))


def _batches(kind: str, steps: int = STEPS, batch: int = BATCH, seed: int = 0):
    if kind == "mlp":
        return classification_data((steps, batch), 12, 4, seed)
    return classification_data((steps, batch), (8, 8, 1), 10, seed)


def _split(strategy: jd.Strategy, a: np.ndarray) -> jd.PerReplica:
    n = strategy.num_replicas_in_sync
    return jd.PerReplica(a.reshape(n, a.shape[0] // n, *a.shape[1:]))


def _ce(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _reference_nnx(make, xs, ys, tx):
    model = make(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(_ce(m(x), y)))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, x, y)) for x, y in zip(xs, ys, strict=True)]
    return model, opt, losses


def _nnx_train_step(strategy: jd.Strategy):
    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):
        global_batch = x.shape[0] * ctx.num_replicas_in_sync

        def loss_fn(m):
            return jnp.sum(_ce(m(x), y)) / global_batch  # this replica's share of the mean

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return {"loss": ctx.all_reduce("sum", loss)}

    return step


def _assert_params_close(a, b) -> None:
    la, lb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=RTOL, atol=ATOL), la, lb)


@pytest.mark.parametrize("make_strategy", _strategies())
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_nnx_training_equals_single_device(make_strategy, kind: str) -> None:
    strategy = make_strategy()
    make = MLP if kind == "mlp" else CNN
    tx = optax.adamw(1e-2)
    xs, ys = _batches(kind)
    with strategy.scope():
        model = make(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = _nnx_train_step(strategy)
    losses = [
        float(step(model, opt, _split(strategy, x), _split(strategy, y))["loss"])
        for x, y in zip(xs, ys, strict=True)
    ]
    ref_model, ref_opt, ref_losses = _reference_nnx(make, xs, ys, tx)
    assert int(ref_opt.step.get_value()) == STEPS
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    _assert_params_close(model, ref_model)
    assert int(opt.step.get_value()) == STEPS
    # One replicated copy of every parameter; the model works outside the step.
    kernel = model.l1.kernel.get_raw_value() if kind == "mlp" else model.conv.kernel.get_raw_value()
    assert isinstance(kernel, jax.Array)
    assert kernel.sharding.is_fully_replicated or len(kernel.devices()) == 1
    x = xs[0][:3]
    np.testing.assert_allclose(model(x), ref_model(x), rtol=RTOL, atol=1e-5)


def test_second_call_does_not_retrace_and_updates_in_place() -> None:
    strategy = jd.MirroredStrategy()
    traces = []
    with strategy.scope():
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):
        traces.append(1)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(_ce(m(x), y)))(model)
        opt.update(model, ctx.all_reduce("mean", grads))
        return ctx.all_reduce("mean", loss)

    xs, ys = _batches("mlp", steps=3)
    kernel = model.l1.kernel
    before = np.asarray(kernel.get_raw_value())
    for x, y in zip(xs, ys, strict=True):
        loss = step(model, opt, _split(strategy, x), _split(strategy, y))
    assert len(traces) == 1
    assert isinstance(loss, jax.Array) and loss.shape == ()  # replica-invariant: a plain array
    assert model.l1.kernel is kernel  # the same Variable object, new value
    assert not np.allclose(kernel.get_raw_value(), before)


def test_structure_change_between_steps_is_followed() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = _nnx_train_step(strategy)
    xs, ys = _batches("mlp", steps=2)
    step(model, opt, _split(strategy, xs[0]), _split(strategy, ys[0]))
    # Replace a layer (a new Variable object): the cached traversal must notice.
    model.l2 = nnx.Linear(16, 4, rngs=nnx.Rngs(5))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, state = nnx.split(model)
    ref = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))  # own buffers: model's are donated
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    step(model, opt, _split(strategy, xs[1]), _split(strategy, ys[1]))
    _, grads = nnx.value_and_grad(lambda m: jnp.mean(_ce(m(xs[1]), ys[1])))(ref)
    ref_opt.update(ref, grads)
    _assert_params_close(model, ref)


def test_structure_change_inside_the_step_is_an_error() -> None:
    model = MLP(nnx.Rngs(0))

    @jd.train_step(jd.MirroredStrategy(jax.devices()[:2]))
    def step(ctx, model, x):
        model.extra = nnx.Param(jnp.ones(2))
        return ctx.all_reduce("sum", jnp.sum(model(x)))

    with pytest.raises(ValueError, match=r"structure of the NNX objects changed inside the step"):
        step(model, jd.PerReplica(np.ones((2, 3, 12), np.float32)))


def test_dropout_differs_per_replica_and_streams_stay_replicated() -> None:
    strategy = jd.MirroredStrategy()
    rngs = nnx.Rngs(dropout=0)
    drop = nnx.Dropout(0.5, rngs=rngs)
    key_before = np.asarray(jax.random.key_data(rngs.dropout.key.get_raw_value()))

    @jd.train_step(strategy)
    def step(ctx, drop, x):
        return drop(x)

    out = step(drop, jnp.ones((64,)))
    assert isinstance(out, jd.PerReplica)  # each replica drew its own mask
    masks = {tuple(np.asarray(r) != 0) for r in strategy.experimental_local_results(out)}
    assert len(masks) == 8
    assert int(rngs.dropout.count.get_raw_value()) == 1  # advanced once, on every replica
    np.testing.assert_array_equal(jax.random.key_data(rngs.dropout.key.get_raw_value()), key_before)


def test_batch_norm_statistics_are_averaged_across_replicas() -> None:
    strategy = jd.MirroredStrategy()
    bn = nnx.BatchNorm(3, momentum=0.0, rngs=nnx.Rngs(0))  # momentum 0: stats = this batch's

    @jd.train_step(strategy)
    def step(ctx, bn, x):
        return ctx.all_reduce("mean", jnp.mean(bn(x)))

    x = (
        np.random.default_rng(0).normal(size=(8, 5, 3)).astype(np.float32)
        * np.arange(1, 9)[:, None, None]
    )
    step(bn, jd.PerReplica(x))
    mean = bn.batch_stats_mean if hasattr(bn, "batch_stats_mean") else bn.mean
    np.testing.assert_allclose(mean.get_raw_value(), x.mean(axis=1).mean(axis=0), rtol=1e-5)
    assert mean.get_raw_value().sharding.is_fully_replicated


def test_no_all_reduce_beyond_the_hand_written_step() -> None:
    strategy = jd.MirroredStrategy()
    tx = optax.adamw(1e-3)
    xs, ys = _batches("mlp", steps=1)
    with strategy.scope():
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = _nnx_train_step(strategy)
    ours = step.lower(model, opt, _split(strategy, xs[0]), _split(strategy, ys[0]))
    ours_hlo = ours.compile().as_text()

    hand_hlo = hand_written_step_hlo(strategy, MLP(nnx.Rngs(0)), tx, _ce, xs[0], ys[0])
    assert 1 <= all_reduce_count(ours_hlo) <= all_reduce_count(hand_hlo)
    assert "all-gather" not in ours_hlo
    assert ours.compile().memory_analysis() is not None


# Linen + TrainState ------------------------------------------------------------------


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(4)(jnp.tanh(linen.Dense(16)(x)))


@pytest.mark.parametrize("make_strategy", _strategies())
def test_linen_train_state_equals_single_device(make_strategy) -> None:
    strategy = make_strategy()
    module = LinenMLP()
    params = module.init(jax.random.key(0), jnp.ones((1, 12)))["params"]
    tx = optax.adamw(1e-2)
    with strategy.scope():
        state = jd.TrainState.create(apply_fn=module.apply, params=params, tx=tx)

    @jd.train_step(strategy)
    def step(ctx, state, x, y):
        global_batch = x.shape[0] * ctx.num_replicas_in_sync

        def loss_fn(p):
            return jnp.sum(_ce(state.apply_fn({"params": p}, x), y)) / global_batch

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state = state.apply_gradients(grads=ctx.all_reduce("sum", grads))
        return state, ctx.all_reduce("sum", loss)

    ref = jd.TrainState.create(apply_fn=module.apply, params=params, tx=tx)

    @jax.jit
    def ref_step(state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(_ce(state.apply_fn({"params": p}, x), y))
        )(state.params)
        return state.apply_gradients(grads=grads), loss

    xs, ys = _batches("mlp")
    for x, y in zip(xs, ys, strict=True):
        state, loss = step(state, _split(strategy, x), _split(strategy, y))
        ref, ref_loss = ref_step(ref, x, y)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert int(state.step) == STEPS
    leaves = jax.tree.leaves(state)
    assert all(isinstance(v, jax.Array) for v in leaves)  # plain arrays, one copy each
    assert all(v.sharding.is_fully_replicated for v in leaves)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
        state.params,
        ref.params,
    )


def test_train_state_fields_and_errors() -> None:
    state = jd.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(1.0), batch_stats={"m": 0.0}
    )
    assert state.batch_stats == {"m": 0.0}
    state2 = state.replace(batch_stats={"m": 1.0}, step=jnp.int32(5))
    assert int(state2.step) == 5 and state2.batch_stats == {"m": 1.0}
    assert jax.tree.structure(state) == jax.tree.structure(state2)
    with pytest.raises(AttributeError, match=r"TrainState has no field 'nope'"):
        _ = state.nope
    with pytest.raises(AttributeError, match=r"TrainState is immutable"):
        state.step = 3
    with pytest.raises(TypeError, match=r"tx must be an optax GradientTransformation"):
        jd.TrainState.create(apply_fn=None, params={}, tx=3)
    with pytest.raises(ValueError, match=r"reserved"):
        jd.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(1.0), step=1)
    path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(state)[0][0][0])
    assert path == ".step"


def test_strategy_from_scope_and_decorator_forms() -> None:
    seen = []

    @jd.train_step
    def step(ctx, x):
        seen.append(ctx.num_replicas_in_sync)
        return ctx.all_reduce("sum", x)

    with jd.MirroredStrategy(jax.devices()[:2]).scope():
        assert float(step(jnp.float32(1.0))) == 2.0
    assert float(step(jnp.float32(1.0))) == 1.0  # the default strategy outside a scope
    assert seen == [2, 1]
    with pytest.raises(TypeError, match=r"expected a strategy or the step function"):
        jd.train_step(3)
    with pytest.raises(TypeError, match=r"donate must be a bool"):
        jd.train_step(donate="yes")


def test_donated_train_state_is_consumed() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        state = jd.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))

    @jd.train_step(strategy)
    def step(ctx, state):
        return state.apply_gradients(grads={"w": ctx.all_reduce("mean", jnp.ones(3))})

    new = step(state)
    assert state.params["w"].is_deleted()  # donated
    np.testing.assert_allclose(new.params["w"], np.full(3, 0.9), rtol=1e-6)
    kept = jd.train_step(strategy, donate=False)(lambda ctx, s: s.replace(step=s.step + 1))
    again = kept(new)
    assert not new.params["w"].is_deleted() and int(again.step) == 2
