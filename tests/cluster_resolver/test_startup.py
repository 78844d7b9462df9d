"""Start-up of a multi-process job: who is missing, said while waiting and on timeout.

The rendezvous itself (jaxdist/cluster_resolver/_rendezvous.py) runs in threads of
this process (one per simulated process, on a free loopback port); the end-to-end
tests start real `jaxdist.initialize` processes of a 2-process job, one of which is
never started, with short timeouts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from jaxdist.cluster_resolver._rendezvous import rendezvous

from _helpers import REPO, free_port


class _Process(threading.Thread):
    """One simulated process running the rendezvous; records what it says and how it ends."""

    def __init__(self, address: str, n: int, process_id: int, timeout: float) -> None:
        super().__init__(daemon=True)
        self.args = (address, n, process_id, timeout)
        self.said: list[str] = []
        self.error: BaseException | None = None
        self.ended = float("nan")

    def run(self) -> None:
        try:
            rendezvous(*self.args, report_interval=0.5, say=self.said.append)
        except BaseException as e:
            self.error = e
        self.ended = time.monotonic()


def _start(n: int, ids: list[int], timeout: float) -> tuple[str, dict[int, _Process]]:
    address = f"127.0.0.1:{free_port()}"
    procs = {i: _Process(address, n, i, timeout) for i in ids}
    for i in ids:
        procs[i].start()
        time.sleep(0.05)  # process 0 first, usually: the others retry until it listens
    return address, procs


def test_everyone_checks_in_then_the_port_is_free_again() -> None:
    address, procs = _start(3, [2, 1, 0], timeout=30)
    for p in procs.values():
        p.join(30)
        assert p.error is None and not p.is_alive()
    host, port = address.rsplit(":", 1)
    import socket

    with socket.create_server((host, int(port))):  # what JAX's service does next
        pass


def test_a_missing_process_is_named_while_waiting_and_on_timeout() -> None:
    started = time.monotonic()
    address, procs = _start(3, [0, 2], timeout=2.5)
    for p in procs.values():
        p.join(30)
    for i, p in procs.items():
        assert isinstance(p.error, RuntimeError)
        assert re.fullmatch(
            rf"jaxdist.initialize\(\): 1 of 3 processes did not connect to {address} within "
            r"2.5 s \(initialization_timeout, or JAXDIST_INITIALIZATION_TIMEOUT\): missing "
            r"process 1\. Start every process of the job with the same coordinator address .*",
            str(p.error),
        ), (i, p.error)
        assert p.ended - started < 2.5 + 3, p.ended - started
        waiting = [s for s in p.said if "waiting for 1 of 3 processes" in s]
        assert len(waiting) >= 3, p.said  # every 0.5 s
        assert waiting[0].startswith(
            f"process {i}: waiting for 1 of 3 processes to connect to {address} "
            "(missing: process 1; "
        ), waiting[0]


def test_without_process_0_the_others_name_it() -> None:
    address, procs = _start(2, [1], timeout=1.5)
    procs[1].join(30)
    assert isinstance(procs[1].error, RuntimeError)
    assert str(procs[1].error).startswith(
        f"jaxdist.initialize(): process 1 could not reach process 0 (the coordinator) at "
        f"{address} within 1.5 s (initialization_timeout, or JAXDIST_INITIALIZATION_TIMEOUT): "
        "missing process 0."
    )
    waiting = f"process 1: waiting for process 0 (the coordinator) to listen at {address} ("
    assert procs[1].said[0].startswith(waiting), procs[1].said


@pytest.mark.parametrize(
    ("n", "claims", "message"),
    [
        (2, [(0, 2), (1, 3)], r"process 1 was started for 3 processes, process 0 for 2\."),
        (3, [(0, 3), (1, 3), (1, 3)], r"two processes claim process id 1 \(of 3\)"),
    ],
)
def test_inconsistent_jobs_fail_at_once(
    n: int, claims: list[tuple[int, int]], message: str
) -> None:
    address = f"127.0.0.1:{free_port()}"
    procs = [_Process(address, count, i, timeout=30) for i, count in claims]
    for p in procs:
        p.start()
        time.sleep(0.2)
    for p in procs:
        p.join(30)
    assert isinstance(procs[0].error, RuntimeError)
    assert re.search(message, str(procs[0].error)), procs[0].error
    assert any(re.search(message, str(p.error)) for p in procs[1:])
    del n


# -- real processes ------------------------------------------------------------------------

_SCRIPT = """
import sys, time
t = time.monotonic()
import jaxdist as jd
try:
    jd.initialize(initialization_timeout=4)
except RuntimeError as e:
    print(f"FAILED {time.monotonic() - t:.1f} {e}", flush=True)
    sys.exit(1)
print("STARTED", flush=True)
"""


def _env(process_id: int, port: int, **extra: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_", "XLA_"))}
    return {
        **env,
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        "JAXDIST_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAXDIST_NUM_PROCESSES": "2",
        "JAXDIST_PROCESS_ID": str(process_id),
        "JAXDIST_STARTUP_REPORT_INTERVAL": "1",
        **extra,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("present", [0, 1])
def test_a_process_that_never_starts_is_named(present: int) -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=_env(present, port),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    failed = re.search(r"^FAILED (\S+) (.*)$", proc.stdout, re.M)
    assert failed, (proc.stdout, proc.stderr[-3000:])
    print(f"process {present} alone: initialize raised after {failed[1]} s (timeout 4 s)")
    assert float(failed[1]) < 4 + 12, failed[1]  # the timeout, not JAX's 300 s abort
    address = f"127.0.0.1:{port}"
    missing = 1 - present
    assert f"missing process {missing}." in failed[2], failed[2]
    assert address in failed[2]
    if present == 0:
        pattern = rf"waiting for 1 of 2 processes to connect to {address} \(missing: process 1;"
    else:
        pattern = rf"process 1: waiting for process 0 \(the coordinator\) to listen at {address}"
    assert len(re.findall(pattern, proc.stderr)) >= 2, proc.stderr[-3000:]  # every second


@pytest.mark.timeout(120)
def test_two_processes_start_through_the_rendezvous() -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT],
            env=_env(i, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 0)
    ]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == "STARTED", (out, err[-3000:])
