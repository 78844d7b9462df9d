"""Errors a new user meets outside the training step (issue 20): a parameter-server task
given to `MultiWorkerMirroredStrategy`, NNX objects moved between strategies, a checkpoint
directory that disappears during a run."""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd

# 11. A ps task is not a MultiWorkerMirroredStrategy worker ---------------------------------


@pytest.mark.parametrize("task", ["ps", "chief_helper"])
def test_multi_worker_strategy_refuses_a_task_outside_the_collective_group(
    monkeypatch, task: str
) -> None:
    cluster = {"worker": ["localhost:2222", "localhost:2223"], task: ["localhost:2224"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": task, "index": 0}})
    )
    with pytest.raises(
        ValueError,
        match=rf"(?s)MultiWorkerMirroredStrategy: .*task '{task}' 0 is not "
        r"part of the JAX collective group.*ParameterServerStrategy",
    ):
        jd.MultiWorkerMirroredStrategy()


def test_multi_worker_strategy_lets_an_evaluator_run_alone(monkeypatch) -> None:
    # As in TF: an evaluator task runs its own one-process program beside the job.
    cluster = {"worker": ["localhost:2222", "localhost:2223"], "evaluator": ["localhost:2224"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}})
    )
    strategy = jd.MultiWorkerMirroredStrategy()
    assert strategy.extended.worker_devices and strategy.cluster_resolver.task_type == "evaluator"


# 10. The checkpoint directory disappears ---------------------------------------------------


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


# 9. NNX objects stepped by another strategy ------------------------------------------------


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
