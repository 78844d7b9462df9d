"""The local launcher (`python -m jaxdist.launch`) with real processes on localhost.

Most tests start the launcher as its own process and child scripts that need no
JAX (tests/launch_scripts/launch_child.py); each takes a few seconds at most. The
launcher's ``__main__.py`` is run directly (``python -P jaxdist/launch/__main__.py``), as
``python -m jaxdist.launch`` (tested separately); one end-to-end test runs a
`jax.distributed` psum over 2 x 2 devices.

The last tests start real MultiWorkerMirroredStrategy jobs (2 processes x 4 devices,
training with gloo collectives, tests/mp_scripts/launched_training.py) through
``python -m jaxdist.launch``: one process killed from outside mid-training, and a
job that fails once and completes after ``--max-restarts 1``.
"""

from __future__ import annotations

import io
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

import jaxdist.launch.cli as launch_module
from jaxdist.cluster_resolver import launcher as resolver_module
from jaxdist.launch.cli import LaunchConfig, child_environment, main
from jaxdist.launch.output import Output

from _helpers import REPO

LAUNCH = REPO / "jaxdist" / "launch" / "__main__.py"
SCRIPTS = REPO / "tests" / "launch_scripts"
CHILD = SCRIPTS / "launch_child.py"
PSUM = SCRIPTS / "launch_jax_psum.py"
TRAINING = REPO / "tests" / "mp_scripts" / "launched_training.py"
LINUX = sys.platform.startswith("linux")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting for a parent that may never reap it, does not)."""
    if LINUX:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return False
        return stat[stat.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _session_members(sessions: list[int]) -> list[int]:
    """Live processes (not zombies) in any of these sessions: whatever a job process started."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_bytes()
            except OSError:  # gone meanwhile
                continue
            state, _, _, session = stat[stat.rindex(b")") + 2 :].split()[:4]
            if int(session) in sessions and state not in (b"Z", b"X"):
                members.append(int(entry.name))
    return members


def _wait_dead(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after waiting up to ``timeout`` seconds for all to end."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


class Launcher:
    """A launcher process whose output is read in the background, killed with all it reported."""

    def __init__(
        self,
        *args: str | Path,
        env: dict[str, str] | None = None,
        module: bool = False,
        **kw: Any,
    ) -> None:
        """Runs ``python -P jaxdist/launch.py ARGS``; ``python -m jaxdist.launch`` if ``module``."""
        entry = ["-m", "jaxdist.launch"] if module else ["-P", str(LAUNCH)]
        if module:
            kw.setdefault("cwd", REPO)
        cmd = [sys.executable, *entry, *map(str, args)]
        env = dict(os.environ if env is None else env)  # this checkout's jaxdist, not an install
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw
        )
        self.lines: dict[str, list[str]] = {"out": [], "err": []}
        self._queue: queue.Queue[tuple[str, str]] = queue.Queue()
        self._threads = [
            self._reader(self.proc.stdout, "out"),
            self._reader(self.proc.stderr, "err"),
        ]

    def _reader(self, pipe: IO[str] | None, name: str) -> threading.Thread:
        def read() -> None:
            assert pipe is not None
            for line in pipe:
                self.lines[name].append(line)
                self._queue.put((name, line))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 30) -> list[str]:
        """Waits until ``count`` output lines (stdout or stderr) match ``pattern``."""
        deadline = time.monotonic() + timeout
        found = [
            line for name in ("out", "err") for line in self.lines[name] if re.search(pattern, line)
        ]
        while len(found) < count:
            try:
                _, line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {count} lines match {pattern!r} in {timeout} s: {self.lines}"
                ) from None
            if re.search(pattern, line):
                found.append(line)
        return found

    def reports(self, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        """The ``READY`` reports of ``count`` child processes, by rank."""
        lines = self.wait_for(r"READY ", count, timeout)
        reports = [json.loads(line.split("READY ", 1)[1]) for line in lines]
        return sorted(reports, key=lambda r: (r["env"]["JAXDIST_RESTART_COUNT"], r["rank"]))

    def finish(self, timeout: float = 30) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout=timeout)
        self._close()
        return rc, "".join(self.lines["out"]), "".join(self.lines["err"])

    def _close(self) -> None:
        for thread in self._threads:
            thread.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def job_pids(self) -> list[int]:
        """The pids the job's processes reported: their own, and their helpers'."""
        pids = []
        for line in self.lines["out"]:
            if "READY " in line:
                report = json.loads(line.split("READY ", 1)[1])
                pids += [report["pid"]] + ([report["helper"]] if report["helper"] else [])
            elif m := re.fullmatch(r"\[\d+\] (?:STARTED|HELPER) (\d+)\n?", line):
                pids.append(int(m[1]))
        return pids

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()
        for pid in self.job_pids():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launcher() -> Iterator[type[Launcher]]:
    """Starts launchers; afterwards kills whatever they or their processes left running."""
    started: list[Launcher] = []

    class Tracked(Launcher):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            started.append(self)

    yield Tracked
    for job in started:
        job.kill_all()


# -- the environment contract -------------------------------------------------------------


def test_variable_names_match_the_resolver() -> None:
    for name in (
        "COORDINATOR_ADDRESS",
        "NUM_PROCESSES",
        "PROCESS_ID",
        "LOCAL_DEVICE_COUNT",
        "RESTART_COUNT",
    ):
        assert getattr(launch_module, f"ENV_{name}") == getattr(resolver_module, f"ENV_{name}")


def test_child_environment_cpu_replaces_inherited_device_count() -> None:
    config = LaunchConfig("train.py", nprocs=3)
    base = {"JAX_NUM_CPU_DEVICES": "8", "HOME": "/home/user", "PYTHONUNBUFFERED": "0"}
    env = child_environment(config, 2, port=1234, restart_count=5, base=base)
    assert env == {
        "HOME": "/home/user",
        "PYTHONUNBUFFERED": "0",
        "JAXDIST_COORDINATOR_ADDRESS": "127.0.0.1:1234",
        "JAXDIST_NUM_PROCESSES": "3",
        "JAXDIST_PROCESS_ID": "2",
        "JAXDIST_LOCAL_DEVICE_COUNT": "1",
        "JAXDIST_RESTART_COUNT": "5",
        "JAX_NUM_CPU_DEVICES": "1",
        "JAX_PLATFORMS": "cpu",
    }
    assert base["JAX_NUM_CPU_DEVICES"] == "8"  # the input is not modified
    user_platform = child_environment(config, 0, 1234, base={"JAX_PLATFORMS": "cpu,cuda"})
    assert user_platform["JAX_PLATFORMS"] == "cpu,cuda"


def test_child_environment_gpu_slices() -> None:
    config = LaunchConfig("train.py", nprocs=2, gpus_per_proc=2)
    unset = [child_environment(config, i, 1, base={}) for i in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in unset] == ["0,1", "2,3"]
    assert all(e["JAXDIST_LOCAL_DEVICE_COUNT"] == "2" for e in unset)
    assert not any("JAX_PLATFORMS" in e or "JAX_NUM_CPU_DEVICES" in e for e in unset)
    listed = {"CUDA_VISIBLE_DEVICES": "7, 5,3,1"}
    assert child_environment(config, 1, 1, base=listed)["CUDA_VISIBLE_DEVICES"] == "3,1"
    with pytest.raises(
        ValueError,
        match=r"--gpus-per-proc 2 x --nprocs 2 needs 4 GPUs but CUDA_VISIBLE_DEVICES='0,1' lists 2",
    ):
        child_environment(config, 0, 1, base={"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match=r"child_environment\(process_id=2\): must be in 0\.\.1"):
        child_environment(config, 2, 1, base={})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nprocs": 0}, r"\(nprocs=0\) \(--nprocs\): must be at least 1 \(the number of"),
        ({"max_restarts": -1}, r"\(max_restarts=-1\) \(--max-restarts\): must be >= 0 \(0: never"),
        (
            {"kill_timeout": -0.5},
            r"\(kill_timeout=-0.5\) \(--kill-timeout\): must be >= 0 \(0: SIG",
        ),
        ({"devices_per_proc": 0}, r"\(devices_per_proc=0\) \(--devices-per-proc\): must be >= 1"),
        ({"gpus_per_proc": -1}, r"\(gpus_per_proc=-1\) \(--gpus-per-proc\): must be >= 1, or None"),
        (
            {"coordinator_port": 0},
            r"\(coordinator_port=0\) \(--coordinator-port\): must be in 1\.\.",
        ),
        (
            {"devices_per_proc": 2, "gpus_per_proc": 1},
            r"devices_per_proc=2, gpus_per_proc=1\): .* pass one of them",
        ),
        (
            {"module": True, "program": "my-module"},
            r"program='my-module', module=True\): not a dotted module name",
        ),
    ],
)
def test_launch_config_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchConfig(**{"program": "train.py", **kwargs})


# -- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], r"the following arguments are required: program"),
        (["--nprocs", "0", "CHILD"], r"error: LaunchConfig\(nprocs=0\) \(--nprocs\): must be at"),
        (["--nprocs", "-2", "CHILD"], r"error: LaunchConfig\(nprocs=-2\) \(--nprocs\): must be at"),
        (["--nprocs", "two", "CHILD"], r"error: argument --nprocs: invalid int value: 'two'"),
        (["--devices-per-proc", "-1", "CHILD"], r"\(devices_per_proc=-1\) \(--devices-per-proc\)"),
        (["--max-restarts", "-1", "CHILD"], r"\(max_restarts=-1\) \(--max-restarts\): must be >="),
        (
            ["--kill-timeout", "-1", "CHILD"],
            r"\(kill_timeout=-1.0\) \(--kill-timeout\): must be >=",
        ),
        (["--master-port", "70000", "CHILD"], r"\(coordinator_port=70000\) \(--coordinator-port\)"),
        (["--bogus", "CHILD"], r"unrecognized arguments: --bogus"),
        (["--nproc", "2", "CHILD"], r"unrecognized arguments: --nproc"),  # no abbreviations
        (
            ["--devices-per-proc", "2", "--gpus-per-proc", "2", "CHILD"],
            r"not allowed with argument",
        ),
        (
            ["-m", "not-a.module"],
            r"program='not-a.module', module=True\): not a dotted module name",
        ),
        (
            ["--gpus-per-proc", "1", "--nprocs", "3", "CHILD"],
            r"needs 3 GPUs but CUDA_VISIBLE_DEVICES='0' lists 1",
        ),
    ],
)
def test_bad_arguments_print_usage_and_exit_2(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(subprocess, "Popen", _no_process)
    assert main([str(CHILD) if a == "CHILD" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m jaxdist.launch [-h] [--nprocs N]")
    assert re.search(message, err), err
    assert "Traceback" not in err


def _no_process(*args: Any, **kwargs: Any) -> None:
    raise AssertionError(f"a process was started: {args}")


def test_missing_script_fails_before_starting_anything(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", _no_process)
    assert main(["--nprocs", "2", "missing.py", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: the script 'missing.py' does not exist (relative to " in err
    assert "pass the path of a Python script, or -m MODULE to run a module" in err
    with pytest.raises(FileNotFoundError, match=r"launch: the script 'missing.py' does not exist"):
        launch_module.launch(LaunchConfig("missing.py"))


def test_pinned_port_in_use_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--coordinator-port", str(port), str(CHILD)]) == 2
    assert f"argument --coordinator-port: 127.0.0.1:{port} is in use" in capsys.readouterr().err


def test_process_that_cannot_start_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    assert main(["--nprocs", "2", str(CHILD)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"jaxdist.launch: could not start process 0 ({tmp_path / 'no-python'} ")
    assert "No such file or directory" in err


@pytest.mark.timeout(60)
def test_start_failure_half_way_stops_the_started(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    start = launch_module._Job._start

    def start_one_then_fail(self: Any, env: dict[str, str]) -> subprocess.Popen[bytes]:
        if started:
            raise OSError(24, "Too many open files")
        started.append(start(self, env))
        return started[0]

    monkeypatch.setattr(launch_module._Job, "_start", start_one_then_fail)
    assert main(["--nprocs", "3", str(CHILD), "--sleep", "30"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxdist.launch: could not start process 1 (")
    assert err.endswith("[Errno 24] Too many open files.\n")
    assert started[0].returncode == -signal.SIGKILL


def test_help_returns_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--devices-per-proc K" in out and "--max-restarts K" in out


def test_python_dash_m_entry_point() -> None:
    """``python -m jaxdist.launch``: bad arguments exit 2 without a traceback; a job runs."""
    bad = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--nprocs", "0", str(CHILD)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.startswith("usage: python -m jaxdist.launch")
    assert "Traceback" not in bad.stderr
    good = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--nprocs", "2", str(CHILD)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert good.returncode == 0, good.stderr
    assert sorted(re.findall(r"^\[(\d)\] READY", good.stdout, re.M)) == ["0", "1"]


def test_console_script() -> None:
    """``jaxdist-launch``, installed by the package, is the same launcher."""
    script = Path(sys.executable).parent / "jaxdist-launch"
    assert script.exists(), "reinstall the package (pip install -e .) to get the console script"
    run = subprocess.run(
        [str(script), "--nprocs", "2", "--devices-per-proc", "2", str(CHILD)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(re.findall(r"^\[(\d)\] READY", run.stdout, re.M)) == ["0", "1"]
    bad = subprocess.run([str(script)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage: jaxdist-launch" in bad.stderr, bad.stderr


# -- running jobs --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_success_environment_and_arguments(launcher: type[Launcher]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    assert env["JAX_NUM_CPU_DEVICES"] == "8"  # from the root conftest: must be replaced
    job = launcher(
        "--nprocs", "2", "--devices-per-proc", "3", CHILD, "--sleep", "0", "--", "-x", env=env
    )
    rc, _, err = job.finish()
    assert rc == 0, err
    assert err == ""
    reports = job.reports(2)
    address = reports[0]["env"]["JAXDIST_COORDINATOR_ADDRESS"]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
    for rank, report in enumerate(reports):
        assert report["argv"] == ["--sleep", "0", "--", "-x"]
        assert report["pgid"] == report["pid"]  # its own process group
        assert report["env"] == {
            "JAXDIST_COORDINATOR_ADDRESS": address,
            "JAXDIST_NUM_PROCESSES": "2",
            "JAXDIST_PROCESS_ID": str(rank),
            "JAXDIST_LOCAL_DEVICE_COUNT": "3",
            "JAXDIST_RESTART_COUNT": "0",
            "JAX_NUM_CPU_DEVICES": "3",
            "JAX_PLATFORMS": "cpu",
            "CUDA_VISIBLE_DEVICES": None,
            "PYTHONUNBUFFERED": "1",
        }


@pytest.mark.timeout(60)
def test_module_mode_and_gpu_environment(launcher: type[Launcher]) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,2,1,0", "JAX_PLATFORMS": "cuda"}
    job = launcher(
        "--nprocs",
        "2",
        "--gpus-per-proc",
        "2",
        "-m",
        "launch_child",
        "--sleep",
        "0",
        env=env,
        cwd=SCRIPTS,
    )
    rc, _, err = job.finish()
    assert rc == 0, err
    reports = job.reports(2)
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in reports] == ["3,2", "1,0"]
    assert all(r["env"]["JAX_PLATFORMS"] == "cuda" for r in reports)
    assert all(r["env"]["JAXDIST_LOCAL_DEVICE_COUNT"] == "2" for r in reports)
    assert all(r["argv"] == ["--sleep", "0"] for r in reports)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefix", [True, False])
def test_output_is_copied_line_by_line(launcher: type[Launcher], prefix: bool) -> None:
    # Lines longer than PIPE_BUF reach the launcher in pieces, from both processes at once.
    lines, width = 300, 5000
    flags = [] if prefix else ["--no-prefix"]
    job = launcher("--nprocs", "2", *flags, CHILD, "--lines", lines, "--width", width)
    rc, out, err = job.finish()
    assert rc == 0, err[-2000:]
    tag = r"\[(\d)\] " if prefix else r"()"
    seen: dict[str, list[int]] = {"0": [], "1": []}
    for line in out.splitlines():
        if "READY" in line:
            continue
        if m := re.fullmatch(tag + r"partial line of (\d)", line):
            assert not prefix or m[1] == m[2]
            continue
        m = re.fullmatch(tag + r"(\d) (\d+) (x+)", line)
        assert m, f"a mixed or cut line: {line[:120]!r}"
        assert not prefix or m[1] == m[2]
        assert len(m[4]) == width
        seen[m[2]].append(int(m[3]))
    assert seen == {"0": list(range(lines)), "1": list(range(lines))}
    assert sorted(re.findall(tag + r"partial line of (\d)\n", out)) == (
        [("0", "0"), ("1", "1")] if prefix else [("", "0"), ("", "1")]
    )
    expected_err = {f"[{r}] stderr of {r}" if prefix else f"stderr of {r}" for r in "01"}
    assert set(err.splitlines()) == expected_err


def test_output_cuts_lines_longer_than_64_kib() -> None:
    out, err = io.StringIO(), io.StringIO()  # text streams without a byte buffer
    output = Output(out, err)
    read, write = os.pipe()
    output.add(os.fdopen(read, "rb"), out, b"[3] ")
    data = b"a" * 70_000 + b"\n\nb\xff"

    def writer() -> None:
        with os.fdopen(write, "wb") as f:
            f.write(data)

    thread = threading.Thread(target=writer)
    thread.start()
    output.drain(timeout=10)
    thread.join()
    assert out.getvalue() == (
        f"[3] {'a' * 65536}\n[3] {'a' * (70_000 - 65536)}\n[3] \n[3] b\N{REPLACEMENT CHARACTER}\n"
    )
    assert err.getvalue() == ""


_GLOO = (
    b"[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
)


@pytest.mark.parametrize("shown", [False, True])
def test_gloo_connection_lines_are_left_out_unless_asked_for(shown: bool) -> None:
    # Before: eight such lines per start, some cutting another line in two.
    out, err = io.StringIO(), io.StringIO()
    output = Output(out, err, gloo=shown)
    read, write = os.pipe()
    output.add(os.fdopen(read, "rb"), err, b"[3] ")
    pieces = [b"starting\n", _GLOO, b"loss 0.5", _GLOO[:20], _GLOO[20:], b"23\n", b"done\n"]

    def writer() -> None:
        with os.fdopen(write, "wb", buffering=0) as f:
            for piece in pieces:
                f.write(piece)
                time.sleep(0.02)  # separate reads, so a Gloo line arrives in two

    thread = threading.Thread(target=writer)
    thread.start()
    output.drain(timeout=10)
    thread.join()
    if shown:
        gloo = _GLOO.decode()
        assert err.getvalue() == f"[3] starting\n[3] {gloo}[3] loss 0.5{gloo}[3] 23\n[3] done\n"
    else:  # cut out, and the line it split is whole again
        assert err.getvalue() == "[3] starting\n[3] loss 0.523\n[3] done\n"
    assert out.getvalue() == ""


def test_gloo_lines_written_in_pieces_by_several_threads_are_left_out() -> None:
    out, err = io.StringIO(), io.StringIO()
    output = Output(out, err)
    read, write = os.pipe()
    output.add(os.fdopen(read, "rb"), err, b"[1] ")
    data = (  # as seen from a 4-device process: its threads' pieces, mixed
        b"START 1\n Expected number of connected peer ranks is : 7\n[Gloo] Rank  Expected number "
        b"of connected peer ranks is : 7\n6 is connected to 7 peer ranks. Expected number of "
        b"connected peer ranks is : 7\n\nR 64.0\n"
    )
    with os.fdopen(write, "wb") as f:
        f.write(data)
    output.drain(timeout=10)
    assert err.getvalue() == "[1] START 1\n[1] \n[1] R 64.0\n"  # the program's empty line stays


def test_a_gloo_piece_that_starts_a_line_of_the_program_is_left_out() -> None:
    # Seen in CI: a thread's "[Gloo] Rank " flushed before the program's line, the rest of
    # its Gloo line in a later read. The program's line must keep its start.
    out, err = io.StringIO(), io.StringIO()
    output = Output(out, err)
    read, write = os.pipe()
    output.add(os.fdopen(read, "rb"), out, b"[1] ")
    pieces = [b"[Gloo] Rank ", b"START 0 4242 0\n", _GLOO[len(b"[Gloo] Rank ") :], b"STEP 1\n"]

    def writer() -> None:
        with os.fdopen(write, "wb", buffering=0) as f:
            for piece in pieces:
                f.write(piece)
                time.sleep(0.02)  # separate reads

    thread = threading.Thread(target=writer)
    thread.start()
    output.drain(timeout=10)
    thread.join()
    assert out.getvalue() == "[1] START 0 4242 0\n[1] STEP 1\n"
    assert err.getvalue() == ""


# A connection line as one device thread writes it: eight writes.
_GLOO_WRITES = (
    b"[Gloo] Rank ", b"3", b" is connected to ", b"7", b" peer ranks. ",
    b"Expected number of connected peer ranks is : ", b"7", b"\n",
)  # fmt: skip


def _copied(data: bytes) -> str:
    out = io.StringIO()
    output = Output(out, io.StringIO())
    read, write = os.pipe()
    output.add(os.fdopen(read, "rb"), out, b"[1] ")
    with os.fdopen(write, "wb") as f:
        f.write(data)
    output.drain(timeout=10)
    return out.getvalue()


@pytest.mark.parametrize("seen", [False, True], ids=["first_gloo_line", "after_a_whole_one"])
@pytest.mark.parametrize("line", [b"START 0 4242 0", b"STEP 12", b"loss 0.5", b"x", b"DONE 120"])
def test_a_program_line_among_the_pieces_of_a_gloo_line_keeps_every_byte(
    line: bytes, seen: bool
) -> None:
    """The program writes its line and its newline (two writes, as unbuffered Python does)
    anywhere among the eight writes of a Gloo thread: the copy is the program's line, whole.
    Before, ``[Gloo] Rank `` + ``3`` + the line gave ``3START 0 4242 0``, and a rank written
    after the program's digits stayed there (``DONE 1203``)."""
    whole = _GLOO.replace(b"Rank 3", b"Rank 1")  # another thread's, written whole
    cases = 0
    for text_at in range(len(_GLOO_WRITES) + 1):
        for newline_at in range(text_at, len(_GLOO_WRITES) + 1):
            writes = [*_GLOO_WRITES[:text_at], line, *_GLOO_WRITES[text_at:newline_at], b"\n"]
            writes += _GLOO_WRITES[newline_at:]
            data = b"before 1\n" + (whole if seen else b"") + b"".join(writes) + b"after 2\n"
            got = _copied(data)
            assert got == f"[1] before 1\n[1] {line.decode()}\n[1] after 2\n", data
            cases += 1
    assert cases == 45


def test_a_line_kept_back_for_its_last_digits_is_copied_when_nothing_follows() -> None:
    # "[Gloo] Rank " + the program's "STEP 5" + "3"(?) + newline: whose the 3 is shows only in
    # the next line (" is connected to" at its start: Gloo's). Nothing comes: copied as read.
    out = io.StringIO()
    output = Output(out, io.StringIO())
    read, write = os.pipe()
    output.add(os.fdopen(read, "rb"), out, b"[1] ")
    with os.fdopen(write, "wb", buffering=0) as f:
        f.write(b"[Gloo] Rank STEP 53\n")
        output.pump(1.0)
        assert out.getvalue() == ""  # kept back
        output.pump(0.05)
        assert out.getvalue() == "[1] STEP 53\n"  # no next line within a poll
        f.write(b"[Gloo] Rank STEP 6\n3 is connected to 7 peer ranks.\n")
        output.pump(1.0)
        assert out.getvalue() == "[1] STEP 53\n[1] STEP 6\n"
    output.drain(timeout=10)


def test_the_launcher_takes_show_gloo() -> None:
    assert launch_module._parse(["--show-gloo", str(CHILD)], "launch").show_gloo
    assert not launch_module._parse([str(CHILD)], "launch").show_gloo


@pytest.mark.timeout(60)
def test_launch_api_in_process(capfd: pytest.CaptureFixture[str]) -> None:
    handler = signal.getsignal(signal.SIGINT)
    out, err = io.StringIO(), io.StringIO()
    args = ("--exit", "3", "--exit-after", "0", "--sleep", "30")
    config = LaunchConfig(str(CHILD), args=args, nprocs=2, kill_timeout=2)
    assert launch_module.launch(config, stdout=out, stderr=err) == 3
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    assert sorted(re.findall(r"^\[(\d)\] READY ", out.getvalue(), re.M)) == ["0", "1"]
    assert err.getvalue() == (
        "jaxdist.launch: process 1 exited with code 3 (first failure); "
        "stopped the other 1 process.\n"
    )
    assert capfd.readouterr() == ("", "")  # nothing went to the real streams


@pytest.mark.timeout(60)
def test_first_failure_stops_the_others(launcher: type[Launcher]) -> None:
    start = time.monotonic()
    job = launcher(
        "--nprocs", "3", CHILD, "--exit", "3", "--exit-rank", "1", "--sleep", "60", "--spawn"
    )
    rc, _, err = job.finish()
    assert rc == 3
    assert time.monotonic() - start < 20  # not the 60 s the others would sleep
    assert err.strip().splitlines()[-1] == (
        "jaxdist.launch: process 1 exited with code 3 (first failure); "
        "stopped the other 2 processes."
    )
    assert len(job.job_pids()) == 6
    assert _wait_dead(job.job_pids(), 5) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signals", ["default", "report"])
def test_first_failure_sends_sigterm_well_before_the_kill_timeout(
    launcher: type[Launcher], signals: str
) -> None:
    # The others are asked to stop with SIGTERM at the first failure: they end within
    # seconds, far from the 40 s after which the launcher would SIGKILL them.
    kill_timeout = 40
    job = launcher(
        "--nprocs", "3", "--kill-timeout", kill_timeout, CHILD, "--exit", "3",
        "--exit-rank", "1", "--exit-after", "0.5", "--sleep", "60", "--signals", signals,
        "--spawn",
    )  # fmt: skip
    job.reports(3)  # every process runs; rank 1 fails 0.5 s after the barrier
    start = time.monotonic()
    rc, out, err = job.finish(timeout=kill_timeout + 30)
    elapsed = time.monotonic() - start
    assert rc == 3
    assert elapsed < kill_timeout / 4, f"the job took {elapsed:.1f} s to stop: {err}"
    assert "sent SIGKILL" not in err
    if signals == "report":  # the signal itself, as each process saw it
        assert sorted(re.findall(r"^\[(\d)\] got SIGTERM$", out, re.M)) == ["0", "2"]
    assert "(first failure); stopped the other 2 processes." in err
    assert _wait_dead(job.job_pids(), 5) == []


@pytest.mark.timeout(90)
def test_killed_process_is_named_and_nothing_is_left(launcher: type[Launcher]) -> None:
    job = launcher("--nprocs", "2", CHILD, "--sleep", "60", "--spawn")
    reports = job.reports(2)
    os.kill(reports[1]["pid"], signal.SIGKILL)
    start = time.monotonic()
    rc, _, err = job.finish(timeout=60)
    assert time.monotonic() - start < 60
    assert rc == 128 + signal.SIGKILL
    assert (
        "jaxdist.launch: process 1 was killed by signal SIGKILL (first failure); "
        "stopped the other 1 process.\n"
    ) in err
    pids = job.job_pids()
    assert len(pids) == 4  # 2 processes and the helper each started in its group
    assert _wait_dead(pids, 5) == []


@pytest.mark.timeout(60)
def test_sigkill_after_kill_timeout(launcher: type[Launcher]) -> None:
    start = time.monotonic()
    job = launcher(
        "--nprocs",
        "2",
        "--kill-timeout",
        "1",
        CHILD,
        "--signals",
        "ignore",
        "--exit",
        "5",
        "--sleep",
        "60",
    )
    rc, _, err = job.finish()
    assert rc == 5
    assert 1 <= time.monotonic() - start < 20
    assert (
        "jaxdist.launch: 1 process (0) still running 1 s after being asked to stop; sent SIGKILL.\n"
        in err
    )
    assert (
        "jaxdist.launch: process 1 exited with code 5 (first failure); "
        "stopped the other 1 process.\n"
    ) in err
    assert _wait_dead(job.job_pids(), 5) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_are_forwarded(launcher: type[Launcher], sig: signal.Signals) -> None:
    job = launcher("--nprocs", "2", CHILD, "--signals", "report", "--sleep", "60")
    job.reports(2)
    job.proc.send_signal(sig)
    rc, out, err = job.finish()
    assert rc == 128 + sig
    assert sorted(re.findall(rf"^\[(\d)\] got {sig.name}$", out, re.M)) == ["0", "1"]
    assert f"jaxdist.launch: received {sig.name}; forwarded it to 2 processes" in err
    assert err.strip().splitlines()[-1] == f"jaxdist.launch: stopped after {sig.name}."


@pytest.mark.timeout(60)
def test_second_interrupt_kills(launcher: type[Launcher]) -> None:
    job = launcher(
        "--nprocs",
        "2",
        "--kill-timeout",
        "60",
        CHILD,
        "--signals",
        "ignore",
        "--sleep",
        "60",
        "--spawn",
    )
    job.reports(2)
    start = time.monotonic()
    job.proc.send_signal(signal.SIGINT)
    job.wait_for(r"received SIGINT; forwarded it to 2 processes")
    job.proc.send_signal(signal.SIGINT)
    rc, _, err = job.finish()
    assert rc == 130
    assert time.monotonic() - start < 20  # not the 60 s kill timeout
    assert "jaxdist.launch: received SIGINT again; killed 2 processes.\n" in err
    assert _wait_dead(job.job_pids(), 5) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_max_restarts(launcher: type[Launcher], max_restarts: int) -> None:
    job = launcher(
        "--nprocs",
        "2",
        "--max-restarts",
        max_restarts,
        CHILD,
        "--fail-first-start",
        "--sleep",
        "0.2",
    )
    rc, _, err = job.finish()
    failure = (
        "jaxdist.launch: process 1 exited with code 3 (first failure); "
        "stopped the other 1 process.\n"
    )
    assert err.count(failure) == 1
    if max_restarts == 0:
        assert rc == 3
        assert "restarting" not in err
        return
    assert rc == 0, err
    reports = job.reports(4)
    assert [(r["env"]["JAXDIST_RESTART_COUNT"], r["rank"]) for r in reports] == [
        ("0", 0),
        ("0", 1),
        ("1", 0),
        ("1", 1),
    ]
    first, second = reports[0]["env"], reports[2]["env"]
    assert first["JAXDIST_COORDINATOR_ADDRESS"] != second["JAXDIST_COORDINATOR_ADDRESS"]
    assert (
        f"jaxdist.launch: restarting all 2 processes (restart 1 of 1, coordinator "
        f"{second['JAXDIST_COORDINATOR_ADDRESS']}).\n"
    ) in err
    assert _wait_dead(job.job_pids(), 5) == []


@pytest.mark.timeout(60)
def test_restarts_exhausted(launcher: type[Launcher]) -> None:
    job = launcher(
        "--nprocs",
        "2",
        "--max-restarts",
        "2",
        CHILD,
        "--exit",
        "4",
        "--exit-after",
        "0",
        "--sleep",
        "30",
    )
    rc, _, err = job.finish()
    assert rc == 4
    assert err.count("(first failure)") == 3
    assert (
        err.strip().splitlines()[-1]
        == "jaxdist.launch: no restart left (--max-restarts 2); exit code 4."
    )
    assert len(job.reports(6)) == 6


@pytest.mark.timeout(60)
def test_preemptions_restart_without_counting(launcher: type[Launcher]) -> None:
    # Process 1 exits 42 ("preempted, restart me") in starts 0, 1 and 2; --max-restarts 1 would
    # allow one failure, but preemptions are not failures.
    job = launcher(
        "--nprocs", "2", "--max-restarts", "1", CHILD,
        "--preempted-starts", "3", "--exit-after", "0", "--sleep", "0.5",
    )  # fmt: skip
    rc, _, err = job.finish()
    assert rc == 0, err
    assert (
        err.count(
            "jaxdist.launch: process 1 exited with code 42 (first failure: preempted); "
            "stopped the other 1 process.\n"
        )
        == 3
    )
    for k in (1, 2, 3):
        assert re.search(
            rf"jaxdist.launch: restarting all 2 processes \(after preemption {k}, not counted "
            r"against --max-restarts 1, coordinator 127\.0\.0\.1:\d+\)\.\n",
            err,
        ), err
    restarts = [r["env"]["JAXDIST_RESTART_COUNT"] for r in job.reports(8)]
    assert restarts == ["0", "0", "1", "1", "2", "2", "3", "3"]


@pytest.mark.timeout(60)
def test_counted_preemptions_and_no_restarts(launcher: type[Launcher]) -> None:
    job = launcher(
        "--nprocs", "2", "--max-restarts", "1", "--count-preemptions", CHILD,
        "--preempted-starts", "5", "--exit-after", "0", "--sleep", "30",
    )  # fmt: skip
    rc, _, err = job.finish()
    assert rc == 42
    assert "restarting all 2 processes (restart 1 of 1, coordinator" in err
    assert err.strip().splitlines()[-1] == (
        "jaxdist.launch: no restart left (--max-restarts 1); exit code 42."
    )
    # Without --max-restarts the code goes out, for an outer scheduler, with a hint.
    job = launcher("--nprocs", "2", CHILD, "--preempted-starts", "1", "--exit-after", "0")
    rc, _, err = job.finish()
    assert rc == 42 and "restarting" not in err
    assert err.strip().splitlines()[-1] == (
        "jaxdist.launch: exit code 42: the process saved a checkpoint and asks to be restarted; "
        "--max-restarts K restarts such a job (without counting it)."
    )


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_of_a_preempted_job_exits_42(launcher: type[Launcher]) -> None:
    job = launcher("--nprocs", "2", "--max-restarts", "3", CHILD, "--signals", "preempted",
                   "--sleep", "30")  # fmt: skip
    job.reports(2)
    job.proc.send_signal(signal.SIGTERM)
    rc, out, err = job.finish()
    assert rc == 42, err
    assert out.count("saved after SIGTERM") == 2 and "restarting" not in err
    assert err.strip().splitlines()[-1] == (
        "jaxdist.launch: stopped after SIGTERM; every process exited with code 42 (preempted)."
    )


def test_preempted_exit_code_matches_the_handler() -> None:
    from jaxdist.experimental.preemption import handler

    assert launch_module.PREEMPTED_EXIT_CODE == handler.RESTART_EXIT_CODE == 42


@pytest.mark.timeout(60)
def test_helpers_left_after_success_are_stopped(launcher: type[Launcher]) -> None:
    job = launcher("--nprocs", "2", CHILD, "--spawn")
    rc, _, err = job.finish()
    assert rc == 0, err
    helpers = [r["helper"] for r in job.reports(2)]
    assert _wait_dead(helpers, 5) == []


@pytest.mark.timeout(60)
@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux only")
def test_processes_die_with_the_launcher(launcher: type[Launcher]) -> None:
    job = launcher("--nprocs", "2", CHILD, "--signals", "ignore", "--sleep", "60")
    pids = [r["pid"] for r in job.reports(2)]
    job.proc.kill()
    job.proc.wait()
    assert _wait_dead(pids, 10) == []


@pytest.mark.timeout(120)
def test_jax_distributed_psum_across_two_processes(launcher: type[Launcher]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    job = launcher("--nprocs", "2", "--devices-per-proc", "2", "--kill-timeout", "2", PSUM, env=env)
    rc, out, err = job.finish(timeout=110)
    assert rc == 0, err[-4000:]
    # The reference: every device's value (process p's local device j holds 10 p + j + 1), summed.
    expected = float(np.concatenate([np.arange(2) + 10 * p + 1 for p in range(2)]).sum())
    found = sorted(re.findall(r"^\[(\d)\] PSUM (\S+) (\d+)$", out, re.M))
    assert [(rank, devices) for rank, _, devices in found] == [("0", "4"), ("1", "4")]
    for _, value, _ in found:
        assert abs(float(value) - expected) <= 1e-6 * expected


# -- MultiWorkerMirroredStrategy jobs ------------------------------------------------------


def _training_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_", "XLA_"))}
    env["JAXDIST_HEARTBEAT_TIMEOUT"] = "10"  # the fallback if the launcher could not stop them
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_mwms_job_with_a_process_killed_mid_training(launcher: type[Launcher]) -> None:
    job = launcher(
        "--nprocs", "2", "--devices-per-proc", "4", "--kill-timeout", "5",
        TRAINING, "1000000", "--spawn-helper",
        env=_training_env(), module=True,
    )  # fmt: skip
    started = job.wait_for(r"^\[\d\] STARTED \d+$", 2, timeout=100)
    job.wait_for(r"^\[\d\] HELPER \d+$", 2, timeout=10)
    job.wait_for(r"^\[\d\] STEP 20$", 2, timeout=60)  # training: collectives in flight
    victim = next(int(line.split()[-1]) for line in started if line.startswith("[1] "))
    pids = job.job_pids()
    assert len(pids) == 4 and all(map(_alive, pids))  # 2 processes and the helper each started
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    rc, _, err = job.finish(timeout=60)
    elapsed = time.monotonic() - killed_at  # about --kill-timeout: JAX takes SIGTERM as a notice
    assert elapsed < 60, elapsed
    assert rc == 128 + signal.SIGKILL, err[-3000:]
    assert (
        "jaxdist.launch: process 1 was killed by signal SIGKILL (first failure); "
        "stopped the other 1 process.\n"
    ) in err
    assert _wait_dead(pids, 5) == []
    assert _session_members(pids) == []  # nothing they started is left either


def _expected_w(steps: int) -> float:
    """The weight launched_training.py trains, computed in NumPy (float32, like the job)."""
    x = np.arange(1, 9, dtype=np.float32)
    w = np.float32(0.0)
    for _ in range(steps):
        w = np.float32(w - np.float32(0.01) * np.mean((w * x - 1.0) * x, dtype=np.float32))
    return float(w)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_mwms_job_that_fails_once_completes_after_a_restart(launcher: type[Launcher]) -> None:
    steps = 40
    job = launcher(
        "--nprocs", "2", "--devices-per-proc", "4", "--kill-timeout", "5", "--max-restarts", "1",
        TRAINING, str(steps), "--fail-first-start",
        env=_training_env(), module=True,
    )  # fmt: skip
    rc, out, err = job.finish(timeout=140)
    assert rc == 0, err[-3000:]
    # The first attempt trained (step 0 is a collective), then process 1 raised at step 5.
    assert len(re.findall(r"^\[\d\] STEP 0$", out, re.M)) == 4, out[-3000:]
    assert "[1] RuntimeError: failing on purpose" in err
    assert "jaxdist.launch: process 1 exited with code 1 (first failure)" in err
    assert re.search(r"jaxdist.launch: restarting all 2 processes \(restart 1 of 1, ", err)
    done = re.findall(r"^\[(\d)\] DONE (\d) (\S+)$", out, re.M)
    assert sorted(rank for rank, _, _ in done) == ["0", "1"], out[-3000:]
    for _, restart, w in done:
        assert restart == "1"
        np.testing.assert_allclose(float(w), _expected_w(steps), rtol=1e-5)
    assert _wait_dead(job.job_pids(), 5) == []


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_mwms_job_with_a_failing_sys_exit_ends_at_once(launcher: type[Launcher]) -> None:
    job = launcher(
        "--nprocs", "2", "--devices-per-proc", "4", "--kill-timeout", "5",
        TRAINING, "1000000", "--exit-first-start",
        env=_training_env(), module=True,
    )  # fmt: skip
    exiting = job.wait_for(r"^\[1\] EXITING \S+$", timeout=120)[0]
    rc, out, err = job.finish(timeout=60)
    elapsed = time.time() - float(exiting.split()[-1])
    # Process 1 exits with 3 at once (not in jax.distributed's shutdown barrier, where it
    # used to wait 300 s for process 0 until the coordinator aborted that one, code 134);
    # process 0, blocked in a collective, is stopped by the launcher.
    print(f"the job ended {elapsed:.1f} s after sys.exit(3)")
    assert elapsed < 30, (elapsed, err[-3000:])
    assert rc == 3, err[-3000:]
    assert (
        "jaxdist.launch: process 1 exited with code 3 (first failure); "
        "stopped the other 1 process.\n"
    ) in err
    assert "DONE" not in out
    assert _wait_dead(job.job_pids(), 5) == []
