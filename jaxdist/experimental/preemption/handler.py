"""`PreemptionCheckpointHandler` and `TerminationConfig`: save at one agreed step when a
process is told it will be stopped, then exit to be restarted (TF's names and semantics).

A platform that reclaims machines (Cloud TPU and GPU VMs, Slurm, Kubernetes)
says so first: SIGTERM, or a notice a program can poll. The handler turns
that notice into a checkpoint at a step boundary that every process of the
job agrees on, then calls ``exit_fn`` (by default ``sys.exit(42)``, the code
``python -m jaxdist.launch --max-restarts K`` and TF's tooling restart). When
the job starts again the handler restores the checkpoint as it is created,
``total_run_calls`` included, so the loop resumes exactly where it stopped.

The save happens where TF's does: at the start of a ``run()`` call, before
the function runs. So whatever the loop rebinds after a call is saved, with
either habit: ``ckpt.state = handler.run(train, ckpt.state, next(it))`` (TF's)
or ``handler.run(step)`` with ``ckpt.state = train(ckpt.state, batch)`` inside.
Iterator items are saved at their position at the end of the previous call,
so a batch already taken for the call (``next(it)`` as an argument) is not
skipped on resume.

``total_run_calls`` keeps TF's name but counts steps: a function that runs
several in one call (a ``jd.train_step(..., steps_per_execution=k)``) says how
many in its ``last_call_steps`` attribute, and the handler saves between
calls, the step boundary it can reach.

How the processes agree is in `jaxdist.experimental.preemption.agreement`:
one process saves at the start of the call after the notice; several publish
how many ``run`` calls they made through the ``jax.distributed`` key-value
store, agree after the call that follows the largest of them, and save at
the start of the next.

`jaxdist.fit` takes a handler made with its `jaxdist.training.Checkpoint`
callback (``preemption_handler=``): the same agreement (fit calls it once a step),
and the callback's save (state, data position, step counter, history).

Left out of TF's: detecting the platform (Borg, GCE maintenance events);
propagating an error in one process's step to the others (in jaxdist an
uncaught error already ends the job, see `jaxdist.initialize`); and
``save_checkpoint_if_preempted`` (a save inside a multi-step call: the state
exists only at the end of the call, which is where the handler saves).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import jax

from jaxdist._jax_compat import distributed_client
from jaxdist.checkpoint import Checkpoint, CheckpointManager
from jaxdist.checkpoint._checkpoint import (
    META,
    held_positions,
    iterator_positions,
    refuse_deleted,
)
from jaxdist.checkpoint._files import check_writable, read_json
from jaxdist.cluster_resolver import ClusterResolver, is_initialized
from jaxdist.experimental.preemption.agreement import (
    DEFAULT_TIMEOUT_S,
    KeyValueAgreement,
    LocalAgreement,
)
from jaxdist.experimental.preemption.termination import (
    RESTART_EXIT_CODE,
    TerminationConfig,
    check_config,
    default_exit,
)
from jaxdist.training.fit.checkpoints import Checkpoint as FitCheckpoint

__all__ = ["RESTART_EXIT_CODE", "PreemptionCheckpointHandler", "TerminationConfig"]

RUN_CALLS_ITEM = "total_run_calls"
"""The item the handler adds to the checkpoint: its count of steps (``run`` calls, or the
steps they ran where the function has ``last_call_steps``)."""

STEPS_ATTRIBUTE = "last_call_steps"
"""The attribute of a function given to ``run`` that says how many steps its last call
ran (`jaxdist.training.step.TrainStep` has it); without it, a call is one step."""

WATCH_INTERVAL_S = 0.5
"""How often the watcher thread calls ``termination_watcher_fn`` (at least once a second)."""

_WHERE = "jaxdist.experimental.PreemptionCheckpointHandler"
_NAME = "PreemptionCheckpointHandler"
NOTICE_TEXT = "termination notice received"
"""What the handler writes to stderr when its process gets a notice (the launcher's
`jaxdist.launch.config.NOTICE` finds it: keep the two equal)."""


class PreemptionCheckpointHandler:
    """Saves a checkpoint at a step every process agrees on when one is about to be
    stopped, then exits to be restarted; restores it when created (TF's handler).

    Args:
        cluster_resolver: the job's `jaxdist.cluster_resolver.ClusterResolver`
            (``strategy.cluster_resolver``), or None. The processes themselves
            are ``jax.distributed``'s: create the strategy (which starts it)
            before the handler.
        checkpoint_or_checkpoint_manager: a `jaxdist.checkpoint.Checkpoint`
            holding the training state (the handler then makes a
            ``CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=1)``),
            or a `jaxdist.checkpoint.CheckpointManager` you also save with; or,
            for `jaxdist.fit`, the `jaxdist.training.Checkpoint` callback that
            fit saves through (see "Under fit" below).
        checkpoint_dir: the directory of the checkpoints; required with a
            ``Checkpoint``, and left out (or the manager's) with a manager or a
            fit callback.
        termination_config: a `TerminationConfig`; default: SIGTERM is the
            notice, no grace period, ``sys.exit(42)`` after the save.

    The handler adds an item ``total_run_calls`` to the checkpoint, restores
    the latest checkpoint in the directory, and from then on:

    - `run` calls the training step and counts it (`total_run_calls`, which is
      saved in the checkpoint and restored, so a restarted loop knows where
      it is); a call that runs several steps counts as that many (see
      "Several steps per call" below);
    - on SIGTERM (a handler it installs, which also calls a Python SIGTERM
      handler installed before it; it replaces JAX's own preemption notifier),
      or once ``termination_watcher_fn`` returns True, every process of the
      job saves at the start of the same `run` call (before its function
      runs, as TF's handler does), then calls ``exit_fn``.

    One process, as TF's handler alone: the call that starts after the notice
    runs, and the save is at the start of the call after it.
    Several agree through the ``jax.distributed`` key-value store: a process
    with a notice publishes how many `run` calls it made, every process looks
    for such counts after each call (one non-blocking request) and publishes
    its own, and all save at the start of the call after the one that follows
    the largest count. So every process must call `run` once per training
    step (or group of steps), the same number of times.

    Either rebinding habit is saved whole: TF's, ``ckpt.state =
    handler.run(train, ckpt.state, next(it))``, where the new state reaches the
    checkpoint after `run` returns, and the state rebound inside the function
    (``ckpt.state = train(ckpt.state, ckpt.data)``). Iterator items are saved
    at their position at the end of the previous call (``get_state()`` after
    each call), so a batch taken for the next call before `run` is not skipped
    on resume. A checkpoint item that holds a deleted array (a state donated
    to a step, never rebound: ``state = handler.run(train, state, batch)`` with
    the checkpoint holding the first ``state``) is refused at the start of the
    second call, naming the item, not found first at preemption time.

    Several steps per call: ``total_run_calls`` keeps TF's name but counts
    steps. When the function given to `run` has an attribute
    ``last_call_steps`` (a ``jd.train_step(..., steps_per_execution=k)`` has:
    k, or fewer for the last group of the data), the handler adds it after
    each call instead of 1, and saves between calls (the state exists only
    there), which every process reaches after the same steps. A function
    that wraps such a step passes the count on::

        def step():
            ckpt.state = train(ckpt.state, ckpt.data)  # up to k batches from the iterator
            step.last_call_steps = train.last_call_steps

    The checkpoint must hold everything a step changes, including the data
    iterator (its position) and functional state rebound after each step.
    Take the batch inside the function, or pass ``next(iterator)`` as its
    argument; either way the saved position is after the batches the saved
    steps used. With ``save_fn`` the positions are the iterators' own at the
    start of the call (save_fn saves what it wants).

    Under fit: ``jd.fit(..., callbacks=[ckpt], preemption_handler=handler,
    resume=True)`` with ``handler = PreemptionCheckpointHandler(resolver,
    ckpt)`` and ``ckpt`` a `jaxdist.training.Checkpoint` callback. Such a
    handler restores nothing when it is created (``fit(resume=True)`` does, the
    data position and the step included) and has no `run`: fit tells it of
    every completed step, and at the agreed step boundary the callback saves
    (``ckpt-<step>``, waited for) before ``exit_fn`` runs. `total_run_calls`
    is then fit's global step. ``exit_fn`` and ``grace_period`` work as
    described; ``save_fn`` is refused (the callback is the save).

    Attributes:
        restored_from: the checkpoint restored when the handler was created, or None.
        last_save_seconds: how long the last save took, or None before the first.

    Example:
        >>> import tempfile, jax.numpy as jnp, jaxdist as jd
        >>> ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(()))
        >>> handler = jd.experimental.PreemptionCheckpointHandler(
        ...     None, ckpt, tempfile.mkdtemp(),
        ...     jd.experimental.TerminationConfig(termination_watcher_fn=lambda: False))
        >>> def step():
        ...     ckpt.w = ckpt.w + 1.0
        ...     return float(ckpt.w)
        >>> [handler.run(step) for _ in range(3)], handler.total_run_calls
        ([1.0, 2.0, 3.0], 3)
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None,
        checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        config = check_config(termination_config)
        # fit's Checkpoint callback, when fit saves (then there is no manager of its own).
        self.fit_checkpoint = _fit_callback(checkpoint_or_checkpoint_manager, checkpoint_dir)
        if self.fit_checkpoint is not None and config.save_fn is not None:
            raise ValueError(
                f"{_WHERE}: TerminationConfig(save_fn=...) replaces the handler's save, but a "
                "handler made with a jd.training.Checkpoint callback saves through that "
                "callback under jd.fit (state, data position, step and history); drop save_fn, "
                "or save in a callback of your own."
            )
        self._manager: CheckpointManager | None = None
        self._checkpoint: Checkpoint | None = None
        if self.fit_checkpoint is None:
            self._manager = _manager(checkpoint_or_checkpoint_manager, checkpoint_dir)
            self._checkpoint = self._manager.checkpoint
        if config.save_fn is None:  # the handler's save writes there: find a problem now
            owner = self._manager if self._manager is not None else self.fit_checkpoint
            assert owner is not None
            check_writable(_WHERE, owner.directory, "checkpoint_dir")
        self._agreement = _agreement(cluster_resolver)
        self._me = jax.process_index()
        self._watcher_fn = config.termination_watcher_fn
        self._exit_fn = config.exit_fn or default_exit
        self._save_fn = config.save_fn
        self._grace_period = float(config.grace_period or 0.0)

        self._run_counter = 0  # steps, restored from the checkpoint
        self._calls = 0  # run() calls (or fit steps) since this handler was made
        self._save_due = False  # every process agreed: save at the start of the next run()
        self._items_checked = False  # the checkpoint's items checked for donated arrays
        self._positions: dict[str, Any] = {}  # its iterators' positions after the last call
        self._last_steps = 1  # the steps of the last call
        self.restored_from: str | None = None
        if self._manager is not None:
            self._restore()
        # The round in progress (see _preemption_agreement), and this process's part in it.
        self._round = 0
        self._published: int | None = None  # the count this process published
        self._target: int | None = None  # the count every process saves at
        self._countdown = False  # between the first save and the final one (grace period)
        self._deadline: float | None = None  # when this process starts the final round
        self._margin = 0.0  # seconds left before the end of the grace period for the last save
        self._step_s = 0.0  # moving average of the time between run() calls
        self._last_call: float | None = None
        # Set from the signal handler or the watcher thread.
        self._notice_time: float | None = None
        self._noticed = False
        self._watcher_error: BaseException | None = None
        self._stop_watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self.last_save_seconds: float | None = None

        if self._watcher_fn is None:
            self._install_sigterm()
        else:
            self._start_watcher()
        if self._agreement.process_count > 1:
            atexit.register(self._at_exit)

    # Restoring ---------------------------------------------------------------------------

    def _restore(self) -> None:
        ckpt, manager = self._checkpoint, self._manager
        assert ckpt is not None and manager is not None
        if not hasattr(ckpt, RUN_CALLS_ITEM):
            setattr(ckpt, RUN_CALLS_ITEM, 0)
        latest = manager.latest_checkpoint
        if latest is not None:
            meta = read_json(_WHERE, os.path.join(latest, META), "the checkpoint's metadata")
            if RUN_CALLS_ITEM not in meta.get("items", {}):
                raise ValueError(
                    f"{_WHERE}: the latest checkpoint {latest} has no {RUN_CALLS_ITEM!r} item, "
                    "so it was not saved through a PreemptionCheckpointHandler and the handler "
                    "cannot tell how many steps it holds. Give the handler a directory of its "
                    "own, or create the handler before the manager saves there (it adds the "
                    "item to the Checkpoint)."
                )
        manager.restore_or_initialize()
        self._positions = iterator_positions(ckpt)
        self._run_counter = _count(getattr(ckpt, RUN_CALLS_ITEM))
        self.restored_from = latest

    # Watching ----------------------------------------------------------------------------

    def _notice(self, source: str) -> None:
        """A termination notice for this process (from SIGTERM or the watcher)."""
        if self._notice_time is None:
            self._notice_time = time.monotonic()
            if not self._countdown:
                # Written straight to the file descriptor: this runs in a signal handler,
                # which may interrupt a print in progress. The launcher reads it to say
                # which process was preempted.
                with contextlib.suppress(OSError):
                    os.write(2, f"jaxdist: {_NAME} (process {self._me}): {NOTICE_TEXT} "
                                f"({source}); saving at the start of the run() call every "
                                "process agrees on.\n".encode())  # fmt: skip
            if self._countdown and self._deadline is None:
                self._deadline = self._notice_time + self._grace_period - self._margin
        self._noticed = True

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                f"{_WHERE}: without a termination_watcher_fn the handler watches for SIGTERM, "
                "and Python installs signal handlers only in the main thread; create the "
                "handler in the main thread, or give TerminationConfig(termination_watcher_fn="
                "...) a function that polls for the notice."
            )
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            self._notice("SIGTERM")
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _start_watcher(self) -> None:
        fn = self._watcher_fn
        assert fn is not None
        self._stop_watching = stop = threading.Event()
        ref = weakref.ref(self)  # the thread ends once the handler is gone

        def watch() -> None:
            while not stop.is_set():
                try:
                    fired, error = bool(fn()), None
                except BaseException as e:  # reported by the next run() call
                    fired, error = False, e
                handler = ref()
                if handler is None:
                    return
                if error is not None:
                    handler._watcher_error = error
                    return
                if fired:
                    handler._notice("termination_watcher_fn")
                    return
                del handler
                stop.wait(WATCH_INTERVAL_S)

        name = f"jaxdist-preemption-watcher-{self._me}"
        self._watcher = threading.Thread(target=watch, name=name, daemon=True)
        self._watcher.start()

    def _stop_watcher(self) -> None:
        self._stop_watching.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * WATCH_INTERVAL_S)
        self._watcher = None

    def _at_exit(self) -> None:
        """A process that leaves while a round is under way tells the others its count, so
        that a process waiting for it is not kept waiting (the job has no step left)."""
        with contextlib.suppress(Exception):
            if self._published is None and self._agreement.peers_noticed(self._round):
                self._agreement.publish(self._round, self._calls)

    # Running -----------------------------------------------------------------------------

    @property
    def total_run_calls(self) -> int:
        """How many steps `run` ran, counting those before the restart that the restored
        checkpoint holds (TF's name): one per call, or the function's
        ``last_call_steps`` after each call where it has that attribute. So
        ``total_run_calls // steps_per_epoch`` is the epoch to resume at."""
        return self._run_counter

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs one training step, ``distributed_train_function(*args, **kwargs)``, and
        returns its result; then, if a preemption round is under way, takes this
        process's part in it (which may save the checkpoint and call ``exit_fn``).

        Call it once per training step (or group of steps), in every process. A
        ``distributed_train_function`` with an attribute ``last_call_steps`` (a
        ``jd.train_step(..., steps_per_execution=k)``) adds that many steps to
        `total_run_calls` after each call; any other adds 1.

        Raises:
            RuntimeError: the ``termination_watcher_fn`` raised (chained), or a
                process did not reach the agreed step (see the message).
            TypeError: the function's ``last_call_steps`` is not an int >= 1.
            ValueError: the handler was made with a `jaxdist.training.Checkpoint`
                callback (it is for `jaxdist.fit`).
        """
        if self.fit_checkpoint is not None:
            raise ValueError(
                f"{_WHERE}.run: this handler was made with a jd.training.Checkpoint callback "
                "and saves through jd.fit; pass it to fit (jd.fit(..., callbacks=[checkpoint], "
                "preemption_handler=handler)), or make the handler with a "
                "jd.checkpoint.Checkpoint of the state for a loop of your own."
            )
        self._raise_watcher_error("run")
        self._before_call()
        result = distributed_train_function(*args, **kwargs)
        steps = _steps_of(distributed_train_function)
        self._last_steps = steps
        self._counted(self._run_counter + steps)
        return result

    def fit_step_end(self, step: int) -> None:
        """Called by `jaxdist.fit` after each completed step (its global ``step``), in every
        process: this process's part in a preemption round, which may save through fit's
        `Checkpoint` callback and call ``exit_fn``."""
        self._raise_watcher_error("jaxdist.fit")
        self._counted(step)

    def _raise_watcher_error(self, where: str) -> None:
        if self._watcher_error is not None:
            error, self._watcher_error = self._watcher_error, None
            name = f"{_WHERE}.run" if where == "run" else f"{where} (preemption_handler)"
            raise RuntimeError(
                f"{name}: the termination_watcher_fn raised {type(error).__name__}: "
                f"{error}; it must return True or False without raising."
            ) from error

    def _counted(self, count: int) -> None:
        """A call completed: ``count`` steps now (counted by run(), or fit's global step)."""
        self._run_counter = count
        self._calls += 1
        if self._checkpoint is not None:
            setattr(self._checkpoint, RUN_CALLS_ITEM, count)
            self._positions = iterator_positions(self._checkpoint)
        if self._grace_period:
            now = time.monotonic()
            if self._last_call is not None:
                self._step_s += 0.2 * ((now - self._last_call) - self._step_s)
            self._last_call = now
        if self._checkpoint is not None and self._agreement.process_count == 1:
            return  # one process in a loop of its own: the next run() call decides
        if self._noticed or self._published is not None or self._agreement.process_count > 1:
            self._after_call()

    def _before_call(self) -> None:
        """The start of a run() call: the save agreed on happens here, before the call, as
        in TF: the checkpoint then holds what the loop rebound after the previous call
        (``ckpt.state = handler.run(...)``). In one process, as TF's local mode: the call
        that starts after a notice (or the grace period's end) runs, and the save is at the
        start of the call after it, so a job of one process and one of several save after
        the same call (several: `agreement`, ``max(c) + 1``)."""
        assert self._checkpoint is not None
        if self._calls == 1 and not self._items_checked:
            # The second call: a loop that never rebinds the checkpoint's state shows here.
            self._items_checked = True
            refuse_deleted(f"{_WHERE}.run", self._checkpoint, _REBIND)
        if self._save_due:
            self._save_due = False
            self._save_and_exit()
        elif self._agreement.process_count == 1 and self._round_begun():
            if self._target is None:
                self._target = self._calls + 1  # this call runs; TF: run_counter + 1
            elif self._calls >= self._target:
                self._save_and_exit()

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """A context for the training loop; it does nothing here (TF needs it for
        TPUStrategy; kept so that TF code runs unchanged).

        Example:
            >>> import tempfile, jaxdist as jd
            >>> handler = jd.experimental.PreemptionCheckpointHandler(
            ...     None, jd.checkpoint.Checkpoint(), tempfile.mkdtemp(),
            ...     jd.experimental.TerminationConfig(termination_watcher_fn=lambda: False))
            >>> with handler.watch_preemption_scope():
            ...     handler.run(lambda: 1)
            1
        """
        yield

    def _after_call(self) -> None:
        # The processes agree on a call, not a step count: they run the same calls, each
        # of the same steps, but the next call's steps are unknown (a short last group).
        count = self._calls
        if self._published is None:
            if not self._round_begun():
                return
            self._published = count
            self._agreement.publish(self._round, count)
            if self._agreement.process_count > 1:
                return  # one more call: the others may need it to publish
        if self._target is None:
            self._target = self._agreement.target(self._round, count)
        if count < self._target:
            return
        if count > self._target:  # only a run() call outside the training loop can do this
            raise RuntimeError(
                f"{_WHERE}.run: process {self._me} made {count} run() calls since the handler "
                f"was made, past the {self._target} after which every process saves; each "
                "process must call run() once per training step (or group of steps), the "
                "same number of times."
            )
        if self.fit_checkpoint is not None:
            self._save_and_exit()  # fit holds the state itself: saved after the step
        else:
            self._save_due = True  # at the start of the next run() call, in every process

    def _round_begun(self) -> bool:
        if self._countdown:  # the final round: this process's deadline, or another's
            mine = self._deadline is not None and time.monotonic() >= self._deadline
        else:
            mine = self._noticed
        return mine or self._agreement.peers_noticed(self._round)

    def _save_and_exit(self) -> None:
        start = time.monotonic()
        if self._save_fn is not None:
            self._save_fn()
            saved = "saved with save_fn"
        elif self.fit_checkpoint is not None:
            self.fit_checkpoint.save()  # this step's checkpoint, unless it was just saved
            self.fit_checkpoint.wait_until_finished()  # written before exit_fn
            saved = f"fit's Checkpoint callback saved {self.fit_checkpoint.last_checkpoint}"
        else:
            assert self._manager is not None and self._checkpoint is not None
            refuse_deleted(f"{_WHERE}.run", self._checkpoint, _REBIND)
            with held_positions(self._checkpoint, self._positions):
                saved = f"saved {self._manager.save()}"
            self._manager.wait_until_finished()  # an asynchronous manager: written before exit
        self.last_save_seconds = time.monotonic() - start
        if self.fit_checkpoint is not None:
            what = f"{saved} after step {self._run_counter}"
        elif self._last_steps == 1:
            what = f"{saved} after run() call {self._run_counter}"
        else:
            what = (
                f"{saved} after step {self._run_counter} (the end of a run() call of "
                f"{self._last_steps} steps)"
            )
        self._round += 1
        self._published = self._target = None
        if self._grace_period and not self._countdown:
            self._countdown = True
            self._margin = self.last_save_seconds + 3 * self._step_s
            if self._notice_time is not None:
                self._deadline = self._notice_time + self._grace_period - self._margin
            left = ""
            if self._notice_time is not None:
                seconds = self._grace_period - (time.monotonic() - self._notice_time)
                left = f", {seconds:.1f} s left"
            _say(self._me, f"{what}; training on for the grace period{left}.")
            return
        self._stop_watcher()
        self._countdown, self._deadline = False, None
        self._notice_time, self._noticed = None, False
        _say(self._me, f"{what}; calling exit_fn.")
        self._exit_fn()
        # exit_fn returned: training goes on, and the next notice starts a new round.
        if self._watcher_fn is not None:
            self._start_watcher()


_REBIND = (
    "the handler saves at the start of a run() call, so the checkpoint must hold the state "
    "the previous call returned: rebind it after each call (ckpt.state = handler.run(train, "
    "ckpt.state, next(it))) or inside the function given to run (ckpt.state = "
    "train(ckpt.state, batch)), not a local variable the checkpoint does not see"
)


def _say(process: int, message: str) -> None:
    print(f"jaxdist: {_NAME} (process {process}): {message}", file=sys.stderr, flush=True)


def _steps_of(fn: Any) -> int:
    """The steps ``fn``'s last call ran: its ``last_call_steps``, or 1 without it."""
    steps = getattr(fn, STEPS_ATTRIBUTE, 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise TypeError(
            f"{_WHERE}.run: {getattr(fn, '__name__', repr(fn))}.{STEPS_ATTRIBUTE} is "
            f"{steps!r}; the handler reads it after each call as the number of steps that "
            "call ran (an int >= 1). Set it to the steps run (a wrapper of a "
            "jd.train_step: `fn.last_call_steps = train.last_call_steps`), or remove it "
            "to count one step per call."
        )
    return steps


def _count(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{_WHERE}: the checkpoint's {RUN_CALLS_ITEM!r} item is {value!r}, not a count; the "
            "handler keeps its count of steps in that item, so leave the name to it."
        ) from None


def _fit_callback(item: Any, checkpoint_dir: str | os.PathLike[str] | None) -> FitCheckpoint | None:
    """The `jaxdist.training.Checkpoint` callback given (fit saves through it), or None."""
    if not isinstance(item, FitCheckpoint):
        return None
    if checkpoint_dir is not None and os.path.abspath(checkpoint_dir) != item.directory:
        raise ValueError(
            f"{_WHERE}: checkpoint_dir={os.fspath(checkpoint_dir)!r} differs from the "
            f"directory of the jd.training.Checkpoint callback given ({item.directory!r}); "
            "leave checkpoint_dir out with a callback (its directory is used)."
        )
    return item


def _manager(item: Any, checkpoint_dir: str | os.PathLike[str] | None) -> CheckpointManager:
    if isinstance(item, CheckpointManager):
        if checkpoint_dir is not None and os.path.abspath(checkpoint_dir) != item.directory:
            raise ValueError(
                f"{_WHERE}: checkpoint_dir={os.fspath(checkpoint_dir)!r} differs from the "
                f"directory of the CheckpointManager given ({item.directory!r}); leave "
                "checkpoint_dir out with a manager (its directory is used)."
            )
        return item
    if isinstance(item, Checkpoint):
        if checkpoint_dir is None:
            raise ValueError(
                f"{_WHERE}: checkpoint_dir is required with a Checkpoint (the handler makes "
                "CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=1)); pass a "
                "directory, or a CheckpointManager instead of the Checkpoint."
            )
        return CheckpointManager(item, checkpoint_dir, max_to_keep=1)
    raise TypeError(
        f"{_WHERE}: checkpoint_or_checkpoint_manager must be a jaxdist.checkpoint.Checkpoint or "
        f"CheckpointManager (or, for jd.fit, a jd.training.Checkpoint callback), got "
        f"{type(item).__name__}. Wrap the state: "
        "jd.checkpoint.Checkpoint(model=model, optimizer=optimizer, data=iterator)."
    )


def _agreement(resolver: Any) -> LocalAgreement | KeyValueAgreement:
    if resolver is not None and not isinstance(resolver, ClusterResolver):
        raise TypeError(
            f"{_WHERE}: cluster_resolver must be a jaxdist.cluster_resolver.ClusterResolver "
            f"(e.g. strategy.cluster_resolver) or None, got {type(resolver).__name__}."
        )
    count = jax.process_count()
    if count == 1:
        if resolver is not None and not is_initialized():
            try:
                wanted = int(resolver.jax_initialize_kwargs()["num_processes"])
            except ValueError:  # an empty cluster: one process
                wanted = 1
            if wanted > 1:
                raise RuntimeError(
                    f"{_WHERE}: the cluster resolver describes {wanted} processes, but "
                    "jax.distributed is not running in this one; create the strategy first "
                    "(jd.MultiWorkerMirroredStrategy(cluster_resolver)) or call "
                    "jd.initialize(cluster_resolver), then the handler."
                )
        return LocalAgreement()
    client = distributed_client()
    if client is None:
        raise RuntimeError(
            f"{_WHERE}: this job has {count} processes but no jax.distributed coordination "
            "service, through which the processes agree on the step to save at; start the "
            "job with jax.distributed (jd.initialize() or jd.MultiWorkerMirroredStrategy())."
        )
    return KeyValueAgreement(client, jax.process_index(), count, DEFAULT_TIMEOUT_S)
