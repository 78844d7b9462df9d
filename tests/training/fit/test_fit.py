"""`jd.fit`, its callbacks and its Ctrl-C handling, against NumPy and hand-run steps.

References: epoch metrics against NumPy means over the whole dataset (float32
per-example values summed on the device, rtol 1e-6); training through `fit`
against the same `train_step` called by hand on the same batches (the same
program on the same inputs: bit-identical, compared with
``assert_array_equal``); restored checkpoints against the saved state
(bit-identical). A checkpoint directory that disappears, or is a file, is named.
"""

from __future__ import annotations

import functools
import os
import pty
import re
import select
import shutil
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd

from _helpers import TanhMLP, classification_data, strategy_params

RTOL = 1e-6
ROWS, FEATURES, CLASSES, BATCH = 50, 4, 3, 16  # 4 batches per epoch, the last of 2 rows


def _strategies() -> list:
    return strategy_params("one_device", "mirrored2", "mirrored8", "central8")


def _data(rows: int = ROWS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return classification_data(rows, FEATURES, CLASSES, seed)


MLP = functools.partial(TanhMLP, (FEATURES, 8, CLASSES))


def _ce(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _make(strategy: jd.Strategy, lr: float = 0.1) -> tuple[MLP, nnx.Optimizer]:
    with strategy.scope():
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
    return model, opt


def _nnx_step(strategy: jd.Strategy):
    @jd.train_step(strategy)
    def step(ctx, model, opt, batch):
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m: jd.compute_average_loss(_ce(m(x), y)))(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return {"loss": ctx.all_reduce("sum", loss)}

    return step


def _mirrored_nnx() -> tuple[jd.Strategy, np.ndarray, np.ndarray, Any, Any, nnx.Optimizer]:
    """A MirroredStrategy of every device, the data ``x, y``, the NNX train step, and a fresh
    model and optimizer."""
    strategy = jd.MirroredStrategy()
    return (strategy, *_data(), _nnx_step(strategy), *_make(strategy))


def _quiet_fit(step: Any, model: Any, opt: Any, x: Any, y: Any, **kwargs: Any) -> Any:
    """``jd.fit`` of an NNX step on ``(x, y)`` in batches of ``BATCH``, without progress."""
    data = jd.data.from_arrays(x, y, batch_size=BATCH)
    return jd.fit(step, model, opt, data=data, verbose=False, **kwargs)


def _params(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _assert_same_params(a: nnx.Module, b: nnx.Module) -> None:
    for u, v in zip(_params(a), _params(b), strict=True):
        np.testing.assert_array_equal(u, v)


# Metrics ------------------------------------------------------------------------------


@pytest.mark.parametrize("make_strategy", _strategies())
def test_epoch_metrics_are_dataset_means(make_strategy) -> None:
    """Replicated, per-replica and per-example metrics all average to the NumPy dataset mean,
    with a padded last batch (2 rows: on 8 replicas, 6 replicas get no real row)."""
    strategy = make_strategy()
    x, y = _data()
    w = np.random.default_rng(1).normal(size=(FEATURES, CLASSES)).astype(np.float32)
    with strategy.scope():
        state = {"w": jnp.asarray(w)}

    @jd.train_step(strategy)
    def step(ctx, state, batch):
        xb, yb = batch
        per_example = _ce(xb @ state["w"], yb)
        mask = ctx.valid_mask(xb.shape[0])
        mine = jnp.sum(jnp.where(mask, per_example, 0)) / jnp.sum(mask)  # NaN without rows
        return state, {
            "loss": ctx.all_reduce("sum", jd.compute_average_loss(per_example)),
            "replica_mean": mine,
            "per_example": per_example,
        }

    state, history = jd.fit(step, state, data=jd.data.from_arrays(x, y, batch_size=BATCH))
    expected = np.mean(np.asarray(_ce(x @ w, y), np.float64))
    assert history.epochs == [0] and history.step == 4
    for name in ("loss", "replica_mean", "per_example"):
        np.testing.assert_allclose(history.history[name], [expected], rtol=RTOL, err_msg=name)
    np.testing.assert_array_equal(state["w"], w)


def test_replicated_metric_must_be_scalar() -> None:
    @jd.train_step(jd.MirroredStrategy(jax.devices()[:2]))
    def step(ctx, state, batch):
        return state, {"logits": ctx.all_reduce("sum", jnp.ones(3))}

    with pytest.raises(
        ValueError, match=r"metric 'logits' of the step is an array of shape \(3,\)"
    ):
        jd.fit(step, {"w": jnp.ones(2)}, data=jd.data.from_arrays(np.ones((4, 2)), batch_size=4))


# Training through fit equals training by hand -------------------------------------------


@pytest.mark.parametrize("make_strategy", _strategies())
def test_nnx_fit_equals_steps_by_hand(make_strategy) -> None:
    strategy = make_strategy()
    x, y = _data()
    model, opt = _make(strategy)
    step = _nnx_step(strategy)
    history = jd.fit(
        step, model, opt, data=jd.data.from_arrays(x, y, batch_size=BATCH, shuffle=True), epochs=3
    )
    assert isinstance(history, jd.training.History)
    ref, ref_opt = _make(strategy)
    dist = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(x, y, batch_size=BATCH, shuffle=True)
    )
    epoch_losses = []
    for _ in range(3):
        total = rows = 0.0
        for batch in dist:
            loss = float(step(ref, ref_opt, batch)["loss"])
            n = int(np.sum(np.asarray(batch[0].valid)))
            total, rows = total + loss * n, rows + n
        epoch_losses.append(total / rows)
    _assert_same_params(model, ref)
    np.testing.assert_allclose(history.history["loss"], epoch_losses, rtol=RTOL)
    assert history.step == 12 and int(opt.step.get_value()) == 12
    assert history.history["loss"][-1] < history.history["loss"][0]


def _linen_like_state(strategy: jd.Strategy) -> jd.TrainState:
    params = {"w": jnp.zeros((FEATURES, CLASSES)), "b": jnp.zeros(CLASSES)}
    with strategy.scope():
        return jd.TrainState.create(
            apply_fn=lambda p, x: x @ p["w"] + p["b"], params=params, tx=optax.sgd(0.5)
        )


def _functional_step(strategy: jd.Strategy):
    @jd.train_step(strategy)
    def step(ctx, state, batch):
        x, y = batch

        def loss_fn(p):
            return jd.compute_average_loss(_ce(state.apply_fn(p, x), y))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state = state.apply_gradients(grads=ctx.all_reduce("sum", grads))
        return state, ctx.all_reduce("sum", loss)

    return step


def test_functional_state_steps_span_epochs() -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data()
    step = _functional_step(strategy)
    complete = []

    class Complete(jd.training.Callback):
        def on_epoch_end(self, epoch, logs) -> None:
            complete.append(self.loop.at_epoch_end)

    state, history = jd.fit(
        step,
        _linen_like_state(strategy),
        data=jd.data.from_arrays(x, y, batch_size=BATCH),
        steps=7,
        callbacks=[Complete()],
    )
    assert isinstance(state, jd.TrainState) and int(state.step) == 7
    assert history.epochs == [0, 1] and history.step == 7  # 4 steps, then 3 of epoch 1
    assert complete == [True, False]  # epoch 1 was cut short by steps
    ref = _linen_like_state(strategy)
    dist = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=BATCH))
    batches = [*dist, *dist][:7]
    for batch in batches:
        ref, _ = step(ref, batch)
    jax.tree.map(np.testing.assert_array_equal, state.params, ref.params)
    # epochs and steps together: whichever comes first.
    _, history = jd.fit(
        step, state, data=jd.data.from_arrays(x, y, batch_size=BATCH), epochs=1, steps=100
    )
    assert history.step == 4 and history.epochs == [0]
    # Nothing left to do: initial_epoch already at epochs.
    same, history = jd.fit(step, ref, data=[], epochs=3, initial_epoch=3)
    assert same is ref and history.epochs == [] and history.step == 0


# Evaluation ---------------------------------------------------------------------------


@pytest.mark.parametrize("make_strategy", _strategies())
def test_eval_accuracy_equals_numpy_over_the_whole_eval_set(make_strategy) -> None:
    strategy = make_strategy()
    x, y = _data()
    ex, ey = _data(rows=37, seed=3)  # 3 batches of 16: the last has 5 real rows
    model, opt = _make(strategy)

    @jd.train_step(strategy, donate=False)
    def eval_step(ctx, model, opt, batch):
        xb, yb = batch
        logits = model(xb)
        correct = (jnp.argmax(logits, -1) == yb).astype(jnp.float32)
        return {
            "loss": ctx.all_reduce("sum", jd.compute_average_loss(_ce(logits, yb))),
            "accuracy": correct,  # per example: averaged over the real rows
            "accuracy_sum": ctx.all_reduce("sum", jd.compute_average_loss(correct)),
        }

    history = jd.fit(
        _nnx_step(strategy),
        model,
        opt,
        data=jd.data.from_arrays(x, y, batch_size=BATCH),
        epochs=2,
        eval_step=eval_step,
        eval_data=jd.data.from_arrays(ex, ey, batch_size=BATCH),
    )
    logits = np.asarray(model(ex))
    accuracy = np.mean(np.argmax(logits, -1) == ey)
    loss = np.mean(np.asarray(_ce(logits, ey), np.float64))
    speed = {"examples_per_second", "flops_per_step", "tflops_per_device"}  # CPU: no mfu
    assert set(history.history) - speed == {"loss", "val_accuracy", "val_accuracy_sum", "val_loss"}
    assert "examples_per_second" in history.history
    assert len(history.history["val_accuracy"]) == 2
    np.testing.assert_allclose(history.history["val_accuracy"][-1], accuracy, rtol=RTOL)
    np.testing.assert_allclose(history.history["val_accuracy_sum"][-1], accuracy, rtol=RTOL)
    np.testing.assert_allclose(history.history["val_loss"][-1], loss, rtol=1e-5)


def test_functional_eval_step_must_not_donate() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    data = jd.data.from_arrays(*_data(), batch_size=BATCH)
    # A donating train_step given as eval_step is run by fit without donating (and without
    # writing state back): the functional state survives evaluation.
    donating = jd.train_step(strategy)(lambda ctx, state, batch: {"n": 1.0})
    state, history = jd.fit(
        _functional_step(strategy),
        _linen_like_state(strategy),
        data=data,
        eval_step=donating,
        eval_data=data,
        verbose=False,
    )
    assert history.history["val_n"] == [1.0]
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    # Asked to write state back, a donating one would consume the state: refused.
    writing = jd.train_step(strategy, update_state=True)(lambda ctx, state, batch: {"n": 1.0})
    with pytest.raises(ValueError, match=r"update_state=True that donates.*donate=False"):
        jd.fit(
            _functional_step(strategy),
            _linen_like_state(strategy),
            data=data,
            eval_step=writing,
            eval_data=data,
        )


# Errors that teach --------------------------------------------------------------------


def test_functional_step_that_does_not_return_its_state() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])

    @jd.train_step(strategy)
    def step(ctx, state, batch):
        return {"loss": ctx.all_reduce("sum", jnp.sum(batch[0]))}

    with pytest.raises(TypeError, match=r"1 functional state argument.*\(new_state, metrics\)"):
        jd.fit(step, _linen_like_state(strategy), data=jd.data.from_arrays(*_data(), batch_size=8))


def test_nnx_step_returning_a_tuple_is_explained() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _make(strategy)

    @jd.train_step(strategy)
    def step(ctx, model, opt, batch):
        loss = ctx.all_reduce("sum", jnp.sum(batch[0]))
        return loss, loss

    with pytest.raises(TypeError, match=r"returned a tuple; metrics must be a dict"):
        jd.fit(step, model, opt, data=jd.data.from_arrays(*_data(), batch_size=8))


def test_state_that_differs_between_replicas_is_explained() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])

    @jd.train_step(strategy)
    def step(ctx, state, batch):
        return {"w": state["w"] + jnp.sum(batch[0])}, {}  # not all-reduced: per replica

    with pytest.raises(ValueError, match=r"state argument 0 differs between replicas"):
        jd.fit(step, {"w": jnp.zeros(())}, data=jd.data.from_arrays(*_data(), batch_size=8))


def test_argument_errors() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    step = _nnx_step(strategy)
    model, opt = _make(strategy)
    data = jd.data.from_arrays(*_data(), batch_size=8)
    with pytest.raises(TypeError, match=r"give the training state"):
        jd.fit(step, data=data)
    with pytest.raises(ValueError, match=r"epochs must be an int >= 0, got -1"):
        jd.fit(step, model, opt, data=data, epochs=-1)
    with pytest.raises(
        ValueError, match=r"eval_step and eval_data go together; got only eval_step"
    ):
        jd.fit(step, model, opt, data=data, eval_step=step)
    with pytest.raises(ValueError, match=r"the step runs on MirroredStrategy.*strategy="):
        jd.fit(step, model, opt, data=data, strategy=jd.OneDeviceStrategy())
    with pytest.raises(TypeError, match=r"holding NNX objects; pass NNX objects directly"):
        jd.fit(step, (model, opt), data=data)
    with pytest.raises(TypeError, match=r"callbacks must be jd.training.Callback objects"):
        jd.fit(step, model, opt, data=data, callbacks=[print])
    with pytest.raises(ValueError, match=r"progress must be True"):
        jd.fit(step, model, opt, data=data, progress="yes")
    with pytest.raises(ValueError, match=r"the data yielded no batches in epoch 1\."):
        jd.fit(step, model, opt, data=[])
    one_epoch = iter(jd.data.from_arrays(*_data(), batch_size=8))
    with pytest.raises(RuntimeError, match=r"an iterator that gives one epoch"):
        jd.fit(step, model, opt, data=one_epoch, epochs=2, verbose=False)


# Progress -----------------------------------------------------------------------------


def test_progress_lines_bar_and_silence(capsys) -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _make(strategy)
    step = _nnx_step(strategy)
    data = jd.data.from_arrays(*_data(), batch_size=BATCH)
    jd.fit(step, model, opt, data=data, epochs=2, progress=False, verbose=False)
    assert capsys.readouterr().out == ""
    jd.fit(step, model, opt, data=data, epochs=2)  # "auto": stdout is captured, not a TTY
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("epoch 2/2  4 steps")
    assert re.fullmatch(
        r"epoch 1/2  4 steps  \d+\.\ds  [\d,]+ examples/s  [\d,]+\.\d\d steps/s  "
        r"\S+ TFLOP/s/device  loss \d\.\d{4}",
        lines[0],
    )
    jd.fit(step, model, opt, data=data, epochs=1, progress=True)
    out = capsys.readouterr().out
    assert "epoch 1/1" in out and "4/4" in out and "examples/s" in out and "loss" in out


# Checkpoints --------------------------------------------------------------------------


class _EpochShuffled:
    """A source with ``set_epoch``: each epoch's order depends only on the epoch number."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y, self.epoch = x, y, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = np.random.default_rng(self.epoch).permutation(len(self.x))
        for i in range(0, len(order), BATCH):
            yield self.x[order[i : i + BATCH]], self.y[order[i : i + BATCH]]


class _Losses(jd.training.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, step, logs) -> None:
        self.losses.append(logs["loss"])


@pytest.mark.timeout(120)
def test_checkpoint_every_n_steps_restore_and_resume(tmp_path) -> None:
    strategy, x, y, step, model, opt = _mirrored_nnx()
    losses = _Losses()
    ckpt = jd.training.Checkpoint(tmp_path / "run", every_n_steps=2, every_epoch=False, keep=3)
    jd.fit(step, model, opt, data=_EpochShuffled(x, y), epochs=3, callbacks=[ckpt, losses])
    assert ckpt.all_steps() == [8, 10, 12]  # every 2 steps of 12; the newest 3 kept
    assert sorted(os.listdir(tmp_path / "run")) == [
        "ckpt-10",
        "ckpt-12",
        "ckpt-8",
        "jaxdist_checkpoints.json",  # the CheckpointManager's record
    ]
    ckpt.close()
    # The latest checkpoint restores bit for bit, in place.
    fresh, fresh_opt = _make(strategy, lr=0.1)
    restored = jd.training.restore_checkpoint(tmp_path / "run", fresh, fresh_opt)
    assert (restored.state, restored.step, restored.epoch) == (None, 12, 3)
    _assert_same_params(fresh, model)
    np.testing.assert_array_equal(
        fresh_opt.opt_state[0].mu["l1"]["kernel"].get_value(),
        opt.opt_state[0].mu["l1"]["kernel"].get_value(),
    )
    # Resume from step 8 (the end of epoch 2): the loss curve goes on as uninterrupted.
    resumed, resumed_opt = _make(strategy)
    r = jd.training.restore_checkpoint(tmp_path / "run", resumed, resumed_opt, step=8)
    assert (r.step, r.epoch) == (8, 2)
    tail = _Losses()
    history = jd.fit(
        step,
        resumed,
        resumed_opt,
        data=_EpochShuffled(x, y),
        epochs=3,
        initial_epoch=r.epoch,
        initial_step=r.step,
        callbacks=[tail],
    )
    assert history.epochs == [2] and history.step == 12
    np.testing.assert_array_equal(tail.losses, losses.losses[8:])
    _assert_same_params(resumed, model)


def test_checkpoint_of_functional_state_and_random_streams(tmp_path) -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        state = jd.TrainState.create(
            apply_fn=None,
            params={"w": jnp.arange(6.0).reshape(2, 3)},
            tx=optax.adam(0.1),
            key=jax.random.key(7),
        )
    rngs = nnx.Rngs(dropout=3)
    loop = jd.training.FitLoop(strategy, (state, rngs), (True, False), step=4)
    ckpt = jd.training.Checkpoint(tmp_path / "c", async_write=False)
    ckpt.set_loop(loop)
    ckpt.save()
    ckpt.close()
    template = state.replace(params={"w": jnp.zeros((2, 3))}, key=jax.random.key(0))
    other_rngs = nnx.Rngs(dropout=11)
    r = jd.training.restore_checkpoint(tmp_path / "c", template, other_rngs)
    assert r.step == 4 and r.epoch == 0
    np.testing.assert_array_equal(r.state.params["w"], np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(jax.random.key_data(r.state.key), jax.random.key_data(state.key))
    np.testing.assert_array_equal(
        jax.random.key_data(other_rngs.dropout.key.get_value()),
        jax.random.key_data(rngs.dropout.key.get_value()),
    )
    with pytest.raises(
        ValueError,
        match=r"\['state_0'\]\['params'\]\['w'\] has shape \(2, 3\) in the checkpoint, but "
        r"the template's array has shape \(3,\)",
    ):
        jd.training.restore_checkpoint(
            tmp_path / "c", state.replace(params={"w": jnp.ones(3)}), other_rngs
        )
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 5; it has steps \[4\]"):
        jd.training.restore_checkpoint(tmp_path / "c", template, other_rngs, step=5)


def test_checkpoint_checksums_are_verified(tmp_path) -> None:
    """Each fit checkpoint is a CheckpointManager entry: a SHA-256 manifest of every array and
    checksummed JSON records; a changed byte refuses to restore, naming what differs."""
    import json

    state = {"w": jnp.arange(6.0).reshape(2, 3), "n": jnp.int32(5), "h": jnp.ones(2, jnp.bfloat16)}
    loop = jd.training.FitLoop(jd.get_strategy(), (state,), (True,), step=3)
    ckpt = jd.training.Checkpoint(tmp_path / "c", async_write=False)
    ckpt.set_loop(loop)
    ckpt.save()
    ckpt.close()
    template = jax.tree.map(jnp.zeros_like, state)
    r = jd.training.restore_checkpoint(tmp_path / "c", template)
    jax.tree.map(np.testing.assert_array_equal, r.state, state)

    path = tmp_path / "c" / "ckpt-3"
    manifest_file = path / jd.checkpoint.MANIFEST
    intact = manifest_file.read_text()
    manifest = json.loads(intact)
    leaves = {tuple(e["path"]): e for e in manifest["leaves"]}
    assert {("items", "state_0", k) for k in state} <= set(leaves)
    # The record and the data disagree (as after a damaged write): refused, naming the array.
    leaves["items", "state_0", "w"]["sha256"] = "0" * 64
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(
        ValueError,
        match=r"restore_checkpoint: the checkpoint .*ckpt-3 cannot be restored: .*leaf "
        r"\['items'\]\['state_0'\]\['w'\] of the checkpoint in .*ckpt-3 does not match its "
        r"manifest: sha256 is",
    ):
        jd.training.restore_checkpoint(tmp_path / "c", template)
    manifest_file.write_text(intact)
    # The loop's record (step, epoch, data position) is checksummed too.
    record_file = path / "jaxdist_iterators.0.json"
    record = json.loads(record_file.read_text())
    record["body"]["iterators"]["loop"]["step"] = 4
    record_file.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"does not match its SHA-256 checksum"):
        jd.training.restore_checkpoint(tmp_path / "c", template)
    # verify=False no longer skips the check.
    with (
        pytest.warns(DeprecationWarning, match=r"verify=False is deprecated and ignored"),
        pytest.raises(ValueError, match=r"does not match its SHA-256 checksum"),
    ):
        jd.training.restore_checkpoint(tmp_path / "c", template, verify=False)


def test_unfinished_writes_are_ignored_and_old_runs_refused(tmp_path) -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _make(strategy)
    step = _nnx_step(strategy)
    data = jd.data.from_arrays(*_data(), batch_size=BATCH)
    jd.fit(step, model, opt, data=data, callbacks=[jd.training.Checkpoint(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["ckpt-4", "jaxdist_checkpoints.json"]
    # A write cut short leaves a temporary directory: never taken for a checkpoint.
    (tmp_path / "ckpt-9.tmp").mkdir()
    (tmp_path / "ckpt-9.tmp" / "state").write_text("half")
    fresh, fresh_opt = _make(strategy)
    restored = jd.training.restore_checkpoint(tmp_path, fresh, fresh_opt)
    assert (restored.step, restored.epoch) == (4, 1)  # after epoch 0: one epoch complete
    _assert_same_params(fresh, model)
    with pytest.raises(
        ValueError, match=r"already holds checkpoints at steps \[4\], past step 0.*resume=True"
    ):
        jd.fit(step, model, opt, data=data, callbacks=[jd.training.Checkpoint(tmp_path)])
    # An earlier jaxdist's fit checkpoints (orbax steps named by number) are named as such.
    (tmp_path / "old" / "4").mkdir(parents=True)
    with pytest.raises(
        FileNotFoundError, match=r"holds no complete checkpoint .*named by step number"
    ):
        jd.training.restore_checkpoint(tmp_path / "old", fresh, fresh_opt)


# Early stopping -----------------------------------------------------------------------


def _scripted(strategy: jd.Strategy, values: list[float]):
    """A step whose metric 'score' is values[epoch] (4 steps per epoch), counted in the state."""
    table = jnp.asarray(values, jnp.float32)

    @jd.train_step(strategy)
    def step(ctx, model, opt, counter, batch):
        x, y = batch
        _, grads = nnx.value_and_grad(lambda m: jd.compute_average_loss(_ce(m(x), y)))(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return counter + 1, {"score": table[counter // 4]}

    return step


@pytest.mark.parametrize(
    ("values", "patience", "mode", "min_delta", "stopped"),
    [
        ([5.0, 4.0, 4.5, 3.0, 3.5, 3.6, 1.0], 2, "min", 0.0, 5),
        ([5.0, 4.0, 4.5, 3.0, 3.5, 3.6, 1.0], 0, "min", 0.0, 2),
        ([5.0, 4.0, 3.99, 3.98, 1.0, 1.0, 1.0], 1, "min", 0.05, 2),
        ([0.1, 0.5, 0.4, 0.6, 0.6, 0.6, 0.9], 2, "max", 0.0, 5),
    ],
)
def test_early_stopping_stops_at_the_right_epoch(values, patience, mode, min_delta, stopped):
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _make(strategy)
    stop = jd.training.EarlyStopping("score", patience=patience, mode=mode, min_delta=min_delta)
    counter, history = jd.fit(
        _scripted(strategy, values),
        model,
        opt,
        jnp.int32(0),
        data=jd.data.from_arrays(*_data(), batch_size=BATCH),
        epochs=len(values),
        callbacks=[stop],
    )
    assert stop.stopped_epoch == stopped and history.epochs == list(range(stopped + 1))
    assert history.stopped_early and int(counter) == 4 * (stopped + 1)
    np.testing.assert_allclose(history.history["score"], values[: stopped + 1])


def test_early_stopping_restores_the_best_state() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _make(strategy)
    snapshots = {}

    class Snapshot(jd.training.Callback):
        def on_epoch_end(self, epoch, logs) -> None:
            snapshots[epoch] = _params(model)

    stop = jd.training.EarlyStopping("score", patience=2, restore_best=True)
    jd.fit(
        _scripted(strategy, [3.0, 1.0, 2.0, 2.0, 0.0]),
        model,
        opt,
        jnp.int32(0),
        data=jd.data.from_arrays(*_data(), batch_size=BATCH),
        epochs=5,
        callbacks=[Snapshot(), stop],
    )
    assert stop.best_epoch == 1 and stop.stopped_epoch == 3
    for a, b in zip(_params(model), snapshots[1], strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(KeyError, match=r"monitor='val_loss' is not among.*need eval_step"):
        jd.fit(
            _scripted(strategy, [1.0]),
            model,
            opt,
            jnp.int32(0),
            data=jd.data.from_arrays(*_data(), batch_size=BATCH),
            callbacks=[jd.training.EarlyStopping()],
        )


# Ctrl-C -------------------------------------------------------------------------------


def test_sigint_handler_is_restored_after_fit_and_after_errors() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model, opt = _make(strategy)
    data = jd.data.from_arrays(*_data(), batch_size=BATCH)
    before = signal.getsignal(signal.SIGINT)
    jd.fit(_nnx_step(strategy), model, opt, data=data, verbose=False)
    assert signal.getsignal(signal.SIGINT) is before

    @jd.train_step(strategy)
    def broken(ctx, model, opt, batch):
        raise RuntimeError("broken step")

    with pytest.raises(RuntimeError, match="broken step"):
        jd.fit(broken, model, opt, data=data)
    assert signal.getsignal(signal.SIGINT) is before


class _InterruptSoon(jd.training.Callback):
    """Sends SIGINT to this process from another thread shortly after step 2."""

    def on_step_end(self, step, logs) -> None:
        if step == 2:

            def send() -> None:
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGINT)

            threading.Thread(target=send, daemon=True).start()


@pytest.mark.timeout(120)
def test_ctrl_c_finishes_the_step_and_keeps_state_and_checkpoint(tmp_path) -> None:
    strategy, x, y, step, model, opt = _mirrored_nnx()
    ckpt = jd.training.Checkpoint(tmp_path, every_n_steps=3, every_epoch=False)
    with pytest.raises(jd.training.FitInterrupted, match=r"stopped by Ctrl-C after step") as info:
        _quiet_fit(step, model, opt, x, y, steps=100_000, callbacks=[ckpt, _InterruptSoon()])
    done = info.value.history.step
    assert isinstance(info.value, KeyboardInterrupt) and info.value.state is None
    assert 2 <= done < 100_000
    leaves = jax.tree.leaves(nnx.state((model, opt)))
    assert not any(v.is_deleted() for v in leaves)  # nothing lost to donation
    assert int(opt.step.get_value()) == done
    ref, ref_opt = _make(strategy)
    jd.fit(step, ref, ref_opt, data=jd.data.from_arrays(x, y, batch_size=BATCH), steps=done)
    _assert_same_params(model, ref)
    # Ctrl-C saved the interrupted step itself; that checkpoint is complete and restores it.
    last = max(ckpt.all_steps())
    ckpt.close()
    assert last == done and not [p for p in os.listdir(tmp_path) if "tmp" in p]
    back, back_opt = _make(strategy)
    assert jd.training.restore_checkpoint(tmp_path, back, back_opt).step == last
    ref, ref_opt = _make(strategy)
    jd.fit(step, ref, ref_opt, data=jd.data.from_arrays(x, y, batch_size=BATCH), steps=last)
    _assert_same_params(back, ref)
    # Training goes on from the interrupted state.
    jd.fit(step, model, opt, data=jd.data.from_arrays(x, y, batch_size=BATCH), steps=1)
    assert int(opt.step.get_value()) == done + 1


@pytest.mark.timeout(120)
def test_ctrl_c_hands_back_the_functional_state() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    step = _functional_step(strategy)
    data = jd.data.from_arrays(*_data(), batch_size=BATCH)
    with pytest.raises(KeyboardInterrupt) as info:
        jd.fit(
            step,
            _linen_like_state(strategy),
            data=data,
            steps=100_000,
            callbacks=[_InterruptSoon()],
            verbose=False,
        )
    state = info.value.state
    assert isinstance(state, jd.TrainState) and int(state.step) == info.value.history.step
    assert not any(v.is_deleted() for v in jax.tree.leaves(state))
    state, _ = jd.fit(step, state, data=data, steps=int(state.step) + 1)  # still usable


class _InterruptAt(jd.training.Callback):
    """At global step ``step``: raises KeyboardInterrupt, or sends this process SIGINT
    ``signals`` times (from the main thread, so the handler runs before the next line)."""

    def __init__(self, step: int, *, signals: int = 0) -> None:
        self.step, self.signals = step, signals

    def on_step_end(self, step, logs) -> None:
        if step != self.step:
            return
        if not self.signals:
            raise KeyboardInterrupt("raised by a callback")
        for _ in range(self.signals):
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signals", [1, 2], ids=["ctrl_c", "ctrl_c_twice"])
def test_sigint_from_a_callback_mid_epoch_stops_after_that_step(tmp_path, signals: int) -> None:
    """Step 6 is the second step of epoch 1 (4 steps per epoch). A second Ctrl-C stops at
    once, outside the step, with the same consistent state."""
    strategy, x, y, step, model, opt = _mirrored_nnx()
    ckpt = jd.training.Checkpoint(tmp_path, every_n_steps=4, every_epoch=False)
    with pytest.raises(jd.training.FitInterrupted, match=r"stopped by Ctrl-C after step 6, ") as e:
        stop = _InterruptAt(6, signals=signals)
        _quiet_fit(step, model, opt, x, y, epochs=3, callbacks=[ckpt, stop])
    if signals == 2:
        assert "second Ctrl-C" in str(e.value.__cause__)
    else:
        assert e.value.__cause__ is None
    assert e.value.history.step == 6 and e.value.history.epochs == [0]  # epoch 1 unfinished
    assert int(opt.step.get_value()) == 6
    ref, ref_opt = _make(strategy)
    jd.fit(step, ref, ref_opt, data=jd.data.from_arrays(x, y, batch_size=BATCH), steps=6)
    _assert_same_params(model, ref)
    assert ckpt.all_steps() == [4, 6]  # every 4 steps, and step 6 where Ctrl-C stopped
    ckpt.close()
    for at in (4, 6):
        back, back_opt = _make(strategy)
        restored = jd.training.restore_checkpoint(tmp_path, back, back_opt, step=at)
        assert (restored.step, restored.epoch) == (at, 1)
        ref, ref_opt = _make(strategy)
        jd.fit(step, ref, ref_opt, data=jd.data.from_arrays(x, y, batch_size=BATCH), steps=at)
        _assert_same_params(back, ref)


@pytest.mark.timeout(120)
def test_keyboard_interrupt_from_a_callback_hands_back_the_functional_state(tmp_path) -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    step = _functional_step(strategy)
    data = jd.data.from_arrays(*_data(), batch_size=BATCH)
    ckpt = jd.training.Checkpoint(tmp_path, every_n_steps=5, every_epoch=False)
    with pytest.raises(
        jd.training.FitInterrupted,
        match=r"stopped by a KeyboardInterrupt after step 6, epoch 2 of \d+; the state is that of "
        r"the last completed step",
    ) as e:
        jd.fit(
            step,
            _linen_like_state(strategy),
            data=data,
            epochs=3,
            callbacks=[ckpt, _InterruptAt(6)],
            verbose=False,
        )
    assert str(e.value.__cause__) == "raised by a callback"
    state = e.value.state
    assert isinstance(state, jd.TrainState) and int(state.step) == 6
    assert not any(v.is_deleted() for v in jax.tree.leaves(state))
    ref, _ = jd.fit(step, _linen_like_state(strategy), data=data, steps=6, verbose=False)
    jax.tree.map(np.testing.assert_array_equal, state.params, ref.params)
    # Step 5 (every 5 steps) and step 6 (where the interrupt stopped) are whole and restore
    # their steps' state.
    assert ckpt.all_steps() == [5, 6]
    ckpt.close()
    for at in (5, 6):
        restored = jd.training.restore_checkpoint(tmp_path, _linen_like_state(strategy), step=at)
        assert (restored.step, restored.epoch) == (at, 1)
        ref, _ = jd.fit(step, _linen_like_state(strategy), data=data, steps=at, verbose=False)
        jax.tree.map(np.testing.assert_array_equal, restored.state.params, ref.params)
        assert int(restored.state.step) == at


def test_keyboard_interrupt_inside_a_step_is_not_taken_for_a_clean_stop() -> None:
    """Inside a step the state may be donated and not yet written back: fit re-raises the
    interrupt as it is, without claiming a consistent state."""
    strategy = jd.MirroredStrategy(jax.devices()[:2])

    @jd.train_step(strategy)
    def step(ctx, state, batch):
        raise KeyboardInterrupt("inside the step")

    with pytest.raises(KeyboardInterrupt, match="inside the step") as e:
        jd.fit(step, {"w": jnp.zeros(2)}, data=jd.data.from_arrays(*_data(), batch_size=BATCH))
    assert not isinstance(e.value, jd.training.FitInterrupted)


def _read_all(fd: int) -> str:
    """Everything written to a pseudo terminal so far: one read may return only the first
    part (the terminal delivers in pieces, more so on a loaded machine)."""
    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_bar_on_a_terminal_that_reports_no_size() -> None:
    """A pseudo terminal of size 0 x 0 (as CI runners give) is a terminal: "auto" draws the
    bar, and it is drawn (tqdm alone hides a bar on a terminal of 0 lines)."""
    from jaxdist.training.fit.progress import Progress, want_bar

    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as stream:
        assert os.get_terminal_size(stream.fileno()) == (0, 0)
        assert want_bar("auto", stream, "fit")
        display = Progress(bar=True, verbose=True, epochs=2, stream=stream)
        display.epoch_begin(0, 4)
        display.epoch_end(0, 4, {"loss": 0.25}, 1234.0, 0.1)
        display.close()
        stream.flush()
        out = _read_all(master)
    os.close(master)
    assert re.search(r"epoch 1/2: 100%\|.*\| 4/4 .*loss 0\.2500  1,234 examples/s", out), out


def _fit_with(callbacks) -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @jd.train_step(strategy)
    def step(ctx, model, opt, batch):
        x, y = batch
        loss_fn = lambda m: jd.compute_average_loss(jnp.sum((m(x) - y) ** 2, axis=-1))  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return {"loss": ctx.all_reduce("sum", loss)}

    x = np.ones((32, 3), np.float32)
    data = jd.data.from_arrays(x, x[:, :1], batch_size=8)
    jd.fit(step, model, opt, data=data, callbacks=callbacks, verbose=False)


@pytest.mark.parametrize("async_write", [False, True])
def test_checkpoint_directory_removed_during_the_run(tmp_path, async_write: bool) -> None:
    directory = tmp_path / "ckpt"

    class Remove(jd.training.Callback):
        def on_step_end(self, step, logs):
            if step == 2:
                ckpt._wait()  # the first save is complete: then the directory goes
                shutil.rmtree(directory)

    ckpt = jd.training.Checkpoint(directory, every_n_steps=1, async_write=async_write)
    with pytest.raises(RuntimeError) as info:
        _fit_with([Remove(), ckpt])
    message = str(info.value)
    assert re.search(
        r"(?s)jaxdist\.training\.Checkpoint: the checkpoint directory .*ckpt disappeared during "
        r"the run.*checkpoint of step 2 is not written.*Keep the directory",
        message,
    ), message


def test_checkpoint_directory_that_is_a_file_is_named_briefly(tmp_path) -> None:
    directory = tmp_path / "ckpt"
    directory.write_text("not a directory")
    with pytest.raises((RuntimeError, ValueError)) as info:
        _fit_with([jd.training.Checkpoint(directory, every_n_steps=1, async_write=False)])
    message = str(info.value)
    assert "is a file, not a directory" in message and len(message) < 1000, message
