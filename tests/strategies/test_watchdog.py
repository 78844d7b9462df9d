"""The collective watchdog of every multi-process job: ``CommunicationOptions(timeout_seconds=T)``
(or the default timeout) ends a stuck job, lines report a waiting step, and the launcher
says which process failed first and who waited for it.

In this process: the watch with a fake key-value store and fake step outputs (the lines,
the timeout, a store that does not answer), the settings a job gets by default, which
operations count as steps (on a one-process MultiWorkerMirroredStrategy given a
watchdog), and the launcher's reading of the watchdog's lines. Through
``python -m jaxdist.launch`` with 2 x 4-device jobs (tests/mp_scripts/watchdog_training.py):
a peer that sleeps forever before a step ends the job within T + 30 s naming it; a 3 s
stall with T = 10 completes; lines every 3 s and the default timeout set to 10 s through
the environment end a job whose peer sleeps forever; with the built-in default, a peer
that stalls and then calls ``sys.exit(3)`` is reported with code 3, and the launcher names
the process that was waiting for it.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.collectives.communication import CommunicationOptions
from jaxdist.launch.cli import _first_failure, _Job, _Report, _Round
from jaxdist.launch.config import LaunchConfig, child_environment, watchdog_report
from jaxdist.launch.output import Output
from jaxdist.strategies import _watchdog, multi_worker
from jaxdist.strategies.multi_worker import (
    _DEFAULT_SOURCE,
    _default_timeout,
    _program_name,
    _watchdog_settings,
)

from _helpers import REPO

SCRIPT = REPO / "tests" / "mp_scripts" / "watchdog_training.py"


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


def _watchdog_for(
    store: FakeStore, timeout: float | None, n: int = 3, **kw: Any
) -> tuple[Any, list[Any]]:
    """A watchdog of process 0 of ``n`` that records its lines and exit code in ``events``
    (and sets ``dog.done`` when it would exit)."""
    events: list[Any] = []
    done = threading.Event()

    def exit_now(code: int) -> None:
        events.append(code)
        done.set()

    dog = _watchdog.Watchdog(
        timeout, store, 0, n, poll=0.02, say=events.append, exit_now=exit_now, **kw
    )
    dog.done = done  # type: ignore[attr-defined]
    return dog, events


def _dog(timeout: float | None, interval: float | None, source: str) -> tuple[Any, list[Any]]:
    """Process 0 of 2, with lines every ``interval`` seconds and the timeout's ``source``."""
    return _watchdog_for(FakeStore(), timeout, 2, log_interval=interval, source=source)


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
def test_the_stall_clock_counts_from_the_oldest_step_in_flight_not_the_last_dispatch() -> None:
    # A planted bug restarted the clock on every dispatch: a loop that keeps dispatching
    # (JAX's asynchronous dispatch) behind a stuck step was never ended.
    dog, events = _watchdog_for(FakeStore(), timeout=0.5, n=2)
    started = time.monotonic()
    dog.dispatched(FakeOutput())  # stuck: never completes, and nothing after it can
    while not dog.done.is_set() and time.monotonic() - started < 5:
        dog.dispatched(FakeOutput())  # the loop goes on dispatching
        time.sleep(0.05)
    assert dog.done.is_set() and 0.5 <= time.monotonic() - started < 2.5
    assert events[-1] == 1 and "did not complete within 0.5 s" in events[0]


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


@pytest.mark.usefixtures("arrays")
def test_a_waiting_step_is_reported_every_interval_without_a_timeout() -> None:
    dog, events = _dog(None, 0.3, "CommunicationOptions(timeout_seconds=0)")
    dog._client.values[f"{dog._prefix}1"] = "4:strategy.run(step)"  # process 1: steps 0..3
    for _ in range(4):
        dog.dispatched(FakeOutput(ready=True), "strategy.run(step)")
    out = FakeOutput()
    dog.dispatched(out, "strategy.reduce")  # step 4: process 1 never dispatches it
    time.sleep(1.05)  # about 3 intervals
    out.ready = True
    time.sleep(0.5)  # done: no more lines
    dog.stop()
    assert 2 <= len(events) <= 4, events  # one per interval (the machine may be slow)
    for k, line in enumerate(events, 1):
        waited = float(re.search(r"has waited (\S+) s", line)[1])  # type: ignore[index]
        assert 0.3 * k <= waited < 0.3 * k + 0.3, events
        assert line == (
            f"jaxdist: MultiWorkerMirroredStrategy: process 0 has waited {waited:g} s for "
            "step 4 (strategy.reduce) to complete; not arrived: process 1 (its last step: 3, "
            "strategy.run(step)); no timeout ends the job (CommunicationOptions("
            "timeout_seconds=0))."
        )
        assert watchdog_report(line) == ("waiting", 4, (1,))


@pytest.mark.usefixtures("arrays")
def test_lines_then_the_timeout_ends_the_process() -> None:
    dog, events = _dog(
        1.0, 0.4, "JAXDIST_COLLECTIVE_TIMEOUT=1, the launcher's --collective-timeout"
    )
    started = time.monotonic()
    dog.dispatched(FakeOutput(), "strategy.run(step)")  # process 1 never published anything
    assert dog.done.wait(20)
    assert 1.0 <= time.monotonic() - started < 10
    *lines, final, code = events
    assert code == 1 and len(lines) == 2, events
    assert "the job ends after 1 s without progress (JAXDIST_COLLECTIVE_TIMEOUT=1, " in lines[0]
    assert "not arrived: process 1 (its last step: none)" in lines[0]
    assert final == (
        "jaxdist: MultiWorkerMirroredStrategy: step 0 did not complete within 1 s "
        "(JAXDIST_COLLECTIVE_TIMEOUT=1, the launcher's --collective-timeout): process 1 (its "
        "last step: none) did not arrive; ending process 0 with exit code 1."
    )
    assert watchdog_report(final) == ("ended", 0, (1,))
    everyone = (
        "jaxdist: MultiWorkerMirroredStrategy: step 3 did not complete within 1 s (x): every "
        "process arrived (the step itself ran longer than that); ending process 0 with exit code 1."
    )
    assert watchdog_report(everyone) == ("ended", 3, ())
    assert watchdog_report("jaxdist.launch: process 1 exited with code 3 (first failure)") is None


def test_settings_of_a_multi_process_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAXDIST_COLLECTIVE_TIMEOUT", raising=False)
    monkeypatch.delenv("JAXDIST_WATCHDOG_LOG_INTERVAL", raising=False)
    default = CommunicationOptions()
    assert _watchdog_settings(default, "w") == (1200.0, _DEFAULT_SOURCE, 60.0)
    assert _watchdog_settings(CommunicationOptions(timeout_seconds=0), "w") == (
        0.0, "CommunicationOptions(timeout_seconds=0)", 60.0,
    )  # fmt: skip
    monkeypatch.setenv("JAXDIST_COLLECTIVE_TIMEOUT", "0")
    monkeypatch.setenv("JAXDIST_WATCHDOG_LOG_INTERVAL", "2.5")
    assert _watchdog_settings(default, "w") == (
        0.0, "JAXDIST_COLLECTIVE_TIMEOUT=0, the launcher's --collective-timeout", 2.5,
    )  # fmt: skip
    explicit = CommunicationOptions(timeout_seconds=10)  # the options win over the environment
    assert _watchdog_settings(explicit, "w")[:2] == (
        10.0,
        "CommunicationOptions(timeout_seconds=10)",
    )
    monkeypatch.setenv("JAXDIST_WATCHDOG_LOG_INTERVAL", "often")
    with pytest.raises(
        ValueError,
        match=r"w: the environment variable JAXDIST_WATCHDOG_LOG_INTERVAL \(the launcher's "
        r"--watchdog-log-interval\) must be a number of seconds >= 0 \(0: no lines\), got 'often'",
    ):
        _watchdog_settings(default, "w")


def test_the_default_sets_xlas_backstop_only_where_nothing_fixed_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flag = "--xla_cpu_collective_timeout_seconds"
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    started = [False]
    monkeypatch.setattr(multi_worker, "backends_initialized", lambda: started[0])
    multi_worker._set_collective_timeout(1200.0, "w", default=True)
    assert os.environ["XLA_FLAGS"] == f"{flag}=1210"  # the watchdog's line comes first
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_use_xnnpack=false {flag}=99")
    multi_worker._set_collective_timeout(1200.0, "w", default=True)  # the user's value stays
    assert os.environ["XLA_FLAGS"] == f"--xla_cpu_use_xnnpack=false {flag}=99"
    monkeypatch.delenv("XLA_FLAGS")
    started[0] = True
    multi_worker._set_collective_timeout(1200.0, "w", default=True)  # too late: no error
    assert "XLA_FLAGS" not in os.environ
    with pytest.raises(RuntimeError, match=r"w: CommunicationOptions\(timeout_seconds=10\) sets"):
        multi_worker._set_collective_timeout(10, "w")  # an explicit timeout still says so


def test_every_program_the_strategy_dispatches_is_a_step() -> None:
    """run / function / train-step programs and cross-replica operations that dispatch one
    count, in order, with what they are; local results (no program) do not."""
    s = jd.MultiWorkerMirroredStrategy()  # one process here: given a watchdog by hand
    assert s._watchdog is None  # a one-process job has none (no lines, no timeout)
    store = FakeStore()
    dog = _watchdog.Watchdog(None, store, 0, 1, log_interval=None)
    object.__setattr__(s, "_watchdog", dog)
    try:
        n = s.num_replicas_in_sync

        @s.function
        def step(ctx: jd.ReplicaContext, x: jax.Array) -> jax.Array:
            return x * (ctx.replica_id_in_sync_group + 1).astype(jnp.float32)

        seen: list[tuple[int, str]] = []

        def after() -> None:
            seen.append((dog.steps, dog._what))

        per = step(jnp.float32(2.0))
        after()
        total = s.reduce("sum", per, axis=None)
        after()
        gathered = s.gather(s.run(lambda ctx: jnp.ones((2,)) * ctx.replica_id_in_sync_group), 0)
        after()
        local = s.experimental_local_results(per)
        after()
        mirrored = s.extended.reduce_to("mean", per, per)
        after()
        assert seen == [
            (1, "strategy.run(step)"),
            (2, "strategy.reduce"),
            (4, "strategy.gather"),  # the run inside it, then the gather
            (4, "strategy.gather"),  # local results: no program
            (5, "strategy.extended.reduce_to / batch_reduce_to"),
        ]
        reference = 2.0 * np.arange(1, n + 1, dtype=np.float32)
        np.testing.assert_allclose(float(total), reference.sum(), rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray(gathered), np.repeat(np.arange(n, dtype=np.float32), 2), rtol=0
        )
        np.testing.assert_allclose([float(v) for v in local], reference, rtol=0)
        mean = np.asarray(s.experimental_local_results(mirrored)[0])
        np.testing.assert_allclose(mean, reference.mean(), rtol=1e-6)
    finally:
        dog.stop()


def test_program_names() -> None:
    def jaxdist_train_step_loss() -> None: ...

    def call(args: Any, kwargs: Any) -> Any:
        return jitted(args, kwargs)

    jitted = jax.jit(lambda a, k: a)
    jitted.__name__ = "jaxdist_step"  # type: ignore[attr-defined]
    assert _program_name(jitted) == "strategy.run(step)"
    assert _program_name(call) == "strategy.run(step)"  # a donating call holds the program
    assert _program_name(jaxdist_train_step_loss) == "train_step(loss)"
    assert _program_name(lambda a, k: a) == "a compiled step"


def test_the_first_failure_among_those_seen_together() -> None:
    assert _first_failure([None, 0, None]) is None
    assert _first_failure([None, 3, 1]) == 1
    assert _first_failure([-6, 3, None]) == 1  # SIGABRT from the service: a consequence
    assert _first_failure([-9, -6]) == 0


def test_the_launchers_first_failure_line_says_who_waited() -> None:
    config = LaunchConfig("train.py", nprocs=3, watchdog_log_interval=2)
    job = _Job(config, Output(io.StringIO(), io.StringIO()), None)  # type: ignore[arg-type]
    now = time.monotonic()
    result = _Round(failure=(1, 3), running=(0, 2), at=now)
    result.reports = {
        0: _Report(now - 1, "waiting", 20, (1,)),
        2: _Report(now - 60, "waiting", 7, (1,)),  # long over (lines come every 2 s)
    }
    assert job._first_failure(result, preempted=False) == (
        "process 1 exited with code 3 (first failure); stopped the other 2 processes (0 was "
        "waiting in step 20 for process 1)."
    )
    result = _Round(failure=(0, 1), running=(1,), at=now)
    result.reports = {0: _Report(now, "ended", 20, (1,))}
    assert job._first_failure(result, preempted=False) == (
        "process 0 exited with code 1 (first failure: its watchdog ended it: step 20 did not "
        "complete, process 1 did not arrive); stopped the other 1 process."
    )
    result = _Round(failure=(1, 42), running=(), at=now)
    assert job._first_failure(result, preempted=True) == (
        "process 1 exited with code 42 (first failure: preempted); no other process was running."
    )


# -- real jobs through the launcher ----------------------------------------------------------


def _launch(
    *args: str, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str, str, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_", "XLA_"))}
    base.update(PYTHONPATH=str(REPO), JAXDIST_HEARTBEAT_TIMEOUT="10", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--nprocs", "2", "--devices-per-proc", "4",
         "--kill-timeout", "3", *args],
        cwd=REPO, env=base, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr, time.time()


def _seconds_after(event: str, out: str, err: str, ended: float) -> float:
    """Seconds from the time process 1 printed with ``event`` (``[1] EVENT <time>``) to
    ``ended``."""
    printed = re.search(rf"^\[1\] {event} (\S+)$", out, re.M)
    assert printed, (out[-2000:], err[-3000:])
    return ended - float(printed[1])


# What process 0's watchdog and then the launcher say when process 1 never reaches step 20
# (a timeout of 10 s, from the launcher's option or the environment).
_ENDED_IN_STEP_20 = (
    "[0] jaxdist: MultiWorkerMirroredStrategy: step 20 did not complete within 10 s "
    "(JAXDIST_COLLECTIVE_TIMEOUT=10, the launcher's --collective-timeout): process 1 (its "
    "last step: 19) did not arrive; ending process 0 with exit code 1."
)
_LAUNCHER_NAMES_PROCESS_0 = (
    "jaxdist.launch: process 0 exited with code 1 (first failure: its watchdog ended it: "
    "step 20 did not complete, process 1 did not arrive); stopped the other 1 process.\n"
)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_peer_stuck_forever_ends_the_job_naming_it() -> None:
    t = 10
    rc, out, err, ended = _launch(
        "--collective-timeout", str(t), str(SCRIPT), "1", "100000", "1000000", timeout=180
    )
    elapsed = _seconds_after("STALLING", out, err, ended)
    print(f"the job ended {elapsed:.1f} s after process 1 stalled (T = {t} s)")
    assert t <= elapsed < t + 30, (elapsed, err[-3000:])
    assert rc != 0
    lines = re.findall(r"^\[0\] jaxdist: MultiWorkerMirroredStrategy: .*$", err, re.M)
    assert lines == [_ENDED_IN_STEP_20], err[-3000:]
    assert _LAUNCHER_NAMES_PROCESS_0 in err
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


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_default_lines_and_timeout_end_a_job_whose_peer_sleeps_forever() -> None:
    env = {"JAXDIST_COLLECTIVE_TIMEOUT": "10", "JAXDIST_WATCHDOG_LOG_INTERVAL": "3"}
    rc, out, err, ended = _launch(str(SCRIPT), "1", "100000", "1000000", env=env, timeout=180)
    elapsed = _seconds_after("STALLING", out, err, ended)
    print(f"the job ended {elapsed:.1f} s after process 1 stalled (default timeout 10 s)")
    assert 10 <= elapsed < 40, (elapsed, err[-3000:])
    assert rc == 1, err[-3000:]
    waits = re.findall(r"^\[0\] jaxdist: MultiWorkerMirroredStrategy: process 0 has .*$", err, re.M)
    assert 2 <= len(waits) <= 3, err[-3000:]  # at 3, 6 and 9 s
    for line in waits:
        assert re.fullmatch(
            r"\[0\] jaxdist: MultiWorkerMirroredStrategy: process 0 has waited \d+(\.\d+)? s for "
            r"step 20 \(strategy\.run\(step\)\) to complete; not arrived: process 1 \(its last "
            r"step: 19, strategy\.run\(step\)\); the job ends after 10 s without progress "
            r"\(JAXDIST_COLLECTIVE_TIMEOUT=10, the launcher's --collective-timeout\)\.",
            line,
        ), line
    assert re.search(r"^\[1\] jaxdist: MultiWorkerMirroredStrategy", err, re.M) is None
    assert _ENDED_IN_STEP_20 + "\n" in err
    assert _LAUNCHER_NAMES_PROCESS_0 in err
    assert "DONE" not in out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sys_exit_3_after_a_stall_is_reported_with_its_code_and_the_waiting_process() -> None:
    # No timeout anywhere: the built-in default (1200 s) is on, and lines every 2 s.
    env = {"JAXDIST_WATCHDOG_LOG_INTERVAL": "2"}
    rc, out, err, ended = _launch(str(SCRIPT), "1", "5", "1000000", "-", "3", env=env, timeout=180)
    elapsed = _seconds_after("EXITING", out, err, ended)
    print(f"the job ended {elapsed:.1f} s after sys.exit(3)")
    assert elapsed < 30, (elapsed, err[-3000:])
    assert rc == 3, err[-3000:]
    waits = re.findall(r"^\[0\] jaxdist: MultiWorkerMirroredStrategy: process 0 has .*$", err, re.M)
    assert waits, err[-3000:]
    assert (
        "to complete; not arrived: process 1 (its last step: 19, strategy.run(step)); the job "
        f"ends after 1200 s without progress ({_DEFAULT_SOURCE})." in waits[0]
    ), waits[0]
    assert (
        "jaxdist.launch: process 1 exited with code 3 (first failure); stopped the other 1 "
        "process (0 was waiting in step 20 for process 1).\n"
    ) in err
    assert "did not complete" not in err and "DONE" not in out
