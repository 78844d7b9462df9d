"""Per-argument donation: ``RunOptions(donate_argnums=...)``, ``strategy.function(...,
donate_argnums=...)`` and ``jd.train_step(..., donate_argnums=...)``.

Results are compared with the same optax steps in plain single-device JAX, rtol 1e-5 /
atol 1e-6 (float32; per-replica gradients are summed in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

from _helpers import regression_data, strategy_params

TOL = {"rtol": 1e-5, "atol": 1e-6}
TX = optax.adam(1e-2)


def _data(n: int = 16):
    return regression_data(n, 5, 2)


def _init():
    params = {"w": jnp.ones((5, 2)) * 0.1, "b": jnp.zeros(2)}
    return params, TX.init(params)


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _reference(steps: int):
    x, y = _data()
    params, opt_state = _init()
    for _ in range(steps):
        g = jax.grad(_loss)(params, x, y)
        updates, opt_state = TX.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def _fn_step(ctx, params, opt_state, x, y):
    def loss_fn(p):
        return jd.compute_average_loss(jnp.mean((x @ p["w"] + p["b"] - y) ** 2, axis=-1))

    loss, g = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(ctx.all_reduce("sum", g), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("sum", loss)


def _batch(strategy: jd.Strategy):
    x, y = _data()
    n = strategy.num_replicas_in_sync
    return jd.PerReplica(x.reshape(n, -1, 5)), jd.PerReplica(y.reshape(n, -1, 2))


def _placed(strategy: jd.Strategy, tree):
    return jax.tree.map(lambda a: jax.device_put(jnp.array(a), strategy.replicated_sharding), tree)


@pytest.mark.parametrize("make_strategy", strategy_params("one_device", "mirrored8"))
def test_function_donates_only_the_named_arguments(make_strategy) -> None:
    strategy = make_strategy()
    step = strategy.function(_fn_step, donate_argnums=(0, 1))
    xb, yb = _batch(strategy)
    xb = jd.PerReplica(
        jax.device_put(xb.array, NamedSharding(strategy.mesh, P(strategy.axis_name)))
    )
    params, opt_state = _placed(strategy, _init())
    for _ in range(3):
        old = params
        params, opt_state, _ = step(params, opt_state, xb, yb)
        assert all(a.is_deleted() for a in jax.tree.leaves(old))
        assert not xb.array.is_deleted()  # the batch is reused, not donated
    params = jax.tree.map(lambda a: a.array if isinstance(a, jd.Mirrored) else a, params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(_reference(3)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    text = step.lower(params, opt_state, xb, yb).as_text()
    donors = text.count("jax.buffer_donor") + text.count("tf.aliasing_output")
    assert donors == len(jax.tree.leaves((params, opt_state)))  # the state's, not the batch's


def test_function_refuses_a_donated_argument_passed_again() -> None:
    strategy = jd.OneDeviceStrategy()
    step = strategy.function(_fn_step, options=jd.RunOptions(donate_argnums=0))
    xb, yb = _batch(strategy)
    params, opt_state = _placed(strategy, _init())
    step(params, opt_state, xb, yb)
    with pytest.raises(
        RuntimeError,
        match=r"OneDeviceStrategy\.run\(_fn_step\): args\[0\]\['b'\], args\[0\]\['w'\] were "
        r"donated to an earlier call \(RunOptions\(donate_argnums=\.\.\.\)",
    ):
        step(params, opt_state, xb, yb)
    with pytest.raises(
        ValueError,
        match=r"donate_argnums=\(7,\)\) names argument 7, but the function was called with 4",
    ):
        strategy.function(_fn_step, donate_argnums=7)(params, opt_state, xb, yb)


def test_function_donates_trees_with_host_leaves_and_distributed_batches() -> None:
    """The donated arguments may hold NumPy arrays and numbers (checked leaf by leaf) or
    `PerReplica` batches of a distributed dataset (whose shared valid counts are kept)."""
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    x, y = _data()

    def step(ctx, params, scale, batch):
        bx, by = batch

        def loss_fn(p):
            return jd.compute_average_loss(jnp.mean((bx @ p["w"] + p["b"] - by) ** 2, axis=-1))

        g = jax.grad(loss_fn)(params)
        g = ctx.all_reduce("sum", g)
        return jax.tree.map(lambda p, g: p - scale * g, params, g)

    f = strategy.function(step, donate_argnums=(0, 2))
    ds = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=16))
    params = {"w": np.full((5, 2), 0.1, np.float32), "b": np.zeros(2, np.float32)}
    expected = {k: v.copy() for k, v in params.items()}
    for _ in range(2):
        for batch in ds:  # the batches are donated; their valid counts are shared
            params = f(params, 0.1, batch)
        g = jax.grad(_loss)(expected, x, y)
        expected = jax.tree.map(lambda p, g: p - 0.1 * np.asarray(g), expected, g)
    got = jax.tree.map(
        lambda v: np.asarray(strategy.experimental_local_results(v)[0]),
        params,
        is_leaf=lambda v: isinstance(v, jd.Mirrored),
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, expected)
    mixed = {"w": np.ones((5, 2), np.float32), "b": jnp.zeros(2)}
    only_params = strategy.function(step, donate_argnums=0)
    only_params(mixed, 0.1, next(iter(ds)))  # donates mixed["b"] (a jax array)
    with pytest.raises(RuntimeError, match=r"args\[0\]\['b'\] was donated"):
        only_params(mixed, 0.1, next(iter(ds)))


def test_run_options_donate_argnums_validation() -> None:
    assert jd.RunOptions(donate_argnums=1).donate_argnums == (1,)
    assert jd.RunOptions(donate_argnums=(2, 0, 2)).donate_argnums == (0, 2)
    with pytest.raises(ValueError, match=r"donate_args=True \(every argument\) or donate_argnums"):
        jd.RunOptions(donate_args=True, donate_argnums=(0,))
    with pytest.raises(TypeError, match=r"must be an int >= 0 or a tuple of them"):
        jd.RunOptions(donate_argnums=(-1,))


@pytest.mark.parametrize("make_strategy", strategy_params("one_device", "mirrored2"))
def test_train_step_donates_plain_functional_state(make_strategy) -> None:
    strategy = make_strategy()
    step = jd.train_step(strategy, donate_argnums=(0, 1))(_fn_step)
    xb, yb = _batch(strategy)
    params, opt_state = _init()
    originals = jax.tree.leaves(params)
    for _ in range(3):
        old = params
        params, opt_state, _ = step(params, opt_state, xb, yb)
        if old is not None and old["w"] is not originals[1]:
            assert all(a.is_deleted() for a in jax.tree.leaves(old))
    assert not any(a.is_deleted() for a in originals)  # placed into own buffers first
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(_reference(3)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    with pytest.raises(RuntimeError, match=r"argument `params` \(args\[0\]\['b'\]"):
        step(old, opt_state, xb, yb)


def test_train_step_donate_argnums_keeps_an_unnamed_train_state() -> None:
    strategy = jd.OneDeviceStrategy()
    x, y = _data()
    with strategy.scope():
        state = jd.TrainState.create(apply_fn=None, params=_init()[0], tx=TX)

    @jd.train_step(strategy, donate_argnums=())
    def step(ctx, state, x, y):
        loss, g = jax.value_and_grad(_loss)(state.params, x, y)
        return state.apply_gradients(grads=ctx.all_reduce("sum", g)), loss

    new, _ = step(state, x, y)
    new, _ = step(new, x, y)
    assert not any(a.is_deleted() for a in jax.tree.leaves(state))
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(_reference(2)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
    with pytest.raises(ValueError, match=r"donate_argnums cannot be combined with"):
        jd.train_step(strategy, donate_argnums=0, steps_per_execution=2)
