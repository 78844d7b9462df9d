"""What the launcher starts: `LaunchConfig` (its command line as a value), each process's
environment (`child_environment`), and free ports (re-exported by `jaxdist.launch`).

Standard library only: the launcher starts without importing JAX.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from collections.abc import Mapping

__all__ = [
    "ENV_COLLECTIVE_TIMEOUT",
    "ENV_WATCHDOG_LOG_INTERVAL",
    "DEFAULT_KILL_TIMEOUT",
    "ENV_COORDINATOR_ADDRESS",
    "ENV_LOCAL_DEVICE_COUNT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_RESTART_COUNT",
    "LOOPBACK",
    "PREEMPTED_EXIT_CODE",
    "LaunchConfig",
    "child_environment",
    "free_port",
    "port_in_use",
    "watchdog_report",
]

# The launcher's contract with `jaxdist.cluster_resolver.LauncherClusterResolver` (same names;
# a test checks). Spelled out here so that this module and its two private helpers need only the
# standard library: ``import jaxdist`` loads its names lazily, so the launcher starts without
# importing JAX (tests/package/test_package.py checks).
ENV_COORDINATOR_ADDRESS = "JAXDIST_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "JAXDIST_LOCAL_DEVICE_COUNT"
ENV_RESTART_COUNT = "JAXDIST_RESTART_COUNT"
ENV_COLLECTIVE_TIMEOUT = "JAXDIST_COLLECTIVE_TIMEOUT"  # MultiWorkerMirroredStrategy reads it
ENV_WATCHDOG_LOG_INTERVAL = "JAXDIST_WATCHDOG_LOG_INTERVAL"  # and this

LOOPBACK = "127.0.0.1"
DEFAULT_KILL_TIMEOUT = 5.0

# The exit code of a process that saved a checkpoint after a preemption notice and asks to be
# restarted (`jaxdist.experimental.PreemptionCheckpointHandler`'s default, as in TF).
PREEMPTED_EXIT_CODE = 42


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What to start and how: the launcher's command line as a value.

    Args:
        program: the script path, or the module name when ``module`` is true.
        args: the program's arguments.
        module: run ``program`` as ``python -m program``.
        nprocs: the number of processes, at least 1.
        devices_per_proc: CPU only: simulated devices per process (``None``: 1).
        gpus_per_proc: GPUs per process; selects the GPU platform.
        max_restarts: how many times the group may be restarted after a failure.
        count_preemptions: count a restart after a preemption (a first failure with
            exit code `PREEMPTED_EXIT_CODE`) against ``max_restarts``; by default
            such restarts are not counted (with ``max_restarts >= 1``).
        kill_timeout: seconds between SIGTERM and SIGKILL when stopping processes.
        coordinator_port: a fixed coordinator port on 127.0.0.1 (``None``: a free one).
        prefix: prefix each output line with ``[i]`` and a space.
        collective_timeout: seconds after which a `MultiWorkerMirroredStrategy` step
            that does not complete ends the job, for strategies created without
            ``CommunicationOptions(timeout_seconds=...)`` (``None``: the strategy's
            own default, 20 min; ``0``: no timeout).
        watchdog_log_interval: seconds between the lines a process of a
            `MultiWorkerMirroredStrategy` job prints while a step waits (``None``:
            the strategy's default, 60 s; ``0``: no lines).
        show_gloo: copy the CPU collectives' (Gloo's) connection lines, one per
            process per start ("[Gloo] Rank N is connected to M peer ranks"),
            which are left out by default.

    Example:
        >>> from jaxdist.launch import LaunchConfig
        >>> LaunchConfig("train.py", args=("--epochs", "1"), nprocs=2).command()[1:]
        ['train.py', '--epochs', '1']
        >>> LaunchConfig("train.py", nprocs=0)
        Traceback (most recent call last):
        ...
        ValueError: LaunchConfig(nprocs=0) (--nprocs): must be at least 1 (the number of processes).
    """

    program: str
    args: tuple[str, ...] = ()
    module: bool = False
    nprocs: int = 1
    devices_per_proc: int | None = None
    gpus_per_proc: int | None = None
    max_restarts: int = 0
    count_preemptions: bool = False
    kill_timeout: float = DEFAULT_KILL_TIMEOUT
    coordinator_port: int | None = None
    prefix: bool = True
    collective_timeout: float | None = None
    watchdog_log_interval: float | None = None
    show_gloo: bool = False

    def __post_init__(self) -> None:
        port, inf = self.coordinator_port, float("inf")
        for name, value, low, high, why in [
            ("nprocs", self.nprocs, 1, inf, "must be at least 1 (the number of processes)"),
            ("max_restarts", self.max_restarts, 0, inf, "must be >= 0 (0: never restart)"),
            ("kill_timeout", self.kill_timeout, 0, inf, "must be >= 0 (0: SIGKILL at once)"),
            ("devices_per_proc", self.devices_per_proc, 1, inf, "must be >= 1, or None for 1"),
            ("gpus_per_proc", self.gpus_per_proc, 1, inf, "must be >= 1, or None for CPU"),
            ("coordinator_port", port, 1, 65535, "must be in 1..65535, or None for a free one"),
            ("collective_timeout", self.collective_timeout, 0, inf, "must be >= 0 (0: none)"),
            ("watchdog_log_interval", self.watchdog_log_interval, 0, inf, "must be >= 0"),
        ]:
            if value is not None and not low <= value <= high:
                option = "--" + name.replace("_", "-")
                raise ValueError(f"LaunchConfig({name}={value!r}) ({option}): {why}.")
        if self.devices_per_proc is not None and self.gpus_per_proc is not None:
            raise ValueError(
                f"LaunchConfig(devices_per_proc={self.devices_per_proc}, gpus_per_proc="
                f"{self.gpus_per_proc}): devices_per_proc is for simulated CPU devices and "
                "gpus_per_proc for GPUs; pass one of them."
            )
        if self.module and not all(part.isidentifier() for part in self.program.split(".")):
            raise ValueError(
                f"LaunchConfig(program={self.program!r}, module=True): not a dotted module name "
                "such as 'package.module'; without -m (module=False) the program is a script path."
            )

    @property
    def local_device_count(self) -> int:
        """Devices each process gets: ``gpus_per_proc``, else ``devices_per_proc``, else 1."""
        return self.gpus_per_proc or self.devices_per_proc or 1

    def command(self) -> list[str]:
        """The command line of every process: this Python running the program with its args."""
        target = ["-m", self.program] if self.module else [self.program]
        return [sys.executable, *target, *self.args]


def child_environment(
    config: LaunchConfig,
    process_id: int,
    port: int,
    restart_count: int = 0,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``process_id``: ``base`` plus the launcher's variables.

    See the module docstring for the variables. Device variables replace inherited
    ones, since a launcher started from a process with its own device count (a
    test run, a notebook) must still give each process ``K`` devices.

    Args:
        config: the launch configuration.
        process_id: the process's index, ``0 <= process_id < config.nprocs``.
        port: the coordinator's port on 127.0.0.1.
        restart_count: how many times the group was restarted before this start.
        base: the inherited environment (default: this process's ``os.environ``).

    Returns:
        A new dictionary.

    Raises:
        ValueError: ``process_id`` is out of range, or ``--gpus-per-proc`` asks for more
            GPUs than ``CUDA_VISIBLE_DEVICES`` in ``base`` lists.

    Example:
        >>> from jaxdist.launch.config import LaunchConfig, child_environment
        >>> config = LaunchConfig("train.py", nprocs=2, devices_per_proc=4)
        >>> env = child_environment(config, 1, port=8476, base={"JAX_NUM_CPU_DEVICES": "8"})
        >>> for key in sorted(env):
        ...     print(key, env[key])
        JAXDIST_COORDINATOR_ADDRESS 127.0.0.1:8476
        JAXDIST_LOCAL_DEVICE_COUNT 4
        JAXDIST_NUM_PROCESSES 2
        JAXDIST_PROCESS_ID 1
        JAXDIST_RESTART_COUNT 0
        JAX_NUM_CPU_DEVICES 4
        JAX_PLATFORMS cpu
        PYTHONUNBUFFERED 1
        >>> gpus = LaunchConfig("train.py", nprocs=2, gpus_per_proc=2)
        >>> child_environment(gpus, 1, 8476, base={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})[
        ...     "CUDA_VISIBLE_DEVICES"]
        '6,7'
    """
    if not 0 <= process_id < config.nprocs:
        raise ValueError(
            f"child_environment(process_id={process_id}): must be in 0..{config.nprocs - 1} "
            f"for nprocs={config.nprocs}."
        )
    env = dict(os.environ if base is None else base)
    k = config.local_device_count
    env[ENV_COORDINATOR_ADDRESS] = f"{LOOPBACK}:{port}"
    env[ENV_NUM_PROCESSES] = str(config.nprocs)
    env[ENV_PROCESS_ID] = str(process_id)
    env[ENV_LOCAL_DEVICE_COUNT] = str(k)
    env[ENV_RESTART_COUNT] = str(restart_count)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if config.collective_timeout is not None:
        env[ENV_COLLECTIVE_TIMEOUT] = f"{config.collective_timeout:g}"
    if config.watchdog_log_interval is not None:
        env[ENV_WATCHDOG_LOG_INTERVAL] = f"{config.watchdog_log_interval:g}"
    if config.gpus_per_proc is None:
        env["JAX_NUM_CPU_DEVICES"] = str(k)
        env.setdefault("JAX_PLATFORMS", "cpu")
        return env
    listed = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    gpus = [g.strip() for g in listed.split(",") if g.strip()] if listed else None
    needed = config.nprocs * k
    if gpus is None:
        gpus = [str(g) for g in range(needed)]
    if len(gpus) < needed:
        raise ValueError(
            f"child_environment: --gpus-per-proc {k} x --nprocs {config.nprocs} needs {needed} "
            f"GPUs but CUDA_VISIBLE_DEVICES={listed!r} lists {len(gpus)}; lower --nprocs or "
            "--gpus-per-proc, or list more GPUs."
        )
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[process_id * k : (process_id + 1) * k])
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


# The lines of the strategies' collective watchdog (`jaxdist.strategies._watchdog`) that the
# launcher reads from a process's stderr, to say in its first-failure message which step a
# process waited in and for which processes.
_WAITING = re.compile(
    r"jaxdist: \w+: process \d+ has waited \S+ s for step (\d+)\b.*?; "
    r"(?:not arrived: process(?:es)? (.*?); (?:the job ends|no timeout)|every process arrived)"
)
_ENDED = re.compile(
    r"jaxdist: \w+: step (\d+) did not complete within .*?: "
    r"(?:process(?:es)? (.*) did not arrive|every process arrived)"
)
_LATE = re.compile(r"(\d+) \(its last step")


NOTICE = re.compile(
    r"jaxdist: PreemptionCheckpointHandler \(process \d+\): termination notice received"
)
"""The line a process's preemption handler writes when the process gets a termination notice
(SIGTERM, or its watcher function): the launcher names the process that got it."""


def watchdog_report(line: str) -> tuple[str, int, tuple[int, ...]] | None:
    """What a watchdog line says: ``("waiting" | "ended", step, processes not arrived)``;
    ``None`` for any other line.

    Example:
        >>> watchdog_report(
        ...     "jaxdist: MultiWorkerMirroredStrategy: step 20 did not complete within 10 s "
        ...     "(CommunicationOptions(timeout_seconds=10)): process 1 (its last step: 19) did "
        ...     "not arrive; ending process 0 with exit code 1.")
        ('ended', 20, (1,))
    """
    if "jaxdist: " not in line:
        return None
    for kind, pattern in (("waiting", _WAITING), ("ended", _ENDED)):
        found = pattern.search(line)
        if found:
            late = tuple(int(p) for p in _LATE.findall(found[2] or ""))
            return kind, int(found[1]), late
    return None
