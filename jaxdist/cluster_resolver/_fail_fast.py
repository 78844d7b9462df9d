"""Failing processes of a multi-process job end at once (`initialize` installs it).

A process of a `jax.distributed` job that ends through Python's normal exit
runs `jax.distributed`'s shutdown, a barrier that waits (up to
``shutdown_timeout_seconds``) for every other process. When the process
failed, the others are usually blocked in a collective that waits for it,
so the barrier never completes: the job would hang for minutes and then
report the wrong process (the one the coordination service aborted when
the barrier timed out). Two hooks end a failing process at once instead,
before that barrier and with its own exit code, so that the launcher (or
the heartbeat) stops the others and names it:

- an uncaught exception: ``sys.excepthook`` prints the traceback, then the
  process exits with code 1 (130 for ``KeyboardInterrupt``), as Python's own;
- ``sys.exit(status)`` with a failing status (an integer other than 0, or a
  message, which is printed and gives code 1, as in Python): ``sys.exit``
  raises a `SystemExit` subclass, so ``except SystemExit`` and ``finally``
  blocks behave as always; when that exception ends the interpreter (no
  Python frame is left to catch it), the process exits with the status at
  once. A ``SystemExit`` that is caught changes nothing, and neither does
  ``sys.exit()``, ``sys.exit(0)`` or ``sys.exit(None)``: a successful exit
  still waits for the others at the barrier (a chief still writing a
  checkpoint must not make the workers fail).

``raise SystemExit(3)`` written out (rather than ``sys.exit(3)``) creates
Python's own class, which no hook sees: it exits through the barrier.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["install"]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit_code(status: object) -> int | None:
    """The process exit code Python gives ``SystemExit(status)``; ``None`` when it succeeds."""
    if status is None or status == 0:
        return None
    if isinstance(status, int):
        return status
    return 1


class _FailingExit(SystemExit):
    """What ``sys.exit(failing status)`` raises in a multi-process job.

    When the interpreter's top-level handler drops it (no Python frame is
    running in the main thread any more), the process is ending because of it:
    ``__del__`` ends the process with its status right away, before the exit
    handlers that would wait for the other processes. A caught one is dropped
    while the frame that caught it runs, and changes nothing.
    """

    exit_now: Callable[[int], Any] | None = None  # os._exit, set by `install`

    def __del__(self) -> None:
        code = _exit_code(self.code)
        exit_now = type(self).exit_now
        if code is None or exit_now is None:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        if sys._getframe().f_back is not None:  # a Python frame caught it: not an exit
            return
        if not isinstance(self.code, int):
            with contextlib.suppress(Exception):
                print(self.code, file=sys.stderr)  # what Python prints for sys.exit("message")
        _flush()
        exit_now(code)


def install(exit_now: Callable[[int], Any]) -> None:
    """Makes uncaught exceptions and failing ``sys.exit`` calls end the process at once.

    ``exit_now`` ends the process with a code without running exit handlers
    (``os._exit``; tests pass a recorder).
    """
    previous_hook = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous_hook(exc_type, exc, tb)
        _flush()
        exit_now(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    sys.excepthook = hook
    _FailingExit.exit_now = exit_now
    if getattr(sys.exit, "_jaxdist_fail_fast", False):
        return
    python_exit = sys.exit

    def exit(status: object = None, /) -> NoReturn:
        if _exit_code(status) is None:
            python_exit(status)  # type: ignore[arg-type]  # any object, as sys.exit
        raise _FailingExit(status)

    exit.__doc__ = python_exit.__doc__
    exit._jaxdist_fail_fast = True  # type: ignore[attr-defined]
    sys.exit = exit


def uninstall() -> None:
    """Lets a failing ``sys.exit`` go through Python's normal exit again (after `shutdown`)."""
    _FailingExit.exit_now = None
