"""Checkpoint directories: orbax-checkpoint's files of the arrays, with a SHA-256 manifest
(private module; `save`, `restore` and `MANIFEST` are public through `jaxdist.checkpoint`).

`save` writes the host values of a state (`jaxdist.checkpoint.to_saveable`)
with orbax-checkpoint and ``jaxdist_manifest.json`` beside them: the path,
dtype, shape and SHA-256 of every leaf's bytes, hashed in threads while orbax
writes. `restore` reads the arrays back (straight to their devices where the
template places them whole in this process), compares every leaf with the
manifest, and puts them into the template's placement by the rules of
`jaxdist.checkpoint.from_saveable`. See `jaxdist.checkpoint._arrays` for those
rules and for what the checksums cover.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import os
from typing import Any

import jax
import numpy as np

from jaxdist._scope import get_strategy
from jaxdist.checkpoint import _files
from jaxdist.checkpoint._arrays import (
    Placed,
    indexed,
    is_key,
    is_saved_node,
    listed,
    path_tokens,
    restore_tree,
    show,
    to_saveable,
)
from jaxdist.checkpoint._finite import refuse_nonfinite
from jaxdist.errors import CheckpointVerificationError
from jaxdist.values.distributed import Mirrored, PerReplica
from jaxdist.variables.meta import mirrored_sharding

__all__ = ["MANIFEST", "restore", "save", "write_saveable"]

MANIFEST = "jaxdist_manifest.json"
"""The name of the checksum manifest `save` writes into a checkpoint directory."""

_FORMAT = "jaxdist-checkpoint-manifest"
_HASH_THREADS = 4  # leaves hashed at once (SHA-256 runs at about 1 GB/s a core)


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "jaxdist.checkpoint.save/restore need orbax-checkpoint: "
            "pip install 'jaxdist[checkpoint]' (or use to_saveable/from_saveable with your "
            "own storage)."
        ) from e
    return ocp


def _direct_sharding(t: Any, saved: Any) -> Any:
    """The sharding to read a saved array into directly (orbax places it as it reads),
    or None: only where the template asks for an array of the saved shape and dtype in
    a placement this process holds whole; other leaves are read to the host first and
    converted by `_restore_leaf`'s rules."""
    if isinstance(t, (Mirrored, PerReplica)):
        t = t.array
    if isinstance(t, jax.ShapeDtypeStruct):
        sharding = t.sharding if t.sharding is not None else mirrored_sharding(get_strategy())
    elif isinstance(t, jax.Array) and getattr(t, "committed", True):
        sharding = t.sharding
    else:
        return None
    shape, dtype = getattr(saved, "shape", None), getattr(saved, "dtype", None)
    if (
        is_key(t)
        or shape is None
        or dtype is None
        or tuple(shape) != tuple(t.shape)
        or np.dtype(dtype) != np.dtype(t.dtype)
        or not getattr(sharding, "is_fully_addressable", False)
    ):
        return None
    return sharding


def _read(path: str, template: Any) -> Any:
    """The saved tree in ``path``: arrays the template places whole in this process as
    `Placed` device arrays (read straight to their devices, as orbax restores its own
    checkpoints), the other leaves as host arrays."""
    ocp = _orbax()
    reader = ocp.PyTreeCheckpointer()
    try:
        meta = reader.metadata(path).item_metadata
        tree = getattr(meta, "tree", meta)
        targets = {
            path_tokens(p): t
            for p, t in jax.tree_util.tree_flatten_with_path(template, is_leaf=is_saved_node)[0]
        }

        def how(p: Any, m: Any) -> Any:
            sharding = _direct_sharding(targets.get(path_tokens(p)), m)
            if sharding is None:
                return ocp.RestoreArgs(restore_type=np.ndarray)
            return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=m.shape, dtype=m.dtype)

        restore_args = jax.tree_util.tree_map_with_path(how, tree)
        saved = reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    finally:
        reader.close()
    return jax.tree.map(lambda x: Placed(x) if isinstance(x, jax.Array) else x, saved)


def _writer() -> Any:
    """orbax's synchronous writer of a tree of host arrays, local to this process.

    The arrays are jaxdist's own host values, which nothing changes during the
    write, so orbax is told not to copy them again (its NumPy handler copies by
    default, to guard arrays that might change during an asynchronous write).
    The arrays are stored without orbax's zstd compression: jaxdist already
    spends CPU time on their SHA-256, and compressing costs more (on 2 CPU cores,
    a save of 100 MB of float32 took about 20% longer with it and its restore
    about 40% longer, for files about 8% smaller); a reader finds the encoding in
    the files, so compressed checkpoints of earlier versions restore as before.
    The files are otherwise those of orbax's `StandardCheckpointer` (the same
    handler underneath).
    This process is the writer's only participant: orbax synchronizes the
    processes of a job with an XLA collective, which must not run beside a
    training step (or in a background thread), so process 0 writes every array
    (each process holds the whole host state) and the others wait at a barrier
    of the ``jax.distributed`` coordination service.
    """
    ocp = _orbax()
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (bytes, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False)),
        (str, th.StringHandler()),
        (jax.Array, th.ArrayHandler()),  # unused (the leaves are host arrays); orbax wants one
    )
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.PyTreeCheckpointHandler(
        type_handler_registry=registry,
        multiprocessing_options=alone,
        use_compression=False,  # see the docstring
    )
    return ocp.Checkpointer(handler, multiprocessing_options=alone)


def _digest(x: np.ndarray) -> str:
    """SHA-256 of the array's bytes in C order (hashed in place: no copy of a contiguous
    array; hashlib releases the GIL, so several leaves hash in parallel threads)."""
    flat = np.ascontiguousarray(x).reshape(-1)
    try:
        data: Any = flat.view(np.uint8)
    except (TypeError, ValueError):  # a dtype without a fixed byte layout
        data = flat.tobytes()
    return hashlib.sha256(data).hexdigest()


def _entry(leaf: Any) -> dict[str, Any]:
    x = np.asarray(leaf.array if isinstance(leaf, Placed) else leaf)
    return {"dtype": str(x.dtype), "shape": list(x.shape), "sha256": _digest(x)}


def _entries(where: str, tree: Any) -> dict[tuple[str, ...], dict[str, Any]]:
    """Dtype, shape and checksum of every leaf of a saved tree, by path."""
    return {path: _entry(leaf) for path, leaf in indexed(where, tree).items()}


class _Hashing:
    """`_entries` computed in background threads while the caller writes or places the
    same (read-only) arrays."""

    def __init__(self, leaves: dict[tuple[str, ...], Any]) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(_HASH_THREADS, len(leaves))),
            thread_name_prefix="jaxdist-checkpoint-sha256",
        )
        self._futures = {path: self._pool.submit(_entry, leaf) for path, leaf in leaves.items()}

    def result(self) -> dict[tuple[str, ...], dict[str, Any]]:
        try:
            return {path: f.result() for path, f in self._futures.items()}
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def write_saveable(path: str, saveable: Any) -> None:
    """Writes a tree of host arrays (`to_saveable` or `host_copy`) to the new directory
    ``path`` with its checksum manifest; every process of a job calls it, process 0
    writes (see `_writer`).

    It runs no JAX computation and no collective, so it may run in a background
    thread while training goes on (`CheckpointManager`'s asynchronous saves).
    """
    # The others find the directory and its manifest complete, or all raise with process 0.
    with _files.together("arrays"):
        if _files.is_primary():
            try:
                _write_primary(path, saveable)
            except Exception as e:
                _files.remove_tree(path)  # nothing half-written is left behind
                if _out_of_space(e):
                    raise OSError(
                        errno.ENOSPC,
                        f"jaxdist.checkpoint: the disk holding {os.path.dirname(path)} is "
                        f"full ({type(e).__name__}: {str(e)[:300]}); the checkpoint was not "
                        "written, and what was written of it is removed. The checkpoints "
                        "saved before are intact. Free space (or keep fewer checkpoints: "
                        "max_to_keep), then save again.",
                    ) from None
                raise


def _write_primary(path: str, saveable: Any) -> None:
    hashing = _Hashing(indexed("jaxdist.checkpoint.save", saveable))  # while orbax writes
    try:
        ckpt = _writer()
        try:
            ckpt.save(path, saveable)
        finally:
            ckpt.close()
    finally:
        entries = hashing.result()
    leaves = [{"path": list(p), **e} for p, e in entries.items()]
    manifest = {"format": _FORMAT, "version": 1, "leaves": leaves}
    tmp = os.path.join(path, f"{MANIFEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(path, MANIFEST))


def _out_of_space(error: BaseException) -> bool:
    """Whether ``error`` (or an error it came from) says the disk or a quota is full: an
    ``OSError`` of ENOSPC/EDQUOT, or tensorstore's RESOURCE_EXHAUSTED through orbax."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "RESOURCE_EXHAUSTED" in str(e) or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def save(directory: str | os.PathLike[str], state: Any, *, allow_nonfinite: bool = False) -> None:
    """Writes `to_saveable(state)` to a new ``directory`` with orbax-checkpoint, and a
    checksum manifest (`MANIFEST`) beside it that `restore` verifies.

    In a job of several processes every process calls it (with the same state);
    process 0 writes the files, and every process returns once they are complete.

    Args:
        directory: where to write; must not exist yet.
        state: a pytree of arrays, variables and distributed values.
        allow_nonfinite: save a state holding NaN or infinite values; by
            default that raises ``ValueError`` and nothing is written.
    """
    saveable = to_saveable(state)
    if not allow_nonfinite:
        refuse_nonfinite("jaxdist.checkpoint.save", saveable)
    write_saveable(os.path.abspath(directory), saveable)


def _parse_leaves(leaves: Any) -> dict[tuple[str, ...], dict[str, Any]]:
    """The manifest's ``leaves`` record as read back from JSON: path -> dtype, shape and
    SHA-256 of each leaf (KeyError/TypeError when damaged)."""
    out = {}
    for e in leaves:
        out[tuple(str(t) for t in e["path"])] = {
            "dtype": str(e["dtype"]),
            "shape": [int(d) for d in e["shape"]],
            "sha256": str(e["sha256"]),
        }
    return out


_SKIP = "pass verify=False to restore without checking (at your own risk)"


def _read_manifest(where: str, path: str) -> dict[tuple[str, ...], dict[str, Any]]:
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        raise CheckpointVerificationError(
            f"{where}: {path} has no checksum manifest {MANIFEST}: the save did not finish, "
            f"or the checkpoint was not written by jaxdist.checkpoint.save. Restore an earlier "
            f"checkpoint, or {_SKIP}."
        )
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"format is {manifest.get('format')!r}, not {_FORMAT!r}")
        return _parse_leaves(manifest["leaves"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _damaged(where, f"the checksum manifest {file}", path, e) from None


def _damaged(where: str, record: str, path: str, error: Exception) -> ValueError:
    return CheckpointVerificationError(
        f"{where}: {record} is damaged ({type(error).__name__}: {error}), so the checkpoint "
        f"in {path} cannot be verified. Restore an earlier checkpoint, or {_SKIP}."
    )


def _compare(
    where: str,
    path: str,
    expected: dict[tuple[str, ...], dict[str, Any]],
    found: dict[tuple[str, ...], dict[str, Any]],
) -> None:
    fix = "Restore an earlier checkpoint; this one was changed or damaged after it was written."
    if set(found) != set(expected):
        extra = sorted(set(found) - set(expected))
        lost = sorted(set(expected) - set(found))
        raise CheckpointVerificationError(
            f"{where}: the checkpoint in {path} does not hold the leaves its manifest lists: "
            f"unlisted {listed(extra) or 'none'}; missing {listed(lost) or 'none'}. {fix}"
        )
    for key, want in expected.items():
        got = found[key]
        for field in ("dtype", "shape", "sha256"):
            if got[field] != want[field]:
                raise CheckpointVerificationError(
                    f"{where}: leaf {show(key)} of the checkpoint in {path} does not match its "
                    f"manifest: {field} is {got[field]} but {want[field]} was saved. {fix}"
                )


def restore(directory: str | os.PathLike[str], template: Any, *, verify: bool = True) -> Any:
    """Reads ``directory`` (written by `save`) into the placement of ``template``.

    Args:
        directory: a checkpoint written by `save`.
        template: as for `from_saveable`.
        verify: check every leaf against the checksum manifest (nothing is
            returned unless every leaf matches).

    Returns:
        ``template`` with the saved values.

    Raises:
        ValueError: the data does not match its manifest (or the manifest is
            missing or damaged), orbax cannot read it, or it does not fit the
            template (as in `from_saveable`).
    """
    where = "jaxdist.checkpoint.restore"
    path = os.path.abspath(directory)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{where}: no checkpoint directory {path}.")
    expected = _read_manifest(where, path) if verify else {}
    try:
        saved = _read(path, template)
    except Exception as e:
        raise ValueError(
            f"{where}: orbax could not read the checkpoint in {path} ({type(e).__name__}: "
            f"{e}). It is incomplete or damaged; restore an earlier checkpoint."
        ) from e
    if not verify:
        return restore_tree(where, saved, template)
    # The leaves are hashed while they are placed; nothing is returned unless they verify,
    # and a damaged checkpoint is reported before a template that does not fit it.
    hashing = _Hashing(indexed(where, saved))
    try:
        restored = restore_tree(where, saved, template)
    except ValueError:
        _compare(where, path, expected, hashing.result())
        raise
    _compare(where, path, expected, hashing.result())
    return restored
