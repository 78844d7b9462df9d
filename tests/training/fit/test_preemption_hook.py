"""`jd.fit(..., preemption_handler=handler)`: a `jd.experimental.PreemptionCheckpointHandler`
made with fit's `jd.training.Checkpoint` callback. On a notice (SIGTERM, or the handler's
watcher function) every process agrees on one step, the callback saves it, the handler's
``exit_fn`` runs; ``fit(..., resume=True, preemption_handler=...)`` continues exactly.

Reference: the same `fit` call without interruption (and without a handler), in the same
process, or in a fresh run of the same program. Compared with ``assert_array_equal`` (no
tolerance): every array of the final state, and the `History` (exact floats).

The data: 40 rows in batches of 16, shuffled every epoch (3 steps an epoch, the last with
8 real rows), 4 epochs: 12 steps.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
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

from _helpers import REPO, finish, linear_data, load_npz, sigterm_at, start_python

pytest.importorskip("orbax.checkpoint")

ROWS, BATCH, EPOCHS = 40, 16, 4
STEPS = EPOCHS * 3


def _data() -> jd.data.ArrayDataset:
    x, y = linear_data(ROWS, [1.0, -2.0, 0.5, 3.0])
    return jd.data.from_arrays(x, y, batch_size=BATCH, shuffle=True, seed=3)


def _state(strategy: jd.Strategy) -> jd.TrainState:
    with strategy.scope():
        params = {"w": jnp.full((4,), 0.1), "b": jnp.zeros(())}
        return jd.TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.05))


def _step(strategy: jd.Strategy) -> Any:
    @jd.train_step(strategy)
    def step(ctx, state, batch):
        x, y = batch
        loss_fn = lambda p: jd.compute_average_loss((x @ p["w"] + p["b"] - y) ** 2)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=ctx.all_reduce("sum", grads)), ctx.all_reduce(
            "sum", loss
        )

    return step


def _fit(strategy: jd.Strategy, step: Any, callbacks: list, **kwargs: Any) -> tuple[Any, Any]:
    state, history = jd.fit(
        step, _state(strategy), data=_data(), epochs=EPOCHS, callbacks=callbacks,
        verbose=False, strategy=strategy, **kwargs,
    )  # fmt: skip
    return [np.array(x) for x in jax.tree.leaves(state)], history


# Speed figures (fit adds them to ``history.history``): they differ from run to run.
SPEED = ("examples_per_second", "tokens_per_second", "flops_per_step", "tflops_per_device", "mfu")


def _metrics(history: dict[str, list[float]]) -> dict[str, list[float]]:
    """``history.history`` without the speed figures."""
    return {k: v for k, v in history.items() if k not in SPEED}


def _same(a: tuple[Any, Any], b: tuple[Any, Any]) -> None:
    (arrays_a, history_a), (arrays_b, history_b) = a, b
    assert len(arrays_a) == len(arrays_b) >= 4
    for x, y in zip(arrays_a, arrays_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)  # bitwise
    assert _metrics(history_a.history) == _metrics(history_b.history)  # exact floats
    assert history_a.epochs == history_b.epochs and history_a.step == history_b.step == STEPS


def _names(directory: Path) -> list[str]:
    names = [n for n in os.listdir(directory) if n.startswith("ckpt-")]
    return sorted(names, key=lambda n: int(n[5:]))


class _NoticeAt(jd.training.Callback):
    """Gives the handler's watcher its notice at global ``step`` and waits until the handler
    has it, so that it acts at this step's boundary (a job of one process): the watcher
    thread returns once it fired, and the notice is taken back before a new one starts."""

    def __init__(self, step: int) -> None:
        self.step, self.event = step, threading.Event()
        self.handler: Any = None

    def on_step_end(self, step, logs) -> None:
        if step == self.step:
            self.event.set()
            deadline = time.monotonic() + 30
            while not self.handler._noticed and time.monotonic() < deadline:
                time.sleep(0.01)
            self.event.clear()  # one notice (a watcher restarted after exit_fn sees none)


def _handler(
    ckpt: jd.training.Checkpoint, notice: _NoticeAt | None = None, **config: Any
) -> jd.experimental.PreemptionCheckpointHandler:
    watcher = notice.event.is_set if notice is not None else (lambda: False)
    handler = jd.experimental.PreemptionCheckpointHandler(
        None, ckpt, termination_config=jd.experimental.TerminationConfig(
            termination_watcher_fn=watcher, **config),
    )  # fmt: skip
    if notice is not None:
        notice.handler = handler
    return handler


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", [5, 6], ids=["mid-epoch", "epoch-end"])
def test_a_notice_saves_that_step_exits_and_resume_is_exact(tmp_path: Path, at: int) -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    step = _step(strategy)
    reference = _fit(strategy, step, [])

    ckpt = jd.training.Checkpoint(tmp_path, every_n_steps=4, every_epoch=False)
    notice = _NoticeAt(at)
    handler = _handler(ckpt, notice)
    with pytest.raises(SystemExit) as e:  # the default exit_fn
        _fit(strategy, step, [ckpt, notice], preemption_handler=handler, resume=True)
    assert e.value.code == 42
    assert _names(tmp_path) == ["ckpt-4", f"ckpt-{at}"]  # the periodic one, then the notice's
    assert handler.total_run_calls == at

    # The restarted run: fit adds the handler's callback (none in callbacks).
    again = jd.training.Checkpoint(tmp_path, every_n_steps=4, every_epoch=False)
    resumed = _fit(strategy, step, [], preemption_handler=_handler(again), resume=True)
    _same(resumed, reference)


@pytest.mark.timeout(300)
def test_grouped_fit_takes_a_handler_and_saves_at_the_groups_end(tmp_path: Path) -> None:
    # Before: fit(steps_per_execution=k) refused a Checkpoint callback, so it could not
    # checkpoint, resume or take a preemption handler. Groups of 2 over epochs of 3 steps:
    # (1-2, 3), (4-5, 6), ...; the notice at step 4 is acted on at the end of its group.
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    step = _step(strategy)
    reference = _fit(strategy, step, [], steps_per_execution=2)
    ckpt = jd.training.Checkpoint(tmp_path, every_n_steps=4, every_epoch=False)
    notice = _NoticeAt(4)
    handler = _handler(ckpt, notice)
    with pytest.raises(SystemExit) as e:
        _fit(strategy, step, [ckpt, notice], preemption_handler=handler, steps_per_execution=2)
    assert e.value.code == 42
    assert _names(tmp_path) == ["ckpt-5"]  # due at 4 and noticed at 4: saved once, at 5
    assert handler.total_run_calls == 5
    again = jd.training.Checkpoint(tmp_path, every_n_steps=4, every_epoch=False)
    resumed = _fit(
        strategy, step, [], preemption_handler=_handler(again), resume=True, steps_per_execution=2
    )
    _same(resumed, reference)


@pytest.mark.timeout(300)
def test_an_exit_fn_that_returns_lets_fit_go_on_and_grace_period_saves_twice(
    tmp_path: Path,
) -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    step = _step(strategy)
    reference = _fit(strategy, step, [])

    # exit_fn returns: the step is saved, training goes on to the end, unchanged.
    exits: list[int] = []
    ckpt = jd.training.Checkpoint(tmp_path / "a", every_epoch=False, keep=None)
    notice = _NoticeAt(7)
    handler = _handler(ckpt, notice, exit_fn=lambda: exits.append(handler.total_run_calls))
    _same(_fit(strategy, step, [ckpt, notice], preemption_handler=handler), reference)
    assert exits == [7] and _names(tmp_path / "a") == ["ckpt-7"]

    # A grace period longer than the run: saved at the notice, trained on, saved again
    # before the deadline (not reached: the run ends first), exit_fn not called yet.
    ckpt = jd.training.Checkpoint(tmp_path / "b", every_epoch=False, keep=None)
    notice = _NoticeAt(2)
    handler = _handler(ckpt, notice, grace_period=600.0, exit_fn=lambda: exits.append(-1))
    _same(_fit(strategy, step, [ckpt, notice], preemption_handler=handler), reference)
    assert exits == [7] and _names(tmp_path / "b") == ["ckpt-2"]

    # A grace period already over after the first save: the second save comes at the next
    # step boundary, then exit_fn.
    ckpt = jd.training.Checkpoint(tmp_path / "c", every_epoch=False, keep=None)
    notice = _NoticeAt(2)
    handler = _handler(ckpt, notice, grace_period=1e-6, exit_fn=lambda: exits.append(-2))
    _same(_fit(strategy, step, [ckpt, notice], preemption_handler=handler), reference)
    assert exits == [7, -2] and _names(tmp_path / "c") == ["ckpt-2", "ckpt-3"]
    # Either checkpoint resumes to the reference.
    resumed = _fit(
        strategy, step, [], resume=True,
        preemption_handler=_handler(jd.training.Checkpoint(tmp_path / "c", every_epoch=False)),
    )  # fmt: skip
    _same(resumed, reference)


def test_misuse_is_refused_with_the_fix(tmp_path: Path) -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    step = _step(strategy)
    ckpt = jd.training.Checkpoint(tmp_path / "fit")
    handler = _handler(ckpt)
    with pytest.raises(TypeError, match=r"preemption_handler must be a .*PreemptionCheckpoint"):
        _fit(strategy, step, [ckpt], preemption_handler=object())
    own = jd.experimental.PreemptionCheckpointHandler(
        None, jd.checkpoint.Checkpoint(w=jnp.zeros(2)), tmp_path / "own",
        jd.experimental.TerminationConfig(termination_watcher_fn=lambda: False),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"made with a jd.checkpoint.Checkpoint or .*Make the "):
        _fit(strategy, step, [ckpt], preemption_handler=own)
    other = jd.training.Checkpoint(tmp_path / "other")
    with pytest.raises(ValueError, match=r"saves through the .*fit, but callbacks holds another"):
        _fit(strategy, step, [other], preemption_handler=handler)
    with pytest.raises(ValueError, match=r"\.run: this handler was made with a jd.training"):
        handler.run(lambda: None)
    with pytest.raises(ValueError, match=r"save_fn=.* replaces the handler's save"):
        _handler(ckpt, save_fn=lambda: None)
    with pytest.raises(ValueError, match=r"checkpoint_dir=.* differs from the directory of the"):
        jd.experimental.PreemptionCheckpointHandler(None, ckpt, tmp_path / "elsewhere")
    assert not os.path.exists(tmp_path / "fit")  # nothing was written


# A real process sent SIGTERM ---------------------------------------------------------------

_PROGRAM = textwrap.dedent(
    """
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np, optax
    import jaxdist as jd

    directory, out = sys.argv[1], sys.argv[2]
    strategy = jd.MirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)).astype(np.float32)
    with strategy.scope():
        state = jd.TrainState.create(apply_fn=None, params={"w": jnp.full((4,), 0.1),
                                     "b": jnp.zeros(())}, tx=optax.adam(0.05))

    @jd.train_step(strategy)
    def step(ctx, state, batch):
        bx, by = batch
        loss_fn = lambda p: jd.compute_average_loss((bx @ p["w"] + p["b"] - by) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=ctx.all_reduce("sum", grads)), loss

    class Tell(jd.training.Callback):  # the parent reads the steps; a step takes >= 30 ms
        def on_step_end(self, step, logs):
            print("step", step, flush=True)
            time.sleep(0.03)

    kwargs = {}
    if directory != "-":
        ckpt = jd.training.Checkpoint(directory, every_n_steps=5)
        kwargs = dict(resume=True, preemption_handler=jd.experimental.PreemptionCheckpointHandler(
            None, ckpt))
    data = jd.data.from_arrays(x, y, batch_size=16, shuffle=True, seed=3)
    state, history = jd.fit(step, state, data=data, epochs=8, callbacks=[Tell()],
                            verbose=False, **kwargs)
    np.savez(out, *[np.asarray(v) for v in jax.tree.leaves(state)])
    print(json.dumps({"step": history.step, "history": {
                          k: v for k, v in history.history.items() if k == "loss"},
                      "epochs": history.epochs}), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_at_a_random_step_exits_42_and_the_restart_resumes_exactly(
    tmp_path: Path,
) -> None:
    seed = random.randrange(1 << 30)
    at = random.Random(seed).randint(2, 16)  # of 24 steps
    print(f"seed {seed}: SIGTERM at step {at}")
    reference = start_python(_PROGRAM, "-", str(tmp_path / "reference.npz"))
    ref_out, ref_err = finish(reference, 120)
    assert reference.returncode == 0, ref_err[-3000:]

    directory = tmp_path / "run"
    first = start_python(_PROGRAM, str(directory), str(tmp_path / "first.npz"))
    out, err = sigterm_at(first, f"step {at}", 120)
    assert first.returncode == 42, f"seed {seed}: {err[-3000:]}"
    m = re.search(r"Checkpoint callback saved \S*ckpt-(\d+) after step (\d+); calling exit", err)
    assert m is not None and m[1] == m[2], err[-3000:]
    stopped = int(m[1])
    assert at <= stopped <= at + 6, (seed, at, stopped)  # the next step boundary or so
    assert not (tmp_path / "first.npz").exists()

    second = start_python(_PROGRAM, str(directory), str(tmp_path / "second.npz"))
    out, err = finish(second, 120)
    assert second.returncode == 0, err[-3000:]
    assert next(ln for ln in out.splitlines() if ln.startswith("step")) == f"step {stopped + 1}"
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(ref_out.strip().splitlines()[-1])
    for a, b in zip(
        load_npz(tmp_path / "second.npz"), load_npz(tmp_path / "reference.npz"), strict=True
    ):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)  # bitwise
    print(f"seed {seed}: SIGTERM at step {at}, saved step {stopped}")


# 2 processes x 4 devices through the launcher -----------------------------------------------

TRAINING = REPO / "tests" / "mp_scripts" / "fit_preemption_training.py"


def _launch(out: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["JAXDIST_HEARTBEAT_TIMEOUT"] = "10"
    return subprocess.Popen(
        [
            sys.executable, "-m", "jaxdist.launch", "--nprocs", "2", "--devices-per-proc", "4",
            "--max-restarts", "2", str(TRAINING), str(out / "ckpt"), str(out / "final"), *extra,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_processes_sigterm_one_the_job_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM to one process of a 2 x 4 job at a random step: both save the same step
    through fit's callback and exit 42, the launcher restarts the job, fit resumes, and each
    process ends bitwise equal to its part of an uninterrupted run of the same job."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    at, victim = rng.randint(2, 15), rng.randrange(2)  # of 30 steps
    # From step `at` on, the first run's steps take 1 s: the signal lands before the end.
    slow = ("--sleep", "0.05", "--slow-after", str(at))
    procs = [_launch(tmp_path / "reference"), _launch(tmp_path / "preempted", *slow)]
    try:
        job = procs[1]
        assert job.stdout is not None
        lines, pids = [], {}
        for line in job.stdout:
            lines.append(line.rstrip("\n"))
            if m := re.match(r"^\[(\d)\] START 0 (\d+)$", line):
                pids[int(m[1])] = int(m[2])
            if line.strip() == f"[{victim}] STEP {at}":
                os.kill(pids[victim], signal.SIGTERM)
                break
        rest, _ = finish(job, timeout=100)
        out = "\n".join(lines) + "\n" + rest
        assert job.returncode == 0, f"seed {seed}: {out[-4000:]}"
        ref_out, _ = finish(procs[0], timeout=100)
        assert procs[0].returncode == 0, ref_out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    saved = re.findall(
        r"^\[(\d)\] .*\(process \d\): fit's Checkpoint callback saved \S*ckpt-(\d+) after "
        r"step (\d+); calling exit_fn",
        out,
        re.M,
    )
    assert sorted(p for p, _, _ in saved) == ["0", "1"], out[-4000:]
    steps = {int(s) for _, s, _ in saved} | {int(s) for _, _, s in saved}
    assert len(steps) == 1, saved  # one agreed step, in both processes
    stopped = steps.pop()
    assert at <= stopped <= at + 12, (seed, at, stopped)  # soon after (output lags behind)
    assert "exited with code 42 (first failure: preempted)" in out
    assert len(re.findall(r"^\[\d\] START 1 \d+$", out, re.M)) == 2  # restarted once
    assert re.search(rf"^\[\d\] STEP {stopped + 1}$", out[out.index(" START 1 ") :], re.M)
    assert len(re.findall(r"^\[\d\] DONE 30$", out, re.M)) == 2
    for p in range(2):
        with (
            np.load(tmp_path / "reference" / "final" / f"final.{p}.npz") as a,
            np.load(tmp_path / "preempted" / "final" / f"final.{p}.npz") as b,
        ):
            assert sorted(a.files) == sorted(b.files) and len(a.files) >= 10
            for key in a.files:
                assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # bitwise
    print(f"seed {seed}: SIGTERM to process {victim} at step {at}, saved step {stopped}")
