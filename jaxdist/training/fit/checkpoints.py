"""`jaxdist.fit`'s checkpoints: the `Checkpoint` callback, resuming, `restore_checkpoint`.

`Checkpoint` saves through `jaxdist.checkpoint.CheckpointManager`, the one
checkpoint code path of jaxdist: entries ``<directory>/ckpt-<step>``, each
written under a temporary name and renamed into place when complete (a
process killed during a save leaves the previous checkpoints as they were),
each carrying the SHA-256 manifest that every restore verifies. A fit
checkpoint holds the state arguments (NNX objects restored in place,
functional states as pytrees), the training data's position
(`DistributedIterator.get_state`) and the loop's counters, running epoch
metrics and `History` (see `jaxdist.training.fit.resume`), so that
``fit(..., resume=True)`` continues mid-epoch exactly where it stopped.

The arrays are copied to the host when the save starts, so the next
training step (which donates its input buffers) cannot change what is
written; with ``async_write`` the files are then written by a background
thread while training goes on, one save at a time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import jax

from jaxdist.checkpoint import Checkpoint as _ItemCheckpoint
from jaxdist.checkpoint import CheckpointManager
from jaxdist.checkpoint._finite import refuse_nonfinite
from jaxdist.training.fit.callbacks import Callback, FitLoop, functional_result
from jaxdist.training.fit.resume import (
    DATA,
    LOOP,
    Frozen,
    Sink,
    item_name,
    parse_loop_state,
    snapshot,
)
from jaxdist.training.step.nnx import is_nnx_node, nnx_module

__all__ = ["Checkpoint", "Restored", "restore_checkpoint"]

_ENTRY = "ckpt"
_STEP_DIR = re.compile(r"^\d+$")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `restore_checkpoint` returns.

    Attributes:
        state: the functional state(s) read back: the value itself when one
            state argument is functional, a tuple of them (in argument order)
            when several are, None when every argument is an NNX object
            (restored in place).
        step: the global step the checkpoint was written at.
        epoch: the epochs whose batches were all trained when it was written.
    """

    state: Any
    step: int
    epoch: int


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What `Checkpoint.restore_latest` read besides the state (private to `fit`)."""

    path: str
    loop: dict[str, Any]  # `parse_loop_state`'s record
    data: Any  # the iterator's state, or None when it was not recorded


def _bind(ckpt: _ItemCheckpoint, items: dict[str, Any], bound: set[str]) -> set[str]:
    """Makes ``items`` the checkpoint's items, dropping those of ``bound`` (the names bound
    before) that it lacks; returns the names now bound."""
    for name in bound - set(items):
        delattr(ckpt, name)
    for name, item in items.items():
        setattr(ckpt, name, item)
    return set(items)


def _restore_items(state: tuple[Any, ...]) -> tuple[dict[str, Any], Sink, Sink]:
    """The items to restore into: the state arguments and two sinks (data position, loop
    record)."""
    data, loop = Sink(), Sink()
    return {**{item_name(i): s for i, s in enumerate(state)}, DATA: data, LOOP: loop}, data, loop


def _restored_state(ckpt: _ItemCheckpoint, state: tuple[Any, ...]) -> tuple[Any, ...]:
    """The state arguments after a restore: NNX objects (updated in place) as they are,
    functional states replaced by the restored values."""
    return tuple(s if is_nnx_node(s) else getattr(ckpt, item_name(i)) for i, s in enumerate(state))


def _old_format_hint(directory: str) -> str:
    if os.path.isdir(directory) and any(_STEP_DIR.match(n) for n in os.listdir(directory)):
        return (
            " It holds directories named by step number: checkpoints of an earlier jaxdist "
            "(orbax steps without the data position), which this version does not read."
        )
    return ""


_DIRECTORY_FIX = (
    "Keep the directory for the whole run (another job or a cleanup script may have removed "
    "it), or give the Checkpoint a directory this process can write."
)


def _directory_problem(directory: str, missing: str = "disappeared") -> str | None:
    """What is wrong with a checkpoint directory: None if nothing."""
    if not os.path.lexists(directory):
        return missing
    if not os.path.isdir(directory):
        return "is a file, not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def _short(error: BaseException, limit: int = 300) -> str:
    """The first ``limit`` characters of an error's message (storage layers can write
    kilobytes of spec; the whole error stays chained as the cause)."""
    text = str(error)
    return text if len(text) <= limit else f"{text[:limit]}... (the whole error is the cause)"


def _arrays_of(item: Any) -> Any:
    """The arrays of a `snapshot`: an NNX object's state, or the pytree itself."""
    if is_nnx_node(item):
        nnx = nnx_module()
        assert nnx is not None
        return nnx.state(item)
    return item


class Checkpoint(Callback):
    """Saves the training state every few steps and/or every epoch, keeping the last few.

    Each checkpoint is ``<directory>/ckpt-<step>``, written by a
    `jaxdist.checkpoint.CheckpointManager` (atomic entries with a verified
    SHA-256 manifest). It holds the state arguments, the position of the
    training data and the loop's counters, so ``jd.fit(..., resume=True)``
    with this callback continues from the latest checkpoint exactly (mid-epoch
    included). When `fit` stops on Ctrl-C or SIGTERM, the callback also saves
    at that step boundary. The arrays are copied to the host when a save
    starts; with ``async_write`` the files are written in the background while
    training goes on (`fit` waits for the last write before it returns, also
    after Ctrl-C).

    Args:
        directory: where to write; created if missing. Without
            ``resume=True`` it must not hold checkpoints past the step
            training starts from.
        every_n_steps: also save after every ``every_n_steps``-th global step.
        every_epoch: save at the end of every epoch.
        keep: how many checkpoints to keep (the newest); None keeps all.
        async_write: write the files in a background thread (in a job of one
            process; with several, the processes take the state's host copy
            and meet at the save's barriers in the training thread).
        allow_nonfinite: save states holding NaN or infinite values. By
            default such a save raises ``ValueError`` naming the step, the
            epoch and the first non-finite arrays, and nothing is written
            (the latest checkpoint stays the last finite state). After
            `TerminateOnNaN` stopped training, nothing is saved either way.

    Attributes:
        last_checkpoint: the path of the last checkpoint this callback wrote
            (None before the first).

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
        allow_nonfinite: bool = False,
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
        self.allow_nonfinite = allow_nonfinite
        self.last_checkpoint: str | None = None
        self._items = _ItemCheckpoint()
        self._bound: set[str] = set()  # the names of the items bound to it
        self._manager: CheckpointManager | None = None
        self._last_saved: tuple[int, bool] | None = None
        self._writer: threading.Thread | None = None
        self._failure: tuple[int, BaseException] | None = None
        self._saved_in_run = False  # this fit run has saved here (the directory must stay)
        self._group_due = False  # a save fell due inside a group of steps_per_execution

    @property
    def manager(self) -> CheckpointManager:
        """The `jaxdist.checkpoint.CheckpointManager` over `directory` (made on first use)."""
        if self._manager is None:
            self._manager = CheckpointManager(
                self._items, self.directory, max_to_keep=self.keep, checkpoint_name=_ENTRY
            )
        return self._manager

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints in the directory, ascending."""
        self._wait()
        return sorted(int(os.path.basename(p).rsplit("-", 1)[1]) for p in self.manager.checkpoints)

    # Hooks ----------------------------------------------------------------------------

    def on_train_begin(self, logs: dict[str, float]) -> None:
        self._saved_in_run = False
        later = [s for s in self.all_steps() if s > self.loop.step]
        if later:
            raise ValueError(
                f"jaxdist.training.Checkpoint: {self.directory} already holds checkpoints at "
                f"steps {later}, past step {self.loop.step} where this training starts; they "
                "would be mixed with this run's. To continue from the latest, pass "
                "resume=True to jd.fit; otherwise use a new directory."
            )

    def on_step_end(self, step: int, logs: Mapping[str, float]) -> None:
        due = self.every_n_steps is not None and step % self.every_n_steps == 0
        if self.loop.mid_group:  # steps_per_execution: saved at the group's end
            self._group_due = self._group_due or due
            return
        due, self._group_due = due or self._group_due, False
        if due and not (self.every_epoch and self.loop.at_epoch_end):  # else saved at its end
            self.save()

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        if self.every_epoch:
            self.save()

    def on_train_end(self, logs: dict[str, float]) -> None:
        # Ctrl-C or SIGTERM: save at this step boundary, unless this step's checkpoint exists.
        if self.loop.interrupted and (self._last_saved or (None,))[0] != self.loop.step:
            self.save()
        self._wait()

    # Saving ---------------------------------------------------------------------------

    def save(self) -> None:
        """Saves the loop's current state now, as checkpoint ``ckpt-<loop.step>``.

        The arrays are copied to the host before this returns; with
        ``async_write`` the files are written in the background (an error
        there is raised by the next save or by `close`).
        """
        loop = self.loop
        record = loop.record
        key = (loop.step, record.epoch_ended)
        if self._last_saved == key or loop.nonfinite is not None:
            return
        self._wait()
        problem = _directory_problem(self.directory) if self._saved_in_run else None
        if problem is not None:
            raise RuntimeError(
                f"jaxdist.training.Checkpoint: the checkpoint directory {self.directory} "
                f"{problem} during the run, after it received this run's checkpoints; they "
                f"are gone, and the checkpoint of step {loop.step} is not written. "
                f"{_DIRECTORY_FIX}"
            )
        self._saved_in_run = True
        items = {item_name(i): snapshot(s) for i, s in enumerate(loop.state)}
        if not self.allow_nonfinite:
            refuse_nonfinite(
                "jaxdist.training.Checkpoint",
                {name: _arrays_of(item) for name, item in items.items()},
                f"the state after {loop.where}",
            )
        items[DATA] = Frozen(record.data)
        items[LOOP] = Frozen(record.state(loop.step, loop.epoch, loop.at_epoch_end))
        self._bound = _bind(self._items, items, self._bound)
        self._last_saved = key
        step = loop.step
        # Several processes write in the training thread: the save reads every array to the
        # host and meets the other processes at barriers, which keeps it in step order.
        if self.async_write and jax.process_count() == 1:
            self._writer = threading.Thread(
                target=self._write, args=(step,), name="jaxdist-fit-checkpoint"
            )
            self._writer.start()
        else:
            self._write(step)
            self._wait()

    def _write(self, step: int) -> None:
        try:
            # The state was checked in `save` (host copies: no second pass needed here).
            self.last_checkpoint = self.manager.save(checkpoint_number=step, allow_nonfinite=True)
        except BaseException as e:  # raised in the training thread by _wait
            self._failure = (step, e)

    def wait_until_finished(self) -> None:
        """Waits for the write in progress (``async_write``); raises its error, if it failed."""
        self._wait()

    def _wait(self) -> None:
        """Waits for the write in progress; raises its error, if it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            (step, error), self._failure = self._failure, None
            problem = _directory_problem(
                self.directory, "does not exist (removed during the run, or not creatable)"
            )
            if problem is not None:
                raise RuntimeError(
                    f"jaxdist.training.Checkpoint: the checkpoint directory {self.directory} "
                    f"{problem}, so the checkpoint of step {step} could not be written "
                    f"({type(error).__name__}: {_short(error)}). {_DIRECTORY_FIX}"
                ) from error
            raise RuntimeError(
                f"jaxdist.training.Checkpoint: writing the checkpoint of step {step} to "
                f"{self.directory} failed ({type(error).__name__}: {_short(error)}); the "
                "checkpoints written before it are intact."
            ) from error

    def close(self) -> None:
        """Waits for the write in progress (raising its error, if it failed); the next `fit`
        call reads the directory afresh."""
        try:
            self._wait()
        finally:
            self._manager = None

    # Restoring ------------------------------------------------------------------------

    def restore_latest(self, loop: FitLoop) -> Resumed | None:
        """Restores the latest checkpoint into ``loop.state`` (verified; nothing changes
        unless it all verifies); None when there is none. Used by ``fit(resume=True)``."""
        where = "jaxdist.fit(resume=True)"
        self._wait()
        manager = self.manager
        path = manager.latest_checkpoint
        if path is None:
            return None
        items, data, record = _restore_items(loop.state)
        self._bound = _bind(self._items, items, self._bound)
        try:
            self._items.restore(path)
        except (ValueError, FileNotFoundError) as e:
            earlier = manager.checkpoints[:-1]
            fallback = (
                f"delete {path} to resume from the one before ({earlier[-1]})"
                if earlier
                else f"delete {path} to start afresh"
            )
            raise ValueError(
                f"{where}: the latest checkpoint {path} cannot be restored: {e} Nothing was "
                f"changed. To go on, {fallback}, or pass resume=False with a new directory."
            ) from e
        loop.state = _restored_state(self._items, loop.state)
        saved = parse_loop_state(where, path, record.state)
        self._last_saved = (saved["step"], saved["epoch_ended"])
        return Resumed(path, saved, data.state)


def restore_checkpoint(
    directory: str | os.PathLike[str], *state: Any, step: int | None = None, verify: bool = True
) -> Restored:
    """Restores the state from a checkpoint written by `Checkpoint` into ``state``.

    NNX objects among ``state`` are updated in place (their variables get the
    saved values, placed where the current values are); functional states
    (a `TrainState`, a pytree of arrays) serve as templates for structure,
    dtype and placement, and the restored values are returned. Every array is
    checked against the checkpoint's SHA-256 manifest first.

    This gives the state only (for evaluation, or another program). To
    continue training, pass ``resume=True`` to `fit` with the same
    `Checkpoint` callback: it also restores the data position and the
    loop's counters, mid-epoch included.

    Args:
        directory: the directory given to `Checkpoint`.
        *state: the state arguments, as given to `fit` (same order).
        step: the checkpoint to read; the latest by default.
        verify: deprecated and ignored: checkpoints are always verified.

    Returns:
        A `Restored` with the functional state(s), the step and the epoch.

    Example:
        >>> import tempfile, jax.numpy as jnp, jaxdist as jd
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
    if not verify:
        warnings.warn(
            f"{where}: verify=False is deprecated and ignored: fit's checkpoints are written "
            "by jaxdist.checkpoint.CheckpointManager and always verified against their "
            "SHA-256 manifest.",
            DeprecationWarning,
            stacklevel=2,
        )
    if not state:
        raise TypeError(
            f"{where}: give the state to restore into after the directory, as given to fit: "
            "restore_checkpoint(directory, model, optimizer) or restore_checkpoint(directory, "
            "train_state)."
        )
    path = os.path.abspath(directory)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{where}: no checkpoint directory {path}.")
    items = _ItemCheckpoint()
    manager = CheckpointManager(items, path, max_to_keep=None, checkpoint_name=_ENTRY)
    entries = manager.checkpoints
    if not entries:
        raise FileNotFoundError(
            f"{where}: {path} holds no complete checkpoint (no {_ENTRY}-<step> entry)."
            + _old_format_hint(path)
        )
    if step is None:
        chosen = entries[-1]
    else:
        chosen = os.path.join(path, f"{_ENTRY}-{step}")
        if chosen not in entries:
            steps = sorted(int(os.path.basename(p).rsplit("-", 1)[1]) for p in entries)
            raise FileNotFoundError(
                f"{where}: {path} has no checkpoint at step {step}; it has steps {steps}."
            )
    bound, _, record = _restore_items(tuple(state))
    _bind(items, bound, set())
    try:
        items.restore(chosen)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{where}: the checkpoint {chosen} cannot be restored: {e}") from e
    loop = parse_loop_state(where, chosen, record.state)
    restored = _restored_state(items, tuple(state))
    functional = tuple(not is_nnx_node(s) for s in state)
    epoch = loop["epoch"] + (1 if loop["data_done"] else 0)
    return Restored(functional_result(restored, functional), loop["step"], epoch)
