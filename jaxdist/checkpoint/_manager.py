"""`CheckpointManager`: numbered checkpoints in one directory, the last few kept (TF's).

Entries are directories ``<directory>/<checkpoint_name>-<N>``, each a whole
`Checkpoint` written under a temporary name and renamed into place when
complete (a process killed during a save leaves the previous entries as they
were, and its temporary directory is removed by the next save). Deleting an
old entry renames it away first, so a half-deleted entry is never listed.

The manager's state (its entries, oldest first) is recorded in
``jaxdist_checkpoints.json`` in the directory, so a new manager over the same
directory (after a restart) manages the same entries; complete entries on
disk that the record lacks (a save interrupted between its rename and the
record's update) are added after the recorded ones, by number.

Asynchronous saves (``enable_async_checkpointing=True``, orbax's option): `save`
copies the arrays to the host (training stalls only for that copy) and returns;
a background thread writes the directory, flushes it, renames it into place and
updates the record, while training goes on. One save is in flight at a time:
the next `save`, `restore_or_initialize`, `latest_checkpoint`, `checkpoints`,
`wait_until_finished` and `close` wait for it first, and raise its error if it
failed (the entries saved before it are intact). The background thread runs no
JAX computation and no XLA collective (see `Snapshot`), so it never overlaps a
training step's collectives, also in a job of several processes.

Left out of TF's ``tf.train.CheckpointManager``: ``keep_checkpoint_every_n_hours``,
``step_counter`` / ``checkpoint_interval`` (save when you want a checkpoint)
and save ``options``.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxdist.checkpoint import _files
from jaxdist.checkpoint._checkpoint import (
    META,
    Checkpoint,
    Snapshot,
    set_save_counter,
    take_snapshot,
)
from jaxdist.checkpoint._lock import DirectoryLock, describe, writer_identity

__all__ = ["CheckpointManager"]

STATE = "jaxdist_checkpoints.json"
_FORMAT = "jaxdist-checkpoint-manager"
_CHECKPOINT_NAME = re.compile(r"^[^./\\\x00][^/\\\x00]*$")  # a file name, not hidden


class CheckpointManager:
    """Saves numbered checkpoints of a `Checkpoint` into a directory, keeping the newest.

    Args:
        checkpoint: the `Checkpoint` to save and restore.
        directory: where the checkpoints go (created on the first save).
        max_to_keep: how many checkpoints to keep, the newest; ``None`` keeps
            all. Older ones are deleted right after a save.
        checkpoint_name: the entries' name before ``-<N>``.
        init_fn: called by `restore_or_initialize` when there is no
            checkpoint to restore.
        enable_async_checkpointing: write in a background thread: `save`
            returns once the arrays are copied to the host, and the files are
            written while training goes on (see `wait_until_finished`).

    A manager over a directory that already holds checkpoints (a restarted
    job) takes them over: `latest_checkpoint` is the last written (also by
    `Checkpoint.save` into the directory, as in TF), and the next save
    deletes the oldest beyond ``max_to_keep``. Directories named like its
    entries that jaxdist did not write are refused (``FileExistsError``), never
    replaced. One manager writes into a directory at a time: the first `save`
    locks it until `close` (or the end of the process), and a second manager's
    `save` raises ``RuntimeError`` naming the first's process and program. In
    a job of several processes every process makes the manager and calls
    `save` at the same step; process 0
    writes the files and renames and deletes the entries.

    With ``enable_async_checkpointing=True`` (orbax's option) `save` stalls the
    caller only for the copy of the arrays to the host, and a background thread
    writes the entry while training goes on; the next save, a restore,
    `latest_checkpoint`, `checkpoints` and `wait_until_finished` wait for it (and
    raise its error, if it failed). Call `wait_until_finished` (or `close`)
    before the program reads the files itself, calls
    ``jax.distributed.shutdown()`` or ends with ``os._exit``; a normal exit
    waits for the write.

    Example:
        >>> import os, tempfile, jax.numpy as jnp, jaxdist as jd
        >>> ckpt = jd.checkpoint.Checkpoint(step=jnp.int32(0))
        >>> manager = jd.checkpoint.CheckpointManager(ckpt, tempfile.mkdtemp(), max_to_keep=2)
        >>> manager.restore_or_initialize() is None  # nothing saved yet
        True
        >>> for step in range(1, 4):
        ...     ckpt.step = jnp.int32(step)
        ...     _ = manager.save()
        >>> [os.path.basename(p) for p in manager.checkpoints]
        ['ckpt-2', 'ckpt-3']
        >>> os.path.basename(manager.restore_or_initialize()), int(ckpt.step)
        ('ckpt-3', 3)
        >>> background = jd.checkpoint.CheckpointManager(
        ...     ckpt, tempfile.mkdtemp(), enable_async_checkpointing=True
        ... )
        >>> path = background.save()  # returns once the arrays are on the host
        >>> background.wait_until_finished()  # the entry is complete and listed
        >>> background.latest_checkpoint == path
        True
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 1,
        *,
        checkpoint_name: str = "ckpt",
        init_fn: Callable[[], Any] | None = None,
        enable_async_checkpointing: bool = False,
    ) -> None:
        where = "jaxdist.checkpoint.CheckpointManager"
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"{where}: checkpoint must be a jaxdist.checkpoint.Checkpoint, got "
                f"{type(checkpoint).__name__}. Wrap the state: "
                "CheckpointManager(jd.checkpoint.Checkpoint(model=model, ...), directory)."
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(
                f"{where}: max_to_keep must be a positive int or None (keep all), got "
                f"{max_to_keep!r}."
            )
        if not isinstance(checkpoint_name, str) or not _CHECKPOINT_NAME.match(checkpoint_name):
            raise ValueError(
                f"{where}: checkpoint_name must be a file name (not empty, no '/' or '\\', "
                f"not starting with '.'), got {checkpoint_name!r}."
            )
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"{where}: init_fn must be callable, got {type(init_fn).__name__}.")
        if not isinstance(enable_async_checkpointing, bool):
            raise TypeError(
                f"{where}: enable_async_checkpointing must be True or False, got "
                f"{enable_async_checkpointing!r}."
            )
        self._checkpoint = checkpoint
        self._directory = os.path.abspath(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._init_fn = init_fn
        self._entry = re.compile(rf"^{re.escape(checkpoint_name)}-(\d+)$")
        self._async = enable_async_checkpointing
        self._writer: threading.Thread | None = None
        self._failure: tuple[str, BaseException] | None = None
        self._lock = DirectoryLock(self._directory)
        self._identity: dict[str, Any] | None = None
        self._entries = self._recover()

    # State ------------------------------------------------------------------------------

    def _recover(self) -> list[str]:
        """The complete entries on disk, oldest first: the recorded ones in the recorded order,
        the unrecorded ones before or after them by when they were written."""
        if not os.path.isdir(self._directory):
            return []
        named = [
            n
            for n in os.listdir(self._directory)
            if self._entry.match(n) and os.path.isdir(os.path.join(self._directory, n))
        ]
        on_disk = {n for n in named if os.path.exists(os.path.join(self._directory, n, META))}
        foreign = sorted(set(named) - on_disk, key=lambda n: int(n.rsplit("-", 1)[1]))
        if foreign:
            raise FileExistsError(
                f"jaxdist.checkpoint.CheckpointManager: {self._directory} holds "
                f"{', '.join(foreign)}, named like this manager's checkpoints but not written "
                f"by jaxdist (no {META} inside); a save would replace them. Move them out, or "
                "give the manager another directory or checkpoint_name."
            )
        recorded: list[str] = []
        state_file = os.path.join(self._directory, STATE)
        if os.path.exists(state_file):
            try:
                body = _files.read_json("CheckpointManager", state_file, "the manager's record")
                if not isinstance(body, dict) or body.get("format") != _FORMAT:
                    raise ValueError(f"{state_file} is not a CheckpointManager record")
                recorded = [str(n) for n in body["checkpoints"]]
            except (ValueError, KeyError, TypeError) as e:
                warnings.warn(
                    f"jaxdist.checkpoint.CheckpointManager: ignoring its record in "
                    f"{self._directory} ({e}); the checkpoints there are taken in the order "
                    "of their numbers.",
                    UserWarning,
                    stacklevel=3,
                )
        kept = [n for n in recorded if n in on_disk]
        rest = sorted(on_disk - set(kept), key=lambda n: int(n.rsplit("-", 1)[1]))
        if not kept:
            return rest
        # An unrecorded entry written after the record is a save interrupted before its
        # record (the newest); one written before it (by `Checkpoint.save` into this
        # directory) is older than every recorded one: the latest is the last written, as
        # TF's `latest_checkpoint` (whose metadata `Checkpoint.save` updates) says.
        recorded_at = os.stat(state_file).st_mtime_ns
        older = [n for n in rest if self._written_at(n) < recorded_at]
        return older + kept + [n for n in rest if n not in older]

    def _written_at(self, name: str) -> int:
        """When entry ``name``'s metadata was written (nanoseconds since the epoch)."""
        return os.stat(os.path.join(self._directory, name, META)).st_mtime_ns

    def _record(self) -> None:
        body = {
            "format": _FORMAT,
            "version": 1,
            "checkpoints": list(self._entries),
            "writer": self._identity,
        }
        _files.write_json(os.path.join(self._directory, STATE), body)

    def _take_lock(self) -> None:
        """Makes this manager the directory's one writer (process 0, at the first save)."""
        if not _files.is_primary() or self._lock.held:
            return
        if not self._lock.acquire():
            writer = None
            with contextlib.suppress(Exception):
                body = _files.read_json("", os.path.join(self._directory, STATE), "")
                writer = body.get("writer")
            raise RuntimeError(
                f"jaxdist.checkpoint.CheckpointManager.save: {self._directory} is locked by "
                f"{describe(writer)}, which saves checkpoints there; two writers would delete "
                "each other's checkpoints. Nothing was saved. Stop the other writer (or close "
                "its manager: manager.close()), or give this one another directory."
            )
        if self._lock.held:
            self._identity = writer_identity()
            self._record()  # names this writer to a manager the lock refuses

    # Properties -------------------------------------------------------------------------

    @property
    def enable_async_checkpointing(self) -> bool:
        """Whether `save` writes in a background thread."""
        return self._async

    @property
    def checkpoint(self) -> Checkpoint:
        """The `Checkpoint` this manager saves."""
        return self._checkpoint

    @property
    def directory(self) -> str:
        """The directory of the checkpoints (absolute)."""
        return self._directory

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the most recently saved checkpoint, or None when there is none
        (after the save in flight, if any, completes)."""
        self.wait_until_finished()
        return os.path.join(self._directory, self._entries[-1]) if self._entries else None

    @property
    def checkpoints(self) -> list[str]:
        """The paths of the managed checkpoints, oldest first (after the save in flight,
        if any, completes)."""
        self.wait_until_finished()
        return [os.path.join(self._directory, n) for n in self._entries]

    # Saving and restoring ---------------------------------------------------------------

    def save(self, checkpoint_number: Any = None, *, allow_nonfinite: bool = False) -> str:
        """Saves the checkpoint as ``<checkpoint_name>-<N>`` and deletes the oldest beyond
        ``max_to_keep``.

        ``N`` is ``checkpoint_number`` when given (an int, or an integer scalar
        such as a step counter), else the checkpoint's `save_counter`, which
        every save increments either way (as in TF). Saving a number that
        exists replaces that checkpoint, which becomes the newest. A state
        holding NaN or infinite values is refused (``ValueError``; nothing is
        written and `save_counter` is left as it was) unless
        ``allow_nonfinite=True``.

        With ``enable_async_checkpointing`` it waits for the save in flight (raising
        its error), copies the arrays to the host and returns; the entry appears
        under the returned path once written completely (`wait_until_finished`).

        Returns:
            The path of the new checkpoint.
        """
        self.wait_until_finished()
        self._take_lock()
        ckpt = self._checkpoint
        counter = ckpt.save_counter + 1
        set_save_counter(ckpt, counter)
        number = counter if checkpoint_number is None else _number(checkpoint_number)
        name = f"{self._name}-{number}"
        try:
            snapshot = take_snapshot(
                ckpt,
                "jaxdist.checkpoint.CheckpointManager.save",
                frozen=self._async,
                allow_nonfinite=allow_nonfinite,
            )
        except BaseException:
            set_save_counter(ckpt, counter - 1)
            raise
        if not self._async:
            return self._write(snapshot, name)
        # Not a daemon: an interpreter that exits normally finishes the write first.
        self._writer = threading.Thread(
            target=self._write_in_background,
            args=(snapshot, name),
            name=f"jaxdist-checkpoint-{name}",
        )
        self._writer.start()
        return os.path.join(self._directory, name)

    def _write_in_background(self, snapshot: Snapshot, name: str) -> None:
        try:
            self._write(snapshot, name)
        except BaseException as e:  # raised in the caller's thread by wait_until_finished
            self._failure = (name, e)

    def _write(self, snapshot: Snapshot, name: str) -> str:
        """Writes ``snapshot`` as the entry ``name``, deletes the oldest beyond
        ``max_to_keep`` and records the entries."""
        path = snapshot.write(os.path.join(self._directory, name))
        entries = [n for n in self._entries if n != name] + [name]
        doomed: list[str] = []
        if self._max_to_keep is not None and len(entries) > self._max_to_keep:
            doomed = entries[: -self._max_to_keep]
            entries = entries[-self._max_to_keep :]
        self._entries = entries
        if _files.is_primary():
            # Deleted, then recorded: a save interrupted before its record leaves the new
            # entry unrecorded, which `_recover` takes as the newest (old entries that
            # survive an interrupted sweep are still recorded as the oldest).
            for old in doomed:
                _files.remove_tree(os.path.join(self._directory, old))
            self._record()
        return path

    def wait_until_finished(self) -> None:
        """Waits until the save in flight (an asynchronous one) is complete.

        Raises:
            RuntimeError: the save in flight failed (its error is the cause);
                the checkpoints saved before it are intact, and the manager
                can save again.
        """
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            (name, error), self._failure = self._failure, None
            raise RuntimeError(
                f"jaxdist.checkpoint.CheckpointManager: the asynchronous save of {name} to "
                f"{self._directory} failed ({type(error).__name__}: {error}). The checkpoints "
                "saved before it are intact; fix the cause and save again."
            ) from error

    def close(self) -> None:
        """Waits for the save in flight, like `wait_until_finished` (orbax's name), and lets
        go of the directory, which another manager may then write (a later `save` takes it
        again)."""
        try:
            self.wait_until_finished()
        finally:
            self._lock.release()

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint into the `Checkpoint`, or, when there is none,
        calls ``init_fn`` (if given).

        Returns:
            The path restored, or None when there was no checkpoint.
        """
        latest = self.latest_checkpoint  # after the save in flight
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None


def _number(value: Any) -> int:
    x = np.asarray(value)
    if x.ndim or not np.issubdtype(x.dtype, np.integer) or int(x) < 0:
        raise ValueError(
            "jaxdist.checkpoint.CheckpointManager.save: checkpoint_number must be a "
            f"non-negative integer (an int or an integer scalar array), got {value!r}."
        )
    return int(x)
