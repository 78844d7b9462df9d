"""One `jaxdist.fit` call's loop: its epochs and steps, the resumed position, and how it ends
(`History`, `FitInterrupted` and `FitPreempted` are public through
`jaxdist.training`). See `jaxdist.training.fit` for the behaviour."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxdist.training.fit.callbacks import Callback, FitLoop, functional_result
from jaxdist.training.fit.checkpoints import Checkpoint, Resumed
from jaxdist.training.fit.groups import GroupFeed
from jaxdist.training.fit.interrupts import PREEMPTED_EXIT_CODE, Interrupts
from jaxdist.training.fit.meter import FitMeter
from jaxdist.training.fit.modes import eval_mode
from jaxdist.training.fit.preemption_hook import PreemptionHandlerLike
from jaxdist.training.fit.progress import EpochMean, MetricReader, Progress, StepLogs, as_metrics
from jaxdist.values.distributed import PerReplica

__all__ = ["FitInterrupted", "FitPreempted", "History", "Runner"]

_WHERE = "jaxdist.fit"
_END = object()


@dataclasses.dataclass
class History:
    """What `fit` returns: the metrics of every epoch, Keras style.

    Attributes:
        history: metric name to its per-epoch values (training metrics, then
            ``val_`` metrics), e.g. ``history["val_accuracy"][-1]``.
        epochs: the epochs that ran (0-based, from ``initial_epoch``); after
            ``resume=True``, those before the restart too.
        step: the global step reached (optimizer steps, from ``initial_step``).
        examples_per_second: training throughput of each epoch (real rows per
            second of the training steps, evaluation excluded; of the steps
            after the restart, for an epoch resumed in its middle); also
            ``history["examples_per_second"]``, beside the other speed figures
            there (``"tokens_per_second"``, ``"flops_per_step"``,
            ``"tflops_per_device"``, ``"mfu"``; see `jaxdist.fit`).
        stopped_early: True when a callback set ``loop.stop_training``.
    """

    history: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    epochs: list[int] = dataclasses.field(default_factory=list)
    step: int = 0
    examples_per_second: list[float] = dataclasses.field(default_factory=list)
    stopped_early: bool = False

    def record_epoch(
        self,
        epoch: int,
        logs: Mapping[str, float],
        examples_per_s: float,
        speed: Mapping[str, float] | None = None,
    ) -> None:
        """Adds one epoch's logs, throughput and other speed figures (called by `fit` at
        the end of each epoch)."""
        self.epochs.append(epoch)
        self.examples_per_second.append(examples_per_s)
        for k, v in {**logs, **(speed or {})}.items():
            self.history.setdefault(k, []).append(v)


class FitInterrupted(KeyboardInterrupt):
    """Raised by `fit` after Ctrl-C, once the step in progress has completed.

    Also raised for a ``KeyboardInterrupt`` from code outside a step (a callback,
    the data pipeline), which is then its ``__cause__``.

    The NNX objects passed to `fit` hold the state after the last completed
    step; the functional state after it is ``.state`` (as `fit` would have
    returned it). The checkpoint callback saved that step, and checkpoint
    writes have finished.

    Attributes:
        history: the `History` of the epochs completed before the interrupt.
        state: the functional state(s) after the last completed step, or None
            when every state argument is an NNX object.
    """

    def __init__(self, message: str, history: History, state: Any) -> None:
        super().__init__(message)
        self.history = history
        self.state = state


class FitPreempted(SystemExit):
    """Raised by `fit` after SIGTERM, once the step in progress has completed and the
    checkpoint callback (if any) has saved it: a ``SystemExit`` with ``code`` 42, so an
    uncaught one ends the process with exit status 42, which the launcher (``python -m
    jaxdist.launch --max-restarts N``) and TF's tooling take for "preempted: restart me".
    Run the same program again with ``fit(..., resume=True)`` to continue.

    Attributes:
        message: what happened, also printed to stderr.
        history: the `History` so far.
        state: the functional state(s) after the last completed step, or None.
    """

    def __init__(self, message: str, history: History, state: Any) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message
        self.history = history
        self.state = state

    def __str__(self) -> str:
        return self.message


# Steps ----------------------------------------------------------------------------------


def _new_state(out: Any, loop: FitLoop, check: bool) -> tuple[tuple[Any, ...], Any]:
    """Splits a training step's output into the new state arguments and the metrics."""
    n = sum(loop.functional)
    if n == 0:
        return loop.state, out
    if check or not isinstance(out, tuple) or len(out) != n + 1:
        _check_new_state(out, loop, n)
    it = iter(out[:n])
    return tuple(
        next(it) if f else s for s, f in zip(loop.state, loop.functional, strict=True)
    ), out[n]


def _check_new_state(out: Any, loop: FitLoop, n: int) -> None:
    """Explains a step output that is not ``(*new_functional_states, metrics)`` of the
    state's structure, or whose new state differs between replicas."""
    positions = [i for i, f in enumerate(loop.functional) if f]
    if not isinstance(out, tuple) or len(out) != n + 1:
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise TypeError(
            f"{_WHERE}: the step got {n} functional state argument(s) (positions {positions}: "
            f"{', '.join(type(loop.state[i]).__name__ for i in positions)}) and must return "
            f"their new values and then the metrics, ({'new_state, ' * n}metrics); it "
            f"returned {got}. For example: return state.apply_gradients(grads=grads), "
            "{'loss': loss}. (NNX objects are updated in place and are not returned.) The "
            "state passed to this step may have been donated: rebuild it before retrying."
        )
    for i, value in zip(positions, out[:n], strict=True):
        if any(
            isinstance(x, PerReplica)
            for x in jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, PerReplica))
        ):
            raise ValueError(
                f"{_WHERE}: the new value of state argument {i} differs between replicas "
                "(it came back PerReplica), so it cannot be one replicated state. Update "
                "it from all-reduced values: grads = ctx.all_reduce('sum', grads) before "
                "state.apply_gradients(grads=grads)."
            )
        before: Any = jax.tree.structure(loop.state[i])
        after: Any = jax.tree.structure(value)
        if before != after:
            raise TypeError(
                f"{_WHERE}: the step returned a new state argument {i} whose structure "
                f"{after} differs from the one passed in {before}; return "
                f"({'new_state, ' * n}metrics) with the new states in the order of the "
                "functional arguments."
            )


# The loop -------------------------------------------------------------------------------


def _at_position(it: Any, data: Any, next_epoch: bool) -> None:
    """Moves a new iterator of the training data to a saved position; with ``next_epoch``
    (its epoch's data was all trained) only to that epoch, so the next ``iter()`` starts the
    one after it without reading this one's batches again."""
    if data is None:
        return
    it.set_state({**data, "batches": 0} if next_epoch else data)


@dataclasses.dataclass
class Runner:
    """One `fit` call's loop (private)."""

    step: Callable[..., Any]
    loop: FitLoop
    callbacks: Sequence[Callback]
    display: Progress
    interrupts: Interrupts
    history: History
    train: Any  # the distributed training data
    total: int | None  # its batches per epoch, when known
    source: Any  # the data as given to fit (told each epoch's number by set_epoch)
    eval_step: Callable[..., Any] | None
    evaluation: Any  # the distributed evaluation data
    track: bool = False  # record the data position after every step (for checkpoints)
    preemption: PreemptionHandlerLike | None = None  # fit's preemption_handler
    resumed: Resumed | None = None  # the checkpoint the first epoch resumes from
    reader: MetricReader = dataclasses.field(default_factory=MetricReader)
    checked: bool = False
    meter: FitMeter | None = None  # the speed figures (fit's flops_per_step=, ...)
    steps_run: int = 0  # steps the last train_epoch ran (not those before a restart)

    def __post_init__(self) -> None:
        self.loop.record.history = self.history

    def resume(self, resumed: Resumed) -> None:
        """Puts the loop where the checkpoint was written (the state is already restored)."""
        loop, record, saved = self.loop, self.loop.record, resumed.loop
        loop.step, loop.epoch = saved["step"], saved["epoch"]
        history = self.history
        history.history = saved["history"]
        history.epochs = saved["epochs"]
        history.examples_per_second = saved["examples_per_second"]
        history.step = loop.step
        record.data = resumed.data
        if saved["epoch_ended"] and saved["data_done"]:  # the next epoch starts afresh
            self.set_epoch(loop.epoch)
            it = iter(self.train)
            _at_position(it, resumed.data, next_epoch=True)
            _close(it)
            loop.epoch += 1
            self._say_resumed(resumed)
            return
        if saved["epoch_ended"] and resumed.data is not None:
            # The epoch was cut short (steps=, stop_training) and logged; it goes on from
            # its data position and is logged again, whole, when it ends.
            count = len(history.epochs)
            columns: list[list[Any]] = [
                history.epochs,
                history.examples_per_second,
                *history.history.values(),
            ]
            for values in columns:
                if count and len(values) == count:
                    values.pop()
            history.history = {k: v for k, v in history.history.items() if v}
        self.resumed = resumed
        self._say_resumed(resumed)

    def _say_resumed(self, resumed: Resumed) -> None:
        """Tells the user what ``fit(resume=True)`` resumed (process 0)."""
        if jax.process_index() == 0:
            name = os.path.basename(resumed.path)
            print(f"{_WHERE}: resumed from {name} ({self.loop.where})", file=self.display.stream,
                  flush=True)  # fmt: skip

    def mid_group(self) -> bool:
        """Whether the step just logged is inside a group of ``steps_per_execution`` (more of
        the group's steps, already run, are still to be logged)."""
        return isinstance(self.step, GroupFeed) and self.step.mid_group

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def train_epoch(self, resumed: Resumed | None) -> tuple[dict[str, float], int, int, float]:
        """Runs one epoch's steps (the rest of the resumed one); returns (metrics, steps, real
        rows trained, training seconds)."""
        loop, interrupts, display, record = self.loop, self.interrupts, self.display, None
        mean, done, start = EpochMean(), 0, time.perf_counter()
        self.steps_run = 0
        loop.at_epoch_end = False
        if self.track:
            record = loop.record
            record.mean, record.pending, record.epoch_steps = mean, None, 0
        it = iter(self.train)
        try:
            batch: Any = _END
            if resumed is not None and resumed.data is not None:
                saved = resumed.loop
                mean.sums, mean.rows = dict(saved["metric_sums"]), saved["metric_rows"]
                done = saved["epoch_steps"]
                if record is not None:
                    record.epoch_steps = done
                _at_position(it, resumed.data, next_epoch=saved["data_done"])
                limit = loop.steps is not None and loop.step >= loop.steps
                if not saved["data_done"] and not limit:
                    batch = next(it, _END)
                if batch is _END and done:
                    # Stopped after the epoch's last step (or at the step limit): only the
                    # epoch's end (evaluation, history, on_epoch_end) is left.
                    loop.at_epoch_end = saved["data_done"] or not limit
                    return mean.result(), done, 0, 0.0
            else:  # a new epoch (or a checkpoint without a data position: its epoch afresh)
                batch = next(it, _END)
            rows_before, steps_before = mean.rows, done
            if batch is _END:
                raise ValueError(
                    f"{_WHERE}: the data yielded no batches in epoch {loop.epoch + 1}. An iterator "
                    "(a generator, a DistributedIterator) gives a single epoch: pass a "
                    "re-iterable dataset (jd.data.from_arrays(...), jd.data.from_generator(fn), "
                    "a list of batches) or bound training with steps=."
                )
            pending: StepLogs | None = None
            while True:
                with interrupts.step():
                    out = self.step(*loop.state, batch)
                    loop.state, raw = _new_state(out, loop, check=not self.checked)
                    loop.step += 1
                if self.meter is not None and not self.meter.measured:
                    start += self.meter.measure(self.step, loop.state, batch)
                if not self.checked:
                    raw = as_metrics(raw, "step")
                    self.checked = True
                elif not isinstance(raw, dict):
                    raw = as_metrics(raw, "step")
                done += 1
                logs = StepLogs(raw, batch, self.reader, "step")
                if pending is not None:  # read one step late: the device runs ahead
                    mean.add(pending)
                    if display.bar:
                        seconds = time.perf_counter() - start
                        rate = (mean.rows - rows_before) / max(seconds, 1e-9)
                        speed = None
                        if self.meter is not None:
                            rows = mean.rows - rows_before
                            speed = self.meter.rates(done - 1 - steps_before, rows, seconds)
                        display.step(done - 1, mean.result(), rate, speed)
                pending = logs
                mid_group = loop.mid_group = self.mid_group()
                if record is not None and not mid_group:  # the position after this batch
                    record.data, record.epoch_steps, record.pending = it.get_state(), done, logs
                if interrupts.interrupted and not mid_group:
                    batch = _END
                else:
                    batch = next(it, _END)  # also at the step limit: is the epoch complete?
                    loop.at_epoch_end = batch is _END
                    if loop.steps is not None and loop.step >= loop.steps:
                        batch = _END
                for cb in self.callbacks:
                    cb.on_step_end(loop.step, logs)
                if mid_group:  # the group's other steps are done: log them before stopping
                    continue
                if self.preemption is not None and not interrupts.interrupted:
                    # Every process, every step (or group): may save this step through the
                    # Checkpoint callback (the position is known: at_epoch_end is set) and exit.
                    self.preemption.fit_step_end(loop.step)
                if batch is _END or loop.stop_training or interrupts.interrupted:
                    break
            mean.add(pending)
            if record is not None:
                record.pending = None
            self.steps_run = done - steps_before
            return mean.result(), done, mean.rows - rows_before, time.perf_counter() - start
        finally:
            _close(it)

    def evaluate(self, eval_step: Callable[..., Any]) -> dict[str, float] | None:
        """The ``val_`` metrics over the evaluation data; None when Ctrl-C stopped it."""
        mean, pending = EpochMean(), None
        for batch in self.evaluation:
            if self.interrupts.interrupted:
                return None
            raw = as_metrics(eval_step(*self.loop.state, batch), "eval_step")
            if pending is not None:
                mean.add(pending)
            pending = StepLogs(raw, batch, self.reader, "eval_step")
        if pending is None:
            raise ValueError(f"{_WHERE}: eval_data yielded no batches.")
        mean.add(pending)
        return mean.result("val_")

    def run(self) -> None:
        """The epochs between the callbacks' train hooks; `FitInterrupted` after Ctrl-C,
        `FitPreempted` after SIGTERM."""
        loop, callbacks, interrupts = self.loop, self.callbacks, self.interrupts
        for cb in callbacks:
            cb.set_loop(loop)
        logs: dict[str, float] = {}
        cause: KeyboardInterrupt | None = None
        try:
            for cb in callbacks:
                cb.on_train_begin({})
            logs = self.epochs()
        except KeyboardInterrupt as e:
            # Raised outside a step (a callback, the data, evaluation, a second Ctrl-C): the
            # state is that of the last completed step, as after Ctrl-C. Inside a step it may
            # have been donated and not written back: nothing to hand over, so re-raise.
            if isinstance(e, FitInterrupted) or interrupts.step_failed:
                raise
            cause = e
        self.history.step = loop.step
        if interrupts.interrupted or cause is not None:
            loop.interrupted = True
            loop.preempted = interrupts.terminated
            self.display.close()
            for cb in callbacks:
                cb.on_train_end(logs)  # the checkpoint callback saves this step
            state = functional_result(loop.state, loop.functional)
            if interrupts.terminated:
                self.preempted(state)
            how = "Ctrl-C" if interrupts.interrupted else "a KeyboardInterrupt"
            raise FitInterrupted(
                f"{_WHERE}: stopped by {how} after {loop.where}; the "
                "state is that of the last completed step (functional state: .state of this "
                "exception).",
                self.history,
                state,
            ) from cause
        for cb in callbacks:
            cb.on_train_end(logs)

    def preempted(self, state: Any) -> None:
        """After SIGTERM and the save: tells stderr, chains the previous handler, exits 42."""
        loop = self.loop
        saved = any(isinstance(cb, Checkpoint) for cb in self.callbacks)
        message = (
            f"{_WHERE}: SIGTERM: stopped after {loop.where}; "
            + (
                "the checkpoint callback saved this step"
                if saved
                else "nothing was saved (no jd.training.Checkpoint callback)"
            )
            + f". Exiting with code {PREEMPTED_EXIT_CODE} (preempted): run the program again "
            "with fit(..., resume=True) to continue."
        )
        print(message, file=sys.stderr, flush=True)
        previous = self.interrupts.previous_term
        if previous is not None:
            previous(signal.SIGTERM, None)
        raise FitPreempted(message, self.history, state)

    def epochs(self) -> dict[str, float]:
        """The epochs until a bound, ``stop_training`` or Ctrl-C; returns the last epoch's logs."""
        loop, interrupts, history = self.loop, self.interrupts, self.history
        logs: dict[str, float] = {}
        resumed, self.resumed = self.resumed, None
        while not (
            (loop.epochs is not None and loop.epoch >= loop.epochs)
            or (
                loop.steps is not None
                and loop.step >= loop.steps
                and (resumed is None or resumed.data is None)  # else its epoch's end is left
            )
        ):
            self.set_epoch(loop.epoch)
            loop.record.epoch_ended = False
            for cb in self.callbacks:
                cb.on_epoch_begin(loop.epoch, {})
            total = self.total
            remaining = None if loop.steps is None else loop.steps - loop.step
            shown = total if remaining is None else min(total or remaining, remaining)
            self.display.epoch_begin(loop.epoch, shown)
            train_logs, done, rows, seconds = self.train_epoch(resumed)
            resumed = None
            logs = dict(train_logs)
            if not interrupts.interrupted and self.eval_step is not None:
                with eval_mode(loop.state):
                    val = self.evaluate(self.eval_step)
                logs.update(val or {})
            if interrupts.interrupted:
                break
            if total is None and loop.at_epoch_end:
                self.total = done  # the data ran out: steps per epoch, now known
            rate = rows / max(seconds, 1e-9)
            speed = None
            if self.meter is not None:
                speed = self.meter.rates(self.steps_run, rows, seconds)
            self.display.epoch_end(loop.epoch, done, logs, rate, seconds, speed)
            history.record_epoch(loop.epoch, logs, rate, None if speed is None else speed.as_logs())
            history.step = loop.step
            loop.record.epoch_ended = True
            for cb in self.callbacks:
                cb.on_epoch_end(loop.epoch, logs)
            loop.epoch += 1
            if loop.stop_training:
                history.stopped_early = True
                break
        return logs


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None and hasattr(it, "__next__"):
        close()
