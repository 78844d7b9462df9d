"""MultiWorkerMirroredStrategy across real processes on localhost (CPU gloo collectives).

The same workload (tests/mp_scripts/workload.py) runs as 2 processes x 4 devices
and as 1 process x 8 devices; every result must agree (float32, rtol 1e-5:
the all-reduces sum the same per-replica values, grouped differently across
processes), and the trained MLP must match plain single-device JAX on the
whole batches (rtol 1e-5, atol 1e-6). Then: how a job ends when one of its
processes dies or hangs, and `CommunicationOptions.timeout_seconds`. In this process:
which ``TF_CONFIG`` tasks may make the strategy.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdist as jd
from jaxdist.strategies import multi_worker

from _helpers import REPO, free_port, load_script

SCRIPTS = REPO / "tests" / "mp_scripts"
WORKLOAD = SCRIPTS / "workload.py"
RTOL, ATOL = 1e-5, 1e-6
WEIGHTS = ("w1", "b1", "w2", "b2")
HEARTBEAT = 10  # seconds: JAXDIST_HEARTBEAT_TIMEOUT of these jobs


wl = load_script(WORKLOAD, "mp_workload")


def _env(devices: int, process: int | None, processes: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_", "XLA_"))}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)})
    repo = str(REPO)  # this checkout's jaxdist, not an install
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    if process is not None:
        env.update(
            {
                "JAXDIST_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAXDIST_NUM_PROCESSES": str(processes),
                "JAXDIST_PROCESS_ID": str(process),
                "JAXDIST_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
            }
        )
    return env


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    """Kills whichever of ``procs`` still run and reaps them (their output stays unread)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _output(proc: subprocess.Popen[str]) -> str:
    """What an ended process wrote (its stdout pipe, not yet read)."""
    assert proc.stdout is not None
    with proc.stdout:
        return proc.stdout.read()


def _run(out: Path, processes: int, devices: int, *args: str, timeout: float = 240) -> list[dict]:
    """Runs the workload as ``processes`` processes of ``devices`` devices each."""
    out.mkdir()
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKLOAD), str(out), *args],
            env=_env(devices, None if processes == 1 else i, processes, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        _stop(procs)
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"
    return [json.loads((out / f"process{i}.json").read_text()) for i in range(processes)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    two_dir = tmp_path_factory.mktemp("two") / "run"
    two = _run(two_dir, processes=2, devices=4)
    # The one-process run also restores the checkpoint the two processes wrote.
    (one,) = _run(tmp_path_factory.mktemp("one") / "run", 1, 8, str(two_dir / "ckpt"))
    return two, one


def _reference() -> dict[str, Any]:
    """The MLP trained by plain single-device JAX on the same batches (no replicas)."""
    x, y = wl.data()
    params = {k: jnp.asarray(v) for k, v in wl.init_mlp().items()}

    def loss_fn(p: dict[str, Any], bx: Any, by: Any) -> Any:
        return jnp.sum((wl.mlp(p, bx) - by) ** 2) / bx.shape[0]

    grad = jax.jit(jax.value_and_grad(loss_fn))
    loss_sum = 0.0
    for _ in range(wl.EPOCHS):
        for start in range(0, wl.ROWS, wl.BATCH):
            bx, by = x[start : start + wl.BATCH], y[start : start + wl.BATCH]
            loss, g = grad(params, bx, by)
            loss_sum += float(loss) * bx.shape[0]
            params = {k: params[k] - wl.LR * g[k] for k in params}
    return {"params": {k: np.asarray(v).ravel() for k, v in params.items()}, "loss_sum": loss_sum}


def _rows_per_replica(batch: int, replicas: int) -> list[int]:
    """How tf.distribute splits a batch of ``batch`` rows: ``ceil(batch / N)`` per replica,
    in replica order, the last ones getting what is left."""
    each = math.ceil(batch / replicas)
    return [max(0, min(each, batch - r * each)) for r in range(replicas)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_layout(results) -> None:
    two, one = results
    assert [r["process"] for r in two] == [0, 1]
    assert all(r["processes"] == 2 and r["replicas"] == 8 for r in two)
    assert all(r["local_replicas"] == 4 for r in two)
    assert one["processes"] == 1 and one["replicas"] == 8 and one["local_replicas"] == 8


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", WEIGHTS)
def test_mlp_training_matches_one_process_and_plain_jax(results, key: str) -> None:
    two, one = results
    for r in two:
        np.testing.assert_allclose(r[key], one[key], rtol=RTOL, atol=ATOL)
    reference = _reference()["params"][key]
    np.testing.assert_allclose(one[key], reference, rtol=RTOL, atol=ATOL)
    assert not np.allclose(reference, wl.init_mlp()[key].ravel())  # it did train


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nnx_training_matches_one_process(results) -> None:
    two, one = results
    for r in two:
        np.testing.assert_allclose(r["nnx_kernel"], one["nnx_kernel"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(r["nnx_loss"], one["nnx_loss"], rtol=RTOL)
    init = nnx.Linear(wl.FEATURES, 1, rngs=nnx.Rngs(0)).kernel.get_value()
    assert not np.allclose(one["nnx_kernel"], np.asarray(init).ravel())  # it did train


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_read_totals_are_global(results) -> None:
    two, one = results
    total = wl.EPOCHS * wl.ROWS
    per_replica = np.zeros(8)
    for start in range(0, wl.ROWS, wl.BATCH):
        per_replica += _rows_per_replica(min(wl.BATCH, wl.ROWS - start), 8)
    per_replica *= wl.EPOCHS
    # Each process holds only its own replicas' counts ...
    assert two[0]["local_seen"] == per_replica[:4].tolist()
    assert two[1]["local_seen"] == per_replica[4:].tolist()
    assert one["local_seen"] == per_replica.tolist()
    assert sum(two[0]["local_seen"]) != sum(two[1]["local_seen"])  # the partial batches
    # ... and reading the variable gives the total over every process's replicas.
    reference = _reference()["loss_sum"]
    for r in (*two, one):
        assert r["seen"] == total
        np.testing.assert_allclose(r["loss_sum"], one["loss_sum"], rtol=RTOL)
        np.testing.assert_allclose(r["loss_sum"], reference, rtol=RTOL)


def _pipeline_assignment(pipelines: int, pipeline: int, local_replicas: int) -> list[list[int]]:
    """Which rows each local replica should get from the pipeline's per-replica batches."""
    ids = list(range(wl.PIPELINE_ROWS))[pipeline::pipelines]
    per_replica_batch = wl.PIPELINE_BATCH // 8
    elements = [ids[i : i + per_replica_batch] for i in range(0, len(ids), per_replica_batch)]
    rows: list[list[int]] = [[] for _ in range(local_replicas)]
    for k, element in enumerate(elements):  # consecutive elements feed the replicas in turn
        rows[k % local_replicas].extend(element)
    return rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_pipeline_per_process_no_row_lost_or_repeated(results) -> None:
    two, one = results
    assert [r["pipelines"] for r in two] == [[[2, 0]], [[2, 1]]]
    assert one["pipelines"] == [[1, 0]]
    everything = list(range(wl.PIPELINE_ROWS))
    # Every row of the dataset reached exactly one replica of one process.
    seen = [i for r in two for rows in r["local_rows"] for i in rows]
    assert sorted(seen) == everything
    for p, r in enumerate(two):
        assert r["local_rows"] == _pipeline_assignment(2, p, 4)
        assert sorted(r["gathered_rows"]) == everything  # the global batches, padding left out
    assert one["local_rows"] == _pipeline_assignment(1, 0, 8)
    assert sorted(one["gathered_rows"]) == everything


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_results_of_a_padded_batch_leave_the_padding_out(results) -> None:
    two, one = results
    for r in (*two, one):
        assert "trimmed_error" not in r, r["trimmed_error"]
        assert r["trimmed_rows"] == r["local_rows"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cross_replica_api(results) -> None:
    two, one = results
    assert two[0]["local_results"] == [[float(r)] * 2 for r in range(4)]
    assert two[1]["local_results"] == [[float(r)] * 2 for r in range(4, 8)]
    for r in (*two, one):
        assert r["reduce_sum"] == [28.0, 28.0]
        assert r["gather"] == [float(i) for i in range(8) for _ in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_restores_in_the_same_and_in_another_layout(results) -> None:
    two, one = results
    for r in two:
        for k in WEIGHTS:
            np.testing.assert_array_equal(r[f"restored_{k}"], r[k])
        assert r["restored_seen"] == wl.EPOCHS * wl.ROWS
    # Written by 2 processes x 4 devices, read by 1 process x 8: the same values.
    for k in WEIGHTS:
        np.testing.assert_array_equal(one[f"moved_{k}"], two[0][k])
    assert one["moved_seen"] == wl.EPOCHS * wl.ROWS


# -- failures --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("victim", "how", "timeout", "bound", "code", "reason"),
    [
        # A dead worker stops sending heartbeats: JAX ends the others HEARTBEAT s later.
        (1, "exit", None, HEARTBEAT + 15, -signal.SIGABRT, "stopped sending heartbeats"),
        # Process 0 hosts the coordination service: the others lose it at once.
        (0, "exit", None, 10, -signal.SIGABRT, "the JAX distributed service detected fatal"),
        # A live, stuck process keeps its heartbeat: the watchdog of timeout_seconds ends the
        # wait, naming the step and the process that did not arrive
        # (tests/strategies/test_watchdog.py).
        (
            1,
            "stall",
            5,
            5 + 15,
            1,
            r"jaxdist: MultiWorkerMirroredStrategy: step 20 did not complete within 5 s "
            r"\(CommunicationOptions\(timeout_seconds=5\)\): process 1 \(its last step: 19\) "
            r"did not arrive; ending process 0 with exit code 1\.",
        ),
    ],
    ids=["worker-dies", "coordinator-dies", "worker-hangs-timeout"],
)
def test_the_other_process_ends_within_a_bounded_time(
    victim: int, how: str, timeout: int | None, bound: float, code: int, reason: str
) -> None:
    script = SCRIPTS / "die_midway.py"
    port = free_port()
    args = [how] if timeout is None else [how, str(timeout)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(victim), *args],
            env=_env(4, i, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    survivor = procs[1 - victim]
    try:
        log = survivor.communicate(timeout=100)[0]  # must not hang
        ended = time.time()
    finally:
        _stop(procs)
    failing = re.search(rf"^FAILING {how} (\S+)$", _output(procs[victim]), re.M)
    assert failing, f"the victim never reached step 20:\n{log[-3000:]}"
    elapsed = ended - float(failing[1])
    assert 0 <= elapsed < bound, (elapsed, log[-3000:])
    assert survivor.returncode == code, log[-3000:]
    assert re.search(reason, log), log[-3000:]


# -- CommunicationOptions.timeout_seconds ------------------------------------------------------


@pytest.fixture
def xla_flags(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    return monkeypatch


def _backend(monkeypatch: pytest.MonkeyPatch, started: bool) -> None:
    """Makes jaxdist see JAX's backend as started (or not). Imports the module itself: in a
    run of this file alone nothing has imported it yet (jaxdist loads it lazily)."""
    init_mod = importlib.import_module("jaxdist.cluster_resolver.initialize")
    monkeypatch.setattr(init_mod, "backends_initialized", lambda: started)
    if hasattr(multi_worker, "backends_initialized"):  # imported by name at module level
        monkeypatch.setattr(multi_worker, "backends_initialized", lambda: started)


def test_timeout_seconds_sets_the_cpu_collective_timeout(xla_flags: pytest.MonkeyPatch) -> None:
    _backend(xla_flags, started=False)
    for nothing in (None, 0, 0.0):
        multi_worker._set_collective_timeout(nothing, "where")
        assert "XLA_FLAGS" not in os.environ
    # Whole seconds, rounded up, plus 10: a backstop behind the watchdog.
    multi_worker._set_collective_timeout(7.2, "where")
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_collective_timeout_seconds=18"
    xla_flags.setenv(
        "XLA_FLAGS", "--xla_cpu_use_xnnpack=false --xla_cpu_collective_timeout_seconds=99"
    )
    multi_worker._set_collective_timeout(0.2, "where")  # replaces the value, keeps the rest
    assert os.environ["XLA_FLAGS"] == (
        "--xla_cpu_use_xnnpack=false --xla_cpu_collective_timeout_seconds=11"
    )


def test_timeout_seconds_after_the_backend_started(xla_flags: pytest.MonkeyPatch) -> None:
    _backend(xla_flags, started=True)
    xla_flags.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=30")
    multi_worker._set_collective_timeout(20, "MultiWorkerMirroredStrategy")  # the same: fine
    with pytest.raises(
        RuntimeError,
        match=r"MultiWorkerMirroredStrategy: CommunicationOptions\(timeout_seconds=10\) sets "
        r"XLA's CPU collective timeout \(--xla_cpu_collective_timeout_seconds\) to 20 s, which "
        r"is read once, when JAX's backend starts; it has started with 30 s\. Create the "
        r"strategy before anything touches devices .* or start the program with "
        r"XLA_FLAGS='--xla_cpu_collective_timeout_seconds=20'",
    ):
        multi_worker._set_collective_timeout(10, "MultiWorkerMirroredStrategy")
    xla_flags.delenv("XLA_FLAGS")
    with pytest.raises(RuntimeError, match=r"it has started with XLA's default \(1800 s\)"):
        multi_worker._set_collective_timeout(10, "MultiWorkerMirroredStrategy")
    assert "XLA_FLAGS" not in os.environ


def test_one_process_strategy_leaves_the_flags_alone(xla_flags: pytest.MonkeyPatch) -> None:
    # No cluster, so no cross-process collective to time out, and the backend already runs.
    options = jd.experimental.CommunicationOptions(timeout_seconds=5)
    strategy = jd.MultiWorkerMirroredStrategy(communication_options=options)
    assert strategy.communication_options.timeout_seconds == 5.0
    assert "XLA_FLAGS" not in os.environ


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
