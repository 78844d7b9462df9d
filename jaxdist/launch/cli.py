"""`python -m jaxdist.launch`: start a multi-process jaxdist job on this machine (like torchrun).

Usage::

    python -m jaxdist.launch [options] script.py [script arguments ...]
    python -m jaxdist.launch [options] -m package.module [module arguments ...]
    jaxdist-launch [options] script.py [script arguments ...]

``python -m jaxdist.launch --nprocs 2 --devices-per-proc 4 train.py --epochs 1``
starts two processes that each run ``python train.py --epochs 1`` with 4
simulated CPU devices, and a coordinator address on a free loopback port; in
``train.py``, ``jaxdist.MultiWorkerMirroredStrategy()`` (or
``jaxdist.initialize()``) finds them and starts `jax.distributed`. Every
argument after the script (or after ``-m MODULE``) goes to the program
unchanged, ``--`` included.

Options:

===========================  =====================================================
``--nprocs N``               processes to start (default 1)
``--devices-per-proc K``     CPU: simulated devices per process (default 1)
``--gpus-per-proc K``        GPU: give process ``i`` the GPUs ``i*K .. i*K+K-1``
``--max-restarts K``         restart the whole group up to K times (default 0)
``--count-preemptions``      count restarts after preemptions against K too
``--kill-timeout SECONDS``   grace between SIGTERM and SIGKILL (default 5)
``--collective-timeout T``   end the job when a MultiWorkerMirroredStrategy step
                             does not complete in T s (default: the strategy's,
                             1200 s; 0: no limit)
``--watchdog-log-interval``  S: while a step waits, each waiting process says
                             so every S s (default: the strategy's, 60 s; 0: never)
``--coordinator-port PORT``  pin the coordinator port (alias ``--master-port``)
``--no-prefix``              do not prefix output lines with ``[i] ``
``--show-gloo``              show the CPU collectives' (Gloo's) connection lines,
                             left out by default
``-m``                       the program is a module name, as in ``python -m``
===========================  =====================================================

Environment of process ``i`` (everything else is inherited from the launcher):

=================================  ==============================================
``JAXDIST_COORDINATOR_ADDRESS``    ``127.0.0.1:PORT``, a free port picked at each
                                   (re)start unless ``--coordinator-port``
``JAXDIST_NUM_PROCESSES``          ``N``
``JAXDIST_PROCESS_ID``             ``i``, from 0 to ``N - 1``
``JAXDIST_LOCAL_DEVICE_COUNT``     devices per process ``K``
``JAXDIST_RESTART_COUNT``          restarts of the group so far (0 at first)
``JAX_NUM_CPU_DEVICES``            CPU only: ``K``, replacing an inherited value
``JAX_PLATFORMS``                  CPU only: ``cpu``, unless already set
``CUDA_VISIBLE_DEVICES``           ``--gpus-per-proc`` only: this process's slice
                                   of the launcher's own list (or of ``0, 1, ...``)
``PYTHONUNBUFFERED``               ``1`` unless already set, so lines show at once
``JAXDIST_COLLECTIVE_TIMEOUT``     ``--collective-timeout`` only: ``T``, the
                                   ``timeout_seconds`` of strategies whose
                                   ``CommunicationOptions`` give none
``JAXDIST_WATCHDOG_LOG_INTERVAL``  ``--watchdog-log-interval`` only: ``S``
=================================  ==============================================

Output: each line a process writes to stdout (stderr) is copied whole to the
launcher's stdout (stderr), prefixed with ``[i] ``; lines of different
processes never mix within a line. Processes read no standard input.

Failures: the first process to exit with a non-zero code or to die by a
signal stops the job: the launcher sends SIGTERM to the others, SIGKILL to
those still running ``--kill-timeout`` seconds later, and says which process
failed first, with its own exit code, e.g. ``jaxdist.launch: process 1 exited
with code 3 (first failure); stopped the other 1 process.`` The launcher reads
the lines the strategies' watchdog prints (`MultiWorkerMirroredStrategy`: every
60 s that a step waits, and when its timeout ends a process) and adds what they
said: which processes were still waiting, in which step, for whom (``stopped
the other 1 process (0 was waiting in step 20 for process 1)``; lines older
than two intervals are over and left out), or that the first failure was a
watchdog ending its process (``process 0 exited with code 1 (first failure:
its watchdog ended it: step 20 did not complete, process 1 did not arrive)``).
With ``--max-restarts K`` the whole
group is then started again, with a new coordinator port and
``JAXDIST_RESTART_COUNT`` one higher, at most K times; scripts resume from
their checkpoints. A process that exits with code 0 while others run is
simply done.

Preemptions: exit code 42 (`PREEMPTED_EXIT_CODE`) means "preempted: I saved a
checkpoint, restart me", as in TF; it is what
`jaxdist.experimental.PreemptionCheckpointHandler` exits with after its save.
When the first failure of a start is that code, ``--max-restarts K`` (K >= 1)
restarts the group without counting it against K, as often as it happens
(``--count-preemptions`` counts it like any failure); the message reads
``process 1 exited with code 42 (first failure: preempted); process 0 got the
termination notice; ...`` (the process whose handler wrote that it got the
notice, before the launcher signalled any; the first to exit may be another)
and then
``restarting all 2 processes (after preemption 1, not counted against
--max-restarts 1, ...)``. ``JAXDIST_RESTART_COUNT`` counts every restart.
The handler restores the latest checkpoint when it is created, so the
restarted job resumes where it stopped. Without ``--max-restarts`` the
launcher exits with code 42, for an outer scheduler to restart, as it does
when it was sent SIGTERM itself (it forwards it; restarts stop) and every
process saved and exited with 42: leave ``--kill-timeout`` long enough for
that save.

In a `jax.distributed` job (``MultiWorkerMirroredStrategy``) SIGTERM does
not stop a process: JAX's preemption service takes it as a preemption notice
(`jax.experimental.multihost_utils.reached_preemption_sync_point` reports it)
and training goes on (a `PreemptionCheckpointHandler` takes it instead: it
saves and exits with 42). Such a job therefore stops ``--kill-timeout``
seconds after the first failure, by SIGKILL: measured on localhost with 2
processes x 4 CPU devices, the launcher exited 5.4 s after one process was
killed, with the default of 5 s.

Exit code of the launcher:

* 0: every process exited with code 0;
* the first failure's exit code, or ``128 + S`` if it died by signal ``S``
  (137 for SIGKILL), once no restart is left;
* 2: bad arguments, or a script that does not exist (nothing was started);
* ``128 + S`` when the launcher itself got signal ``S`` (130 for Ctrl-C),
  except 42 when every process then exited with 42 (each saved a checkpoint);
* 1: a process could not be started at all.

Signals: SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to
every process (and restarts stop); a second one, or ``--kill-timeout``
seconds without the processes exiting, sends SIGKILL. Each process runs in
its own session and process group, and the launcher signals whole groups,
so helpers that a process started die with it; when every process has
exited, members of their groups still running get SIGTERM, then SIGKILL.
On Linux each process also gets SIGKILL if the launcher itself dies
abruptly (``PR_SET_PDEATHSIG``); helpers a process started are not covered
by that. POSIX only.

The free port is found by binding port 0 on 127.0.0.1 and closing the
socket; another program could take it before process 0 listens there, in
which case the job fails and ``--max-restarts`` retries with a new port.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from jaxdist.launch.config import (
    DEFAULT_KILL_TIMEOUT,
    ENV_COLLECTIVE_TIMEOUT,
    ENV_COORDINATOR_ADDRESS,
    ENV_LOCAL_DEVICE_COUNT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    ENV_WATCHDOG_LOG_INTERVAL,
    LOOPBACK,
    NOTICE,
    PREEMPTED_EXIT_CODE,
    LaunchConfig,
    child_environment,
    free_port,
    port_in_use,
    watchdog_report,
)
from jaxdist.launch.output import POLL_INTERVAL as POLL_INTERVAL
from jaxdist.launch.output import Output as Output
from jaxdist.launch.processes import (
    SignalTrap,
    describe,
    exit_code,
    live_groups,
    signal_groups,
    status,
    with_deathsig,
)

__all__ = [
    "DEFAULT_KILL_TIMEOUT",
    "ENV_COORDINATOR_ADDRESS",
    "ENV_LOCAL_DEVICE_COUNT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_RESTART_COUNT",
    "PREEMPTED_EXIT_CODE",
    "LaunchConfig",
    "child_environment",
    "free_port",
    "launch",
    "main",
]

_DRAIN_TIMEOUT = 2.0  # seconds to finish copying output after the processes exited
_LOG_INTERVAL = 60.0  # the strategies' default seconds between watchdog lines


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _ids(ids: Sequence[int]) -> str:
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(map(str, ids))


def _first_failure(codes: Sequence[int | None]) -> int | None:
    """Which of the processes that failed since the last look (return codes, ``None`` while
    running) to report as the first failure: one that exited with a code of its own before
    one killed by a signal (as the coordination service ends the others, with SIGABRT, when
    the process hosting it exits), then the lowest id; ``None`` when none failed."""
    failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
    return min(failed, key=lambda i: ((codes[i] or 0) < 0, i), default=None)


@dataclasses.dataclass(frozen=True)
class _Report:
    """The last watchdog line of a process: when it came, and what it said."""

    at: float  # time.monotonic()
    kind: str  # "waiting" (a periodic line) or "ended" (its watchdog ended it)
    step: int
    late: tuple[int, ...]  # the processes that had not reached the step


class _StartError(RuntimeError):
    """A process could not be started (the launcher exits with code 1)."""


@dataclasses.dataclass
class _Round:
    """How one start of the group ended."""

    failure: tuple[int, int] | None = None  # (process id, return code) of the first failure
    signal: int | None = None  # the first signal the launcher got
    preempted: bool = False  # every process exited with PREEMPTED_EXIT_CODE
    running: tuple[int, ...] = ()  # the processes still running at the first failure
    at: float = 0.0  # when the first failure was seen (time.monotonic())
    reports: dict[int, _Report] = dataclasses.field(default_factory=dict)  # by process
    noticed: tuple[int, ...] = ()  # the processes whose handler got a termination notice


class _Job:
    """Starts, watches and stops the group, restarting it after failures as configured."""

    def __init__(self, config: LaunchConfig, output: Output, trap: SignalTrap) -> None:
        self._config, self._output, self._trap = config, output, trap
        self._parent = os.getpid()
        self._reports: dict[int, _Report] = {}  # of the current start, by process
        self._noticed: list[int] = []  # processes whose handler got a notice, in order
        self._signalled = False
        interval = config.watchdog_log_interval
        if interval is None:
            try:
                interval = float(os.environ.get(ENV_WATCHDOG_LOG_INTERVAL, "") or _LOG_INTERVAL)
            except ValueError:
                interval = _LOG_INTERVAL
        # A "waiting" line is repeated every interval while the wait lasts: an older one is over.
        self._fresh = 2 * (interval or _LOG_INTERVAL) + 5

    def _note(self, rank: int, line: str) -> None:
        """Keeps what a watchdog line of process ``rank`` says (its stderr, as copied), and
        that its preemption handler got a termination notice."""
        if NOTICE.search(line) and rank not in self._noticed and not self._signalled:
            self._noticed.append(rank)
        report = watchdog_report(line)
        if report is not None:
            self._reports[rank] = _Report(time.monotonic(), *report)

    def _first_failure(self, result: _Round, preempted: bool) -> str:
        """The launcher's line about the first failure of a start: which process, how it
        ended, and, where the watchdogs' lines said so, what it and the others waited for."""
        assert result.failure is not None
        rank, returncode = result.failure
        first = "first failure: preempted" if preempted else "first failure"
        own = result.reports.get(rank)
        if own is not None and own.kind == "ended":
            first += f": its watchdog ended it: step {own.step} did not complete"
            if own.late:
                first += f", {_ids(own.late)} did not arrive"
        others = len(result.running)
        ended = f"process {rank} {describe(returncode)} ({first})"
        if preempted and result.noticed:  # the one that exited first need not be the one told
            ended += f"; {_ids(result.noticed)} got the termination notice"
        if not others:
            return f"{ended}; no other process was running."
        waiting = []
        for i in result.running:
            report = result.reports.get(i)
            if report is None or report.kind != "waiting" or not report.late:
                continue
            if report.at >= result.at - self._fresh:
                waiting.append(f"{i} was waiting in step {report.step} for {_ids(report.late)}")
        stopped = f"stopped the other {_processes(others)}"
        if waiting:
            stopped += " (" + "; ".join(waiting) + ")"
        return f"{ended}; {stopped}."

    def run(self) -> int:
        config, say = self._config, self._output.message
        restarts = failures = preemptions = 0  # all restarts; those counted; those not
        why = ""
        while True:
            port = config.coordinator_port or free_port()
            if restarts:
                group = _processes(config.nprocs)
                say(f"restarting all {group} ({why}, coordinator {LOOPBACK}:{port}).")
            result = self._run_round(
                [child_environment(config, i, port, restarts) for i in range(config.nprocs)]
            )
            if result.failure is None:
                if result.signal is None:
                    return 0
                name = signal.Signals(result.signal).name
                if result.preempted:  # they took the signal as a preemption notice
                    say(f"stopped after {name}; every process exited with code 42 (preempted).")
                    return PREEMPTED_EXIT_CODE
                say(f"stopped after {name}.")
                return 128 + result.signal
            returncode = result.failure[1]
            code = exit_code(returncode)
            preempted = returncode == PREEMPTED_EXIT_CODE
            say(self._first_failure(result, preempted))
            if result.signal is not None or self._trap.received:
                return code
            restarts += 1
            if preempted and config.max_restarts and not config.count_preemptions:
                preemptions += 1
                why = (
                    f"after preemption {preemptions}, not counted against --max-restarts "
                    f"{config.max_restarts}"
                )
                continue
            if failures >= config.max_restarts:
                if config.max_restarts:
                    say(
                        f"no restart left (--max-restarts {config.max_restarts}); exit code {code}."
                    )
                elif preempted:
                    say(
                        f"exit code {code}: the process saved a checkpoint and asks to be "
                        "restarted; --max-restarts K restarts such a job (without counting it)."
                    )
                return code
            failures += 1
            why = f"restart {failures} of {config.max_restarts}"

    def _start(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            with_deathsig(self._config.command(), self._parent),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own session and process group, led by its pid
        )

    def _run_round(self, envs: list[dict[str, str]]) -> _Round:
        config, output, say = self._config, self._output, self._output.message
        procs: list[subprocess.Popen[bytes]] = []
        self._reports, self._noticed = {}, []
        self._signalled = False  # the launcher signalled the processes (notices are its own)
        try:
            for i, env in enumerate(envs):
                proc = self._start(env)
                procs.append(proc)
                prefix = f"[{i}] ".encode() if config.prefix else b""
                assert proc.stdout is not None and proc.stderr is not None
                output.add(proc.stdout, output.stdout, prefix)
                output.add(proc.stderr, output.stderr, prefix, functools.partial(self._note, i))
        except OSError as exc:
            self._finish(procs)
            command = " ".join(config.command())
            raise _StartError(f"could not start process {len(procs)} ({command}): {exc}") from exc
        groups = [proc.pid for proc in procs]
        result = _Round()
        stop_at: float | None = None  # when the processes were asked to stop
        killed = False
        while True:
            output.pump(POLL_INTERVAL)
            codes = [status(proc) for proc in procs]
            running = [i for i, code in enumerate(codes) if code is None]
            while self._trap.pending:
                sig = self._trap.pending.pop(0)
                name = signal.Signals(sig).name
                if result.signal is None and stop_at is None:
                    result.signal, stop_at = sig, time.monotonic()
                    self._signalled = True
                    signal_groups(groups, sig)
                    n = _processes(len(running))
                    say(f"received {name}; forwarded it to {n} (send it again to kill them).")
                elif not killed:
                    again = "again" if result.signal else "while stopping them"
                    result.signal, killed = result.signal or sig, True
                    signal_groups(groups, signal.SIGKILL)
                    say(f"received {name} {again}; killed {_processes(len(running))}.")
            first = _first_failure(codes)
            if first is not None and stop_at is None:
                result.failure = (first, codes[first] or 0)
                stop_at = time.monotonic()
                result.running, result.at = tuple(running), stop_at
                self._signalled = True
                signal_groups(groups, signal.SIGTERM)
            if not running:
                result.preempted = all(code == PREEMPTED_EXIT_CODE for code in codes)
                break
            if (
                stop_at is not None
                and not killed
                and time.monotonic() >= stop_at + config.kill_timeout
            ):
                killed = True
                signal_groups(groups, signal.SIGKILL)
                ids = ", ".join(map(str, running))
                say(
                    f"{_processes(len(running))} ({ids}) still running {config.kill_timeout:g} s "
                    "after being asked to stop; sent SIGKILL."
                )
        self._finish(procs)
        result.reports = dict(self._reports)  # with the processes' last lines
        result.noticed = tuple(self._noticed)
        return result

    def _finish(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """Stops what is left in the processes' groups, reaps the processes, copies the rest.

        When every process has exited, helpers still running in their groups get
        SIGTERM, then SIGKILL after ``kill_timeout`` (where liveness cannot be read
        from /proc, after a short grace).
        """
        groups = [proc.pid for proc in procs]
        signal_groups([p.pid for p in procs if status(p) is None], signal.SIGKILL)
        live = live_groups(groups)
        if live is None or live:
            signal_groups(groups if live is None else live, signal.SIGTERM)
            grace = self._config.kill_timeout if live else min(self._config.kill_timeout, 0.2)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and (live is None or live):
                self._output.pump(POLL_INTERVAL)
                live = None if live is None else live_groups(live)
            signal_groups(groups if live is None else live, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        self._output.drain(_DRAIN_TIMEOUT)


def launch(
    config: LaunchConfig, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Runs the job ``config`` describes and returns the launcher's exit code.

    The Python form of ``python -m jaxdist.launch``; see the module docstring for
    the processes' environment, output, failures, restarts and exit codes.
    Forwarding SIGINT/SIGTERM/SIGHUP needs the main thread; called from another
    thread, the processes are still stopped on failure and never outlive the call.

    Args:
        config: what to start.
        stdout: where the processes' stdout goes (default: ``sys.stdout``).
        stderr: where their stderr and the launcher's messages go (default: ``sys.stderr``).

    Returns:
        0 if every process succeeded, else the exit code the module docstring describes.

    Raises:
        FileNotFoundError: the script does not exist (nothing was started).
        RuntimeError: a process could not be started.
    """
    if not config.module and not os.path.exists(config.program):
        raise FileNotFoundError(
            f"launch: the script {config.program!r} does not exist (relative to {os.getcwd()!r}); "
            "pass an existing script path, or module=True (-m) to run a module."
        )
    output = Output(stdout or sys.stdout, stderr or sys.stderr, gloo=config.show_gloo)
    trap = SignalTrap()
    with trap.installed():
        return _Job(config, output, trap).run()


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description="Start N local processes of a jaxdist program with the environment "
        "MultiWorkerMirroredStrategy reads; stop them all when one fails.",
        epilog="Exit code: 0 when every process succeeded; else the first failure's code "
        "(128+signal if it was killed); 2 for bad arguments; 128+signal if the launcher was "
        "interrupted.",
    )
    add = parser.add_argument
    add("--nprocs", type=int, default=1, metavar="N", help="processes to start (default 1)")
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument("--devices-per-proc", type=int, metavar="K",
                         help="simulated CPU devices per process (default 1)")  # fmt: skip
    devices.add_argument("--gpus-per-proc", type=int, metavar="K",
                         help="GPUs per process, as CUDA_VISIBLE_DEVICES slices")  # fmt: skip
    add(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="group restarts after failures (default 0)",
    )
    add("--count-preemptions", action="store_true",
        help="count restarts after a preemption (exit code 42) against --max-restarts")  # fmt: skip
    add("--kill-timeout", type=float, default=DEFAULT_KILL_TIMEOUT, metavar="SECONDS",
        help=f"grace between SIGTERM and SIGKILL (default {DEFAULT_KILL_TIMEOUT:g})")  # fmt: skip
    add("--collective-timeout", type=float, metavar="SECONDS",
        help="end the job when a MultiWorkerMirroredStrategy step does not complete in this "
        "time, for strategies whose CommunicationOptions give no timeout_seconds (sets "
        f"{ENV_COLLECTIVE_TIMEOUT}; default: the strategy's, 1200 s; 0: no limit)")  # fmt: skip
    add("--watchdog-log-interval", type=float, metavar="SECONDS",
        help="while a MultiWorkerMirroredStrategy step waits, each waiting process says so "
        f"every this many seconds (sets {ENV_WATCHDOG_LOG_INTERVAL}; default: the "
        "strategy's, 60 s; 0: never)")  # fmt: skip
    add("--coordinator-port", "--master-port", type=int, metavar="PORT",
        help="coordinator port on 127.0.0.1 (default: a free one)")  # fmt: skip
    add("--no-prefix", action="store_true", help="do not prefix output lines with '[i] '")
    add("--show-gloo", action="store_true",
        help="show the CPU collectives' '[Gloo] Rank N is connected...' lines")  # fmt: skip
    add("-m", "--module", action="store_true", help="run the program as a module (python -m)")
    add("program", help="the script to run (a module name with -m)")
    add("args", nargs=argparse.REMAINDER, help="the program's arguments")
    return parser


def _program_args(argv: list[str], program: str, parsed: list[str]) -> list[str]:
    """The arguments after ``program`` in ``argv``, exactly (argparse drops a ``--`` there)."""
    for k, token in enumerate(argv):
        rest = argv[k + 1 :]
        if token == program and (rest == parsed or (rest[:1] == ["--"] and rest[1:] == parsed)):
            return rest
    return parsed


def _parse(argv: list[str], prog: str) -> LaunchConfig:
    parser = _parser(prog)
    ns = parser.parse_args(argv)
    try:
        config = LaunchConfig(
            program=ns.program,
            args=tuple(_program_args(argv, ns.program, ns.args)),
            module=ns.module,
            nprocs=ns.nprocs,
            devices_per_proc=ns.devices_per_proc,
            gpus_per_proc=ns.gpus_per_proc,
            max_restarts=ns.max_restarts,
            count_preemptions=ns.count_preemptions,
            kill_timeout=ns.kill_timeout,
            coordinator_port=ns.coordinator_port,
            prefix=not ns.no_prefix,
            collective_timeout=ns.collective_timeout,
            watchdog_log_interval=ns.watchdog_log_interval,
            show_gloo=ns.show_gloo,
        )
        child_environment(config, 0, 1)  # e.g. too few GPUs listed: fail before starting
    except ValueError as exc:
        parser.error(str(exc))
    if not config.module and not os.path.exists(config.program):
        parser.error(
            f"the script {config.program!r} does not exist (relative to {os.getcwd()!r}); "
            "pass the path of a Python script, or -m MODULE to run a module"
        )
    if config.coordinator_port is not None and port_in_use(config.coordinator_port):
        parser.error(
            f"argument --coordinator-port: {LOOPBACK}:{config.coordinator_port} is in use; "
            "pick another port, or leave the option out to use a free one"
        )
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher's command line and returns its exit code (never raises ``SystemExit``).

    ``python -m jaxdist.launch`` and a ``jaxdist-launch = "jaxdist.launch:main"``
    console script both end with ``sys.exit(main())``.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code (see the module docstring): 2 after a usage message for bad arguments.

    Example:
        >>> from jaxdist.launch import main
        >>> main(["--nprocs", "0", "train.py"])  # the usage message goes to stderr
        2
    """
    args = list(sys.argv[1:] if argv is None else argv)
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = invoked if invoked.startswith("jaxdist-launch") else "python -m jaxdist.launch"
    try:
        config = _parse(args, prog)
    except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return launch(config)
    except _StartError as exc:
        Output(sys.stdout, sys.stderr).message(f"{exc}.")
        return 1
