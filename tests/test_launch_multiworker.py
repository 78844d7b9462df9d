"""`python -m jaxdist.launch` running real MultiWorkerMirroredStrategy jobs (CPU gloo collectives).

2 processes x 4 simulated devices on localhost. A process killed from outside in
the middle of training makes the launcher exit within 60 s naming it, and leaves
no process of the job; ``--max-restarts 1`` brings a job that fails once (an
uncaught exception in one process, which must not hang in jax.distributed's
shutdown barrier) back to completion, with the result NumPy computes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SCRIPT = Path(__file__).parent / "mp_scripts" / "launched_training.py"
ROOT = Path(__file__).parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_", "XLA_"))}
    env["JAXDIST_HEARTBEAT_TIMEOUT"] = "10"  # how long survivors wait for a dead peer
    return env


class _Job:
    """The launcher in a subprocess, its stdout read line by line on a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.launch", "--nprocs", "2", "--devices-per-proc", "4",
             "--kill-timeout", "5", *args],
            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, sink), daemon=True)
            for stream, sink in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, count: int, timeout: float) -> list[re.Match[str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for line in list(self.lines) if (m := re.match(pattern, line))]
            if len(found) >= count:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {count} lines matching {pattern!r}:\n" + "\n".join(self.lines))

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for reader in self._readers:
            reader.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return self.proc.returncode, "\n".join(self.errors) + "\n"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def _job_processes(token: str) -> list[int]:
    """Every live process whose command line mentions ``token`` (this job's script)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if token in cmdline and _alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_one_process_mid_training_stops_the_job_and_names_it() -> None:
    job = _Job(str(SCRIPT), "1000000")
    try:
        started = job.wait_for(r"^\[(\d)\] STARTED (\d+)$", 2, timeout=120)
        job.wait_for(r"^\[\d\] STEP 20$", 2, timeout=60)  # training, collectives in flight
        victim = next(int(m.group(2)) for m in started if m.group(1) == "1")
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        rc, err = job.finish(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert rc == 128 + signal.SIGKILL, err[-3000:]
    assert elapsed < 60
    assert (
        "jaxdist.launch: process 1 was killed by signal SIGKILL (first failure); "
        "stopped the other 1 process."
    ) in err
    deadline = time.monotonic() + 10
    while (left := _job_processes(str(SCRIPT))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"processes of the job still running: {left}"


def _expected_w(steps: int) -> float:
    x = np.arange(1, 9, dtype=np.float32)
    w = np.float32(0.0)
    for _ in range(steps):
        w = np.float32(w - np.float32(0.01) * np.mean((w * x - 1.0) * x, dtype=np.float32))
    return float(w)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_max_restarts_brings_a_job_that_fails_once_to_completion() -> None:
    steps = 40
    job = _Job("--max-restarts", "1", str(SCRIPT), str(steps), "--fail-first-start")
    rc, err = job.finish(timeout=220)
    out = "\n".join(job.lines)
    assert rc == 0, err[-3000:]
    assert "RuntimeError: failing on purpose" in err
    assert "jaxdist.launch: process 1 exited with code 1 (first failure)" in err
    assert "jaxdist.launch: restarting all 2 processes (restart 1 of 1" in err
    done = re.findall(r"^\[(\d)\] DONE (\d) (\S+)$", out, re.M)
    assert sorted(rank for rank, _, _ in done) == ["0", "1"], out[-3000:]
    for _, restart, w in done:
        assert restart == "1"
        np.testing.assert_allclose(float(w), _expected_w(steps), rtol=1e-5)
