"""`fit`: the training loop: epochs over a distributed dataset, evaluation, callbacks, progress.

``jd.fit(step, *state, data=...)`` calls ``step(*state, batch)`` for every
batch of every epoch, the way ``model.fit`` does in Keras, with a
`jaxdist.train_step` (or any callable of that form) as the step.

The state arguments are of two kinds, told apart by their type:

- NNX objects (``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``: any NNX
  graph node) are updated in place by the step;
- every other state argument (a `TrainState`, a pytree of arrays) is
  functional: the step returns its new value.

So an in-place step returns its metrics, and a step with functional state
returns ``(*new_functional_states, metrics)``, the new values in the order of
the functional arguments. Metrics are a dict of name to value (a single
value is named ``"loss"``):

- a value that is the same on every replica (a plain array, e.g. from
  ``ctx.all_reduce``) is the batch's value as it is;
- a `PerReplica` value is reduced across replicas as ``strategy.reduce("mean",
  ...)`` does: one value per replica is averaged, weighted by each replica's
  real rows in a padded batch; per-example values (a row axis) are averaged
  over the real rows only.

Epoch metrics average the batches' values weighted by each batch's number of
real rows (a padded last batch counts its real rows only), so a per-batch mean
loss gives the mean over the dataset.

Ctrl-C during `fit` does not break a step: the step in progress completes and
writes its state back (a step donates its input buffers, so stopping between
its dispatch and its write-back would lose the state), then `fit` stops,
waits for checkpoint writes in progress, and raises `FitInterrupted` (a
``KeyboardInterrupt``) carrying the history so far and the functional state.
A second Ctrl-C outside a step stops at once (to leave a data pipeline that
hangs), and a ``KeyboardInterrupt`` raised outside a step by other code (a
callback, the data pipeline, an evaluation step) stops the same way: both end
in `FitInterrupted` with the state of the last completed step, the original
exception as its ``__cause__``. The handler is in place only while `fit` runs,
and only when it runs in the main thread (where Python delivers signals); the
previous handler is put back afterwards, also after errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import jax

from jaxdist._scope import get_strategy
from jaxdist.input import DistributedDataset, DistributedIterator
from jaxdist.strategy import Strategy
from jaxdist.training._nnx import is_nnx_node
from jaxdist.training.callbacks import Callback, FitLoop, functional_result
from jaxdist.training.progress import (
    EpochMean,
    MetricReader,
    Progress,
    StepLogs,
    as_metrics,
    want_bar,
)
from jaxdist.training.step import TrainStep
from jaxdist.values import PerReplica

__all__ = ["FitInterrupted", "History", "fit"]

_WHERE = "jaxdist.fit"
_END = object()


@dataclasses.dataclass
class History:
    """What `fit` returns: the metrics of every epoch, Keras style.

    Attributes:
        history: metric name to its per-epoch values (training metrics, then
            ``val_`` metrics), e.g. ``history["val_accuracy"][-1]``.
        epochs: the epochs that ran (0-based, from ``initial_epoch``).
        step: the global step reached (optimizer steps, from ``initial_step``).
        examples_per_second: training throughput of each epoch (real rows per
            second of the training steps, evaluation excluded).
        stopped_early: True when a callback set ``loop.stop_training``.
    """

    history: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    epochs: list[int] = dataclasses.field(default_factory=list)
    step: int = 0
    examples_per_second: list[float] = dataclasses.field(default_factory=list)
    stopped_early: bool = False

    def _append(self, epoch: int, logs: Mapping[str, float], examples_per_s: float) -> None:
        self.epochs.append(epoch)
        self.examples_per_second.append(examples_per_s)
        for k, v in logs.items():
            self.history.setdefault(k, []).append(v)


class FitInterrupted(KeyboardInterrupt):
    """Raised by `fit` after Ctrl-C, once the step in progress has completed.

    Also raised for a ``KeyboardInterrupt`` from code outside a step (a callback,
    the data pipeline), which is then its ``__cause__``.

    The NNX objects passed to `fit` hold the state after the last completed
    step; the functional state after it is ``.state`` (as `fit` would have
    returned it). Checkpoint writes have finished.

    Attributes:
        history: the `History` of the epochs completed before the interrupt.
        state: the functional state(s) after the last completed step, or None
            when every state argument is an NNX object.
    """

    def __init__(self, message: str, history: History, state: Any) -> None:
        super().__init__(message)
        self.history = history
        self.state = state


# Ctrl-C ---------------------------------------------------------------------------------


class _Interrupts:
    """A SIGINT handler for the duration of `fit` that records Ctrl-C instead of raising.

    Installed only from the main thread (the only one Python delivers signals to);
    the previous handler is put back on exit, errors included.
    """

    def __init__(self) -> None:
        self.count = 0
        self.in_step = False
        self.step_failed = False  # an exception left a step between dispatch and write-back
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGINT, previous)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count > 1 and not self.in_step:
            raise KeyboardInterrupt(
                f"{_WHERE}: second Ctrl-C: stopped at once, outside any step (the state is "
                "that of the last completed step)."
            )

    @property
    def interrupted(self) -> bool:
        return self.count > 0

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


# Arguments ------------------------------------------------------------------------------


def _strategy_for(step: Any, strategy: Strategy | None) -> Strategy:
    own = step._strategy if isinstance(step, TrainStep) else None
    if strategy is None:
        # Scopes only ever hold `Strategy` instances (StrategyLike is their low-layer face).
        return own if own is not None else cast(Strategy, get_strategy())
    if not isinstance(strategy, Strategy):
        raise TypeError(
            f"{_WHERE}: strategy must be a jaxdist.Strategy, got {type(strategy).__name__}."
        )
    if own is not None and own != strategy:
        raise ValueError(
            f"{_WHERE}: the step runs on {own!r} (given to jd.train_step) but fit was given "
            f"strategy={strategy!r}; drop fit's strategy argument or build the step with the "
            "same strategy."
        )
    return strategy


def _check_counts(**counts: int | None) -> None:
    for name, v in counts.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{_WHERE}: {name} must be an int >= 0, got {v!r}.")


def _check_state(state: tuple[Any, ...], functional: tuple[bool, ...]) -> None:
    for i, (s, f) in enumerate(zip(state, functional, strict=True)):
        if f and any(is_nnx_node(x) for x in jax.tree.leaves(s, is_leaf=is_nnx_node)):
            raise TypeError(
                f"{_WHERE}: state argument {i} is a {type(s).__name__} holding NNX objects; "
                "pass NNX objects directly as state arguments (fit(step, model, optimizer, "
                "data=...)) so they are updated in place."
            )


def _distributed(strategy: Strategy, data: Any) -> tuple[Any, int | None]:
    """The data as distributed batches, and its batch count per epoch when known."""
    if isinstance(data, (DistributedDataset, DistributedIterator)):
        return data, None
    total = None
    with contextlib.suppress(TypeError):
        total = len(data)
    return strategy.experimental_distribute_dataset(data), total


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


@dataclasses.dataclass
class _Runner:
    """One `fit` call's loop (private)."""

    step: Callable[..., Any]
    loop: FitLoop
    callbacks: Sequence[Callback]
    display: Progress
    interrupts: _Interrupts
    history: History
    train: Any  # the distributed training data
    total: int | None  # its batches per epoch, when known
    source: Any  # the data as given to fit (told each epoch's number by set_epoch)
    eval_step: Callable[..., Any] | None
    evaluation: Any  # the distributed evaluation data
    reader: MetricReader = dataclasses.field(default_factory=MetricReader)
    checked: bool = False

    def train_epoch(self) -> tuple[dict[str, float], int, int, float]:
        """Runs one epoch's steps; returns (metrics, steps, real rows, training seconds)."""
        loop, interrupts, display = self.loop, self.interrupts, self.display
        mean, done, start = EpochMean(), 0, time.perf_counter()
        loop.at_epoch_end = False
        it = iter(self.train)
        try:
            batch = next(it, _END)
            if batch is _END:
                raise ValueError(
                    f"{_WHERE}: the data yielded no batches in epoch {loop.epoch}. An iterator "
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
                        rate = mean.rows / max(time.perf_counter() - start, 1e-9)
                        display.step(done - 1, mean.result(), rate)
                pending = logs
                if interrupts.interrupted:
                    batch = _END
                else:
                    batch = next(it, _END)  # also at the step limit: is the epoch complete?
                    loop.at_epoch_end = batch is _END
                    if loop.steps is not None and loop.step >= loop.steps:
                        batch = _END
                for cb in self.callbacks:
                    cb.on_step_end(loop.step, logs)
                if batch is _END or loop.stop_training or interrupts.interrupted:
                    break
            mean.add(pending)
            return mean.result(), done, mean.rows, time.perf_counter() - start
        finally:
            close = getattr(it, "close", None)
            if close is not None and hasattr(it, "__next__"):
                close()

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
        """The epochs between the callbacks' train hooks; `FitInterrupted` after Ctrl-C."""
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
            self.display.close()
            for cb in callbacks:
                cb.on_train_end(logs)
            how = "Ctrl-C" if interrupts.interrupted else "a KeyboardInterrupt"
            raise FitInterrupted(
                f"{_WHERE}: stopped by {how} after step {loop.step} (epoch {loop.epoch}); the "
                "state is that of the last completed step (functional state: .state of this "
                "exception).",
                self.history,
                functional_result(loop.state, loop.functional),
            ) from cause
        for cb in callbacks:
            cb.on_train_end(logs)

    def epochs(self) -> dict[str, float]:
        """The epochs until a bound, ``stop_training`` or Ctrl-C; returns the last epoch's logs."""
        loop, interrupts, history = self.loop, self.interrupts, self.history
        logs: dict[str, float] = {}
        set_epoch = getattr(self.source, "set_epoch", None)
        while not (
            (loop.epochs is not None and loop.epoch >= loop.epochs)
            or (loop.steps is not None and loop.step >= loop.steps)
        ):
            if callable(set_epoch):
                set_epoch(loop.epoch)
            for cb in self.callbacks:
                cb.on_epoch_begin(loop.epoch, {})
            total = self.total
            remaining = None if loop.steps is None else loop.steps - loop.step
            shown = total if remaining is None else min(total or remaining, remaining)
            self.display.epoch_begin(loop.epoch, shown)
            train_logs, done, rows, seconds = self.train_epoch()
            logs = dict(train_logs)
            if not interrupts.interrupted and self.eval_step is not None:
                val = self.evaluate(self.eval_step)
                logs.update(val or {})
            if interrupts.interrupted:
                break
            if total is None and (loop.steps is None or loop.step < loop.steps):
                self.total = done  # the data ran out: steps per epoch, now known
            rate = rows / max(seconds, 1e-9)
            self.display.epoch_end(loop.epoch, done, logs, rate, seconds)
            history._append(loop.epoch, logs, rate)
            history.step = loop.step
            for cb in self.callbacks:
                cb.on_epoch_end(loop.epoch, logs)
            loop.epoch += 1
            if loop.stop_training:
                history.stopped_early = True
                break
        return logs


def fit(
    step: Callable[..., Any],
    *state: Any,
    data: Any,
    epochs: int | None = None,
    steps: int | None = None,
    eval_step: Callable[..., Any] | None = None,
    eval_data: Any = None,
    callbacks: Sequence[Callback] = (),
    progress: bool | str = "auto",
    verbose: bool = True,
    initial_epoch: int = 0,
    initial_step: int = 0,
    strategy: Strategy | None = None,
) -> Any:  # History, or (new_state, History) for functional state
    """Trains with ``step(*state, batch)`` over ``data`` for some epochs or steps.

    Args:
        step: the training step, usually a `jaxdist.train_step`: called as
            ``step(*state, batch)``. It returns the metrics when every state
            argument is an NNX object (updated in place), else
            ``(*new_functional_states, metrics)`` (see the module docs).
        *state: the state arguments: NNX objects and/or functional states.
        data: a distributed dataset, or anything
            ``strategy.experimental_distribute_dataset`` accepts (distributed
            here); iterated once per epoch. A source with a ``set_epoch(epoch)``
            method is told each epoch's number first.
        epochs: the epoch to train up to (as in Keras: with ``initial_epoch=2``,
            ``epochs=5`` runs epochs 2, 3 and 4).
        steps: the global step to train up to, spanning epochs (the last epoch
            may end early). With both, training stops at whichever comes first;
            with neither, one epoch.
        eval_step: ``eval_step(*state, batch)`` returning metrics, run over
            ``eval_data`` after every epoch; they are logged with a ``val_``
            prefix. It must not donate functional state (use
            ``jd.train_step(strategy, donate=False)`` for it).
        eval_data: the evaluation data (as ``data``).
        callbacks: `Callback` objects (`Checkpoint`, `EarlyStopping`, ...).
        progress: ``"auto"``: a progress bar when stdout is a terminal;
            ``True``: always; ``False``: never.
        verbose: without a bar, print one line per epoch (else nothing).
        initial_epoch: the epoch to start at (resuming: ``Restored.epoch``).
        initial_step: the global step to start at (resuming: ``Restored.step``).
        strategy: the strategy; by default the step's (a `train_step` built
            with one), else the one of the enclosing ``strategy.scope()``. The
            loop runs inside its scope.

    Returns:
        The `History` when every state argument is an NNX object; otherwise
        ``(new_state, history)``, where ``new_state`` is the functional state
        after the last step (a tuple of them when several arguments are
        functional, in order).

    Raises:
        FitInterrupted: after Ctrl-C, once the step in progress has completed
            (or after a ``KeyboardInterrupt`` raised outside a step).

    Example:
        >>> import jax.numpy as jnp, numpy as np, optax, jaxdist as jd
        >>> from flax import nnx
        >>> x = np.linspace(-1, 1, 64, dtype=np.float32)[:, None]
        >>> model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
        >>> @jd.train_step
        ... def step(ctx, model, opt, batch):
        ...     x, y = batch
        ...     def loss_fn(m):
        ...         return jd.compute_average_loss(jnp.sum((m(x) - y) ** 2, axis=-1))
        ...     loss, grads = nnx.value_and_grad(loss_fn)(model)
        ...     opt.update(model, ctx.all_reduce("sum", grads))
        ...     return {"loss": ctx.all_reduce("sum", loss)}
        >>> data = jd.data.from_arrays(x, 3 * x, batch_size=16)
        >>> history = jd.fit(step, model, opt, data=data, epochs=20, verbose=False)
        >>> history.history["loss"][-1] < 1e-3 < history.history["loss"][0]
        True
    """
    if not callable(step):
        raise TypeError(f"{_WHERE}: step must be callable, got {type(step).__name__}.")
    if not state:
        raise TypeError(
            f"{_WHERE}: give the training state after the step: fit(step, model, optimizer, "
            "data=...) or fit(step, train_state, data=...)."
        )
    _check_counts(
        epochs=epochs, steps=steps, initial_epoch=initial_epoch, initial_step=initial_step
    )
    if (eval_step is None) != (eval_data is None):
        raise ValueError(
            f"{_WHERE}: eval_step and eval_data go together; got only "
            f"{'eval_step' if eval_data is None else 'eval_data'}."
        )
    if eval_step is not None and not callable(eval_step):
        raise TypeError(f"{_WHERE}: eval_step must be callable, got {type(eval_step).__name__}.")
    callbacks = list(callbacks)
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(
                f"{_WHERE}: callbacks must be jd.training.Callback objects, got "
                f"{type(cb).__name__}; subclass Callback and override its hooks."
            )
    if epochs is None and steps is None:
        epochs = initial_epoch + 1
    functional = tuple(not is_nnx_node(s) for s in state)
    _check_state(state, functional)
    if any(functional) and isinstance(eval_step, TrainStep) and eval_step._donate:
        raise ValueError(
            f"{_WHERE}: eval_step is a jd.train_step that donates its arguments (the default), "
            "so it would consume the functional state it is given and return only metrics. "
            "Build it with jd.train_step(strategy, donate=False)."
        )
    strategy = _strategy_for(step, strategy)
    display = Progress(bar=want_bar(progress, sys.stdout, _WHERE), verbose=verbose, epochs=epochs)
    loop = FitLoop(
        strategy,
        tuple(state),
        functional,
        epoch=initial_epoch,
        step=initial_step,
        epochs=epochs,
        steps=steps,
    )
    history = History(step=initial_step)
    with strategy.scope(), _Interrupts() as interrupts:
        try:
            train, total = _distributed(strategy, data)
            evaluation = None if eval_data is None else _distributed(strategy, eval_data)[0]
            _Runner(
                step,
                loop,
                callbacks,
                display,
                interrupts,
                history,
                train=train,
                total=total,
                source=data,
                eval_step=eval_step,
                evaluation=evaluation,
            ).run()
        finally:
            display.close()
            for cb in callbacks:
                cb.close()
    if not any(functional):
        return history
    return functional_result(loop.state, functional), history
