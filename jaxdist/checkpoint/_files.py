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
from collections.abc import Iterator
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
    "together",
    "write_json",
]

# A barrier waits this long for the other processes (a save of a large state by a slow
# process can take minutes); a process that died ends the job through jax.distributed's
# heartbeat before that.
BARRIER_TIMEOUT_S = 1800

_BARRIERS = itertools.count()  # every process passes the same barriers in the same order
_MAX_REPORT = 2000  # characters of a failed process's error that the others show


def is_primary() -> bool:
    """True in the process that creates, renames and deletes checkpoint directories."""
    return jax.process_index() == 0


def barrier(what: str, failure: Exception | None = None) -> None:
    """Waits until every process of the job has reached this point, then raises in every
    process if any of them arrived with a ``failure``: its own in that process, a
    `RuntimeError` naming it in the others. So a process whose part of a save failed
    never leaves the others waiting for it, and all of them pass the same barriers in
    the same order afterwards. In one process: raises ``failure``, if any.
    """
    client = distributed_client()
    if client is None or jax.process_count() == 1:
        if failure is not None:
            raise failure
        return
    name = f"jaxdist/checkpoint/{next(_BARRIERS)}/{what}"
    if failure is not None:
        text = f"{type(failure).__name__}: {failure}"
        client.key_value_set(f"{name}/failed/{jax.process_index()}", text[:_MAX_REPORT])
    client.wait_at_barrier(name, BARRIER_TIMEOUT_S * 1000)
    if failure is not None:
        raise failure
    failed = sorted(
        (int(key.rsplit("/", 1)[1]), text)
        for key, text in client.key_value_dir_get(f"{name}/failed/")
    )
    if failed:
        who = "; ".join(f"process {p}: {text}" for p, text in failed)
        raise RuntimeError(
            f"jaxdist.checkpoint: the save failed in another process of the job, at its "
            f"'{what}' step ({who}). Nothing was saved by this save; the checkpoints saved "
            "before are intact. Every process raises this error together, so the job may "
            "catch it and save again later (after fixing the cause), or end."
        )


@contextlib.contextmanager
def together(what: str) -> Iterator[None]:
    """Runs the body in every process, then `barrier` ``what``: if the body raised in any
    process, every process raises (see `barrier`)."""
    failure: Exception | None = None
    try:
        yield
    except Exception as e:  # reported to the other processes, then raised
        failure = e
    barrier(what, failure)


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
    """Makes the complete directory ``tmp`` visible as ``final`` (replacing one there; if
    the new one cannot take its name, the old one gets it back)."""
    fsync_tree(tmp)
    parent = os.path.dirname(final)
    doomed = None
    if os.path.lexists(final):  # overwritten: the old one leaves under another name first
        doomed = f"{final}.deleted"
        if os.path.lexists(doomed):
            shutil.rmtree(doomed, ignore_errors=True)
        os.rename(final, doomed)
    try:
        os.rename(tmp, final)
    except OSError:
        if doomed is not None:
            os.rename(doomed, final)
        raise
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
