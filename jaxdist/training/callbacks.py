"""Callbacks for `jaxdist.fit`: the hook protocol, checkpoints and early stopping.

A callback subclasses `Callback` and overrides the hooks it needs. `fit`
hands every callback the running `FitLoop` (``callback.loop``) before the
first hook: the training state, the position (epoch, global step) and a
``stop_training`` switch.

`Checkpoint` saves the state with orbax-checkpoint (``pip install
'jaxdist[checkpoint]'``): NNX objects as their ``nnx.state``, functional
states (a `TrainState`, any pytree of arrays) as they are, every array as a
host copy. orbax writes each checkpoint into a temporary directory and
renames it when complete, so a checkpoint on disk is always whole; an
interrupted write leaves only a temporary directory that restoring ignores.
Each checkpoint also records the SHA-256 of every array (beside the step, in
its JSON metadata); `restore_checkpoint` verifies them, so a file damaged
after it was written cannot restore silently.
`restore_checkpoint` puts a checkpoint back: NNX objects in place, functional
states returned. `EarlyStopping` stops when a monitored metric stops
improving and can put the best state back.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jaxdist.checkpoint import manifest_leaves, verify_leaves
from jaxdist.training._nnx import is_nnx_node
from jaxdist.training._state_io import (
    host_state,
    load_state,
)

__all__ = [
    "Callback",
    "Checkpoint",
    "EarlyStopping",
    "FitLoop",
    "Restored",
    "restore_checkpoint",
]


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
        interrupted: True once Ctrl-C stopped the loop.
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


# Checkpoints ------------------------------------------------------------------------------


def _orbax(where: str) -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            f"{where} needs orbax-checkpoint: pip install 'jaxdist[checkpoint]'."
        ) from e
    return ocp


def _manager(directory: str, keep: int | None, async_write: bool, create: bool) -> Any:
    ocp = _orbax("jaxdist.training.Checkpoint")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=create, enable_async_checkpointing=async_write
    )
    return ocp.CheckpointManager(directory, options=options)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `restore_checkpoint` returns.

    Attributes:
        state: the functional state(s) read back: the value itself when one
            state argument is functional, a tuple of them (in argument order)
            when several are, None when every argument is an NNX object
            (restored in place).
        step: the global step the checkpoint was written at (``initial_step``
            for a resumed `fit`).
        epoch: the epochs whose batches were all trained when it was written
            (``initial_epoch`` for a resumed `fit`).
    """

    state: Any
    step: int
    epoch: int


def functional_result(state: tuple[Any, ...], functional: Sequence[bool]) -> Any:
    """The functional entries of ``state``: one value, a tuple, or None (private helper)."""
    picked = tuple(s for s, f in zip(state, functional, strict=True) if f)
    if not picked:
        return None
    return picked[0] if len(picked) == 1 else picked


def restore_checkpoint(
    directory: str | os.PathLike[str], *state: Any, step: int | None = None, verify: bool = True
) -> Restored:
    """Restores a checkpoint written by `Checkpoint` into ``state``.

    NNX objects among ``state`` are updated in place (their variables get the
    saved values, placed where the current values are); functional states
    (a `TrainState`, a pytree of arrays) serve as templates for structure,
    dtype and placement, and the restored values are returned.

    Args:
        directory: the directory given to `Checkpoint`.
        *state: the state arguments, as given to `fit` (same order).
        step: the checkpoint to read; the latest complete one by default.
        verify: check every array against the checksums saved with it first
            (ValueError naming the first one that differs).

    Returns:
        A `Restored` with the functional state(s), the step and the epoch;
        resume with ``fit(..., initial_step=r.step, initial_epoch=r.epoch)``.

    Example:
        >>> import tempfile, jax.numpy as jnp, optax, jaxdist as jd
        >>> state = {"w": jnp.arange(3.0)}
        >>> loop = jd.training.FitLoop(jd.get_strategy(), (state,), (True,), step=5)
        >>> ckpt = jd.training.Checkpoint(tempfile.mkdtemp() + "/ckpt")
        >>> ckpt.set_loop(loop)
        >>> ckpt.save()
        >>> ckpt.close()
        >>> r = jd.training.restore_checkpoint(ckpt.directory, {"w": jnp.zeros(3)})
        >>> r.step, r.state["w"].tolist()
        (5, [0.0, 1.0, 2.0])
    """
    where = "jaxdist.training.restore_checkpoint"
    if not state:
        raise TypeError(
            f"{where}: give the state to restore into after the directory, as given to fit: "
            "restore_checkpoint(directory, model, optimizer) or restore_checkpoint(directory, "
            "train_state)."
        )
    path = os.path.abspath(directory)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{where}: no checkpoint directory {path}.")
    ocp = _orbax(where)
    manager = _manager(path, None, async_write=False, create=False)
    try:
        steps = manager.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"{where}: {path} holds no complete checkpoint (temporary directories of "
                "unfinished writes are ignored)."
            )
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise FileNotFoundError(
                f"{where}: {path} has no checkpoint at step {step}; it has steps {sorted(steps)}."
            )
        read = manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
        )
    finally:
        manager.close()
    meta = read["meta"]
    if verify:
        where_step = os.path.join(path, str(step))
        if not isinstance(meta, Mapping) or "leaves" not in meta:
            raise ValueError(
                f"{where}: the checkpoint in {where_step} carries no checksums (it was written "
                "by an earlier jaxdist, or its metadata was replaced), so it cannot be "
                "verified. Pass verify=False to restore it without checking."
            )
        verify_leaves(where, where_step, meta["leaves"], read["state"])
    functional = tuple(not is_nnx_node(s) for s in state)
    restored = load_state(read["state"], tuple(state), where)
    return Restored(functional_result(restored, functional), int(meta["step"]), int(meta["epoch"]))


class Checkpoint(Callback):
    """Saves the training state every few steps and/or every epoch, keeping the last few.

    Checkpoints are numbered by global step (directory ``<directory>/<step>``)
    and written with orbax-checkpoint: each goes to a temporary directory
    that is renamed when complete, so what is on disk is always whole. With
    ``async_write`` the files are written in the background while training
    goes on (the arrays are copied to the host first, so later steps cannot
    change them); `fit` waits for the last write before it returns, also
    after Ctrl-C.

    Args:
        directory: where to write; created if missing. It must not hold
            checkpoints past the step training starts from (resume with
            `restore_checkpoint` and ``fit(initial_step=...)``).
        every_n_steps: also save after every ``every_n_steps``-th global step.
        every_epoch: save at the end of every epoch.
        keep: how many checkpoints to keep (the newest); None keeps all.
        async_write: write in a background thread.

    Example:
        >>> import jaxdist as jd
        >>> jd.training.Checkpoint("/tmp/run1", every_n_steps=100, keep=2).keep
        2
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_n_steps: int | None = None,
        every_epoch: bool = True,
        keep: int | None = 3,
        async_write: bool = True,
    ) -> None:
        where = "jaxdist.training.Checkpoint"
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 1
        ):
            raise ValueError(f"{where}: every_n_steps must be an int >= 1, got {every_n_steps!r}.")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"{where}: keep must be an int >= 1 or None, got {keep!r}.")
        self.directory = os.path.abspath(directory)
        self.every_n_steps = every_n_steps
        self.every_epoch = every_epoch
        self.keep = keep
        self.async_write = async_write
        self._manager: Any = None
        self._last_saved: int | None = None

    def on_train_begin(self, logs: dict[str, float]) -> None:
        self._open()
        later = [s for s in self._manager.all_steps() if s > self.loop.step]
        if later:
            raise ValueError(
                f"jaxdist.training.Checkpoint: {self.directory} already holds checkpoints at "
                f"steps {sorted(later)}, past step {self.loop.step} where this training "
                "starts; they would be mixed with this run's. To resume, restore with "
                "jd.training.restore_checkpoint(directory, *state) and pass "
                "initial_step=restored.step to fit; otherwise use a new directory."
            )

    def on_step_end(self, step: int, logs: Mapping[str, float]) -> None:
        due = self.every_n_steps is not None and step % self.every_n_steps == 0
        if due and not (self.every_epoch and self.loop.at_epoch_end):  # else saved at its end
            self.save()

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        if self.every_epoch:
            self.save()

    def on_train_end(self, logs: dict[str, float]) -> None:
        self.close()

    def _open(self) -> None:
        if self._manager is None:
            self._manager = _manager(self.directory, self.keep, self.async_write, create=True)

    def save(self) -> None:
        """Writes the loop's current state now, as checkpoint ``loop.step``."""
        loop = self.loop
        if self._last_saved == loop.step:
            return
        self._open()
        ocp = _orbax("jaxdist.training.Checkpoint")
        epoch = loop.epoch + 1 if loop.at_epoch_end else loop.epoch
        host = host_state(loop.state)
        meta = {
            "step": loop.step,
            "epoch": epoch,
            "leaves": manifest_leaves("jaxdist.training.Checkpoint", host),
        }
        saved = self._manager.save(
            loop.step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(host),
                meta=ocp.args.JsonSave(meta),
            ),
        )
        if not saved:
            raise RuntimeError(
                f"jaxdist.training.Checkpoint: orbax did not write step {loop.step} to "
                f"{self.directory} (a checkpoint of that step exists already)."
            )
        self._last_saved = loop.step

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints in the directory, ascending."""
        self._open()
        return sorted(self._manager.all_steps())

    def close(self) -> None:
        """Waits for the write in progress and closes the orbax manager."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None


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
