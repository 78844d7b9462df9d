"""The launcher's processes: signals it forwards, the trampoline that makes a
process die with the launcher, waiting on and signalling process groups, and how
a process ended."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


class SignalTrap:
    """Records SIGINT/SIGTERM/SIGHUP for the main loop (possible only in the main thread)."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.received: list[int] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalTrap]:
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in _FORWARDED_SIGNALS:
                previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)
        self.received.append(signum)


# Run as ``python -S -c _DEATHSIG <launcher pid> <program> <args...>``: asks the kernel to
# SIGKILL this process when the launcher dies, then becomes the program (the request survives
# exec). A trampoline rather than a ``preexec_fn``: Python code between fork and exec is unsafe
# in a multithreaded launcher (one that imported jax, say), and CPython runs at-fork hooks for it.
_DEATHSIG = (
    "import ctypes,os,sys\n"
    f"ctypes.CDLL(None,use_errno=True).prctl({_PR_SET_PDEATHSIG},{int(signal.SIGKILL)},0,0,0)\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(137)\n"
    "os.execv(sys.argv[2],sys.argv[2:])\n"
)


def with_deathsig(command: list[str], parent: int) -> list[str]:
    """``command`` run so that it gets SIGKILL when the launcher dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return command
    return [command[0], "-S", "-c", _DEATHSIG, str(parent), *command]


def status(proc: subprocess.Popen[bytes]) -> int | None:
    """The process's return code, or None while it runs.

    Where possible the process is not reaped (``WNOWAIT``): as a zombie it keeps its
    pid, so its process group id cannot be reused by an unrelated process while the
    launcher may still signal that group.
    """
    if proc.returncode is not None or not hasattr(os, "waitid"):
        return proc.poll()
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def signal_groups(pgids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)


def live_groups(pgids: Iterable[int]) -> set[int] | None:
    """Which of these process groups still have a member that is not a zombie (None: unknown)."""
    if not os.path.isdir("/proc/self"):
        return None
    wanted, live = set(pgids), set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            state, _, pgrp = stat[stat.rindex(b")") + 2 :].split()[:3]
            if int(pgrp) in wanted and state not in (b"Z", b"X"):
                live.add(int(pgrp))
    return live


def describe(returncode: int) -> str:
    """How a process with this return code ended, for the launcher's messages."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def exit_code(returncode: int) -> int:
    """The launcher's exit code for a process's return code (negative: killed by a signal)."""
    return returncode if returncode >= 0 else 128 - returncode
