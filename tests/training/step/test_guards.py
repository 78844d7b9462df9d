"""Guards of the training surface (issue 20): silent wrong results made errors or warnings,
train and eval modes in `fit`, and errors that teach.

Distributed results are compared with single-device NumPy/optax references at float32
tolerance rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd

from _helpers import linear_data

RTOL, ATOL = 1e-5, 1e-6


def _linear_data(n: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return linear_data(n, [[1.0], [-2.0], [0.5]], seed)


# 1. Per-replica parameters -------------------------------------------------------------


def test_nnx_step_without_gradient_all_reduce_names_the_parameter() -> None:
    strategy = jd.MirroredStrategy()
    with strategy.scope():
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.8), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)  # no all-reduce: per-replica parameters
        return ctx.all_reduce("sum", loss)

    x, y = _linear_data()
    batch = strategy.experimental_distribute_values_from_function(
        lambda c: (
            x.reshape(8, 8, 3)[c.replica_id_in_sync_group],
            y.reshape(8, 8, 1)[c.replica_id_in_sync_group],
        )
    )
    with pytest.raises(
        ValueError,
        match=r"(?s)step.*`model\.bias` \(args\[0\]\.bias.*differs between replicas"
        r".*ctx\.all_reduce\('sum', grads\)",
    ):
        step(model, opt, *batch)
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, before, after)  # nothing was written


def test_nnx_statistics_that_differ_are_still_averaged() -> None:
    # BatchNorm statistics are not parameters: per-replica values are averaged (documented).
    strategy = jd.MirroredStrategy()
    bn = nnx.BatchNorm(2, momentum=0.0, rngs=nnx.Rngs(0))

    @jd.train_step(strategy)
    def step(ctx, bn, x):
        return ctx.all_reduce("mean", jnp.mean(bn(x)))

    x = np.random.default_rng(1).normal(size=(8, 4, 2)).astype(np.float32)
    step(bn, jd.PerReplica(x))
    np.testing.assert_allclose(
        bn.mean.get_raw_value(), x.mean(axis=1).mean(axis=0), rtol=RTOL, atol=ATOL
    )


# 6, 7, 8. Errors that teach ------------------------------------------------------------


def _small() -> tuple[nnx.Linear, nnx.Optimizer]:
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _per_replica_batch(strategy: jd.Strategy) -> jd.PerReplica:
    n = strategy.num_replicas_in_sync
    return jd.PerReplica(np.ones((n, 2, 3), np.float32))


def test_step_without_ctx_is_explained() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _small()

    @jd.train_step(strategy)
    def step(model, opt, batch):
        return jnp.sum(model(batch))

    with pytest.raises(
        TypeError,
        match=r"(?s)step \(.*test_guards\.py:\d+\).*does not "
        r"take the replica context.*`def step\(ctx, model, opt, batch\): \.\.\.`",
    ):
        step(model, opt, _per_replica_batch(strategy))


def test_batch_of_python_lists_names_the_argument() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _small()

    @jd.train_step(strategy)
    def step(ctx, model, opt, batch):
        return ctx.all_reduce("sum", jnp.sum(model(batch["x"])))

    with pytest.raises(
        TypeError,
        match=r"(?s)`batch\['x'\]` \(args\[2\]\['x'\]\) is a Python "
        r"list of numbers \(shape \(4, 3\)\).*np\.asarray",
    ):
        step(model, opt, {"x": [[1.0, 2.0, 3.0]] * 4})


def test_non_array_output_names_the_users_function() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _small()

    @jd.train_step(strategy)
    def step(ctx, model, opt, batch):
        return {"loss": ctx.all_reduce("sum", jnp.sum(model(batch))), "note": "hello"}

    with pytest.raises(
        TypeError,
        match=r"(?s)step \(.*test_guards\.py:\d+\) returned a "
        r"str \('hello'\) at output\['note'\]",
    ):
        step(model, opt, _per_replica_batch(strategy))


# 4. Host batches ---------------------------------------------------------------------------


def test_host_numpy_batch_warns_once_per_step_function() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _small()

    @jd.train_step(strategy)
    def step(ctx, model, opt, x):
        return ctx.all_reduce("sum", jnp.sum(model(x)))

    x = np.ones((4, 3), np.float32)
    with pytest.warns(
        jd.training.HostBatchWarning,
        match=r"(?s)`x` \(args\[2\]\) is a host NumPy array of shape \(4, 3\).*"
        r"each of the 2 replicas.*experimental_distribute_dataset.*"
        r"experimental_distribute_values_from_function",
    ):
        out = step(model, opt, x)
    np.testing.assert_allclose(out, 2 * np.sum(np.asarray(model(x))), rtol=RTOL, atol=1e-5)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, opt, x)  # once per step function
        step(model, opt, np.ones((6, 3), np.float32))  # a new shape: still warned only once
        step(model, opt, jnp.ones((4, 3)))  # a jax.Array is a deliberate broadcast
        single = jd.train_step(jd.OneDeviceStrategy())(step.__wrapped__)
        single(*_small(), x)  # one replica: nothing is repeated


# 2, 3. Evaluation in fit --------------------------------------------------------------------


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.0, rngs=rngs)  # statistics: the last batch's
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.drop(self.bn(self.l1(x))))


def _fit_steps(strategy: jd.Strategy):
    @jd.train_step(strategy)
    def train(ctx, model, opt, batch):
        x, y = batch

        def loss_fn(m):
            return jd.compute_average_loss(jnp.sum((m(x) - y) ** 2, axis=-1))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return {"loss": ctx.all_reduce("sum", loss)}

    @jd.train_step(strategy)
    def evaluate(ctx, model, opt, batch):
        x, y = batch
        loss = jd.compute_average_loss(jnp.sum((model(x) - y) ** 2, axis=-1))
        return {"loss": ctx.all_reduce("sum", loss)}

    return train, evaluate


def test_fit_refuses_the_training_step_as_eval_step() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = _linear_data(32)
    data = jd.data.from_arrays(x, y, batch_size=8)
    train, _ = _fit_steps(strategy)
    with pytest.raises(
        ValueError,
        match=r"(?s)jaxdist\.fit: eval_step train: the step updates "
        r"`model\.bias`.*must not train",
    ):
        jd.fit(train, model, opt, data=data, eval_step=train, eval_data=data, verbose=False)
    assert int(opt.step.get_value()) == 4  # the 4 training steps only


def test_fit_evaluates_in_eval_mode_and_writes_nothing_back() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model = _Net(nnx.Rngs(0))
    model.l2.bias.set_value(jnp.ones((1,)))
    opt = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    x, y = _linear_data(32)
    ex, ey = 100 * x[:16], y[:16]  # statistics far from the training data's
    train, evaluate = _fit_steps(strategy)
    seen: list = []

    class Record(jd.training.Callback):
        def on_step_end(self, step, logs):
            self.after_step = (
                np.asarray(model.bn.mean.get_value()),
                int(model.drop.rngs.count.get_value()),
            )

        def on_epoch_end(self, epoch, logs):  # after the evaluation
            seen.append(
                (
                    model.drop.deterministic,
                    model.bn.use_running_average,
                    np.asarray(model.bn.mean.get_value()),
                    int(model.drop.rngs.count.get_value()),
                    self.after_step,
                )
            )

    record = Record()
    history = jd.fit(
        train,
        model,
        opt,
        data=jd.data.from_arrays(x, y, batch_size=8),
        eval_step=evaluate,
        eval_data=jd.data.from_arrays(ex, ey, batch_size=8),
        callbacks=[record],
        verbose=False,
    )
    ((det, ura, mean, count, (mean_trained, count_trained)),) = seen
    assert det is False and ura is False  # modes back to training after evaluation
    # Evaluation wrote nothing back: the running statistics and the dropout stream are as
    # the last training step left them.
    np.testing.assert_array_equal(mean, mean_trained)
    assert count == count_trained == 4
    # The validation loss is the eval-mode model's loss on the evaluation data, single device.
    model.eval()
    ref = np.mean(np.sum((np.asarray(model(ex)) - ey) ** 2, axis=-1))
    model.train()
    np.testing.assert_allclose(history.history["val_loss"][-1], ref, rtol=1e-5, atol=1e-5)


def test_fit_puts_each_modules_mode_back_and_a_frozen_layer_stays_frozen() -> None:
    # A planted bug forced every module back to train() after evaluation; the model above
    # is all in training mode and could not see it.
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model = _Net(nnx.Rngs(0))
    model.frozen = nnx.BatchNorm(4, use_running_average=True, rngs=nnx.Rngs(1))  # on purpose
    opt = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    x, y = _linear_data(16)
    train, evaluate = _fit_steps(strategy)
    modes: list[tuple[bool, bool, bool]] = []

    class Record(jd.training.Callback):
        def on_epoch_end(self, epoch, logs):  # after the evaluation
            modes.append(
                (model.drop.deterministic, model.bn.use_running_average,
                 model.frozen.use_running_average)
            )  # fmt: skip

    data = jd.data.from_arrays(x, y, batch_size=8)
    jd.fit(train, model, opt, data=data, eval_step=evaluate, eval_data=data,
           callbacks=[Record()], epochs=2, verbose=False)  # fmt: skip
    assert modes == [(False, False, True)] * 2


def test_an_optimizer_state_that_differs_between_replicas_is_refused() -> None:
    # A planted bug dropped nnx.OptState from the guard; parameters alone still caught the
    # usual missing all-reduce, so only an optimizer-state-only divergence shows it.
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @jd.train_step(strategy)
    def skew(ctx, model, opt, batch):
        opt.step.set_value(opt.step.get_value() + ctx.replica_id_in_sync_group)
        return {}

    x = jnp.asarray(_linear_data(8)[0])  # the same on every replica, on purpose
    with pytest.raises(jd.errors.ReplicaDivergenceError, match=r"`opt\.step` .*differs between"):
        skew(model, opt, x)
    assert int(opt.step.get_value()) == 0  # nothing was written back

    @jd.train_step(strategy, update_state=False)
    def counts(ctx, model, opt, batch):
        opt.step.set_value(opt.step.get_value() + 1)
        return {}

    with pytest.raises(ValueError, match=r"the step updates `opt\.step`.*update_state=False"):
        counts(model, opt, x)


def test_update_state_false_writes_nothing_back() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    bn = nnx.BatchNorm(2, momentum=0.0, rngs=nnx.Rngs(0))

    @jd.train_step(strategy, update_state=False)
    def measure(ctx, bn, x):
        return ctx.all_reduce("mean", jnp.mean(bn(x)))

    x = np.random.default_rng(2).normal(size=(2, 4, 2)).astype(np.float32) + 3.0
    measure(bn, jd.PerReplica(x))
    np.testing.assert_array_equal(bn.mean.get_value(), np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=r"update_state must be True, False or None"):
        jd.train_step(strategy, update_state="no")


# 5. NaN -----------------------------------------------------------------------------------


def _nan_run(tmp_path, callbacks_for, epochs: int = 2):
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = _linear_data(32)
    x[17, 1] = np.nan  # in the third batch of 8: global step 3
    train, _ = _fit_steps(strategy)
    ckpt = jd.training.Checkpoint(tmp_path / "ckpt", every_n_steps=1, async_write=False)
    callbacks = callbacks_for(ckpt)
    data = jd.data.from_arrays(x, y, batch_size=8)
    return (
        (model, opt),
        ckpt,
        callbacks,
        lambda: jd.fit(
            train, model, opt, data=data, epochs=epochs, callbacks=callbacks, verbose=False
        ),
    )


def test_terminate_on_nan_stops_at_the_step_and_never_saves_it(tmp_path, capfd) -> None:
    stop = jd.training.TerminateOnNaN()
    # The checkpoint callback is listed first: TerminateOnNaN still runs before it.
    (model, opt), ckpt, _, run = _nan_run(tmp_path, lambda ckpt: [ckpt, stop])
    history = run()
    assert history.stopped_early and history.step == 3 and history.epochs == [0]
    assert (stop.stopped_step, stop.stopped_epoch) == (3, 0)
    assert re.search(r"TerminateOnNaN: loss nan at step 3, epoch 1 of \d+", capfd.readouterr().err)
    assert ckpt.all_steps() == [1, 2]  # the last finite states only
    assert not np.isfinite(np.asarray(model.kernel.get_value())).all()
    restored = jd.training.restore_checkpoint(str(tmp_path / "ckpt"), model, opt)
    assert restored.step == 2
    assert np.isfinite(np.asarray(model.kernel.get_value())).all()


def test_checkpoint_refuses_a_nonfinite_state_unless_told(tmp_path) -> None:
    _, ckpt, _, run = _nan_run(tmp_path, lambda ckpt: [ckpt])
    with pytest.raises(
        ValueError,
        match=r"(?s)jaxdist\.training\.Checkpoint: the state after "
        r"step 3, epoch 1 of \d+ holds NaN.*state_0.*allow_nonfinite=True",
    ):
        run()
    assert ckpt.all_steps() == [1, 2]
    _, ckpt, _, run = _nan_run(
        tmp_path / "b",
        lambda _: [
            jd.training.Checkpoint(
                tmp_path / "b" / "ckpt", every_n_steps=1, async_write=False, allow_nonfinite=True
            )
        ],
        epochs=1,
    )
    run()
    assert sorted(os.listdir(tmp_path / "b" / "ckpt")).count("ckpt-4") == 1


def test_item_checkpoint_refuses_nan_unless_told(tmp_path) -> None:
    bad = {"w": jnp.array([1.0, jnp.inf]), "n": jnp.arange(2)}
    ckpt = jd.checkpoint.Checkpoint(state=bad)
    with pytest.raises(
        ValueError,
        match=r"(?s)Checkpoint\.write: the state holds NaN or infinite"
        r" values: \['state'\]\['w'\] \(1 of 2 values\)",
    ):
        ckpt.write(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    ckpt.write(tmp_path / "a", allow_nonfinite=True)
    with pytest.raises(ValueError, match=r"jaxdist\.checkpoint\.save: the state holds NaN"):
        jd.checkpoint.save(tmp_path / "b", bad)
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path / "m")
    with pytest.raises(ValueError, match=r"NaN or infinite"):
        manager.save()
    assert manager.latest_checkpoint is None
    # A refused save does not count: save_counter is left as it was.
    assert ckpt.save_counter == 0
    assert manager.save(allow_nonfinite=True).endswith("-1")


def test_nnx_object_placed_by_another_strategy_is_refused_with_the_way_to_move_it() -> None:
    a = jd.MirroredStrategy(jax.devices()[4:8])
    b = jd.MirroredStrategy(jax.devices()[:2])
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    ref = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

    def total(ctx, model, x):
        return ctx.all_reduce("sum", jnp.sum(model(x)))

    x = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    jd.train_step(a)(total)(model, jd.PerReplica(x))  # placed on devices 4..7
    step_b = jd.train_step(b)(total)
    with pytest.raises(
        ValueError,
        match=r"(?s)train_step\(total\): NNX variable `model\.bias` \(args\[0\]\.bias\) lives "
        r"on devices \[4, 5, 6, 7\], but this step's MirroredStrategy runs on devices \[0, 1\]"
        r".*nnx\.update\(model, jax\.tree\.map\(np\.asarray, nnx\.state\(model\)\)\)",
    ):
        step_b(model, jd.PerReplica(x[:2]))
    nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))  # the fix the error gives
    out = step_b(model, jd.PerReplica(x[:2]))
    np.testing.assert_allclose(out, np.sum(np.asarray(ref(x[:2].reshape(4, 3)))), rtol=1e-5)
    assert model.kernel.get_raw_value().sharding.device_set == set(jax.devices()[:2])


def test_a_step_called_with_an_extra_argument_is_told_so_not_to_take_the_context() -> None:
    strategy = jd.MirroredStrategy()
    with strategy.scope():
        state = jd.TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1))

    @jd.train_step(strategy)
    def train(ctx: Any, state: Any, batch: Any) -> Any:
        return state

    # Before: "does not take the replica context; write it as def train(ctx, ctx, ...)".
    with pytest.raises(
        TypeError,
        match=r"train_step\(train\): cannot call .*train .* as train\(ctx, <3 positional "
        r"argument\(s\)>\): too many positional arguments\. A train step is called with",
    ):
        train(state, np.zeros((8, 2), np.float32), np.zeros(8, np.float32))

    @jd.train_step(strategy)
    def no_context(state: Any, batch: Any) -> Any:
        return state

    with pytest.raises(TypeError, match=r"does not take the replica context.*def no_context\(ctx"):
        no_context(state, np.zeros((8, 2), np.float32))
