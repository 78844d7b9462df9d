"""`jd.training.MetricsLogger` and `jd.training.Profile`: what they write, read back.

References: the logged values against the `History` fit returns and the step
metrics a recording callback saw (exact floats for JSON; float32 for TensorBoard
event files, rtol 1e-6), the learning rate against the schedule's value.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd

from _helpers import run_workers, worker_script


def _run(callbacks: list, epochs: int = 2) -> tuple[jd.training.History, list[dict[str, float]]]:
    """fit of a linear model with an injected learning rate (4 steps per epoch, with
    evaluation); returns the history and every step's metrics."""
    strategy = jd.MirroredStrategy(["cpu:0", "cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    state = jd.TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)}, tx=tx)

    @jd.train_step(strategy)
    def step(ctx, state, batch):
        bx, by = batch
        loss_fn = lambda p: jd.compute_average_loss((bx @ p["w"] - by) ** 2)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=ctx.all_reduce("sum", grads)), {
            "loss": ctx.all_reduce("sum", loss)
        }

    @jd.train_step(strategy, donate=False)
    def evaluate(ctx, state, batch):
        bx, by = batch
        mse = jd.compute_average_loss((bx @ state.params["w"] - by) ** 2)
        return {"mse": ctx.all_reduce("sum", mse)}

    seen: list[dict[str, float]] = []

    class Record(jd.training.Callback):
        def on_step_end(self, step: int, logs: Any) -> None:
            seen.append({"step": step, **dict(logs)})

    data = jd.data.from_arrays(x, y, batch_size=16)
    _, history = jd.fit(
        step, state, data=data, epochs=epochs, verbose=False, callbacks=[*callbacks, Record()],
        eval_step=evaluate, eval_data=jd.data.from_arrays(x, y, batch_size=32),
    )  # fmt: skip
    return history, seen


def _check_rows(
    rows: dict[int, dict[str, float]], history: jd.training.History, seen: list, rtol: float
) -> None:
    """Steps 2, 4, 6, 8: the step's loss, the learning rate and speed; epoch ends (4, 8):
    every history key under its own name."""
    assert sorted(rows) == [2, 4, 6, 8]
    for s in (2, 4, 6, 8):
        np.testing.assert_allclose(rows[s]["step/loss"], seen[s - 1]["loss"], rtol=rtol)
        assert rows[s]["step/learning_rate"] == float(np.float32(0.05))  # stored as float32
        assert rows[s]["step/steps_per_second"] > 0
        assert rows[s]["step/examples_per_second"] > 0
    for epoch, s in enumerate((4, 8)):
        for key, values in history.history.items():
            np.testing.assert_allclose(rows[s][key], values[epoch], rtol=rtol, err_msg=key)
    assert {"loss", "val_mse", "examples_per_second", "flops_per_step"} <= set(rows[8])


def test_metrics_logger_writes_json_lines(tmp_path: Path) -> None:
    logger = jd.training.MetricsLogger(tmp_path, every_n_steps=2, backend="jsonl")
    history, seen = _run([logger])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4, 4, 6, 8, 8]  # steps, and epoch ends
    assert [r.get("epoch") for r in lines] == [None, None, 0, None, None, 1]
    rows: dict[int, dict[str, float]] = {}
    for r in lines:
        rows.setdefault(r["step"], {}).update(r)
    _check_rows(rows, history, seen, rtol=0)


def _events(directory: Path) -> dict[int, dict[str, float]]:
    """The scalars of TensorBoard event files, parsed with the protobuf classes that ship
    with tensorboardX (records: length, its CRC, the Event bytes, their CRC)."""
    from tensorboardX.proto import event_pb2

    rows: dict[int, dict[str, float]] = {}
    files = sorted(glob.glob(str(directory / "events.out.tfevents.*")))
    assert len(files) == 1, files
    data = Path(files[0]).read_bytes()
    at = 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
        at += 12 + length + 4
        for v in event.summary.value:
            rows.setdefault(event.step, {})[v.tag] = v.simple_value
    return rows


def test_metrics_logger_writes_tensorboard_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    logger = jd.training.MetricsLogger(tmp_path, every_n_steps=2)
    assert logger.backend == "tensorboard"
    history, seen = _run([logger])
    _check_rows(_events(tmp_path), history, seen, rtol=1e-6)  # float32 in the files
    assert not (tmp_path / "metrics.jsonl").exists()


def test_metrics_logger_arguments() -> None:
    with pytest.raises(ValueError, match=r"MetricsLogger: every_n_steps must be an int >= 1"):
        jd.training.MetricsLogger("logs", every_n_steps=0)
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'tensorboard' or 'jsonl'"):
        jd.training.MetricsLogger("logs", backend="csv")  # type: ignore[arg-type]


def test_profile_traces_the_requested_steps_only(tmp_path: Path) -> None:
    """steps=(3, 5): started after step 3, stopped after step 5; one trace run in
    ``process_0`` with an XPlane file; a window after training's end writes nothing."""
    profile = jd.training.Profile(tmp_path / "trace", steps=(3, 5))
    late = jd.training.Profile(tmp_path / "late", steps=(20, 30))
    tracing: list[int] = []

    class Watch(jd.training.Callback):  # runs after Profile: is a trace running?
        def on_step_end(self, step: int, logs: Any) -> None:
            if profile.tracing:
                tracing.append(step)

    _run([profile, late, Watch()])
    assert (profile.started_at, profile.stopped_at) == (3, 5)
    assert tracing == [3, 4]  # steps 4 and 5 run inside the trace
    runs = glob.glob(str(tmp_path / "trace" / "process_0" / "plugins" / "profile" / "*"))
    assert len(runs) == 1, runs
    planes = glob.glob(os.path.join(runs[0], "*.xplane.pb"))
    assert len(planes) == 1 and os.path.getsize(planes[0]) > 0
    assert late.started_at is None and not (tmp_path / "late").exists()


def test_profile_arguments() -> None:
    with pytest.raises(ValueError, match=r"Profile: steps must be \(start, stop\) with 0 <= start"):
        jd.training.Profile("trace", steps=(5, 5))


_TWO_PROCESSES = worker_script(
    """
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxdist as jd

    directory = sys.argv[3]
    strategy = jd.MultiWorkerMirroredStrategy()

    def dataset_fn(ctx):
        rng = np.random.default_rng(ctx.input_pipeline_id)
        x = rng.normal(size=(64, 3)).astype(np.float32)
        return jd.data.from_arrays(x, x.sum(-1), batch_size=4)

    with strategy.scope():
        state = jd.TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)},
                                     tx=optax.sgd(0.1))

    @jd.train_step(strategy)
    def step(ctx, state, batch):
        x, y = batch
        loss_fn = lambda p: jd.compute_average_loss((x @ p["w"] - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=ctx.all_reduce("sum", grads)), ctx.all_reduce(
            "sum", loss)

    logger = jd.training.MetricsLogger(os.path.join(directory, "logs"), every_n_steps=1,
                                       backend="jsonl")
    profile = jd.training.Profile(os.path.join(directory, "trace"), steps=(1, 2))
    data = strategy.distribute_datasets_from_function(dataset_fn)
    _, history = jd.fit(step, state, data=data, epochs=1, verbose=False,
                        callbacks=[logger, profile])
    print(json.dumps({"me": jax.process_index(), "trace": profile.directory,
                      "window": [profile.started_at, profile.stopped_at], "steps": history.step,
                      "flops": history.history["flops_per_step"]}), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_one_log_and_a_trace_each(tmp_path: Path) -> None:
    """A 2 x 4-device job: process 0 alone writes metrics.jsonl; each process writes its
    own trace under ``process_<index>``; both report the same global FLOPs per step."""
    results = run_workers(_TWO_PROCESSES.replace("sys.argv[3]", repr(str(tmp_path))))
    assert [r["me"] for r in results] == [0, 1]
    assert os.listdir(tmp_path / "logs") == ["metrics.jsonl"]
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    steps = results[0]["steps"]
    assert steps >= 3
    expected = [*range(1, steps + 1), steps]  # every step, the epoch's end: one writer
    assert [json.loads(line)["step"] for line in lines] == expected
    for p, r in enumerate(results):
        assert r["trace"] == str(tmp_path / "trace" / f"process_{p}")
        assert r["window"] == [1, 2]
        assert glob.glob(os.path.join(r["trace"], "plugins", "profile", "*", "*.xplane.pb"))
    assert results[0]["flops"] == results[1]["flops"]
