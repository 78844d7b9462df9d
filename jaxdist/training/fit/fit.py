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

Resuming: with a `jaxdist.training.Checkpoint` callback, ``fit(...,
resume=True)`` restores the callback's latest checkpoint (verified against its
SHA-256 manifest) into the state arguments, with the global step, the epoch,
the training data's position, the epoch's running metrics and the `History`
so far, and continues from there: a run stopped at any step boundary and
resumed ends bitwise equal to one that never stopped. The data must be built
as in the stopped run: `jaxdist.data.from_arrays` datasets and lists of
batches start at the saved batch; other sources are read from the start of
the epoch up to it (with a warning), exact when they yield the same batches
again. Without a checkpoint it starts afresh. Callbacks' own state
(`EarlyStopping`'s best value) is not saved, and each process restores its
own data position (the same number of processes).

Ctrl-C and SIGTERM during `fit` do not break a step: the step in progress
completes and writes its state back (a step donates its input buffers, so
stopping between its dispatch and its write-back would lose the state), then
`fit` stops, the checkpoint callback (if any) saves at that step boundary and
its writes finish, and `fit` raises `FitInterrupted` (a ``KeyboardInterrupt``)
after Ctrl-C, or `FitPreempted` (a ``SystemExit`` with code 42, TF's and the
launcher's "preempted: restart me") after SIGTERM; both carry the history so
far and the functional state. A second Ctrl-C outside a step stops at once
(to leave a data pipeline that hangs), and a ``KeyboardInterrupt`` raised
outside a step by other code (a callback, the data pipeline, an evaluation
step) stops the same way: both end in `FitInterrupted` with the state of the
last completed step, the original exception as its ``__cause__``. The
handlers are in place only while `fit` runs, and only when it runs in the
main thread (where Python delivers signals); the previous handlers are put
back afterwards, also after errors. SIGTERM is handled in a job of one
process, unless its handler is ``SIG_IGN`` or was installed outside Python; a
previous Python SIGTERM handler is called after the save, before the exit.

Preemption in a job of several processes: ``fit(..., preemption_handler=
handler)`` with a `jaxdist.experimental.PreemptionCheckpointHandler` made
with the run's `Checkpoint` callback. The handler takes SIGTERM (or its
watcher function's notice); every process saves at one agreed step boundary
through the callback, then the handler's ``exit_fn`` runs (exit code 42 by
default); ``fit(..., resume=True, preemption_handler=...)`` in the restarted
job continues exactly.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax

from jaxdist._scope import get_strategy
from jaxdist.input import DistributedDataset, DistributedIterator
from jaxdist.strategies.base import Strategy
from jaxdist.training.fit.callbacks import Callback, FitLoop, TerminateOnNaN, functional_result
from jaxdist.training.fit.checkpoints import Checkpoint
from jaxdist.training.fit.groups import GroupFeed
from jaxdist.training.fit.interrupts import Interrupts
from jaxdist.training.fit.loop import FitInterrupted, FitPreempted, History, Runner
from jaxdist.training.fit.meter import FitMeter
from jaxdist.training.fit.preemption_hook import PreemptionHandlerLike, fit_checkpoint_of
from jaxdist.training.fit.progress import Progress, want_bar
from jaxdist.training.step.nnx import is_nnx_node
from jaxdist.training.step.state import TrainState
from jaxdist.training.step.train_step import TrainStep

__all__ = ["FitInterrupted", "FitPreempted", "History", "fit"]

_WHERE = "jaxdist.fit"


# Arguments ------------------------------------------------------------------------------


def _strategy_for(step: Any, strategy: Strategy | None) -> Strategy:
    own = step.strategy if isinstance(step, TrainStep) else None
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


def _grouped_step(
    step: Any,
    steps_per_execution: int | None,
    functional: tuple[bool, ...],
    state: tuple[Any, ...],
) -> TrainStep | None:
    """The train step to run when ``steps_per_execution`` (or the step's own) differs
    from the step's; ``None`` to run ``step`` as it is."""
    own = step.steps_per_execution if isinstance(step, TrainStep) else 1
    k = own if steps_per_execution is None else steps_per_execution
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{_WHERE}: steps_per_execution must be an int >= 1, got {k!r}.")
    if k == 1:
        # A grouped train step run one step per call (fit was asked for 1).
        return None if own == 1 else _regrouped(step, 1)
    if not isinstance(step, TrainStep):
        raise TypeError(
            f"{_WHERE}: steps_per_execution={k} needs a jd.train_step as the step (it runs "
            f"the steps in one compiled call); got {type(step).__name__}."
        )
    if step.options.donate_argnums is not None:
        raise ValueError(
            f"{_WHERE}: steps_per_execution={k} cannot be combined with a step made with "
            f"donate_argnums={step.options.donate_argnums} (a group carries its TrainState "
            "arguments and donates them per `donate`); drop donate_argnums, or use "
            "steps_per_execution=1."
        )
    for i, f in enumerate(functional):
        if f and not isinstance(state[i], TrainState):
            raise TypeError(
                f"{_WHERE}: with steps_per_execution={k}, functional state must be "
                f"jd.TrainState objects (carried from step to step inside a call); state "
                f"argument {i} is a {type(state[i]).__name__}."
            )
    return step if own == k else _regrouped(step, k)


def _regrouped(step: TrainStep, k: int) -> TrainStep:
    """``step`` running ``k`` steps per call (its last step's outputs, as fit reads them)."""
    return step.replace(
        steps_per_execution=k, stack_outputs=False, donate_argnums=None, update_state=None
    )


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


def _checkpoint_callback(
    callbacks: Sequence[Callback], resume: bool, initial_epoch: int, initial_step: int
) -> Checkpoint | None:
    """The `Checkpoint` callback among ``callbacks`` (at most one), checked for ``resume``."""
    found = [cb for cb in callbacks if isinstance(cb, Checkpoint)]
    if len(found) > 1:
        raise ValueError(
            f"{_WHERE}: callbacks holds {len(found)} jd.training.Checkpoint callbacks "
            f"({', '.join(cb.directory for cb in found)}); give one (it saves every_n_steps "
            "and/or every_epoch)."
        )
    if not isinstance(resume, bool):
        raise TypeError(f"{_WHERE}: resume must be True or False, got {resume!r}.")
    if resume and not found:
        raise ValueError(
            f"{_WHERE}: resume=True continues from the latest checkpoint of a "
            "jd.training.Checkpoint callback, but callbacks holds none; add one, e.g. "
            "callbacks=[jd.training.Checkpoint(directory, every_n_steps=100)]."
        )
    if resume and (initial_epoch or initial_step):
        raise ValueError(
            f"{_WHERE}: resume=True takes the epoch and step from the checkpoint; drop "
            f"initial_epoch={initial_epoch} and initial_step={initial_step}."
        )
    return found[0] if found else None


def _distributed(strategy: Strategy, data: Any) -> tuple[Any, int | None]:
    """The data as distributed batches, and its batch count per epoch when known."""
    if isinstance(data, (DistributedDataset, DistributedIterator)):
        return data, None
    total = None
    with contextlib.suppress(TypeError):
        total = len(data)
    return strategy.experimental_distribute_dataset(data), total


_EVALUATION: weakref.WeakKeyDictionary[TrainStep, TrainStep] = weakref.WeakKeyDictionary()


def _evaluation_step(eval_step: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The form of a `train_step` fit evaluates with: without ``update_state`` given, one
    that writes nothing back and donates nothing (made once per step, then reused)."""
    if not isinstance(eval_step, TrainStep) or eval_step.options.update_state is not None:
        return eval_step
    found = _EVALUATION.get(eval_step)
    if found is None:
        found = eval_step.replace(
            donate=False,
            update_state=False,
            steps_per_execution=1,
            stack_outputs=False,
            donate_argnums=None,
            where=f"{_WHERE}: eval_step {getattr(eval_step.fn, '__name__', 'step')}",
        )
        _EVALUATION[eval_step] = found
    return found


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
    resume: bool = False,
    steps_per_execution: int | None = None,
    preemption_handler: PreemptionHandlerLike | None = None,
    tokens_per_example: int | None = None,
    flops_per_step: float | None = None,
    peak_flops_per_device: float | None = None,
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
            prefix. It runs with every NNX module among the state in eval mode
            (``module.eval()``: no dropout, BatchNorm on its running averages),
            each module's mode put back afterwards. A `jaxdist.train_step`
            evaluates without writing any state back and without donating
            (as with ``update_state=False``), and one that updates parameters
            or optimizer state (the training step given again) raises
            ``ValueError`` naming eval_step; build it with
            ``update_state=True`` to have its state written back.
        eval_data: the evaluation data (as ``data``).
        callbacks: `Callback` objects (`Checkpoint`, `EarlyStopping`, ...); at
            most one `Checkpoint`.
        progress: ``"auto"``: a progress bar when stdout is a terminal;
            ``True``: always; ``False``: never.
        verbose: without a bar, print one line per epoch (else nothing).
        initial_epoch: the epoch to start at.
        initial_step: the global step to start at.
        strategy: the strategy; by default the step's (a `train_step` built
            with one), else the one of the enclosing ``strategy.scope()``. The
            loop runs inside its scope.
        resume: continue from the latest checkpoint of the `Checkpoint`
            callback's directory: the state arguments (NNX objects in place,
            functional states replaced), the step, the epoch, the data's
            position and the history so far; without a checkpoint there, start
            afresh. Give the state and data built as for the run that saved it.
        steps_per_execution: run this many steps in one compiled call (Keras's
            name): the step must be a `jaxdist.train_step`; ``None`` means the
            step's own (``jd.train_step(..., steps_per_execution=k)``), else a
            copy of the step with this value is used. Callbacks, the progress
            bar and the metrics still see every step, but the state moves a
            group at a time: a callback inside a group sees the state after it
            (``loop.mid_group``), and a stop requested inside a group (Ctrl-C,
            SIGTERM, ``stop_training``) takes effect at the group's end. A
            `Checkpoint` callback saves at group ends (a save due inside a
            group, by ``every_n_steps``, is made at its end, as ``ckpt-<step>``
            of that step), and so does a preemption handler; ``resume=True``
            continues exactly.
        preemption_handler: a `jaxdist.experimental.PreemptionCheckpointHandler`
            made with this run's `Checkpoint` callback
            (``PreemptionCheckpointHandler(strategy.cluster_resolver, ckpt)``;
            fit adds the callback when ``callbacks`` holds no `Checkpoint`, and
            refuses a different one). It takes SIGTERM (or its
            ``termination_watcher_fn``) as the notice in every job, one process
            or several: after each step fit tells the handler the global step,
            the processes agree on one step boundary (through the
            ``jax.distributed`` key-value store), the callback saves that step
            in every process (state, data position, step, history; the write
            is waited for), then the handler's ``exit_fn`` runs (by default
            ``sys.exit(42)``, so the launcher restarts the job; run it with
            ``resume=True`` to continue exactly). An ``exit_fn`` that returns
            lets training go on; ``grace_period`` saves, trains on and saves
            again before the deadline, as the handler documents. fit then
            leaves SIGTERM to the handler (no `FitPreempted`).
        tokens_per_example: the tokens in one example (the sequence length of
            a batch of token sequences): fit then reports tokens per second.
        flops_per_step: the model FLOPs of one global step (all devices
            together), e.g. ``6 * params * tokens_per_step`` plus attention.
            By default fit reads them from the compiled step's cost analysis
            (a `jaxdist.train_step` run one step per call; see
            `jaxdist.training.fit.throughput` for what that counts); with
            ``steps_per_execution > 1``, central storage or another callable,
            only this gives them.
        peak_flops_per_device: the device's dense peak FLOP/s for MFU; by
            default looked up in `jaxdist.training.fit.throughput`'s table of
            dense bf16 peaks (H100/H200 SXM, A100, TPU v4, v5e, v5p, v6e).
            CPUs and unknown chips get no MFU unless this is given.

    Speed: every epoch's line (and the progress bar) shows examples/s, steps/s,
    tokens/s (with ``tokens_per_example``), achieved TFLOP/s per device (model
    FLOPs per step x steps/s / devices) and MFU (that over the peak), and the
    same figures land in ``history.history`` per epoch under
    ``"examples_per_second"``, ``"tokens_per_second"``, ``"flops_per_step"``,
    ``"tflops_per_device"`` and ``"mfu"`` (a fraction), each present when known.
    They are taken from the epoch's training time (evaluation excluded), with
    no device sync beyond fit's own; the first epoch's time includes
    compiling the step.

    Returns:
        The `History` when every state argument is an NNX object; otherwise
        ``(new_state, history)``, where ``new_state`` is the functional state
        after the last step (a tuple of them when several arguments are
        functional, in order).

    Raises:
        FitInterrupted: after Ctrl-C, once the step in progress has completed
            and the checkpoint callback has saved it (or after a
            ``KeyboardInterrupt`` raised outside a step).
        FitPreempted: after SIGTERM, likewise (``SystemExit`` with code 42);
            with a ``preemption_handler``, its ``exit_fn`` decides instead.
        ValueError: ``resume=True`` and the latest checkpoint does not verify
            or does not fit the state (nothing is changed then).

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
    if preemption_handler is not None:
        saves = fit_checkpoint_of(preemption_handler)
        given = [cb for cb in callbacks if isinstance(cb, Checkpoint)]
        if not given:
            callbacks.append(saves)
        elif not any(cb is saves for cb in given):
            raise ValueError(
                f"{_WHERE}: the preemption_handler saves through the jd.training.Checkpoint "
                f"callback of {saves.directory}, but callbacks holds another one "
                f"({', '.join(cb.directory for cb in given)}); pass the handler's callback "
                "(callbacks=[ckpt] with PreemptionCheckpointHandler(resolver, ckpt)), or "
                "leave it out of callbacks (fit adds it)."
            )
    # TerminateOnNaN first: a non-finite step is caught before a checkpoint of it is due.
    callbacks.sort(key=lambda cb: not isinstance(cb, TerminateOnNaN))
    checkpoint = _checkpoint_callback(callbacks, resume, initial_epoch, initial_step)
    if epochs is None and steps is None:
        epochs = initial_epoch + 1
    functional = tuple(not is_nnx_node(s) for s in state)
    grouped = _grouped_step(step, steps_per_execution, functional, state)
    _check_state(state, functional)
    if (
        any(functional)
        and isinstance(eval_step, TrainStep)
        and eval_step.options.donate
        and eval_step.options.update_state
    ):
        raise ValueError(
            f"{_WHERE}: eval_step is a jd.train_step with update_state=True that donates its "
            "arguments (the default), so it would consume the functional state it is given "
            "and return only metrics. Build it with jd.train_step(strategy, donate=False), "
            "or leave update_state at its default (fit then runs it without donating or "
            "writing state back)."
        )
    eval_step = _evaluation_step(eval_step)
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
    meter = FitMeter(
        strategy,
        flops_per_step=flops_per_step,
        peak_flops_per_device=peak_flops_per_device,
        tokens_per_example=tokens_per_example,
    )
    with strategy.scope(), Interrupts(term=preemption_handler is None) as interrupts:
        try:
            train, total = _distributed(strategy, data)
            if grouped is not None and grouped.steps_per_execution == 1:
                step = grouped
            elif grouped is not None:
                feed = GroupFeed(grouped, loop)
                step, train = feed, feed.dataset(train)
            evaluation = None if eval_data is None else _distributed(strategy, eval_data)[0]
            runner = Runner(
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
                track=checkpoint is not None,
                preemption=preemption_handler,
                meter=meter,
            )
            if resume:
                assert checkpoint is not None
                resumed = checkpoint.restore_latest(loop)
                if resumed is not None:
                    runner.resume(resumed)
            runner.run()
        finally:
            display.close()
            for cb in callbacks:
                cb.close()
    if not any(functional):
        return history
    return functional_result(loop.state, functional), history
