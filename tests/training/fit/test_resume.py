"""`jd.fit(..., resume=True)`: a run stopped at any step (Ctrl-C, SIGTERM, a crash) and
resumed from its checkpoints ends bitwise equal to a run that never stopped.

Reference: the same `fit` call run without interruption, in the same process (or, for
the subprocess test, in a fresh process of the same program). Compared with
``assert_array_equal`` (no tolerance): every array of the final state (parameters,
optimizer moments and step counts), and the `History` (epoch metrics as floats, exactly).

The data: 50 rows in batches of 16, shuffled anew every epoch (4 steps per epoch, the last
with 2 real rows, padded across replicas), 8 epochs: 32 steps. Step 11 is the third step
of epoch 2; step 12 is that epoch's last.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import textwrap
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd

from _helpers import (
    ORBAX_CLOSED_LOOP,
    TanhMLP,
    classification_data,
    finish,
    flip_middle_byte,
    load_npz,
    run_workers,
    sigterm_at,
    start_python,
    strategy_params,
    worker_script,
)

pytest.importorskip("orbax.checkpoint")

ROWS, FEATURES, CLASSES, BATCH, EPOCHS = 50, 4, 3, 16, 8
STEPS = EPOCHS * 4


def _data(rows: int = ROWS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return classification_data(rows, FEATURES, CLASSES, seed)


def _train_data() -> jd.data.ArrayDataset:
    return jd.data.from_arrays(*_data(), batch_size=BATCH, shuffle=True, seed=3)


def _eval_data() -> jd.data.ArrayDataset:
    return jd.data.from_arrays(*_data(rows=24, seed=5), batch_size=BATCH)


def _ce(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


MLP = functools.partial(TanhMLP, (FEATURES, 8, CLASSES))


def _mlp(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


class _Setup:
    """A model, its steps and a fresh state, NNX (model + optimizer, updated in place) or
    functional (a `TrainState`, returned)."""

    def __init__(self, strategy: jd.Strategy, kind: str) -> None:
        self.strategy, self.kind = strategy, kind
        if kind == "nnx":

            @jd.train_step(strategy)
            def step(ctx, model, opt, batch):
                x, y = batch
                loss_fn = lambda m: jd.compute_average_loss(_ce(m(x), y))  # noqa: E731
                loss, grads = nnx.value_and_grad(loss_fn)(model)
                opt.update(model, ctx.all_reduce("sum", grads))
                return {"loss": ctx.all_reduce("sum", loss)}

            @jd.train_step(strategy, donate=False)
            def evaluate(ctx, model, opt, batch):
                x, y = batch
                return {"loss": ctx.all_reduce("sum", jd.compute_average_loss(_ce(model(x), y)))}

        else:

            @jd.train_step(strategy)
            def step(ctx, state, batch):
                x, y = batch
                loss_fn = lambda p: jd.compute_average_loss(_ce(state.apply_fn(p, x), y))  # noqa: E731
                loss, grads = jax.value_and_grad(loss_fn)(state.params)
                state = state.apply_gradients(grads=ctx.all_reduce("sum", grads))
                return state, {"loss": ctx.all_reduce("sum", loss)}

            @jd.train_step(strategy, donate=False)
            def evaluate(ctx, state, batch):
                x, y = batch
                logits = state.apply_fn(state.params, x)
                return {"loss": ctx.all_reduce("sum", jd.compute_average_loss(_ce(logits, y)))}

        self.step, self.evaluate = step, evaluate

    def state(self) -> tuple[Any, ...]:
        with self.strategy.scope():
            if self.kind == "nnx":
                model = MLP(nnx.Rngs(0))
                return model, nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
            rng = np.random.default_rng(1)
            params = {
                "w1": jnp.asarray(rng.normal(size=(FEATURES, 8)), jnp.float32) * 0.5,
                "b1": jnp.zeros(8),
                "w2": jnp.asarray(rng.normal(size=(8, CLASSES)), jnp.float32) * 0.5,
                "b2": jnp.zeros(CLASSES),
            }
            return (jd.TrainState.create(apply_fn=_mlp, params=params, tx=optax.adam(0.1)),)

    def fit(
        self, state: tuple[Any, ...], callbacks: list, step: Any = None, **kwargs: Any
    ) -> tuple[Any, Any]:
        """``fit`` to the end; returns (the final state's arrays, the History)."""
        out = jd.fit(
            step if step is not None else self.step,
            *state,
            data=_train_data(),
            epochs=EPOCHS,
            eval_step=self.evaluate,
            eval_data=_eval_data(),
            callbacks=callbacks,
            verbose=False,
            strategy=self.strategy,
            **kwargs,
        )
        if self.kind == "nnx":
            return _arrays(state), out
        return _arrays(out[0]), out[1]


def _arrays(tree: Any) -> list[np.ndarray]:
    """Every array of a state (NNX objects through nnx.state) as host copies, in order."""
    if isinstance(tree, tuple) and all(isinstance(t, nnx.Pytree) for t in tree):
        tree = nnx.state(tree)
    return [np.array(x) for x in jax.tree.leaves(tree)]


# Speed figures (fit adds them to ``history.history``): they differ from run to run.
SPEED = ("examples_per_second", "tokens_per_second", "flops_per_step", "tflops_per_device", "mfu")


def _metrics(history: dict[str, list[float]]) -> dict[str, list[float]]:
    """``history.history`` without the speed figures."""
    return {k: v for k, v in history.items() if k not in SPEED}


def _same_arrays(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)  # bitwise


def _same_history(a: jd.training.History, b: jd.training.History) -> None:
    assert _metrics(a.history) == _metrics(b.history)  # exact floats
    assert a.epochs == b.epochs and a.step == b.step == STEPS
    assert len(a.examples_per_second) == len(b.examples_per_second)


def _names(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))


class _SignalAt(jd.training.Callback):
    """Sends this process ``signum`` at global step ``step`` (from the main thread: the
    handler runs before the next line)."""

    def __init__(self, step: int, signum: int = signal.SIGINT) -> None:
        self.step, self.signum = step, signum

    def on_step_end(self, step, logs) -> None:
        if step == self.step:
            signal.raise_signal(self.signum)


class _CrashAt(jd.training.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, step, logs) -> None:
        if step == self.step:
            raise RuntimeError(f"crash at step {step}")


_REFERENCES: dict[tuple[int, str], tuple[list[np.ndarray], jd.training.History]] = {}


def _reference(setup: _Setup) -> tuple[list[np.ndarray], jd.training.History]:
    """The uninterrupted run (computed once per replica count and kind)."""
    key = (setup.strategy.num_replicas_in_sync, setup.kind)
    if key not in _REFERENCES:
        _REFERENCES[key] = setup.fit(setup.state(), [])
    return _REFERENCES[key]


def _with_reference(
    strategy: jd.Strategy, kind: str
) -> tuple[_Setup, list[np.ndarray], jd.training.History]:
    """A `_Setup` and its uninterrupted run's arrays and `History`."""
    setup = _Setup(strategy, kind)
    return (setup, *_reference(setup))


# Ctrl-C at a step boundary: saved there, resumed there ---------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["nnx", "functional"])
@pytest.mark.parametrize("make_strategy", strategy_params("one_device", "mirrored8"))
@pytest.mark.parametrize("stop_at", [11, 12], ids=["mid-epoch", "epoch-end"])
def test_ctrl_c_then_resume_equals_the_uninterrupted_run(
    tmp_path: Path, make_strategy, kind: str, stop_at: int
) -> None:
    """Checkpoints every 3 steps; Ctrl-C at step 11 (mid-epoch) or 12 (the epoch's last step,
    before its evaluation) saves that step, and resuming ends bitwise equal: 32 steps, the
    same weights, optimizer state and history (the epoch in progress keeps its running
    metrics; the stopped epoch's evaluation runs after the restart)."""
    strategy = make_strategy()
    setup = _Setup(strategy, kind)
    ref_arrays, ref_history = _reference(setup)

    def checkpoint() -> jd.training.Checkpoint:
        return jd.training.Checkpoint(tmp_path, every_n_steps=3, every_epoch=False)

    state = setup.state()
    with pytest.raises(jd.training.FitInterrupted, match=rf"after step {stop_at}, ") as e:
        setup.fit(state, [checkpoint(), _SignalAt(stop_at)])
    assert e.value.history.step == stop_at
    expected = ["ckpt-12", "ckpt-6", "ckpt-9"] if stop_at == 12 else ["ckpt-11", "ckpt-6", "ckpt-9"]
    assert _names(tmp_path) == expected  # the newest 3 kept, the interrupted step among them

    resumed = setup.state()  # a restarted program builds its state afresh
    arrays, history = setup.fit(resumed, [checkpoint()], resume=True)
    _same_arrays(arrays, ref_arrays)
    _same_history(history, ref_history)
    if kind == "nnx":
        assert int(resumed[1].step.get_value()) == STEPS


@pytest.mark.timeout(300)
def test_ctrl_c_inside_an_epochs_last_step_then_resume(
    tmp_path: Path, mirrored8: jd.MirroredStrategy, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while step 12 (the epoch's last) runs: fit stops after it without looking for
    a next batch, so the checkpoint does not know the epoch's data is done; resuming finds
    it done, runs the epoch's evaluation, and goes on exactly."""
    setup, ref_arrays, ref_history = _with_reference(mirrored8, "nnx")
    calls = 0

    def step(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 12:
            signal.raise_signal(signal.SIGINT)  # handled at once: Ctrl-C during the step
        return setup.step(*args)

    with pytest.raises(jd.training.FitInterrupted, match=r"after step 12, epoch 3 of \d+;"):
        setup.fit(setup.state(), [jd.training.Checkpoint(tmp_path, every_epoch=False)], step)
    assert _names(tmp_path) == ["ckpt-12"]
    capsys.readouterr()
    arrays, history = setup.fit(
        setup.state(), [jd.training.Checkpoint(tmp_path, every_epoch=False)], resume=True
    )
    # Before: fit said nothing about what it resumed. Epochs are counted from 1, as the
    # interruption message and the progress bar count them.
    assert "jaxdist.fit: resumed from ckpt-12 (step 12, epoch 3 of 8)" in capsys.readouterr().out
    _same_arrays(arrays, ref_arrays)
    _same_history(history, ref_history)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_write", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("crash_at", [11, 14], ids=["after-mid-epoch-save", "after-epoch-save"])
def test_a_crash_resumes_from_the_last_periodic_checkpoint(
    tmp_path: Path, mirrored8: jd.MirroredStrategy, crash_at: int, async_write: bool
) -> None:
    """A crash (no save at the crash) resumes from the latest periodic checkpoint: step 9
    (the first step of epoch 2: the data resumes at its second batch) or step 12 (saved at
    the end of epoch 2, after its evaluation), and the steps after it run again."""
    setup, ref_arrays, ref_history = _with_reference(mirrored8, "nnx")

    def checkpoint() -> jd.training.Checkpoint:
        return jd.training.Checkpoint(tmp_path, every_n_steps=3, async_write=async_write)

    with pytest.raises(RuntimeError, match=rf"crash at step {crash_at}"):
        setup.fit(setup.state(), [checkpoint(), _CrashAt(crash_at)])
    # Every 3 steps and every epoch (4 steps), the newest 3 kept; 12 is both, saved once.
    saved = [6, 8, 9] if crash_at == 11 else [8, 9, 12]
    assert jd.training.Checkpoint(tmp_path).all_steps() == saved
    restored = jd.training.restore_checkpoint(tmp_path, *setup.state())
    assert restored.step == saved[-1]
    arrays, history = setup.fit(setup.state(), [checkpoint()], resume=True)
    _same_arrays(arrays, ref_arrays)
    _same_history(history, ref_history)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["nnx", "functional"])
def test_grouped_fit_saves_at_group_ends_and_resumes_exactly(
    tmp_path: Path, mirrored8: jd.MirroredStrategy, kind: str
) -> None:
    """steps_per_execution=3 over epochs of 4 steps (groups 1-3, 4; 5-7, 8; ...): saves due
    inside a group (every 2 steps) are made at its end, Ctrl-C inside a group stops at its
    end, and resuming ends bitwise equal to the uninterrupted grouped run (before: fit
    refused a Checkpoint callback with steps_per_execution)."""
    setup = _Setup(mirrored8, kind)
    grouped_arrays, grouped_history = setup.fit(setup.state(), [], steps_per_execution=3)
    ref_arrays = _reference(setup)[0]  # single steps: equal within float error
    for got, want in zip(grouped_arrays, ref_arrays, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    def checkpoint() -> jd.training.Checkpoint:
        return jd.training.Checkpoint(tmp_path, every_n_steps=2, every_epoch=False, keep=None)

    with pytest.raises(jd.training.FitInterrupted, match=r"after step 11, epoch 3 of 8;"):
        setup.fit(setup.state(), [checkpoint(), _SignalAt(10)], steps_per_execution=3)
    # Due at 2, 4, 6, 8, 10: saved at the ends of their groups; 11 by the Ctrl-C.
    assert jd.training.Checkpoint(tmp_path).all_steps() == [3, 4, 7, 8, 11]
    arrays, history = setup.fit(setup.state(), [checkpoint()], resume=True, steps_per_execution=3)
    _same_arrays(arrays, grouped_arrays)
    _same_history(history, grouped_history)


def test_a_source_that_cannot_seek_is_replayed_to_its_position(
    tmp_path: Path, mirrored8: jd.MirroredStrategy
) -> None:
    """A re-iterable source with ``set_epoch`` (each epoch's order from its number) cannot
    seek: resuming reads the epoch's first batches again and drops them (with a warning),
    and the result is still bitwise that of the uninterrupted run."""
    x, y = _data()

    class EpochShuffled:
        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            order = np.random.default_rng(self.epoch).permutation(ROWS)
            for i in range(0, ROWS, BATCH):
                yield x[order[i : i + BATCH]], y[order[i : i + BATCH]]

    setup = _Setup(mirrored8, "nnx")

    def run(callbacks: list, **kwargs: Any) -> tuple[Any, jd.training.History]:
        state = setup.state()
        history = jd.fit(
            setup.step, *state, data=EpochShuffled(), epochs=4, verbose=False,
            callbacks=callbacks, **kwargs,
        )  # fmt: skip
        return _arrays(state), history

    ref_arrays, ref_history = run([])
    with pytest.raises(jd.training.FitInterrupted):
        run([jd.training.Checkpoint(tmp_path, every_epoch=False), _SignalAt(7)])
    with pytest.warns(UserWarning, match=r"cannot seek, so the 3 batches before the saved"):
        arrays, history = run([jd.training.Checkpoint(tmp_path)], resume=True)
    _same_arrays(arrays, ref_arrays)
    assert _metrics(history.history) == _metrics(ref_history.history)
    assert history.epochs == [0, 1, 2, 3]


@pytest.mark.timeout(300)
def test_a_run_bounded_by_steps_extends_as_if_never_stopped(
    tmp_path: Path, mirrored8: jd.MirroredStrategy
) -> None:
    """``steps=10`` ends in the middle of epoch 2 (logged then, cut short); running again
    with ``steps=18`` and resume=True goes on from that epoch's data position and logs the
    epoch once, whole: the same as one run with ``steps=18``."""
    setup = _Setup(mirrored8, "functional")

    def run(steps: int, callbacks: list, **kwargs: Any) -> tuple[Any, jd.training.History]:
        state, history = jd.fit(
            setup.step, *setup.state(), data=_train_data(), steps=steps, verbose=False,
            eval_step=setup.evaluate, eval_data=_eval_data(), callbacks=callbacks, **kwargs,
        )  # fmt: skip
        return _arrays(state), history

    ref_arrays, ref_history = run(18, [])
    _, history = run(10, [jd.training.Checkpoint(tmp_path)])
    assert history.epochs == [0, 1, 2] and history.step == 10
    assert jd.training.Checkpoint(tmp_path).all_steps() == [4, 8, 10]  # every epoch's end
    arrays, history = run(18, [jd.training.Checkpoint(tmp_path)], resume=True)
    _same_arrays(arrays, ref_arrays)
    assert _metrics(history.history) == _metrics(ref_history.history)
    assert history.epochs == ref_history.epochs == [0, 1, 2, 3, 4] and history.step == 18


# SIGTERM --------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_sigterm_saves_the_step_chains_the_previous_handler_and_exits_42(
    tmp_path: Path, mirrored8: jd.MirroredStrategy
) -> None:
    setup, ref_arrays, ref_history = _with_reference(mirrored8, "functional")
    calls: list[tuple[int, list[str]]] = []

    def previous(signum: int, frame: Any) -> None:
        calls.append((signum, _names(tmp_path)))  # what was on disk when it ran

    before = signal.signal(signal.SIGTERM, previous)
    try:
        with pytest.raises(SystemExit) as e:
            setup.fit(
                setup.state(),
                [jd.training.Checkpoint(tmp_path, every_n_steps=4), _SignalAt(7, signal.SIGTERM)],
            )
        assert signal.getsignal(signal.SIGTERM) is previous  # put back after fit
    finally:
        signal.signal(signal.SIGTERM, before)
    assert isinstance(e.value, jd.training.FitPreempted) and e.value.code == 42
    assert re.search(
        r"SIGTERM: stopped after step 7, epoch 2 of \d+; the checkpoint callback", str(e.value)
    )
    assert int(e.value.state.step) == 7 and e.value.history.epochs == [0]
    assert calls == [(signal.SIGTERM, ["ckpt-4", "ckpt-7"])]  # called once, after the save
    arrays, history = setup.fit(
        setup.state(), [jd.training.Checkpoint(tmp_path, every_n_steps=4)], resume=True
    )
    _same_arrays(arrays, ref_arrays)
    _same_history(history, ref_history)


def test_sigterm_ignored_or_outside_the_main_thread_is_left_alone(tmp_path: Path) -> None:
    """A SIGTERM handler set to SIG_IGN stays (the signal is ignored, training goes on), and
    fit in another thread installs no handler."""
    setup = _Setup(jd.MirroredStrategy(jax.devices()[:2]), "nnx")

    class Check(jd.training.Callback):
        def on_step_end(self, step, logs) -> None:
            handlers.append(signal.getsignal(signal.SIGTERM))
            if step == 2 and threading.current_thread() is threading.main_thread():
                signal.raise_signal(signal.SIGTERM)

    handlers: list[Any] = []
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _, history = setup.fit(setup.state(), [Check()])
        assert history.step == STEPS and set(handlers) == {signal.SIG_IGN}
    finally:
        signal.signal(signal.SIGTERM, before)
    handlers.clear()
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(setup.fit(setup.state(), [Check()])))
    thread.start()
    thread.join(timeout=240)
    assert results and results[0][1].step == STEPS
    assert set(handlers) == {before}


_PROGRAM = textwrap.dedent(
    """
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import jaxdist as jd

    directory, out, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "resume"
    strategy = jd.MirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=50).astype(np.int32)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.l2 = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    with strategy.scope():
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

    @jd.train_step(strategy)
    def step(ctx, model, opt, batch):
        xb, yb = batch
        def loss_fn(m):
            ce = optax.softmax_cross_entropy_with_integer_labels(m(xb), yb)
            return jd.compute_average_loss(ce)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return {"loss": ctx.all_reduce("sum", loss)}

    class Tell(jd.training.Callback):  # the parent reads the steps; a step takes >= 50 ms
        def on_step_end(self, step, logs):
            print("step", step, flush=True)
            time.sleep(0.05)

    callbacks = [Tell()]
    if directory != "-":
        callbacks.insert(0, jd.training.Checkpoint(directory, every_n_steps=5))
    data = jd.data.from_arrays(x, y, batch_size=16, shuffle=True, seed=3)
    history = jd.fit(step, model, opt, data=data, epochs=8, callbacks=callbacks,
                     verbose=False, resume=resume)
    leaves = jax.tree.leaves(nnx.state((model, opt)))
    np.savez(out, *[np.asarray(v) for v in leaves])
    speed = ("examples_per_second", "flops_per_step", "tflops_per_device")  # differ run to run
    metrics = {k: v for k, v in history.history.items() if k not in speed}
    print(json.dumps({"step": history.step, "history": metrics,
                      "epochs": history.epochs}), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_process_sent_sigterm_exits_42_and_its_restart_resumes_exactly(
    tmp_path: Path,
) -> None:
    """A real program: SIGTERM while it trains (after step 7 at the earliest), exit status
    42 with the step saved; the same program run again with resume=True ends bitwise equal
    to an uninterrupted run of it (in its own process)."""
    reference = start_python(_PROGRAM, "-", str(tmp_path / "reference.npz"), "fresh")
    ref_out, ref_err = finish(reference, 240)
    assert reference.returncode == 0, ref_err[-3000:]
    ref = json.loads(ref_out.strip().splitlines()[-1])

    directory = tmp_path / "run"
    first = start_python(_PROGRAM, str(directory), str(tmp_path / "first.npz"), "resume")
    out, err = sigterm_at(first, "step 7", 240)
    assert first.returncode == 42, err[-3000:]
    stopped = int(err.split("SIGTERM: stopped after step ")[1].split(",")[0])
    assert 7 <= stopped < STEPS and f"ckpt-{stopped}" in _names(directory)
    assert not (tmp_path / "first.npz").exists()  # it never reached the end

    second = start_python(_PROGRAM, str(directory), str(tmp_path / "second.npz"), "resume")
    out, err = finish(second, 240)
    assert second.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert next(ln for ln in out.splitlines() if ln.startswith("step")) == f"step {stopped + 1}"
    assert got == ref  # step, history (exact floats through JSON) and epochs
    _same_arrays(load_npz(tmp_path / "second.npz"), load_npz(tmp_path / "reference.npz"))


# Damaged checkpoints, no checkpoint, misuse ----------------------------------------------


@ORBAX_CLOSED_LOOP
@pytest.mark.timeout(300)
def test_a_corrupted_checkpoint_is_refused_and_nothing_changes(
    tmp_path: Path, mirrored8: jd.MirroredStrategy
) -> None:
    setup, ref_arrays, ref_history = _with_reference(mirrored8, "nnx")

    def checkpoint() -> jd.training.Checkpoint:
        return jd.training.Checkpoint(tmp_path, every_n_steps=3, every_epoch=False)

    with pytest.raises(jd.training.FitInterrupted):
        setup.fit(setup.state(), [checkpoint(), _SignalAt(11)])
    flip_middle_byte(tmp_path / "ckpt-11")
    fresh = setup.state()
    untouched = _arrays(fresh)
    with pytest.raises(
        ValueError,
        match=r"jaxdist\.fit\(resume=True\): the latest checkpoint .*ckpt-11 cannot be "
        r"restored: .*(does not match its manifest|orbax could not read).* Nothing was changed\. "
        r"To go on, delete .*ckpt-11 to resume from the one before \(.*ckpt-9\)",
    ):
        setup.fit(fresh, [checkpoint()], resume=True)
    _same_arrays(_arrays(fresh), untouched)
    # As the message says: without the damaged one, the one before resumes, exactly.
    shutil.rmtree(tmp_path / "ckpt-11")
    arrays, history = setup.fit(setup.state(), [checkpoint()], resume=True)
    _same_arrays(arrays, ref_arrays)
    _same_history(history, ref_history)


@pytest.mark.timeout(300)
def test_resume_without_a_checkpoint_starts_fresh_and_a_finished_run_stays_finished(
    tmp_path: Path, mirrored8: jd.MirroredStrategy
) -> None:
    setup, ref_arrays, ref_history = _with_reference(mirrored8, "functional")
    arrays, history = setup.fit(
        setup.state(), [jd.training.Checkpoint(tmp_path / "new")], resume=True
    )
    _same_arrays(arrays, ref_arrays)
    _same_history(history, ref_history)
    assert _names(tmp_path / "new") == ["ckpt-24", "ckpt-28", "ckpt-32"]  # every epoch, keep 3
    # Run again: the last checkpoint is the end of the last epoch; nothing is left to do.
    arrays, history = setup.fit(
        setup.state(), [jd.training.Checkpoint(tmp_path / "new")], resume=True
    )
    _same_arrays(arrays, ref_arrays)
    _same_history(history, ref_history)


def test_resume_argument_errors(tmp_path: Path) -> None:
    setup = _Setup(jd.MirroredStrategy(jax.devices()[:2]), "nnx")
    state = setup.state()
    with pytest.raises(ValueError, match=r"resume=True continues from .* callbacks holds none"):
        setup.fit(state, [], resume=True)
    with pytest.raises(ValueError, match=r"resume=True takes the epoch and step .*initial_step=4"):
        setup.fit(state, [jd.training.Checkpoint(tmp_path)], resume=True, initial_step=4)
    with pytest.raises(ValueError, match=r"callbacks holds 2 jd.training.Checkpoint callbacks"):
        setup.fit(state, [jd.training.Checkpoint(tmp_path), jd.training.Checkpoint(tmp_path)])
    with pytest.raises(TypeError, match=r"resume must be True or False, got 'yes'"):
        setup.fit(state, [jd.training.Checkpoint(tmp_path)], resume="yes")
    # A checkpoint of other state (a functional state where an NNX pair was saved).
    with pytest.raises(RuntimeError, match="crash at step 5"):
        setup.fit(state, [jd.training.Checkpoint(tmp_path / "nnx"), _CrashAt(5)])
    other = _Setup(jd.MirroredStrategy(jax.devices()[:2]), "functional")
    with pytest.raises(
        ValueError,
        match=r"the latest checkpoint .*ckpt-4 cannot be restored: .*holds the items "
        r"\['data', 'loop', 'state_0', 'state_1'\], but this Checkpoint has "
        r"\['data', 'loop', 'state_0'\]",
    ):
        other.fit(other.state(), [jd.training.Checkpoint(tmp_path / "nnx")], resume=True)


# Two processes ------------------------------------------------------------------------------

_TWO_PROCESSES = worker_script(
    """
    import jax.numpy as jnp, numpy as np, optax
    import jaxdist as jd

    directory = sys.argv[3]
    strategy = jd.MultiWorkerMirroredStrategy()
    me = jax.process_index()

    def dataset_fn(ctx):  # each process its own rows, shuffled each epoch
        rng = np.random.default_rng(10 + ctx.input_pipeline_id)
        x = rng.normal(size=(40, 4)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32)
        return jd.data.from_arrays(x, y, batch_size=2, shuffle=True, seed=ctx.input_pipeline_id)

    def fresh():
        with strategy.scope():
            params = {"w": jnp.full((4, 2), 0.1), "b": jnp.zeros(2)}
            return jd.TrainState.create(
                apply_fn=lambda p, x: x @ p["w"] + p["b"], params=params, tx=optax.adam(0.05)
            )

    @jd.train_step(strategy)
    def step(ctx, state, batch):
        x, y = batch
        def loss_fn(p):
            ce = optax.softmax_cross_entropy_with_integer_labels(state.apply_fn(p, x), y)
            return jd.compute_average_loss(ce)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        new = state.apply_gradients(grads=ctx.all_reduce("sum", grads))
        return new, ctx.all_reduce("sum", loss)

    class CrashAt(jd.training.Callback):
        def on_step_end(self, step, logs):
            if step == 11:
                raise RuntimeError("crash")

    def run(callbacks, resume=False):
        data = strategy.distribute_datasets_from_function(dataset_fn)
        return jd.fit(step, fresh(), data=data, epochs=4, callbacks=callbacks, verbose=False,
                      resume=resume)

    def checkpoint():
        return jd.training.Checkpoint(directory, every_n_steps=3, every_epoch=False)

    reference, ref_history = run([])
    try:
        run([checkpoint(), CrashAt()])
    except RuntimeError:
        pass
    state, history = run([checkpoint()], resume=True)
    host = lambda s: [np.asarray(v).tolist() for v in jax.tree.leaves(s)]
    import os
    names = [d for d in os.listdir(directory) if d.startswith("ckpt-")]
    latest = max(names, key=lambda d: int(d[5:]))
    print(json.dumps({
        "same": host(state) == host(reference),
        "history": all(history.history[k] == ref_history.history[k]
                       for k in ref_history.history if "second" not in k and "flop" not in k
                       and k != "mfu"),
        "step": history.step,
        "latest": latest,
        "files": sorted(os.listdir(os.path.join(directory, latest))),
    }), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_processes_resume_their_own_data_positions(tmp_path: Path) -> None:
    """2 processes x 4 devices, each reading its own pipeline (40 rows in batches of 2 per
    replica: 5 steps an epoch): a crash at step 11 resumes from step 9 (each process from
    its own position) and ends bitwise equal to the uninterrupted run of the same job."""
    code = _TWO_PROCESSES.replace("sys.argv[3]", repr(str(tmp_path / "run")))
    results = run_workers(code, timeout=360)  # each process must exit 0
    for r in results:
        assert r["same"] and r["history"] and r["step"] == 20 and r["latest"] == "ckpt-18", r
        assert {"jaxdist_iterators.0.json", "jaxdist_iterators.1.json"} <= set(r["files"])
