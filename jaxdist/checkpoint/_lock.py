"""One writer per directory of checkpoints: a `CheckpointManager` holds an exclusive lock on
its directory from its first save until `CheckpointManager.close`.

Two managers saving into one directory (two jobs started with the same
path, or a restarted job while the old one still runs) would delete each
other's entries and interleave their records, and a job restarted from there
restores the wrong entry. The lock is ``flock`` on the directory itself:
the kernel drops it when the holder's process ends however it ends
(``kill -9`` included), so a restarted job never finds a stale lock, and it
holds between two managers in one process too (each opens the directory). The
holder writes who it is into the manager's record, so that the refused one
can name it. Where the file system has no locks (some network and object
stores), saving goes on without one.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["DirectoryLock", "writer_identity"]

try:
    import fcntl
except ImportError:  # not POSIX: no lock (the rest of the checkpoint code works)
    fcntl = None  # type: ignore[assignment]


def writer_identity() -> dict[str, Any]:
    """Who this process is, as the manager's record names the writer of a directory."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "program": " ".join(sys.argv)[:200],
        "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def describe(writer: Any) -> str:
    """A writer recorded by `writer_identity`, in words."""
    if not isinstance(writer, dict):
        return "another CheckpointManager (it has not recorded who it is yet)"
    pid, host = writer.get("pid"), writer.get("host")
    here = pid == os.getpid() and host == socket.gethostname()
    who = "another CheckpointManager in this process" if here else f"process {pid} on {host}"
    return f"{who} (running {writer.get('program')!r}, writing there since {writer.get('since')})"


class DirectoryLock:
    """An exclusive lock on a directory, held from `acquire` to `release`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Takes the lock (creating the directory). Returns False if another holder has it;
        True if taken, or if the file system has no locks."""
        if self._fd is not None or fcntl is None:
            return True
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:  # no directory to lock: the save reports why (and locks next time)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            # Held by another; any other error: no locks here, go on without one.
            return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        self._fd = fd
        return True

    def release(self, _close: Callable[[int], None] = os.close) -> None:
        # ``os.close`` is bound when the class is made, and no module is used: a manager
        # still open when the interpreter exits is released after the modules' globals
        # are gone (``contextlib.suppress`` printed "Exception ignored" there).
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:  # noqa: SIM105 - see above
                _close(fd)  # closing the only descriptor drops the flock
            except OSError:
                pass

    def __del__(self) -> None:
        self.release()
