"""The closure queue of a `ClusterCoordinator`: TF's error and cancellation rules.

Closures wait in a FIFO queue; one dispatcher thread per worker takes them. When a closure
fails, its error is kept and every closure still queued is cancelled (its `RemoteValue`
raises `ClosureCancelledError`); closures already running finish. The kept error is raised
once, by the next `schedule`, `join` or `done`, and then cleared, after which scheduling
works again. A closure whose worker died goes back to the front of the queue. A lost
parameter server is fatal: its error is raised by every later call.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from jaxdist.experimental.parameter_server.values import ClosureCancelledError, RemoteValue

__all__ = ["Closure", "ClosureQueue"]


class Closure:
    """A function with its arguments, and the `RemoteValue` its result goes to."""

    __slots__ = ("args", "fn_key", "fn_ref", "kwargs", "remote_value", "runs")

    def __init__(self, fn_key: str, fn_ref: Any, args: Any, kwargs: Any) -> None:
        self.fn_key = fn_key
        self.fn_ref = fn_ref
        self.args = args
        self.kwargs = kwargs
        self.remote_value = RemoteValue()
        self.runs = 0  # times it was started (more than once after a worker died)


class ClosureQueue:
    """Queued closures, the number running, and the first error."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._closed = False
        self.completed = 0  # closures that finished (successfully or not)
        self.restarted = 0  # closures put back after their worker died

    def put(self, closure: Closure) -> None:
        with self._cond:
            self._raise_error()
            self._queue.append(closure)
            self._cond.notify()

    def get(self) -> Closure | None:
        """The next closure (counted as running), or None once the queue is closed."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            self._inflight += 1
            return self._queue.popleft()

    def put_back(self, closure: Closure) -> None:
        """Its worker died: it runs again, first."""
        with self._cond:
            self._inflight -= 1
            self.restarted += 1
            if self._fatal is not None:
                closure.remote_value.set_outcome(error=self._fatal)
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
            self._inflight -= 1
            self.completed += 1
            closure.remote_value.set_outcome(result, error)
            if error is not None:
                if fatal and self._fatal is None:
                    self._fatal = error
                elif not fatal and self._error is None:
                    self._error = error
                self._cancel_queued(self._fatal or error)
            self._cond.notify_all()

    def _cancel_queued(self, cause: BaseException) -> None:
        while self._queue:
            c = self._queue.popleft()
            error = (
                cause
                if cause is self._fatal
                else ClosureCancelledError(
                    f"The closure was cancelled: an earlier closure failed with "
                    f"{type(cause).__name__}: {cause}"
                )
            )
            c.remote_value.set_outcome(error=error)

    def _raise_error(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def join(self, timeout: float | None = None) -> None:
        """Waits until nothing is queued or running, then raises the kept error, if any."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._inflight, timeout)
            self._raise_error()

    def done(self) -> bool:
        with self._cond:
            self._raise_error()
            return not self._queue and not self._inflight

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
