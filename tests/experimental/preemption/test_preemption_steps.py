"""`jd.experimental.PreemptionCheckpointHandler` over calls of several steps
(``jd.train_step(..., steps_per_execution=k)``): ``total_run_calls`` counts steps, the save
is at the end of a call, a restart resumes to the same bits as a run never stopped; a short
last group; a plain function still counts one per call; two processes agree on a call.

Tolerance: the grouped jaxdist run vs plain single-device NumPy SGD, rtol 1e-5 / atol 1e-6
(float32; per-replica gradients are summed in another order). Interrupted vs uninterrupted
grouped runs: bitwise equal (the same programs over the same batches).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.experimental.preemption import handler as handler_module

from _helpers import linear_data, run_workers, worker_script

pytest.importorskip("orbax.checkpoint")

BATCH, BATCHES, K, LR = 16, 11, 4, 0.1  # groups of 4, 4 and 3 steps
REF = {"rtol": 1e-5, "atol": 1e-6}


def _data(batches: int = BATCHES) -> tuple[np.ndarray, np.ndarray]:
    return linear_data(BATCH * batches, [1.0, -2.0, 0.5, 3.0])


def _reference(batches: int = BATCHES) -> np.ndarray:
    """Plain SGD on one device, float64, batch after batch."""
    x, y = (a.astype(np.float64) for a in _data(batches))
    w = np.zeros(4)
    for i in range(batches):
        bx, by = x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]
        w = w - LR * 2.0 * bx.T @ (bx @ w - by) / BATCH
    return w


class _Training:
    """A grouped train step, its state and data in a Checkpoint, and the function to run."""

    def __init__(self, strategy: jd.Strategy) -> None:
        dataset = strategy.experimental_distribute_dataset(
            jd.data.from_arrays(*_data(), batch_size=BATCH)
        )
        with strategy.scope():
            state = jd.TrainState.create(
                apply_fn=None, params={"w": jnp.zeros(4)}, tx=optax.sgd(LR)
            )

        @jd.train_step(strategy, steps_per_execution=K)
        def train(ctx: Any, state: jd.TrainState, batch: Any) -> jd.TrainState:
            bx, by = batch

            def loss(p: Any) -> jax.Array:
                return jd.compute_average_loss((bx @ p["w"] - by) ** 2)

            grads = ctx.all_reduce("sum", jax.grad(loss)(state.params))
            return state.apply_gradients(grads=grads)

        self.train = train
        self.plain = train.replace(steps_per_execution=1)  # one batch per call
        self.ckpt = jd.checkpoint.Checkpoint(state=state, data=iter(dataset))

        def step() -> None:
            self.ckpt.state = train(self.ckpt.state, self.ckpt.data)
            step.last_call_steps = train.last_call_steps  # type: ignore[attr-defined]

        self.step = step

    def run_to_end(self, handler: Any) -> int:
        """Runs the remaining groups through ``handler``; returns the calls made."""
        calls = 0
        while True:
            try:
                handler.run(self.step)
            except StopIteration:
                return calls
            calls += 1

    def weights(self) -> np.ndarray:
        return np.asarray(self.ckpt.state.params["w"])


def _handler(training: _Training, directory: Path, **config: Any) -> Any:
    return jd.experimental.PreemptionCheckpointHandler(
        None, training.ckpt, directory, jd.experimental.TerminationConfig(**config)
    )


def _uninterrupted(directory: Path) -> np.ndarray:
    training = _Training(jd.MirroredStrategy())
    handler = _handler(training, directory, termination_watcher_fn=lambda: False)
    assert training.run_to_end(handler) == 3  # 4 + 4 + 3 steps
    assert handler.total_run_calls == BATCHES  # the short last group counts 3
    return training.weights()


def test_a_grouped_run_counts_steps_and_the_short_last_group(tmp_path: Path) -> None:
    w = _uninterrupted(tmp_path)
    np.testing.assert_allclose(w, _reference(), **REF)


def test_a_save_during_a_grouped_run_is_at_a_group_boundary_and_resumes_bitwise(
    tmp_path: Path,
) -> None:
    expected = _uninterrupted(tmp_path / "reference")
    notice = threading.Event()
    training = _Training(jd.MirroredStrategy())
    handler = _handler(training, tmp_path / "run", termination_watcher_fn=notice.is_set)
    handler.run(training.step)  # steps 1-4
    assert handler.total_run_calls == K
    notice.set()
    time.sleep(4 * handler_module.WATCH_INTERVAL_S)  # the watcher has seen it
    handler.run(training.step)  # steps 5-8: TF's local mode runs the call after the notice
    assert handler.total_run_calls == 2 * K
    with pytest.raises(SystemExit) as exit_info:  # the default exit_fn: sys.exit(42)
        handler.run(training.step)  # the save, before steps 9-11 (TF's moment)
    assert exit_info.value.code == handler_module.RESTART_EXIT_CODE
    assert handler.total_run_calls == 2 * K  # steps, at the end of the second call

    restarted = _Training(jd.MirroredStrategy())
    again = _handler(restarted, tmp_path / "run", termination_watcher_fn=lambda: False)
    assert again.restored_from is not None
    assert again.total_run_calls == 2 * K and restarted.ckpt.total_run_calls == 2 * K
    assert restarted.run_to_end(again) == 1  # the remaining 3 steps
    assert again.total_run_calls == BATCHES
    np.testing.assert_array_equal(restarted.weights(), expected)  # bitwise
    np.testing.assert_allclose(restarted.weights(), _reference(), **REF)


def test_a_notice_saves_after_the_next_call_before_the_short_last_group(tmp_path: Path) -> None:
    notice, exits = threading.Event(), []

    def exit_fn() -> None:  # returns: training goes on
        exits.append(handler.total_run_calls)
        notice.clear()

    training = _Training(jd.MirroredStrategy())
    handler = _handler(training, tmp_path, termination_watcher_fn=notice.is_set, exit_fn=exit_fn)
    handler.run(training.step)
    notice.set()
    time.sleep(4 * handler_module.WATCH_INTERVAL_S)
    handler.run(training.step)  # the call that starts after the notice runs (TF)
    after_two = training.weights()
    assert exits == []
    assert training.run_to_end(handler) == 1  # the short group ran after the save
    assert exits == [2 * K]  # saved at the start of the third call: 8 steps
    fresh = _Training(jd.MirroredStrategy())
    restored = _handler(fresh, tmp_path, termination_watcher_fn=lambda: False)
    assert restored.total_run_calls == 2 * K
    np.testing.assert_array_equal(fresh.weights(), after_two)
    assert fresh.run_to_end(restored) == 1  # the data position: before the short group
    np.testing.assert_array_equal(fresh.weights(), training.weights())


def test_a_train_step_given_directly_counts_its_steps(tmp_path: Path) -> None:
    training = _Training(jd.MirroredStrategy())
    handler = _handler(training, tmp_path, termination_watcher_fn=lambda: False)
    assert training.train.last_call_steps == 0  # no call yet
    ckpt = training.ckpt  # TF's habit: the new state is rebound after run returns
    ckpt.state = handler.run(training.train, ckpt.state, ckpt.data)
    assert training.train.last_call_steps == K and handler.total_run_calls == K
    ckpt.state = handler.run(training.train, ckpt.state, ckpt.data)
    ckpt.state = handler.run(training.train, ckpt.state, ckpt.data)
    assert training.train.last_call_steps == 3 and handler.total_run_calls == BATCHES
    with pytest.raises(StopIteration):  # nothing left: not counted
        handler.run(training.train, ckpt.state, ckpt.data)
    assert handler.total_run_calls == BATCHES


def test_a_plain_function_counts_one_per_call(tmp_path: Path) -> None:
    handler = jd.experimental.PreemptionCheckpointHandler(
        None,
        jd.checkpoint.Checkpoint(),
        tmp_path,
        jd.experimental.TerminationConfig(termination_watcher_fn=lambda: False),
    )
    assert [handler.run(lambda i=i: i) for i in range(3)] == [0, 1, 2]
    assert handler.total_run_calls == 3


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_a_bad_last_call_steps_is_refused(tmp_path: Path, value: Any) -> None:
    handler = jd.experimental.PreemptionCheckpointHandler(
        None,
        jd.checkpoint.Checkpoint(),
        tmp_path,
        jd.experimental.TerminationConfig(termination_watcher_fn=lambda: False),
    )

    def step() -> None:
        pass

    step.last_call_steps = value  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"run: step\.last_call_steps is .*an int >= 1"):
        handler.run(step)
    assert handler.total_run_calls == 0


# Two processes: the agreement on a call ------------------------------------------------------

_TWO = worker_script(
    """
    import threading, time
    import jax.numpy as jnp
    import numpy as np
    import optax
    import jaxdist as jd

    me = jax.process_index()
    strategy = jd.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * 11, 4)).astype(np.float32)[: 16 * 8]  # 8 batches: 3, 3, 2
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)).astype(np.float32)
    dataset = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(x, y, batch_size=16))

    def fresh_state():
        with strategy.scope():
            return jd.TrainState.create(
                apply_fn=None, params={"w": jnp.zeros(4)}, tx=optax.sgd(0.1))

    @jd.train_step(strategy, steps_per_execution=3)
    def train(ctx, state, batch):
        bx, by = batch
        loss = lambda p: jd.compute_average_loss((bx @ p["w"] - by) ** 2)
        return state.apply_gradients(grads=ctx.all_reduce("sum", jax.grad(loss)(state.params)))

    ckpt = jd.checkpoint.Checkpoint(state=fresh_state(), data=iter(dataset))
    notice, exits, calls = threading.Event(), [], [0]
    handler = jd.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, ckpt, DIRECTORY,
        jd.experimental.TerminationConfig(
            termination_watcher_fn=notice.is_set,
            exit_fn=lambda: exits.append(handler.total_run_calls)))

    def step():
        ckpt.state = jax.block_until_ready(train(ckpt.state, ckpt.data))
        step.last_call_steps = train.last_call_steps
        calls[0] += 1
        if me == 0 and calls[0] == 2:
            # Process 1 publishes as its second call returns; process 0 looks for it
            # after its own second call: this pause makes it see it then, not a call later.
            time.sleep(2.0)

    handler.run(step)
    if me == 1:
        notice.set()  # process 1 alone gets the notice, after the first group
    time.sleep(2.0)  # its watcher sees it before the second group ends
    while True:
        try:
            handler.run(step)
        except StopIteration:
            break
    again = jd.checkpoint.Checkpoint(state=fresh_state(), data=iter(dataset), total_run_calls=0)
    jd.checkpoint.CheckpointManager(again, DIRECTORY).restore_or_initialize()
    print(json.dumps({
        "exits": exits, "total": handler.total_run_calls,
        "w": np.asarray(ckpt.state.params["w"]).tolist(),
        "saved_total": int(again.total_run_calls),
        "saved_w": np.asarray(again.state.params["w"]).tolist()}))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_processes_save_after_the_same_call_the_short_last_group(tmp_path: Path) -> None:
    # Process 1's notice comes after the first group: both publish 2 calls (6 steps), and
    # save after the third call, the short last group: step 8, not 6 + 1 (inside a call).
    results = run_workers(_TWO.replace("DIRECTORY", repr(str(tmp_path))), timeout=100)
    expected = _reference(8)
    for r in results:
        assert r["exits"] == [8] and r["total"] == 8 and r["saved_total"] == 8
        np.testing.assert_allclose(r["w"], expected, **REF)
        np.testing.assert_array_equal(r["saved_w"], r["w"])  # saved after the last step
    assert results[0]["w"] == results[1]["w"]


# TF's rebinding habit -------------------------------------------------------------------------


def _tf_loop(training: _Training, handler: Any, calls: int | None = None) -> int:
    """TF's habit: the batch taken before run(), the new state rebound after it returns."""
    made = 0
    while calls is None or made < calls:
        try:
            batch = next(training.ckpt.data)
        except StopIteration:
            return made
        training.ckpt.state = handler.run(training.plain, training.ckpt.state, batch)
        made += 1
    return made


def test_tf_habit_rebinding_after_run_is_saved_and_resumes_bitwise(tmp_path: Path) -> None:
    # Before: the handler saved inside run(), before the rebinding, and died on the donated
    # state ("Array has been deleted"); now the save comes at the start of the next call.
    reference = _Training(jd.MirroredStrategy())
    never = _handler(reference, tmp_path / "ref", termination_watcher_fn=lambda: False)
    assert _tf_loop(reference, never) == BATCHES
    notice = threading.Event()
    training = _Training(jd.MirroredStrategy())
    handler = _handler(training, tmp_path / "run", termination_watcher_fn=notice.is_set)
    assert _tf_loop(training, handler, calls=5) == 5
    notice.set()
    time.sleep(4 * handler_module.WATCH_INTERVAL_S)
    with pytest.raises(SystemExit):  # the sixth call runs (TF), the seventh saves 6 steps
        _tf_loop(training, handler)  # first, and batch 7 is not used
    restarted = _Training(jd.MirroredStrategy())
    again = _handler(restarted, tmp_path / "run", termination_watcher_fn=lambda: False)
    assert again.total_run_calls == 6
    # The position saved is the end of the sixth call, not past the batch taken for the 7th.
    assert _tf_loop(restarted, again) == BATCHES - 6
    np.testing.assert_array_equal(restarted.weights(), reference.weights())  # bitwise
    np.testing.assert_allclose(restarted.weights(), _reference(), **REF)


def test_a_loop_that_never_rebinds_the_checkpoint_is_refused_at_the_second_call(
    tmp_path: Path,
) -> None:
    training = _Training(jd.MirroredStrategy())
    handler = _handler(training, tmp_path, termination_watcher_fn=lambda: False)
    state = handler.run(training.plain, training.ckpt.state, next(training.ckpt.data))
    with pytest.raises(
        ValueError,
        match=r"run: the checkpoint holds arrays that were deleted .*: state\.step int32\[\]; "
        r"state\.params\['w'\] float32\[4\].*ckpt\.state = handler\.run\(train, ckpt\.state",
    ):
        handler.run(training.plain, state, next(training.ckpt.data))


def test_an_unwritable_directory_is_refused_when_the_handler_is_made(tmp_path: Path) -> None:
    # Before: a raw NotADirectoryError at the first preemption (exit 1 instead of 42).
    (tmp_path / "file").write_text("not a directory")
    training = _Training(jd.MirroredStrategy())
    with pytest.raises(
        ValueError, match=r"checkpoint_dir='.*file/ckpts' cannot hold checkpoints: NotADirectory"
    ):
        _handler(training, tmp_path / "file" / "ckpts")
    made = tmp_path / "new" / "deeper"
    _handler(_Training(jd.MirroredStrategy()), made, termination_watcher_fn=lambda: False)
    assert not (tmp_path / "new").exists()  # checked, and left as it was until a save
