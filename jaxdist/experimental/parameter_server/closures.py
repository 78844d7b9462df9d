"""The closure queue of a `ClusterCoordinator`: TF's error and cancellation rules.

Closures wait in a FIFO queue; one dispatcher thread per worker takes them. The rules are
TF's ``_CoordinatedClosureQueue``'s:

- When a closure fails, its error is kept (the first one only) and every closure still
  queued is cancelled: its `RemoteValue` raises `ClosureCancelledError` (a
  ``concurrent.futures.CancelledError``). Nothing more is started until the error is raised.
- The kept error is raised once, by the next `schedule`, `join` or `done`, and only when no
  closure is running any more: closures in flight when the error happened run to their end
  (a running XLA program cannot be interrupted), and an error one of them raises meanwhile
  is part of that one error (a note on it names them; their own `RemoteValue`\\ s raise
  their own errors). Then the error is cleared and scheduling works again.
- A closure whose worker died goes back to the front of the queue (cancelled instead when
  an error is pending). The coordinator bounds how often (`MAX_WORKER_LOSSES`).
- A lost parameter server is fatal: its error is raised by every later call.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxdist.experimental.parameter_server.values import ClosureCancelledError, RemoteValue

__all__ = ["Closure", "ClosureQueue"]


class Closure:
    """A function with its arguments, and the `RemoteValue` its result goes to."""

    __slots__ = (
        "args",
        "fn_key",
        "fn_ref",
        "kwargs",
        "losses",
        "name",
        "remote_value",
        "runs",
        "started",
        "worker",
    )

    def __init__(self, fn_key: str, fn_ref: Any, args: Any, kwargs: Any, name: str) -> None:
        self.fn_key = fn_key
        self.fn_ref = fn_ref
        self.args = args
        self.kwargs = kwargs
        self.name = name  # the function's qualified name and file, for messages
        self.remote_value = RemoteValue()
        self.runs = 0  # times it was started (more than once after a worker died)
        self.losses: list[str] = []  # what happened to each worker that died running it
        self.worker = -1  # the worker running it now
        self.started = 0.0  # when that run started (time.monotonic())


class ClosureQueue:
    """Queued closures, the running ones, and the first error."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[Closure] = collections.deque()
        self._running: dict[int, Closure] = {}  # id(closure) -> closure
        self._error: BaseException | None = None
        self._also: list[str] = []  # errors of closures that failed while _error was kept
        self._fatal: BaseException | None = None
        self._closed = False
        self.completed = 0  # closures that finished (successfully or not)
        self.restarted = 0  # closures put back after their worker died

    def put(self, closure: Closure) -> None:
        with self._cond:
            self._raise_error()
            self._queue.append(closure)
            self._cond.notify()

    def get(self, worker: int) -> Closure | None:
        """The next closure (now running on ``worker``), or None once the queue is closed.
        Waits while an error is pending (nothing starts until it is raised)."""
        with self._cond:
            while not self._closed and (not self._queue or self._error is not None):
                self._cond.wait()
            if self._closed:
                return None
            closure = self._queue.popleft()
            closure.worker, closure.started = worker, time.monotonic()
            closure.runs += 1
            self._running[id(closure)] = closure
            return closure

    def put_back(self, closure: Closure) -> None:
        """Its worker died: it runs again, first (or is cancelled when an error is kept)."""
        with self._cond:
            del self._running[id(closure)]
            self.restarted += 1
            if self._fatal is not None:
                closure.remote_value.set_outcome(error=self._fatal)
            elif self._error is not None:
                closure.remote_value.set_outcome(error=_cancelled(self._error))
            else:
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def finished(
        self,
        closure: Closure,
        result: Any = None,
        error: BaseException | None = None,
        fatal: bool = False,
    ) -> None:
        with self._cond:
            del self._running[id(closure)]
            self.completed += 1
            closure.remote_value.set_outcome(result, error)
            if error is not None:
                if fatal and self._fatal is None:
                    self._fatal = error
                elif self._error is None and self._fatal is None:
                    self._error = error
                elif error is not self._error and error is not self._fatal:
                    self._also.append(f"{closure.name}: {type(error).__name__}: {error}")
                self._cancel_queued(self._fatal or self._error or error)
            self._cond.notify_all()

    def _cancel_queued(self, cause: BaseException) -> None:
        while self._queue:
            c = self._queue.popleft()
            c.remote_value.set_outcome(error=cause if cause is self._fatal else _cancelled(cause))

    def _raise_error(self) -> None:
        """Raises the fatal error, or the kept one once no closure runs (then clears it).
        Called with the lock held."""
        if self._fatal is not None:
            raise self._fatal
        if self._error is None:
            return
        self._cond.wait_for(lambda: not self._running or self._fatal is not None)
        if self._fatal is not None:
            raise self._fatal
        error, self._error = self._error, None
        also, self._also = self._also, []
        self._cancel_queued(error)
        if also:
            error.add_note(
                f"jaxdist: {len(also)} more closure(s) running at the time failed too (their "
                "errors are part of this one): " + "; ".join(also)
            )
        raise error

    def join(self, report: Callable[[list[Closure]], None] | None, period: float) -> None:
        """Waits until nothing is queued or running, or an error is kept, then raises it.

        While it waits, ``report(running closures)`` is called every ``period`` seconds
        with the closures that have run for ``period`` seconds or more (if any).
        """
        with self._cond:
            while not (
                self._error is not None
                or self._fatal is not None
                or (not self._queue and not self._running)
            ):
                if not self._cond.wait(timeout=period) and report is not None:
                    now = time.monotonic()
                    slow = [c for c in self._running.values() if now - c.started >= period]
                    if slow:
                        report(slow)
            self._raise_error()

    def done(self) -> bool:
        with self._cond:
            self._raise_error()
            return not self._queue and not self._running

    def fail_all(self, error: BaseException) -> None:
        """No worker can run closures any more: every queued closure fails with ``error``."""
        with self._cond:
            if self._fatal is None:
                self._fatal = error
            self._cancel_queued(error)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _cancelled(cause: BaseException) -> ClosureCancelledError:
    return ClosureCancelledError(
        f"The closure was cancelled: an earlier closure failed with {type(cause).__name__}: "
        f"{cause}. Reschedule it after the error is raised (by join, schedule or done)."
    )
