"""Files that appear whole or not at all, and the processes' turns at writing them.

A checkpoint directory is written under a temporary name, flushed to disk
(`fsync_tree`) and renamed into place (`publish`): a rename within one
directory is atomic, so a reader (or a process restarted after ``kill -9``)
sees the old state or the new one, never a half-written one. Small metadata
files go the same way (`write_json`).

In a job of several processes every process holds the whole host state,
so process 0 writes the arrays and creates, renames and deletes
directories, while each process writes its own small files (its iterator
positions); `barrier` keeps the processes in step between those phases,
through the ``jax.distributed`` coordination service (not an XLA collective,
so it never overlaps a training step's programs and may run in a background
thread).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
from typing import Any

import jax

from jaxdist._jax_compat import distributed_client

__all__ = [
    "barrier",
    "check_writable",
    "fsync_tree",
    "is_primary",
    "publish",
    "read_json",
    "remove_tree",
    "write_json",
]

# A barrier waits this long for the other processes (a save of a large state by a slow
# process can take minutes); a process that died ends the job through jax.distributed's
# heartbeat before that.
BARRIER_TIMEOUT_S = 1800

_BARRIERS = itertools.count()  # every process passes the same barriers in the same order


def is_primary() -> bool:
    """True in the process that creates, renames and deletes checkpoint directories."""
    return jax.process_index() == 0


def barrier(what: str) -> None:
    """Waits until every process of the job has reached this point (no-op in one process)."""
    client = distributed_client()
    if client is None or jax.process_count() == 1:
        return
    name = f"jaxdist/checkpoint/{next(_BARRIERS)}/{what}"
    client.wait_at_barrier(name, BARRIER_TIMEOUT_S * 1000)


def check_writable(where: str, directory: str, argument: str) -> None:
    """Raises ``ValueError`` unless files can be created in ``directory`` (made if missing,
    then removed again if this made it): found when a job starts, not at its first save."""
    made: list[str] = []
    here = directory
    while not os.path.lexists(here):
        made.append(here)
        here = os.path.dirname(here)
    probe = os.path.join(directory, f".jaxdist-write-test.{os.getpid()}")
    try:
        for level in reversed(made):
            os.mkdir(level)
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"{where}: {argument}={directory!r} cannot hold checkpoints: {type(e).__name__}: "
            f"{e.strerror or e} ({e.filename or here}). Give a directory this process can "
            "create files in."
        ) from None
    finally:
        for level in made:
            with contextlib.suppress(OSError):
                os.rmdir(level)


def _fsync(path: str, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Flushes every file and directory under ``root`` (and ``root`` itself) to disk."""
    for here, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(os.path.join(here, name), directory=False)
        _fsync(here, directory=True)


def remove_tree(path: str) -> None:
    """Deletes a directory that may be listed as complete: renamed away first (atomically),
    so that an interrupted delete never leaves a partial directory under its name."""
    if not os.path.lexists(path):
        return
    doomed = f"{path}.deleted"
    if os.path.lexists(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def publish(tmp: str, final: str) -> None:
    """Makes the complete directory ``tmp`` visible as ``final`` (replacing one there)."""
    fsync_tree(tmp)
    parent = os.path.dirname(final)
    doomed = None
    if os.path.lexists(final):  # overwritten: the old one leaves under another name first
        doomed = f"{final}.deleted"
        if os.path.lexists(doomed):
            shutil.rmtree(doomed, ignore_errors=True)
        os.rename(final, doomed)
    os.rename(tmp, final)
    _fsync(parent, directory=True)
    if doomed is not None:
        shutil.rmtree(doomed, ignore_errors=True)


def _digest(body: Any) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write_json(path: str, body: Any, *, durable: bool = True) -> None:
    """Writes ``{"body": body, "sha256": ...}`` to ``path`` atomically (temporary file,
    rename); `read_json` checks the checksum. ``durable``: flushed to disk first (not
    needed inside a directory that `publish` flushes)."""
    tmp = f"{path}.{jax.process_index()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"body": body, "sha256": _digest(body)}, f, indent=1, sort_keys=True)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        with contextlib.suppress(OSError):  # some file systems cannot open a directory
            _fsync(os.path.dirname(path) or ".", directory=True)


def read_json(where: str, path: str, what: str) -> Any:
    """The body of a file written by `write_json`, after checking its checksum.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not valid JSON or does not match its checksum.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where}: {what} {path} is missing.")
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        body, digest = record["body"], record["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{where}: {what} {path} is damaged ({type(e).__name__}: {e}). Restore an earlier "
            "checkpoint."
        ) from None
    if _digest(body) != digest:
        raise ValueError(
            f"{where}: {what} {path} does not match its SHA-256 checksum: it was changed or "
            "damaged after it was written. Restore an earlier checkpoint."
        )
    return body
