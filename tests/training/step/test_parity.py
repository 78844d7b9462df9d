"""Training parity: distributed training equals plain single-device Flax training.

The digits demo's CNN (`jaxdist.examples.digits.CNN`, narrowed) as an NNX
model, and its Linen twin in a `jd.TrainState`, train for 20 adamw steps under
every local strategy; the parameters must equal those of plain single-device
Flax training (``nnx.jit`` + ``nnx.Optimizer``; ``jax.jit`` + Flax's own
``flax.training.train_state.TrainState``) on the same global batches:

- full batches, the per-replica losses from `jd.compute_average_loss` and the
  gradients all-reduced once per step;
- the same with `jd.accumulate_gradients` over 4 micro-batches of each
  replica's batch, against the reference's one batch;
- a dataset whose last batch is partial (100 rows at 32: 32, 32, 32, 4),
  distributed padded by ``experimental_distribute_dataset``, against
  single-device training on that smaller batch.

Tolerance: float32, rtol 1e-5 / atol 1e-6 on parameters and losses. The
all-reduce adds per-replica partial sums in another order than one device
adds per-example terms (relative rounding ~1e-7 per step); 20 adam steps
keep the parameter differences below 1e-6. Every step is traced once: each
(strategy, API, accumulation) step is built once and shared by the tests,
and the padded last batch has the shapes of a full one, so after the first
call nothing retraces (counted).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state as flax_train_state

import jaxdist as jd
from jaxdist.examples import digits

from _helpers import classification_data

STEPS, BATCH, MICRO = 20, 32, 4
RTOL, ATOL = 1e-5, 1e-6
FEATURES, HIDDEN = (4, 8), 16  # the demo's CNN, narrower: fast to compile on 2 cores
# (rows, epochs): 20 full batches; or 100 rows (3 full batches and one of 4) for 5 epochs.
DATASETS = {"full": (STEPS * BATCH, 1), "partial": (100, 5)}

_STRATEGIES: dict[str, Callable[[], jd.Strategy]] = {
    "one_device": lambda: jd.OneDeviceStrategy(),
    "mirrored2": lambda: jd.MirroredStrategy(jax.devices()[:2]),
    "mirrored8": lambda: jd.MirroredStrategy(),
    "central_storage": lambda: jd.CentralStorageStrategy(),
}


# One optimizer object for every model: optax transformations are pure, and the optimizer
# is static in a step's signature (a new ``optax.adamw(...)`` would be a new program).
TX = optax.adamw(3e-3, weight_decay=1e-4)


def _ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


@functools.cache
def _data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    return classification_data(rows, (8, 8, 1), 10, seed=rows)


def _slices(rows: int, epochs: int) -> list[slice]:
    """The global batches of ``jd.data.from_arrays(..., batch_size=BATCH)``, epoch by epoch."""
    one = [slice(lo, min(lo + BATCH, rows)) for lo in range(0, rows, BATCH)]
    return one * epochs


def _new_cnn() -> digits.CNN:
    return digits.CNN(nnx.Rngs(0), features=FEATURES, hidden=HIDDEN)


class LinenCNN(linen.Module):
    """The Linen twin of the narrowed digits CNN."""

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = linen.relu(linen.Conv(FEATURES[0], (3, 3))(x))
        x = linen.relu(linen.Conv(FEATURES[1], (3, 3))(x))
        x = linen.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = linen.relu(linen.Dense(HIDDEN)(x.reshape(x.shape[0], -1)))
        return linen.Dense(10)(x)


LINEN = LinenCNN()  # one module: its bound ``apply`` is static in a TrainState's signature


@functools.cache
def _linen_params() -> Any:
    return LINEN.init(jax.random.key(0), jnp.ones((1, 8, 8, 1)))["params"]


# Single-device references (plain Flax, no jaxdist) -----------------------------------


@functools.cache
def _nnx_reference(dataset: str) -> tuple[list[np.ndarray], list[float]]:
    """Parameters (in `nnx.state` order) and per-step losses of plain NNX training."""
    rows, epochs = DATASETS[dataset]
    x, y = _data(rows)
    model = _new_cnn()
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def step(model: digits.CNN, opt: nnx.Optimizer, xb: jax.Array, yb: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(_ce(m(xb), yb)))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, x[s], y[s])) for s in _slices(rows, epochs)]
    return [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))], losses


@functools.cache
def _linen_reference(dataset: str) -> tuple[Any, list[float]]:
    """Parameters and per-step losses of Linen training with Flax's own TrainState."""
    rows, epochs = DATASETS[dataset]
    x, y = _data(rows)
    state = flax_train_state.TrainState.create(apply_fn=LINEN.apply, params=_linen_params(), tx=TX)

    @jax.jit
    def step(state: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, jax.Array]:
        def loss_fn(p: Any) -> jax.Array:
            return jnp.mean(_ce(state.apply_fn({"params": p}, xb), yb))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for s in _slices(rows, epochs):
        state, loss = step(state, x[s], y[s])
        losses.append(float(loss))
    return jax.tree.map(np.asarray, state.params), losses


# Distributed steps: one per (strategy, API, accumulation), shared by the tests -------


@functools.cache
def _strategy(name: str) -> jd.Strategy:
    return _STRATEGIES[name]()


@functools.cache
def _nnx_step(name: str, micro: int | None) -> tuple[Any, list[int]]:
    traces: list[int] = []

    def loss_fn(model: digits.CNN, batch: Any) -> jax.Array:
        images, labels = batch
        return jd.compute_average_loss(_ce(model(images), labels))

    @jd.train_step(_strategy(name))
    def step(ctx: jd.ReplicaContext, model: digits.CNN, opt: nnx.Optimizer, batch: Any) -> Any:
        traces.append(1)
        if micro is None:
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        else:
            loss, grads = jd.accumulate_gradients(loss_fn, model, batch, micro)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    return step, traces


@functools.cache
def _linen_step(name: str, micro: int | None) -> tuple[Any, list[int]]:
    traces: list[int] = []

    @jd.train_step(_strategy(name))
    def step(ctx: jd.ReplicaContext, state: jd.TrainState, batch: Any) -> Any:
        traces.append(1)

        def loss_fn(params: Any, batch: Any) -> jax.Array:
            images, labels = batch
            return jd.compute_average_loss(_ce(state.apply_fn({"params": params}, images), labels))

        if micro is None:
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        else:
            loss, grads = jd.accumulate_gradients(loss_fn, state.params, batch, micro)
        state = state.apply_gradients(grads=ctx.all_reduce("sum", grads))
        return state, ctx.all_reduce("sum", loss)

    return step, traces


def _batches(strategy: jd.Strategy, dataset: str) -> list[Any]:
    """The distributed global batches of ``dataset``, every epoch."""
    rows, epochs = DATASETS[dataset]
    data = jd.data.from_arrays(*_data(rows), batch_size=BATCH)
    dist = strategy.experimental_distribute_dataset(data)
    batches = [batch for _ in range(epochs) for batch in dist]
    assert len(batches) == STEPS
    return batches


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    assert a_def == e_def, what
    for a, e in zip(a_leaves, e_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), e, rtol=RTOL, atol=ATOL, err_msg=what)


_CASES = [
    pytest.param(name, dataset, micro, id=f"{name}-{dataset}-{'acc4' if micro else 'whole'}")
    for name in _STRATEGIES
    for dataset in DATASETS
    for micro in (None, MICRO)
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "dataset", "micro"), _CASES)
def test_nnx_digits_cnn_equals_single_device(name: str, dataset: str, micro: int | None) -> None:
    strategy = _strategy(name)
    step, traces = _nnx_step(name, micro)
    with strategy.scope():
        model = _new_cnn()
        opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    losses = [float(step(model, opt, batch)) for batch in _batches(strategy, dataset)]
    ref_params, ref_losses = _nnx_reference(dataset)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    params = [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    _assert_close(params, ref_params, f"{name} {dataset} micro={micro}")
    assert int(opt.step.get_value()) == STEPS
    assert len(traces) == 1  # the first call traced; every later one (padded too) did not


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "dataset", "micro"), _CASES)
def test_linen_train_state_equals_flax_train_state(
    name: str, dataset: str, micro: int | None
) -> None:
    strategy = _strategy(name)
    step, traces = _linen_step(name, micro)
    with strategy.scope():
        state = jd.TrainState.create(apply_fn=LINEN.apply, params=_linen_params(), tx=TX)
    losses = []
    for batch in _batches(strategy, dataset):
        state, loss = step(state, batch)
        losses.append(float(loss))
    ref_params, ref_losses = _linen_reference(dataset)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    _assert_close(state.params, ref_params, f"{name} {dataset} micro={micro}")
    assert int(state.step) == STEPS
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))  # one copy each
    assert len(traces) == 1


def test_the_partial_batch_is_really_partial_and_padded() -> None:
    """Guards the partial-batch cases: the last batch holds 4 real rows in a padded batch of
    the full shape (so those cases do test padding, and share the full batches' program)."""
    strategy = _strategy("mirrored8")
    batches = _batches(strategy, "partial")
    images = batches[3][0]
    assert isinstance(images, jd.PerReplica)
    assert images.array.shape == (8, BATCH // 8, 8, 8, 1)
    assert np.asarray(images.valid).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert int(np.asarray(batches[0][0].valid).sum()) == BATCH
