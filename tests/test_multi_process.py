"""MultiWorkerMirroredStrategy across real processes on localhost (CPU gloo collectives).

The same workload (tests/mp_scripts/workload.py) runs as 2 processes x 4 devices
and as 1 process x 8 devices; every result must agree (float32, rtol 1e-5:
the all-reduces sum the same per-replica values, grouped differently across
processes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

WORKLOAD = Path(__file__).parent / "mp_scripts" / "workload.py"
RTOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(devices: int, process: int | None, processes: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_", "XLA_"))}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)})
    if process is not None:
        env.update(
            {
                "JAXDIST_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAXDIST_NUM_PROCESSES": str(processes),
                "JAXDIST_PROCESS_ID": str(process),
                "JAXDIST_HEARTBEAT_TIMEOUT": "10",
            }
        )
    return env


def _run(out: Path, processes: int, devices: int, timeout: float = 240) -> list[dict]:
    """Runs the workload as ``processes`` processes of ``devices`` devices each."""
    out.mkdir()
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKLOAD), str(out)],
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
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"
    return [json.loads((out / f"process{i}.json").read_text()) for i in range(processes)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    two = _run(tmp_path_factory.mktemp("two") / "run", processes=2, devices=4)
    (one,) = _run(tmp_path_factory.mktemp("one") / "run", processes=1, devices=8)
    return two, one


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
@pytest.mark.parametrize("key", ["w", "nnx_kernel", "restored_w"])
def test_training_matches_one_process(results, key: str) -> None:
    two, one = results
    for r in two:
        np.testing.assert_allclose(r[key], one[key], rtol=RTOL, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_read_totals_are_global(results) -> None:
    two, one = results
    for r in two:
        assert r["seen"] == one["seen"] == 300.0  # 3 epochs of 100 rows, every process
        assert r["restored_seen"] == 300.0
        np.testing.assert_allclose(r["loss_sum"], one["loss_sum"], rtol=RTOL)
        np.testing.assert_allclose(r["nnx_loss"], one["nnx_loss"], rtol=RTOL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_pipeline_per_process_no_row_lost_or_repeated(results) -> None:
    two, one = results
    assert [r["pipelines"] for r in two] == [[[2, 0]], [[2, 1]]]
    assert one["pipelines"] == [[1, 0]]
    for r in (*two, one):
        assert sorted(r["pipeline_rows"]) == list(range(64))


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
@pytest.mark.timeout(180)
def test_a_dead_process_stops_the_others(tmp_path: Path) -> None:
    script = Path(__file__).parent / "mp_scripts" / "die_midway.py"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=_env(2, i, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        log1 = procs[1].communicate(timeout=120)[0]
        died = time.monotonic()
        assert procs[1].returncode == 7, log1
        log0 = procs[0].communicate(timeout=60)[0]  # must not hang
        assert time.monotonic() - died < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode != 0
    # Either the collective fails (the peer's socket closed: the error is raised and ends the
    # process at once) or the coordination service's heartbeat declares the peer dead.
    reasons = ("another task died", "unhealthy", "Connection reset by peer", "Gloo all-reduce")
    assert any(r in log0 for r in reasons), log0[-3000:]
