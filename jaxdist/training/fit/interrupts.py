"""Ctrl-C and SIGTERM during `jaxdist.fit`: recorded, acted on at the next step boundary
.

`Interrupts` installs, for the duration of a `fit` call and only in the main
thread (the only one Python delivers signals to):

- a SIGINT handler that counts Ctrl-C instead of raising, so the step in
  progress completes and writes its state back (a step donates its input
  buffers); a second Ctrl-C outside a step raises ``KeyboardInterrupt`` at
  once;
- a SIGTERM handler that records the request (preemption: a cluster scheduler
  or a launcher asking the job to stop), in a job of one process, when the
  handler in place is Python's default or a Python function. `previous_term`
  is that function, which `fit` calls after saving, before it exits (chaining).
  A SIGTERM handler set to ``SIG_IGN``, or installed outside Python (as
  ``jax.distributed``'s preemption notifier does in a job of several
  processes), is left alone: it could not be put back afterwards. With
  ``term=False`` (`fit` was given a ``preemption_handler``, whose own SIGTERM
  handler gives the notice) SIGTERM is not touched.

The previous handlers are put back on exit, errors included.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["PREEMPTED_EXIT_CODE", "Interrupts"]

PREEMPTED_EXIT_CODE = 42  # TF's and the launcher's "preempted: restart me"

_WHERE = "jaxdist.fit"


class Interrupts:
    """SIGINT and SIGTERM handlers for the duration of `fit` (a context manager)."""

    def __init__(self, term: bool = True) -> None:
        self._term = term  # handle SIGTERM (where it can be put back afterwards)
        self.count = 0  # Ctrl-C presses
        self.terminated = False  # SIGTERM received
        self.in_step = False
        self.step_failed = False  # an exception left a step between dispatch and write-back
        self._previous_int: Any = None
        self._previous_term: Any = None
        self._int_installed = False
        self._term_installed = False

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._previous_int = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._on_int)
        self._int_installed = True
        previous = signal.getsignal(signal.SIGTERM)
        ours = previous is signal.SIG_DFL or callable(previous)  # not SIG_IGN, not None
        if self._term and ours and jax.process_count() == 1:
            self._previous_term = previous
            signal.signal(signal.SIGTERM, self._on_term)
            self._term_installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._int_installed:
            previous = self._previous_int if self._previous_int is not None else signal.SIG_DFL
            signal.signal(signal.SIGINT, previous)
            self._int_installed = False
        if self._term_installed:
            signal.signal(signal.SIGTERM, self._previous_term)
            self._term_installed = False

    def _on_int(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count > 1 and not self.in_step:
            raise KeyboardInterrupt(
                f"{_WHERE}: second Ctrl-C: stopped at once, outside any step (the state is "
                "that of the last completed step)."
            )

    def _on_term(self, signum: int, frame: Any) -> None:
        self.terminated = True

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C or SIGTERM asked the loop to stop."""
        return self.count > 0 or self.terminated

    @property
    def previous_term(self) -> Callable[[int, Any], Any] | None:
        """The SIGTERM handler `fit` replaced, when it is a Python function (to chain)."""
        previous = self._previous_term
        return previous if callable(previous) else None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A step's dispatch and write-back: a second Ctrl-C is deferred until it ends."""
        self.in_step = True
        try:
            yield
        except BaseException:
            self.step_failed = True
            raise
        finally:
            self.in_step = False
