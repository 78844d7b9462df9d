"""`jd.train_step(..., steps_per_execution=k)`: k steps in one call, against single steps
and plain single-device JAX.

Tolerances: grouped vs single jaxdist steps rtol 1e-6 / atol 1e-7 (the same programs;
XLA may fuse the scanned step differently, float32); jaxdist vs the single-device
reference rtol 1e-5 / atol 1e-6 (per-replica gradients are summed in another order
than one device sums per-example ones).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd

from _helpers import TanhMLP, mse_step, regression_data, small_nnx_model, strategy_params

BATCH = 16
ROWS = 88  # 5 full batches of 16 and a partial one of 8
SAME = {"rtol": 1e-6, "atol": 1e-7}
REF = {"rtol": 1e-5, "atol": 1e-6}


MLP = functools.partial(TanhMLP, (6, 16, 3), dropout=0.0)  # the model of small_nnx_model


def _data(rows: int = ROWS) -> tuple[np.ndarray, np.ndarray]:
    return regression_data(rows, 6, 3)


def _iterator(strategy: jd.Strategy, rows: int = ROWS):
    return iter(
        strategy.experimental_distribute_dataset(
            jd.data.from_arrays(*_data(rows), batch_size=BATCH)
        )
    )


def _run_all(step, model, opt, it) -> list:
    outs = []
    while True:
        try:
            outs.append(step(model, opt, it))
        except StopIteration:
            return outs


def _single_steps(strategy: jd.Strategy, dropout: float = 0.0):
    model, opt = small_nnx_model(strategy, dropout)
    step = mse_step(strategy)
    losses = [float(step(model, opt, batch)) for batch in _iterator(strategy)]
    return np.array(losses), model


def _reference(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, MLP]:
    """Plain single-device NNX over the same global batches (the last one of 8 rows)."""
    model = MLP(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, xb, yb):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(xb) - yb) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [
        float(step(model, opt, x[i : i + BATCH], y[i : i + BATCH])) for i in range(0, len(x), BATCH)
    ]
    return np.array(losses), model


def _params(model) -> list[np.ndarray]:
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize(
    "make_strategy", strategy_params("one_device", "mirrored2", "mirrored8", "central8")
)
def test_grouped_steps_equal_single_steps_and_plain_jax(make_strategy) -> None:
    strategy = make_strategy()
    model, opt = small_nnx_model(strategy)
    step = mse_step(strategy, steps_per_execution=4, stack_outputs=True)
    outs = _run_all(step, model, opt, _iterator(strategy))
    # 6 batches: a group of 4 in one program, then a full batch and the padded last one.
    assert [np.shape(o) for o in outs] == [(4,), (2,)]
    grouped = np.concatenate([np.asarray(o) for o in outs])
    single, single_model = _single_steps(strategy)
    ref, ref_model = _reference(*_data())
    np.testing.assert_allclose(grouped, single, **SAME)
    np.testing.assert_allclose(grouped, ref, **REF)
    for a, b, c in zip(_params(model), _params(single_model), _params(ref_model), strict=True):
        np.testing.assert_allclose(a, b, **SAME)
        np.testing.assert_allclose(a, c, **REF)


def test_each_call_takes_exactly_k_batches_and_returns_the_last_steps_outputs() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = small_nnx_model(strategy)
    step = mse_step(strategy, steps_per_execution=3)
    it = _iterator(strategy)
    last = step(model, opt, it)
    assert np.shape(last) == ()
    x, _ = _data()
    following = next(it)[0]  # the 4th batch: rows 48..63
    np.testing.assert_array_equal(np.asarray(following.array).reshape(-1, 6), x[48:64])
    single, _ = _single_steps(strategy)
    np.testing.assert_allclose(float(last), single[2], **SAME)


def test_a_short_last_group_runs_and_an_empty_iterator_stops() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = small_nnx_model(strategy)
    step = mse_step(strategy, steps_per_execution=4, stack_outputs=True)
    it = _iterator(strategy, rows=96)  # 6 full batches: groups of 4 and 2
    outs = [step(model, opt, it), step(model, opt, it)]
    assert [np.shape(o) for o in outs] == [(4,), (2,)]
    with pytest.raises(StopIteration):
        step(model, opt, it)
    ref, ref_model = _reference(*_data(96))
    np.testing.assert_allclose(np.concatenate([np.asarray(o) for o in outs]), ref, **REF)
    for a, c in zip(_params(model), _params(ref_model), strict=True):
        np.testing.assert_allclose(a, c, **REF)


def test_random_streams_advance_as_in_single_steps() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = small_nnx_model(strategy, dropout=0.5)
    step = mse_step(strategy, steps_per_execution=3, stack_outputs=True)
    it = _iterator(strategy, rows=96)
    grouped = np.concatenate([np.asarray(step(model, opt, it)) for _ in range(2)])
    single, _ = _single_steps(strategy, dropout=0.0)
    single96 = []
    model1, opt1 = small_nnx_model(strategy, dropout=0.5)
    step1 = mse_step(strategy)
    for batch in _iterator(strategy, rows=96):
        single96.append(float(step1(model1, opt1, batch)))
    np.testing.assert_allclose(grouped, single96, **SAME)
    for a, b in zip(_params(model), _params(model1), strict=True):
        np.testing.assert_allclose(a, b, **SAME)
    counts = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.RngCount))]
    counts1 = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model1, nnx.RngCount))]
    assert counts == counts1 and int(counts[0]) > 0
    # The dropout masks were drawn: a model without dropout trains differently.
    assert not np.allclose(grouped, single[:6], rtol=1e-3)


def test_batch_norm_statistics_are_averaged_after_every_step() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])

    class BN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l = nnx.Linear(6, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(6, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l(self.bn(x))

    def train(k: int) -> tuple[np.ndarray, list[np.ndarray]]:
        with strategy.scope():
            model = BN(nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @jd.train_step(strategy, steps_per_execution=k, stack_outputs=True)
        def step(ctx, model, opt, batch):
            x, y = batch
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            opt.update(model, ctx.all_reduce("mean", grads))
            return ctx.all_reduce("mean", loss)

        it = _iterator(strategy, rows=96)
        if k == 1:
            losses = np.array([float(step(model, opt, b)) for b in it])
        else:
            losses = np.concatenate([np.asarray(o) for o in _run_all(step, model, opt, it)])
        return losses, [np.asarray(v) for v in jax.tree.leaves(nnx.state(model))]

    single, single_state = train(1)
    grouped, grouped_state = train(3)
    np.testing.assert_allclose(grouped, single, **SAME)
    for a, b in zip(grouped_state, single_state, strict=True):
        np.testing.assert_allclose(a, b, **SAME)


@pytest.mark.parametrize("make_strategy", strategy_params("one_device", "mirrored8"))
def test_train_state_steps_grouped_equal_plain_optax(make_strategy) -> None:
    strategy = make_strategy()
    tx = optax.adam(1e-2)
    w0 = {"w": jnp.zeros((6, 3)), "b": jnp.zeros(3)}

    def apply(params, x):
        return x @ params["w"] + params["b"]

    with strategy.scope():
        state = jd.TrainState.create(apply_fn=apply, params=w0, tx=tx)

    @jd.train_step(strategy, steps_per_execution=4, stack_outputs=True)
    def step(ctx, state, batch):
        x, y = batch

        def loss_fn(p):
            return jd.compute_average_loss(jnp.mean((state.apply_fn(p, x) - y) ** 2, axis=-1))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state = state.apply_gradients(grads=ctx.all_reduce("sum", grads))
        return state, ctx.all_reduce("sum", loss)

    it = _iterator(strategy)
    losses = []
    while True:
        try:
            state, loss = step(state, it)
        except StopIteration:
            break
        losses.append(np.asarray(loss))
    assert [x.shape for x in losses] == [(4,), (2,)]
    assert int(state.step) == 6

    x, y = _data()
    params, opt_state, ref = w0, tx.init(w0), []
    for i in range(0, ROWS, BATCH):
        xb, yb = x[i : i + BATCH], y[i : i + BATCH]
        loss, g = jax.value_and_grad(lambda p, xb=xb, yb=yb: jnp.mean((apply(p, xb) - yb) ** 2))(
            params
        )
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        ref.append(float(loss))
    np.testing.assert_allclose(np.concatenate(losses), ref, **REF)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **REF)


def test_the_grouped_program_is_traced_once_per_group_length() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = small_nnx_model(strategy)
    traces = []

    @jd.train_step(strategy, steps_per_execution=2)
    def step(ctx, model, opt, batch):
        traces.append(1)
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, ctx.all_reduce("mean", grads))
        return ctx.all_reduce("mean", loss)

    it = _iterator(strategy, rows=BATCH * 8)
    for _ in range(4):
        step(model, opt, it)
    assert len(traces) == 1


def test_grouped_step_errors() -> None:
    strategy = jd.OneDeviceStrategy()
    model, opt = small_nnx_model(strategy)
    step = mse_step(strategy, steps_per_execution=2)
    batch = next(_iterator(strategy))
    with pytest.raises(TypeError, match=r"steps_per_execution=2, pass one iterator of batches"):
        step(model, opt, batch)
    with pytest.raises(ValueError, match=r"steps_per_execution must be an int >= 1.*got 0"):
        jd.train_step(strategy, steps_per_execution=0)
    with pytest.raises(ValueError, match=r"update_state=False .* cannot be combined"):
        jd.train_step(strategy, steps_per_execution=2, update_state=False)
    with strategy.scope():
        state = jd.TrainState.create(
            apply_fn=lambda p, x: x @ p, params=jnp.zeros((6, 3)), tx=optax.sgd(0.1)
        )

    @jd.train_step(strategy, steps_per_execution=2)
    def loss_only(ctx, state, batch):
        x, y = batch
        return jnp.mean((state.apply_fn(state.params, x) - y) ** 2)

    with pytest.raises(ValueError, match=r"must return the new value of each of its 1 TrainState"):
        loss_only(state, _iterator(strategy))


# fit(..., steps_per_execution=k) ----------------------------------------------------------


class _Steps(jd.training.Callback):
    """Records every step's number, loss and the optimizer step it saw."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []

    def on_step_end(self, step, logs) -> None:
        self.steps.append(step)
        self.losses.append(float(logs["loss"]))


def _fit(strategy: jd.Strategy, k: int | None, **kw):
    model, opt = small_nnx_model(strategy)
    seen = _Steps()
    history = jd.fit(
        mse_step(strategy),
        model,
        opt,
        data=jd.data.from_arrays(*_data(), batch_size=BATCH),
        callbacks=[seen],
        progress=False,
        verbose=False,
        steps_per_execution=k,
        **kw,
    )
    return history, seen, model, opt


@pytest.mark.parametrize("make_strategy", strategy_params("one_device", "mirrored8"))
def test_fit_steps_per_execution_logs_every_step_like_single_steps(make_strategy) -> None:
    strategy = make_strategy()
    history, seen, model, opt = _fit(strategy, 4, epochs=2)
    history1, seen1, model1, _ = _fit(strategy, None, epochs=2)
    assert seen.steps == seen1.steps == list(range(1, 13))  # 6 batches a epoch
    assert history.step == 12 and int(opt.step.get_value()) == 12
    np.testing.assert_allclose(seen.losses, seen1.losses, **SAME)
    np.testing.assert_allclose(history.history["loss"], history1.history["loss"], **SAME)
    ref, _ = _reference(*_data())
    np.testing.assert_allclose(seen.losses[:6], ref, **REF)
    for a, b in zip(_params(model), _params(model1), strict=True):
        np.testing.assert_allclose(a, b, **SAME)


def test_fit_steps_per_execution_stops_at_the_step_limit() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    history, seen, model, opt = _fit(strategy, 4, steps=7)
    assert seen.steps == list(range(1, 8))
    assert history.step == 7 and int(opt.step.get_value()) == 7
    _, _, model1, _ = _fit(strategy, 1, steps=7)
    for a, b in zip(_params(model), _params(model1), strict=True):
        np.testing.assert_allclose(a, b, **SAME)


def test_fit_steps_per_execution_with_a_train_state_and_its_errors() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    tx = optax.sgd(0.1)

    def make():
        with strategy.scope():
            return jd.TrainState.create(
                apply_fn=lambda p, x: x @ p, params=jnp.zeros((6, 3)), tx=tx
            )

    @jd.train_step(strategy, steps_per_execution=3)
    def step(ctx, state, batch):
        x, y = batch

        def loss_fn(p):
            return jd.compute_average_loss(jnp.mean((state.apply_fn(p, x) - y) ** 2, axis=-1))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=ctx.all_reduce("sum", grads)), {
            "loss": ctx.all_reduce("sum", loss)
        }

    data = jd.data.from_arrays(*_data(), batch_size=BATCH)
    state, history = jd.fit(step, make(), data=data, progress=False, verbose=False)
    state1, history1 = jd.fit(
        step, make(), data=data, progress=False, verbose=False, steps_per_execution=1
    )
    assert int(state.step) == int(state1.step) == 6
    np.testing.assert_allclose(np.asarray(state.params), np.asarray(state1.params), **SAME)
    np.testing.assert_allclose(history.history["loss"], history1.history["loss"], **SAME)

    x, y = _data()
    w = np.zeros((6, 3), np.float32)
    for i in range(0, ROWS, BATCH):
        xb, yb = x[i : i + BATCH], y[i : i + BATCH]
        g = jax.grad(lambda p, xb=xb, yb=yb: jnp.mean((xb @ p - yb) ** 2))(w)
        w = w - 0.1 * np.asarray(g)
    np.testing.assert_allclose(np.asarray(state.params), w, **REF)

    with pytest.raises(TypeError, match=r"needs a jd.train_step as the step"):
        jd.fit(lambda s, b: (s, 0.0), make(), data=data, steps_per_execution=2, progress=False)
    donating = jd.train_step(strategy, donate_argnums=0)(step.fn)
    with pytest.raises(ValueError, match=r"made with donate_argnums=\(0,\)"):
        jd.fit(donating, make(), data=data, steps_per_execution=2, progress=False)
