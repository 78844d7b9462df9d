"""Callbacks for `jaxdist.fit`: the hook protocol, early stopping and stopping on NaN.

A callback subclasses `Callback` and overrides the hooks it needs. `fit`
hands every callback the running `FitLoop` (``callback.loop``) before the
first hook: the training state, the position (epoch, global step) and a
``stop_training`` switch. `EarlyStopping` stops when a monitored metric stops
improving and can put the best state back; `TerminateOnNaN` stops at the first
non-finite loss. The checkpoint callback is in `jaxdist.training.fit.checkpoints`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jaxdist.training.fit.resume import LoopRecord
from jaxdist.training.fit.state_io import host_state, load_state

__all__ = ["Callback", "EarlyStopping", "FitLoop", "TerminateOnNaN"]


class FitLoop:
    """What callbacks see of a running `jaxdist.fit`.

    Attributes:
        strategy: the strategy the steps run on.
        state: the state arguments as they are now: NNX objects (updated in
            place) and the latest value of each functional state.
        functional: for each state argument, whether it is functional
            (returned by the step) rather than an NNX object.
        epoch: the current epoch (0-based, counted from ``initial_epoch``).
        step: optimizer steps completed, counted from ``initial_step``.
        epochs: the epoch to train up to, or None when only ``steps`` bounds it.
        steps: the global step to train up to, or None.
        at_epoch_end: whether the epoch's data has run out: in ``on_step_end``,
            that step used the epoch's last batch; in ``on_epoch_end``, the
            epoch was complete (not cut short by ``steps``, ``stop_training``
            or Ctrl-C).
        stop_training: set it to True to stop after the current step (the
            epoch then ends as usual: evaluation and ``on_epoch_end`` run).
        interrupted: True once Ctrl-C or SIGTERM stopped the loop (or a
            ``KeyboardInterrupt`` raised outside a step).
        preempted: True once SIGTERM stopped the loop.
        nonfinite: set (to what was found, and where) by `TerminateOnNaN` when
            a loss was NaN or infinite; the `Checkpoint` callback saves
            nothing once it is set. None otherwise.
        mid_group: with ``steps_per_execution=k``, True in ``on_step_end`` for a
            step inside a group of k (the state is already the group's last
            step's; the `Checkpoint` callback saves at the group's end).
    """

    def __init__(
        self,
        strategy: Any,
        state: tuple[Any, ...],
        functional: tuple[bool, ...],
        *,
        epoch: int = 0,
        step: int = 0,
        epochs: int | None = None,
        steps: int | None = None,
    ) -> None:
        self.strategy = strategy
        self.state = state
        self.functional = functional
        self.epoch = epoch
        self.step = step
        self.epochs = epochs
        self.steps = steps
        self.at_epoch_end = False
        self.stop_training = False
        self.interrupted = False
        self.preempted = False
        self.nonfinite: str | None = None
        self.mid_group = False
        self.record = LoopRecord()  # what a Checkpoint callback records of the loop

    @property
    def where(self) -> str:
        """Where training is, as every message of fit says it: ``"step 12, epoch 3 of 6"``
        (epochs counted from 1, as the progress bar does; "of N" when ``epochs`` bounds
        the run)."""
        of = f" of {self.epochs}" if self.epochs is not None else ""
        return f"step {self.step}, epoch {self.epoch + 1}{of}"

    def __repr__(self) -> str:
        return f"FitLoop(epoch={self.epoch}, step={self.step}, stop_training={self.stop_training})"


class Callback:
    """Base class of `jaxdist.fit` callbacks: every hook does nothing until overridden.

    ``logs`` are dicts of metric name to float: the step's own metrics in
    `on_step_end`, the epoch's averages (and ``val_`` metrics) in `on_epoch_end`
    and `on_train_end`. ``self.loop`` is the running `FitLoop`.

    `on_train_end` runs when training ends with a consistent state: after the
    last epoch, after ``stop_training``, and after Ctrl-C or a
    ``KeyboardInterrupt`` raised outside a step (with ``loop.interrupted``
    set). `close` runs last in every case, errors included; release resources
    there.

    Example:
        >>> import jaxdist as jd
        >>> class StopAtStep(jd.training.Callback):
        ...     def __init__(self, last):
        ...         self.last = last
        ...     def on_step_end(self, step, logs):
        ...         if step >= self.last:
        ...             self.loop.stop_training = True
        >>> StopAtStep(3).last
        3
    """

    loop: FitLoop

    def set_loop(self, loop: FitLoop) -> None:
        """Called by `fit` before `on_train_begin`."""
        self.loop = loop

    def on_train_begin(self, logs: dict[str, float]) -> None:
        """Before the first step."""

    def on_epoch_begin(self, epoch: int, logs: dict[str, float]) -> None:
        """Before the first step of ``epoch``."""

    def on_step_end(self, step: int, logs: Mapping[str, float]) -> None:
        """After optimizer step ``step`` (1-based global count) and its state write-back."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """After ``epoch``'s last step and its evaluation."""

    def on_train_end(self, logs: dict[str, float]) -> None:
        """After the last step (also after Ctrl-C, not after any other error)."""

    def close(self) -> None:
        """Releases resources; called once at the end of `fit` in every case."""


def functional_result(state: tuple[Any, ...], functional: Sequence[bool]) -> Any:
    """The functional entries of ``state``: one value, a tuple, or None (private helper)."""
    picked = tuple(s for s, f in zip(state, functional, strict=True) if f)
    if not picked:
        return None
    return picked[0] if len(picked) == 1 else picked


# Early stopping ---------------------------------------------------------------------------


class EarlyStopping(Callback):
    """Stops training when a metric has not improved for ``patience`` epochs.

    After each epoch the monitored metric is compared with the best so far:
    it improves when it is lower by more than ``min_delta`` (``mode="min"``)
    or higher by more than ``min_delta`` (``mode="max"``). After ``patience``
    epochs in a row without improvement, training stops (with ``patience=0``
    at the first one). With ``restore_best`` the state of the best epoch is
    kept (a host copy) and put back when training stops: NNX objects in place,
    functional states in what `fit` returns. After Ctrl-C nothing is put back.

    Args:
        monitor: the metric to watch, as named in the epoch logs (``"loss"``,
            ``"val_loss"``, ``"val_accuracy"``, ...).
        patience: epochs without improvement to allow before stopping.
        mode: ``"min"`` when lower is better, ``"max"`` when higher is.
        min_delta: the smallest change that counts as an improvement.
        restore_best: put the best epoch's state back at the end.

    Attributes:
        best: the best value seen; ``best_epoch`` its epoch; ``stopped_epoch``
            the epoch after which training stopped (None if it did not).

    Example:
        >>> import jaxdist as jd
        >>> stop = jd.training.EarlyStopping("val_accuracy", patience=2, mode="max")
        >>> stop.monitor, stop.patience
        ('val_accuracy', 2)
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        *,
        patience: int = 0,
        mode: Literal["min", "max"] = "min",
        min_delta: float = 0.0,
        restore_best: bool = False,
    ) -> None:
        where = "jaxdist.training.EarlyStopping"
        if mode not in ("min", "max"):
            raise ValueError(
                f"{where}: mode must be 'min' (lower is better, e.g. a loss) or 'max' (higher "
                f"is better, e.g. an accuracy), got {mode!r}."
            )
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"{where}: patience must be an int >= 0, got {patience!r}.")
        if min_delta < 0:
            raise ValueError(f"{where}: min_delta must be >= 0, got {min_delta!r}.")
        self.monitor = monitor
        self.patience = patience
        self.mode = mode
        self.min_delta = float(min_delta)
        self.restore_best = restore_best
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self._wait = 0
        self._best_state: dict[str, Any] | None = None

    def on_train_begin(self, logs: dict[str, float]) -> None:
        self.best = self.best_epoch = self.stopped_epoch = None
        self._wait = 0
        self._best_state = None

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        if self.monitor not in logs:
            hint = (
                " Validation metrics (val_...) need eval_step and eval_data in fit."
                if self.monitor.startswith("val_")
                else ""
            )
            raise KeyError(
                f"jaxdist.training.EarlyStopping: monitor={self.monitor!r} is not among the "
                f"epoch's metrics {sorted(logs)}.{hint}"
            )
        value = float(logs[self.monitor])
        if self._improved(value):
            self.best, self.best_epoch, self._wait = value, epoch, 0
            if self.restore_best:
                self._best_state = host_state(self.loop.state)
            return
        self._wait += 1
        if self._wait >= max(self.patience, 1):
            self.stopped_epoch = epoch
            self.loop.stop_training = True

    def on_train_end(self, logs: dict[str, float]) -> None:
        loop = self.loop
        if self.restore_best and self._best_state is not None and not loop.interrupted:
            loop.state = load_state(self._best_state, loop.state, "jaxdist.training.EarlyStopping")


# Stopping on NaN --------------------------------------------------------------------------


class TerminateOnNaN(Callback):
    """Stops training at the first step whose loss is NaN or infinite (Keras's callback).

    After every step it reads the monitored metric (a device sync per step, as
    in Keras); when it is not finite it prints the step and the epoch to
    stderr, sets ``loop.stop_training`` and ``loop.nonfinite``, and training
    stops after that step: `fit` returns as after early stopping
    (``history.stopped_early``), and the `Checkpoint` callback does not save
    that state, nor any later one (the last checkpoint stays the last finite
    state). `fit` runs this callback's hooks before the other callbacks', so
    a checkpoint due at that very step is not written either.

    Args:
        monitor: the step metric to check (``"loss"``).

    Attributes:
        stopped_step: the global step whose loss was not finite (None while
            training went well); ``stopped_epoch`` its epoch.

    Example:
        >>> import jaxdist as jd
        >>> jd.training.TerminateOnNaN().monitor
        'loss'
    """

    def __init__(self, monitor: str = "loss") -> None:
        if not isinstance(monitor, str):
            raise TypeError(
                f"jaxdist.training.TerminateOnNaN: monitor must be a metric name, got {monitor!r}."
            )
        self.monitor = monitor
        self.stopped_step: int | None = None
        self.stopped_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, float]) -> None:
        self.stopped_step = self.stopped_epoch = None

    def on_step_end(self, step: int, logs: Mapping[str, float]) -> None:
        if self.monitor not in logs:
            raise KeyError(
                f"jaxdist.training.TerminateOnNaN: monitor={self.monitor!r} is not among the "
                f"step's metrics {sorted(logs)}; pass the name of the loss, e.g. "
                "TerminateOnNaN(monitor='loss')."
            )
        value = float(logs[self.monitor])
        if math.isfinite(value):
            return
        loop = self.loop
        self.stopped_step, self.stopped_epoch = step, loop.epoch
        loop.nonfinite = f"{self.monitor} {value} at {loop.where}"
        loop.stop_training = True
        print(
            f"jaxdist.training.TerminateOnNaN: {loop.nonfinite}; training stops here, and "
            "this state is not checkpointed.",
            file=sys.stderr,
            flush=True,
        )
