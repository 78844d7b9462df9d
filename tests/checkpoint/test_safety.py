"""Checkpoints never destroy what is not theirs or the last good state (issue 29, item 2):
a write over a directory of user files is refused; a manager refuses entries it did not
write; one writer per directory, named to the second; a full disk leaves nothing behind."""

from __future__ import annotations

import errno
import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.checkpoint import _storage

from _helpers import finish, start_python

pytest.importorskip("orbax.checkpoint")


def _user_files(directory: Path) -> dict[str, str]:
    directory.mkdir(parents=True)
    files = {"notes.txt": "my results", "data.csv": "1,2,3"}
    for name, text in files.items():
        (directory / name).write_text(text)
    return files


def test_write_over_a_directory_of_user_files_is_refused_and_leaves_them(tmp_path: Path) -> None:
    # Before: the directory was renamed to .deleted and removed with everything in it.
    ckpt = jd.checkpoint.Checkpoint(w=jnp.arange(3.0))
    files = _user_files(tmp_path / "results")
    with pytest.raises(
        FileExistsError,
        match=r"results exists and is not a checkpoint jaxdist wrote: it is a directory of "
        r"other files \(data.csv, notes.txt\)\. .* nothing was written",
    ):
        ckpt.write(tmp_path / "results")
    assert {p.name: p.read_text() for p in (tmp_path / "results").iterdir()} == files
    (tmp_path / "file-1").write_text("not a directory")
    with pytest.raises(FileExistsError, match=r"file-1 exists .*: it is a file\."):
        ckpt.save(tmp_path / "file")
    assert (tmp_path / "file-1").read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file-1", "results"]  # nothing else
    # What may be replaced: an empty directory, and a checkpoint (the next write's).
    (tmp_path / "empty").mkdir()
    ckpt.write(tmp_path / "empty")
    ckpt.w = jnp.ones(3)
    ckpt.write(tmp_path / "empty")
    fresh = jd.checkpoint.Checkpoint(w=jnp.zeros(3))
    fresh.read(tmp_path / "empty")
    np.testing.assert_array_equal(np.asarray(fresh.w), np.ones(3))


def test_a_manager_refuses_an_entry_it_did_not_write(tmp_path: Path) -> None:
    # Before: a user's ckpt-1 folder was adopted as a checkpoint and replaced by the first save.
    files = _user_files(tmp_path / "ckpt-1")
    with pytest.raises(
        FileExistsError,
        match=r"CheckpointManager: .* holds ckpt-1, named like this manager's checkpoints but "
        r"not written by jaxdist \(no jaxdist_checkpoint.json inside\)",
    ):
        jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(w=jnp.zeros(2)), tmp_path)
    assert {p.name: p.read_text() for p in (tmp_path / "ckpt-1").iterdir()} == files
    # Another name leaves it alone.
    other = jd.checkpoint.CheckpointManager(
        jd.checkpoint.Checkpoint(w=jnp.zeros(2)), tmp_path, checkpoint_name="run"
    )
    assert other.save().endswith("run-1") and (tmp_path / "ckpt-1" / "notes.txt").exists()


def test_two_managers_in_one_process_one_writer_at_a_time(tmp_path: Path) -> None:
    # Before: both wrote, deleting each other's entries; a restarted job restored the wrong one.
    first = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(w=jnp.zeros(2)), tmp_path)
    first.save()
    second_ckpt = jd.checkpoint.Checkpoint(w=jnp.ones(2))
    second = jd.checkpoint.CheckpointManager(second_ckpt, tmp_path)
    assert second.latest_checkpoint == str(tmp_path / "ckpt-1")  # reading is fine
    with pytest.raises(
        RuntimeError,
        match=rf"save: {tmp_path} is locked by another CheckpointManager in this process "
        r"\(running .*, writing there since .*\), which saves checkpoints there; .*Nothing was "
        r"saved\. .*manager\.close\(\)",
    ):
        second.save()
    assert second_ckpt.save_counter == 0 and first.checkpoints == [str(tmp_path / "ckpt-1")]
    first.close()  # lets go
    assert second.save() == str(tmp_path / "ckpt-1")  # its counter's number, replacing it
    with pytest.raises(RuntimeError, match=r"is locked by another CheckpointManager"):
        first.save()


_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    import jax.numpy as jnp
    import jaxdist as jd

    manager = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(w=jnp.zeros(2)), sys.argv[1])
    manager.save()
    print(os.getpid(), flush=True)
    time.sleep(120)
    """
)


@pytest.mark.timeout(120)
def test_a_writer_in_another_process_is_named_and_a_killed_one_leaves_no_lock(
    tmp_path: Path,
) -> None:
    holder = start_python(_HOLDER, str(tmp_path), devices=1)
    try:
        assert holder.stdout is not None
        pid = int(holder.stdout.readline())
        manager = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(w=jnp.ones(2)), tmp_path)
        with pytest.raises(RuntimeError, match=rf"is locked by process {pid} on \S+ \(running "):
            manager.save()
        os.kill(pid, signal.SIGKILL)  # kill -9: the kernel drops the lock with the process
        finish(holder, timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert manager.save() == str(tmp_path / "ckpt-1")


_LEFT_OPEN = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp
    import jaxdist as jd

    manager = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(w=jnp.zeros(2)), sys.argv[1])
    manager.save()
    print("saved", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_a_manager_left_open_at_exit_lets_go_quietly(tmp_path: Path) -> None:
    """A script that never closes its manager (a module global, as most training scripts
    have) exits 0 with nothing on stderr about the lock. Before: "Exception ignored in
    DirectoryLock.__del__ ... TypeError: 'NoneType' object is not callable" at every exit
    (the lock was released after the interpreter had torn down its modules)."""
    proc = start_python(_LEFT_OPEN, str(tmp_path), devices=1)
    out, err = finish(proc, timeout=100)
    assert proc.returncode == 0 and out.strip() == "saved", err[-3000:]
    assert "DirectoryLock" not in err and "Exception ignored" not in err, err[-3000:]
    manager = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(w=jnp.ones(2)), tmp_path)
    assert manager.save() == str(tmp_path / "ckpt-1")  # the lock went with the process


class _FullDisk:
    """orbax's writer on a disk that fills up halfway: some files written, then the error
    tensorstore reports through orbax."""

    def __init__(self, path_seen: list[str]) -> None:
        self.path_seen = path_seen

    def save(self, path: str, tree: Any) -> None:
        os.makedirs(path, exist_ok=True)
        Path(path, "half_written").write_bytes(b"\0" * 1024)
        self.path_seen.append(path)
        raise ValueError(
            "RESOURCE_EXHAUSTED: Error writing local file: No space left on device [OSError]"
        )

    def close(self) -> None:
        pass


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_says_so_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    # Before: orbax's raw RESOURCE_EXHAUSTED, and a temporary folder left in the directory.
    ckpt = jd.checkpoint.Checkpoint(w=jnp.arange(4.0))
    manager = jd.checkpoint.CheckpointManager(
        ckpt, tmp_path, max_to_keep=1, enable_async_checkpointing=asynchronous
    )
    manager.save()
    manager.wait_until_finished()
    seen: list[str] = []
    monkeypatch.setattr(_storage, "_writer", lambda: _FullDisk(seen))
    ckpt.w = jnp.zeros(4)
    with pytest.raises((OSError, RuntimeError)) as info:
        manager.save()
        manager.wait_until_finished()
    error = info.value if isinstance(info.value, OSError) else info.value.__cause__
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert "is full (ValueError: RESOURCE_EXHAUSTED" in str(error)
    assert "the checkpoint was not written, and what was written of it is removed" in str(error)
    assert seen and not os.path.exists(seen[0])  # the half-written directory is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1", "jaxdist_checkpoints.json"]
    monkeypatch.undo()  # space again: the last good checkpoint is there, and saving works
    fresh = jd.checkpoint.Checkpoint(w=jnp.zeros(4))
    fresh.restore(manager.latest_checkpoint)
    np.testing.assert_array_equal(np.asarray(fresh.w), np.arange(4.0))
    assert manager.save().endswith("ckpt-3")
    manager.close()  # an asynchronous write finishes inside the test


def test_a_rename_failing_over_an_entry_gives_the_old_entry_its_name_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving a number that exists replaces that entry: the old one is renamed away, then
    the new one renamed in. If the second rename fails, the old entry is renamed back, so
    the error's "the checkpoints saved before are intact" holds. Before: the old entry was
    left as ``ckpt-1.deleted`` and the manager had no ``ckpt-1``."""
    ckpt = jd.checkpoint.Checkpoint(w=jnp.arange(4.0))
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path)
    manager.save(1)
    real_rename = os.rename
    failed: list[str] = []

    def failing(src: Any, dst: Any) -> None:
        if str(src).endswith("ckpt-1.tmp") and not failed:  # once, then the cleanup works
            failed.append(str(dst))
            raise OSError(errno.EIO, "injected rename failure", str(src))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    ckpt.w = jnp.zeros(4)
    with pytest.raises(OSError, match="injected rename failure"):
        manager.save(1)
    monkeypatch.undo()
    assert failed == [str(tmp_path / "ckpt-1")]  # the rename that publishes the new entry
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1", "jaxdist_checkpoints.json"]
    fresh = jd.checkpoint.Checkpoint(w=jnp.ones(4))
    fresh.restore(str(tmp_path / "ckpt-1"))
    np.testing.assert_array_equal(np.asarray(fresh.w), np.arange(4.0))
    manager.close()


def test_every_file_is_flushed_before_the_rename_that_publishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A planted bug skipped the flush: after a power loss the renamed entry could hold
    # empty files under a complete-looking name.
    flushed: set[str] = set()
    published: list[tuple[str, set[str]]] = []
    real_fsync, real_rename = os.fsync, os.rename
    opened: dict[int, str] = {}
    real_open = os.open

    def tracking_open(path: Any, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, *args, **kwargs)
        opened[fd] = os.fspath(path)
        return fd

    def tracking_fsync(fd: int) -> None:
        real_fsync(fd)
        if fd in opened:
            flushed.add(os.path.realpath(opened[fd]))

    def tracking_rename(src: Any, dst: Any) -> None:
        src = os.fspath(src)
        if src.startswith(str(tmp_path)) and src.endswith(".tmp") and os.path.isdir(src):
            files = {os.path.realpath(os.path.join(h, n)) for h, _, ns in os.walk(src) for n in ns}
            published.append((src, files - flushed))
        real_rename(src, dst)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "fsync", tracking_fsync)
    monkeypatch.setattr(os, "rename", tracking_rename)
    manager = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(w=jnp.arange(8.0)), tmp_path)
    manager.save()
    monkeypatch.undo()
    assert len(published) == 1, published  # the entry, renamed from its temporary name
    src, not_flushed = published[0]
    assert src.endswith("ckpt-1.tmp") and not not_flushed, sorted(not_flushed)[:5]
