"""Small helpers shared by the tests (not a test module)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import jaxdist as jd


def value(x: Any) -> np.ndarray:
    """The global array behind a run output: ``x.array`` for distributed values; a plain
    output (what run returns with one replica) as it is."""
    return np.asarray(x.array if isinstance(x, jd.DistributedValues) else x)


def assert_kind(x: Any, kind: type, strategy: jd.Strategy) -> None:
    """``x`` is a ``kind`` (`Mirrored`/`PerReplica`), or a plain array with one replica."""
    if strategy.num_replicas_in_sync == 1:
        assert not isinstance(x, jd.DistributedValues), type(x)
    else:
        assert isinstance(x, kind), type(x)


def rows(x: Any, strategy: jd.Strategy) -> np.ndarray:
    """A per-replica output as ``(N, ...)`` rows (a plain one-replica output gets a row axis)."""
    v = value(x)
    return v if isinstance(x, jd.DistributedValues) else v[None]


_MAKERS: dict[str, Any] = {
    "one_device": lambda: jd.OneDeviceStrategy(),
    "mirrored2": lambda: jd.MirroredStrategy(jax.devices()[:2]),
    "mirrored8": lambda: jd.MirroredStrategy(),
    "central2": lambda: jd.CentralStorageStrategy(jax.devices()[:2]),
    "central8": lambda: jd.CentralStorageStrategy(),
}


def strategy_params(*names: str) -> list[Any]:
    """``pytest.param``s of functions that make the named strategies (made per test, so
    that each test gets a fresh one), for ``@pytest.mark.parametrize("make", ...)``."""
    return [pytest.param(_MAKERS[name], id=name) for name in names]


def free_port() -> int:
    """A localhost TCP port that is free now (for a test job's coordinator)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_workers(code: str, processes: int = 2, timeout: float = 200) -> list[Any]:
    """Runs ``python -c code <process id> <port>`` as a job of ``processes`` processes on
    localhost (CPU only); returns each one's last line of output, parsed as JSON, in
    process order. Fails the test with the stderr tails when a process fails or hangs."""
    port = str(free_port())
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    out = []
    try:
        for i, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                tails = [q.communicate()[1][-2000:] for q in procs]
                pytest.fail(f"process {i} hung; stderr tails: {tails}")
            assert p.returncode == 0, stderr[-3000:]
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, timeout: float = 200, devices: int = 8) -> Any:
    """Runs ``python -c code *args`` in a fresh process with ``devices`` simulated CPU
    devices and this checkout's jaxdist; returns its last line of output parsed as JSON.

    For code that can end the process (an XLA abort, a segmentation fault) or hang: the
    test fails with the exit status and the stderr tail instead of taking pytest down."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"the process did not finish in {timeout} s; stderr tail: {stderr[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(
            f"the process exited with status {proc.returncode} (negative: killed by that "
            f"signal; -11 or 139: segmentation fault; -6: abort); stderr tail: "
            f"{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# orbax may leave a tensorstore callback for an event loop it already closed when a read
# of a deliberately damaged checkpoint fails (seen once in about ten runs on jax 0.12):
# not jaxdist's error, and not what the tests marked with this check.
ORBAX_CLOSED_LOOP = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
