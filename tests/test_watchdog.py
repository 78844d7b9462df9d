"""The collective watchdog: ``CommunicationOptions(timeout_seconds=T)`` ends a stuck job.

The watch itself runs in this process with a fake key-value store and fake step
outputs; the end-to-end tests run 2 x 4-device MultiWorkerMirroredStrategy jobs
(tests/mp_scripts/watchdog_training.py) through ``python -m jaxdist.launch``: a
peer that sleeps forever before a step ends the job within T + 30 s naming it; a
3 s stall with T = 10 completes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jaxdist._launch_config import LaunchConfig, child_environment
from jaxdist.strategies import _watchdog
from jaxdist.strategies.multi_worker import _default_timeout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "mp_scripts" / "watchdog_training.py"


class FakeStore:
    def __init__(self, fail: bool = False) -> None:
        self.values: dict[str, str] = {}
        self.fail = fail

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        assert allow_overwrite
        self.values[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        if self.fail:
            raise RuntimeError("store down")
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


class FakeOutput:
    """A step output whose readiness the test decides."""

    def __init__(self, ready: bool = False) -> None:
        self.ready = ready

    def is_ready(self) -> bool:
        return self.ready


def _watchdog_for(store: FakeStore, timeout: float, n: int = 3) -> tuple[Any, list[Any]]:
    events: list[Any] = []
    done = threading.Event()

    def exit_now(code: int) -> None:
        events.append(code)
        done.set()

    dog = _watchdog.Watchdog(timeout, store, 0, n, poll=0.02, say=events.append, exit_now=exit_now)
    dog.done = done  # type: ignore[attr-defined]
    return dog, events


@pytest.fixture
def arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lets the watch take FakeOutputs for step outputs."""
    monkeypatch.setattr(_watchdog, "_an_array", lambda out: out)


@pytest.mark.usefixtures("arrays")
def test_a_step_that_does_not_complete_names_the_late_processes() -> None:
    store = FakeStore()
    dog, events = _watchdog_for(store, timeout=0.3)
    prefix = dog._prefix
    store.values[f"{prefix}1"] = "3"  # process 1 dispatched steps 0..2; process 2 nothing
    for _ in range(3):
        dog.dispatched(FakeOutput(ready=True), "strategy.run(step)")
    time.sleep(0.1)
    assert store.values[f"{prefix}0"] == "3:strategy.run(step)"  # published
    started = time.monotonic()
    dog.dispatched(FakeOutput(ready=False))  # step 3 never completes
    assert dog.done.wait(10)
    assert 0.3 <= time.monotonic() - started < 3
    assert events == [
        "jaxdist: MultiWorkerMirroredStrategy: step 3 did not complete within 0.3 s "
        "(CommunicationOptions(timeout_seconds=0.3)): processes 1 (its last step: 2), "
        "2 (its last step: none) did not arrive; ending process 0 with exit code 1.",
        1,
    ]


@pytest.mark.usefixtures("arrays")
def test_steps_that_complete_in_time_never_trip_it() -> None:
    store = FakeStore()
    dog, events = _watchdog_for(store, timeout=0.5, n=2)
    for _ in range(5):  # each takes 0.3 s: less than the timeout, 1.5 s in all
        out = FakeOutput()
        dog.dispatched(out)
        time.sleep(0.3)
        out.ready = True
    time.sleep(0.3)
    dog.stop()
    assert events == [] and dog.steps == 5
    assert store.values[f"{dog._prefix}0"] == "5:"


@pytest.mark.usefixtures("arrays")
def test_without_the_store_and_with_everyone_there() -> None:
    dog, events = _watchdog_for(FakeStore(fail=True), timeout=0.2, n=2)
    dog.dispatched(FakeOutput())
    assert dog.done.wait(10)
    assert "step 0 did not complete within 0.2 s" in events[0]
    assert (
        "the other processes' steps are unknown (the key-value store did not answer)" in (events[0])
    )
    store = FakeStore()
    dog, events = _watchdog_for(store, timeout=0.2, n=2)
    store.values[f"{dog._prefix}1"] = "1"  # process 1 dispatched step 0 too
    dog.dispatched(FakeOutput())
    assert dog.done.wait(10)
    assert "every process arrived (the step itself ran longer than that)" in events[0]


def test_the_default_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    config = LaunchConfig("train.py", nprocs=2, collective_timeout=10, watchdog_log_interval=2)
    env = child_environment(config, 0, 1, base={})
    assert env["JAXDIST_COLLECTIVE_TIMEOUT"] == "10"
    assert env["JAXDIST_WATCHDOG_LOG_INTERVAL"] == "2"
    plain = child_environment(LaunchConfig("train.py", nprocs=2), 0, 1, base={})
    assert "JAXDIST_COLLECTIVE_TIMEOUT" not in plain
    assert "JAXDIST_WATCHDOG_LOG_INTERVAL" not in plain
    with pytest.raises(ValueError, match=r"LaunchConfig\(collective_timeout=-1\) "):
        LaunchConfig("train.py", collective_timeout=-1)
    with pytest.raises(ValueError, match=r"LaunchConfig\(watchdog_log_interval=-1\) "):
        LaunchConfig("train.py", watchdog_log_interval=-1)
    monkeypatch.delenv("JAXDIST_COLLECTIVE_TIMEOUT", raising=False)
    assert _default_timeout("where") is None
    monkeypatch.setenv("JAXDIST_COLLECTIVE_TIMEOUT", "7.5")
    assert _default_timeout("where") == 7.5
    monkeypatch.setenv("JAXDIST_COLLECTIVE_TIMEOUT", "0")
    assert _default_timeout("where") == 0
    monkeypatch.setenv("JAXDIST_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(
        ValueError,
        match=r"where: the environment variable JAXDIST_COLLECTIVE_TIMEOUT \(the launcher's "
        r"--collective-timeout\) must be a number of seconds >= 0 \(0: no timeout\), got 'soon'",
    ):
        _default_timeout("where")


# -- real jobs through the launcher ----------------------------------------------------------


def _launch(*args: str, timeout: float) -> tuple[int, str, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_", "XLA_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["JAXDIST_HEARTBEAT_TIMEOUT"] = "10"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--nprocs", "2", "--devices-per-proc", "4",
         "--kill-timeout", "3", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr, time.time()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_peer_stuck_forever_ends_the_job_naming_it() -> None:
    t = 10
    rc, out, err, ended = _launch(
        "--collective-timeout", str(t), str(SCRIPT), "1", "100000", "1000000", timeout=180
    )
    stalled = re.search(r"^\[1\] STALLING (\S+)$", out, re.M)
    assert stalled, (out[-2000:], err[-3000:])
    elapsed = ended - float(stalled[1])
    print(f"the job ended {elapsed:.1f} s after process 1 stalled (T = {t} s)")
    assert t <= elapsed < t + 30, (elapsed, err[-3000:])
    assert rc != 0
    lines = re.findall(r"^\[0\] jaxdist: MultiWorkerMirroredStrategy: .*$", err, re.M)
    assert lines == [
        "[0] jaxdist: MultiWorkerMirroredStrategy: step 20 did not complete within 10 s "
        "(JAXDIST_COLLECTIVE_TIMEOUT=10, the launcher's --collective-timeout): process 1 (its "
        "last step: 19) did not arrive; ending process 0 with exit code 1."
    ], err[-3000:]
    assert (
        "jaxdist.launch: process 0 exited with code 1 (first failure: its watchdog ended it: "
        "step 20 did not complete, process 1 did not arrive); stopped the other 1 process.\n"
    ) in err
    assert "DONE" not in out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_stall_shorter_than_the_timeout_completes() -> None:
    steps = 40
    rc, out, err, _ = _launch(str(SCRIPT), "1", "3", str(steps), "10", timeout=180)
    assert rc == 0, err[-3000:]
    assert re.search(r"^\[1\] STALLING ", out, re.M)
    assert "did not complete" not in err
    done = re.findall(r"^\[(\d)\] DONE (\S+)$", out, re.M)
    assert sorted(rank for rank, _ in done) == ["0", "1"], out[-3000:]
    # Reference: each step adds the sum over the 8 replicas of (replica id + 1).
    expected = np.float32(steps * np.arange(1, 9).sum())
    for _, w in done:
        np.testing.assert_allclose(float(w), expected, rtol=0)
