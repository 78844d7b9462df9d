"""`Profile`: a `jaxdist.fit` callback recording a ``jax.profiler`` trace over a window of
steps.

The trace of steps ``start + 1`` to ``stop`` (global step numbers, as
``on_step_end`` counts them) is written to ``logdir/process_<i>`` in every
process ``i`` of the job: tracing starts after step ``start`` (before the first
step when ``start`` is 0 or the run starts there) and stops after step ``stop``,
once that step's device work is done, so the trace holds the window's steps and
not the compilation of the first one (pick ``start >= 1`` for that). Open it
with TensorBoard's profile plugin (``pip install tensorboard-plugin-profile``;
``tensorboard --logdir LOGDIR``, tab "Profile") or XProf (``xprof --logdir
LOGDIR``); the files are ``process_<i>/plugins/profile/<run>/<host>.xplane.pb``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax

from jaxdist.training.fit.callbacks import Callback

__all__ = ["Profile"]

_WHERE = "jaxdist.training.Profile"


class Profile(Callback):
    """Records a ``jax.profiler`` trace of the steps ``start + 1`` to ``stop``.

    Args:
        logdir: the directory of the traces; each process writes under
            ``logdir/process_<index>``.
        steps: ``(start, stop)``, global step numbers with ``0 <= start <
            stop``: tracing starts after step ``start`` and stops after step
            ``stop``.

    Attributes:
        directory: this process's trace directory.
        started_at: the step after which tracing started (None before).
        stopped_at: the step after which it stopped (None before; the last
            step when training ended inside the window).
        tracing: whether the trace is being recorded now.

    Example:
        >>> import jaxdist as jd
        >>> profile = jd.training.Profile("trace", steps=(10, 15))
        >>> profile.steps
        (10, 15)
    """

    def __init__(self, logdir: str | os.PathLike[str], *, steps: tuple[int, int]) -> None:
        if (
            not isinstance(steps, tuple)
            or len(steps) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
            or not 0 <= steps[0] < steps[1]
        ):
            raise ValueError(
                f"{_WHERE}: steps must be (start, stop) with 0 <= start < stop (global "
                f"steps; the trace holds steps start+1 to stop), got {steps!r}."
            )
        self.logdir = os.fspath(logdir)
        self.steps = steps
        self.directory = os.path.join(self.logdir, f"process_{jax.process_index()}")
        self.started_at: int | None = None
        self.stopped_at: int | None = None
        self.tracing = False

    def _start(self, step: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        jax.profiler.start_trace(self.directory)
        self.tracing, self.started_at = True, step

    def _stop(self, step: int, logs: Mapping[str, float]) -> None:
        # The step's metrics come out of the same program as its new state: reading them
        # (and waiting on the functional state) waits for the step's device work.
        dict(logs)
        jax.block_until_ready(
            [s for s, f in zip(self.loop.state, self.loop.functional, strict=True) if f]
        )
        jax.profiler.stop_trace()
        self.tracing, self.stopped_at = False, step

    def on_train_begin(self, logs: dict[str, float]) -> None:
        if self.started_at is None and self.loop.step == self.steps[0]:
            self._start(self.loop.step)

    def on_step_end(self, step: int, logs: Mapping[str, float]) -> None:
        if self.tracing and step >= self.steps[1]:
            self._stop(step, logs)
        elif not self.tracing and self.started_at is None and step == self.steps[0]:
            self._start(step)

    def on_train_end(self, logs: dict[str, Any]) -> None:
        if self.tracing:
            self._stop(self.loop.step, {})

    def close(self) -> None:
        if self.tracing:  # an error ended fit: end the trace, keep what it holds
            jax.profiler.stop_trace()
            self.tracing = False
