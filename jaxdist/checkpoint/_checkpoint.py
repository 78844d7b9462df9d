"""`Checkpoint`: named training state saved and restored together, like ``tf.train.Checkpoint``.

A checkpoint on disk is a directory:

- orbax-checkpoint's files holding every array (`jaxdist.checkpoint.save`),
  with the SHA-256 manifest of their bytes (`MANIFEST`); the save counter is
  one of those arrays;
- ``jaxdist_checkpoint.json``: the items' names and kinds, and the number of
  processes that wrote it (process 0 writes it);
- ``jaxdist_iterators.<p>.json``: process ``p``'s iterator positions (each
  process writes its own), when the checkpoint holds iterators.

Each JSON file carries the SHA-256 of its content, and `restore` checks them
all before it changes anything. The directory is written under a temporary
name (``<path>.tmp``) and renamed into place once complete and flushed to
disk, so a process killed during a save leaves no partial directory under
the checkpoint's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jaxdist.checkpoint import _arrays, _files, _items, _storage
from jaxdist.checkpoint._finite import refuse_nonfinite
from jaxdist.checkpoint._status import LoadStatus

__all__ = [
    "Checkpoint",
    "Snapshot",
    "held_positions",
    "items_of",
    "iterator_positions",
    "refuse_deleted",
    "set_save_counter",
    "take_snapshot",
]

META = "jaxdist_checkpoint.json"
_FORMAT = "jaxdist-checkpoint"
_ITERATOR_FORMAT = "jaxdist-checkpoint-iterators"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_RESERVED = frozenset({"save", "write", "restore", "read", "save_counter"})


_REBIND = (
    "rebind each step's new state into the checkpoint (ckpt.state = new_state) before it saves"
)


def iterator_file(process: int) -> str:
    """The name of the file holding process ``process``'s iterator positions."""
    return f"jaxdist_iterators.{process}.json"


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"jaxdist.checkpoint.Checkpoint: item name {name!r} is not a name of letters, "
            "digits and underscores starting with a letter; use such a name (it names the "
            "item's directory entries)."
        )
    if name in _RESERVED:
        raise ValueError(
            f"jaxdist.checkpoint.Checkpoint: {name!r} is a method or property of Checkpoint "
            f"and cannot name an item; rename it (e.g. {name}_state)."
        )


def _plain(where: str, tree: Any) -> Any:
    """The leaves of ``tree`` as nested dicts keyed by their path names (orbax-checkpoint
    stores those as they are; the restore matches leaves by the same names)."""
    flat = _arrays.indexed(where, tree)  # raises on two leaves with one name
    if list(flat) == [()]:
        return flat[()]
    out: dict[str, Any] = {}
    for tokens, leaf in flat.items():
        node = out
        for token in tokens[:-1]:
            node = node.setdefault(token, {})
        node[tokens[-1]] = leaf
    return out


class Checkpoint:
    """Named items of training state, saved and restored together (``tf.train.Checkpoint``).

    Items are given as keyword arguments and read and rebound as attributes:

    - pytrees (arrays, `jaxdist.Variable` including ``ON_READ`` ones, distributed
      values, a `jaxdist.TrainState`): functional; after a step, rebind the new
      value (``ckpt.state = new_state``); `restore` replaces it with the saved
      value, placed like the current one (any replica count for variables);
    - Flax NNX modules, optimizers and ``nnx.Rngs``: restored in place;
    - iterators with ``get_state()`` / ``set_state()`` (a `DistributedIterator`,
      a grain iterator): their position; each process saves its own.

    The checkpoint also counts its saves (`save_counter`), as TF's does.

    Example:
        >>> import tempfile, jax.numpy as jnp, jaxdist as jd
        >>> ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(3))
        >>> ckpt.w = ckpt.w + 1.0  # a training step's new value
        >>> path = ckpt.save(tempfile.mkdtemp() + "/ckpt")
        >>> path.endswith("ckpt-1"), ckpt.save_counter
        (True, 1)
        >>> ckpt.w = jnp.zeros(3)
        >>> status = ckpt.restore(path).assert_consumed()  # TF's load status
        >>> ckpt.w.tolist()
        [1.0, 1.0, 1.0]
    """

    def __init__(self, **items: Any) -> None:
        object.__setattr__(self, "_items", {})
        object.__setattr__(self, "_save_counter", 0)
        for name, item in items.items():
            setattr(self, name, item)

    # Items ------------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        _check_name(name)
        self._items[name] = value

    def __getattr__(self, name: str) -> Any:
        items = self.__dict__.get("_items", {})
        if name in items:
            return items[name]
        raise AttributeError(
            f"jaxdist.checkpoint.Checkpoint has no item {name!r}; its items are "
            f"{sorted(items)}. Add one with ckpt.{name} = value."
        )

    def __delattr__(self, name: str) -> None:
        if name not in self._items:
            raise AttributeError(f"jaxdist.checkpoint.Checkpoint has no item {name!r}.")
        del self._items[name]

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._items})

    def __repr__(self) -> str:
        kinds = ", ".join(
            f"{n}=<{_items.kind_of(v)} {type(v).__name__}>" for n, v in self._items.items()
        )
        return f"Checkpoint({kinds})"

    @property
    def save_counter(self) -> int:
        """How many times `save` (or a `CheckpointManager`'s save) ran; restored by
        `restore`, not by `read`."""
        return int(self._save_counter)

    # Saving -----------------------------------------------------------------------------

    def save(self, file_prefix: str | os.PathLike[str], *, allow_nonfinite: bool = False) -> str:
        """Increments `save_counter` and writes the checkpoint to ``<file_prefix>-<count>``.

        A state holding NaN or infinite values is refused (``ValueError``, and
        `save_counter` is left as it was) unless ``allow_nonfinite=True``.

        Returns:
            The path of the checkpoint directory written.
        """
        count = self._save_counter
        object.__setattr__(self, "_save_counter", count + 1)
        try:
            snapshot = take_snapshot(
                self, "jaxdist.checkpoint.Checkpoint.save", allow_nonfinite=allow_nonfinite
            )
        except BaseException:
            object.__setattr__(self, "_save_counter", count)
            raise
        return snapshot.write(f"{os.fspath(file_prefix)}-{self._save_counter}")

    def write(self, path: str | os.PathLike[str], *, allow_nonfinite: bool = False) -> str:
        """Writes the checkpoint to the directory ``path`` (replacing a checkpoint there),
        without counting it. Every process of a job calls it. A state holding NaN
        or infinite values raises ``ValueError`` (nothing is written) unless
        ``allow_nonfinite=True``; a ``path`` that holds anything but a jaxdist
        checkpoint (or nothing) raises ``FileExistsError`` and is left as it was.

        Returns:
            The absolute path written.
        """
        where = "jaxdist.checkpoint.Checkpoint.write"
        return take_snapshot(self, where, allow_nonfinite=allow_nonfinite).write(path)

    # Restoring --------------------------------------------------------------------------

    def restore(self, save_path: str | os.PathLike[str] | None) -> LoadStatus:
        """Restores every item, and `save_counter`, from a checkpoint directory.

        NNX objects and iterators are updated in place; pytree items are
        replaced by the saved values, placed like the current ones. Nothing
        changes unless every item matches and every checksum verifies.
        ``save_path=None`` does nothing (TF's behaviour, so that
        ``ckpt.restore(manager.latest_checkpoint)`` starts fresh when there is
        no checkpoint yet).

        Returns:
            A `LoadStatus`, as TF's (``.expect_partial()``, ``.assert_consumed()``):
            a restore is all or nothing, so its assertions hold once it returned,
            and raise ``AssertionError`` after ``save_path=None``.

        Raises:
            FileNotFoundError: ``save_path`` is not a checkpoint directory.
            ValueError: the checkpoint's items differ from this checkpoint's
                (names or kinds), a checksum does not verify, or an item does
                not fit (shapes, dtypes, structure: see `jaxdist.checkpoint`).
        """
        if save_path is None:
            return LoadStatus(None)
        return self._read("jaxdist.checkpoint.Checkpoint.restore", save_path, counter=True)

    def read(self, save_path: str | os.PathLike[str]) -> LoadStatus:
        """Restores the items like `restore`, but leaves `save_counter` as it is (TF's
        ``read``, for checkpoints written with `write`); returns a `LoadStatus`."""
        return self._read("jaxdist.checkpoint.Checkpoint.read", save_path, counter=False)

    def _read(self, where: str, save_path: str | os.PathLike[str], counter: bool) -> LoadStatus:
        path = os.path.abspath(os.fspath(save_path))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{where}: no checkpoint directory {path}.")
        meta = _read_meta(where, path)
        kinds = {name: _items.kind_of(item) for name, item in self._items.items()}
        _check_items(where, path, meta["items"], kinds)
        positions: dict[str, Any] = {}
        if _items.ITERATOR in kinds.values():
            positions = _read_positions(where, path, int(meta["num_processes"]))
        template = {
            "save_counter": 0,
            "items": {
                n: _items.tree_of(item, kinds[n])
                for n, item in self._items.items()
                if kinds[n] != _items.ITERATOR
            },
        }
        restored = _storage.restore(path, template)  # verified; nothing is changed yet
        for name, kind in kinds.items():
            if kind == _items.ITERATOR:
                if name not in positions:
                    raise ValueError(
                        f"{where}: the checkpoint in {path} has no position of iterator "
                        f"{name!r} for process {jax.process_index()}."
                    )
                self._items[name].set_state(positions[name])
        for name, tree in restored["items"].items():
            self._items[name] = _items.put_back(self._items[name], kinds[name], tree)
        if counter:
            object.__setattr__(self, "_save_counter", int(restored["save_counter"]))
        return LoadStatus(path)


def take_snapshot(
    checkpoint: Checkpoint, where: str, *, frozen: bool = False, allow_nonfinite: bool = False
) -> Snapshot:
    """``checkpoint``'s items now, on the host, ready to be written (`Checkpoint.save`,
    `Checkpoint.write`, `CheckpointManager.save`).

    Everything that can fail on the items' side fails here, before anything is
    written. ``frozen``: nothing can change the arrays (`_arrays.host_copy`), so the
    items may change, and their device buffers be donated, while the snapshot is
    written (an asynchronous save); otherwise NumPy items are taken as they are.
    """
    refuse_deleted(where, checkpoint, _REBIND)
    items = items_of(checkpoint)
    kinds = {name: _items.kind_of(item) for name, item in items.items()}
    trees, positions = {}, {}
    held = _HELD.get(checkpoint, {})
    for name, item in items.items():
        if kinds[name] == _items.ITERATOR:
            positions[name] = held[name] if name in held else _iterator_state(where, name, item)
        else:
            trees[name] = _plain(where, _items.tree_of(item, kinds[name]))
    arrays = {"save_counter": np.int64(checkpoint.save_counter), "items": trees}
    host = _arrays.host_copy(arrays) if frozen else _arrays.to_saveable(arrays)
    if not allow_nonfinite:
        refuse_nonfinite(where, host["items"])
    return Snapshot(kinds=kinds, arrays=host, positions=positions)


def items_of(checkpoint: Checkpoint) -> dict[str, Any]:
    """``checkpoint``'s items by name (the functions of this package read them here)."""
    return checkpoint._items


_HELD: weakref.WeakKeyDictionary[Checkpoint, dict[str, Any]] = weakref.WeakKeyDictionary()
"""Iterator positions that saves of a checkpoint store instead of the current ones, while
`held_positions` holds them."""


def iterator_positions(checkpoint: Checkpoint) -> dict[str, Any]:
    """The positions (``get_state()``) of ``checkpoint``'s iterator items now, by name."""
    return {
        name: item.get_state()
        for name, item in items_of(checkpoint).items()
        if _items.kind_of(item) == _items.ITERATOR
    }


@contextlib.contextmanager
def held_positions(checkpoint: Checkpoint, positions: dict[str, Any]) -> Iterator[None]:
    """Saves made inside the block store ``positions`` for those iterator items instead of
    their current positions: the preemption handler saves at the start of a ``run()`` call
    the positions of the end of the previous one, since a loop that passes
    ``next(iterator)`` to ``run`` has already taken the call's batch."""
    _HELD[checkpoint] = dict(positions)
    try:
        yield
    finally:
        _HELD.pop(checkpoint, None)


def refuse_deleted(where: str, checkpoint: Checkpoint, fix: str) -> None:
    """Raises ``ValueError`` naming every item of ``checkpoint`` that holds a deleted array
    (its buffer donated to a step that returned a new one), with ``fix``; a save would
    otherwise fail deep in the copy to the host."""
    found = []
    for name, item in items_of(checkpoint).items():
        kind = _items.kind_of(item)
        if kind == _items.ITERATOR:
            continue
        flat, _ = jax.tree_util.tree_flatten_with_path(_items.tree_of(item, kind))
        for path, leaf in flat:
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                found.append(f"{name}{jax.tree_util.keystr(path)} {leaf.dtype}{list(leaf.shape)}")
    if found:
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        raise ValueError(
            f"{where}: the checkpoint holds arrays that were deleted (donated to a step that "
            f"returned new ones): {shown}. Nothing was saved. The fix: {fix}."
        )


def set_save_counter(checkpoint: Checkpoint, count: int) -> None:
    """Sets ``checkpoint``'s `save_counter` (`CheckpointManager.save` counts its saves there,
    and takes the count back when the save is refused)."""
    object.__setattr__(checkpoint, "_save_counter", count)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A `Checkpoint`'s items taken on the host (`take_snapshot`), written by `write`.

    Writing runs no JAX computation and no XLA collective (only file operations and
    barriers of the ``jax.distributed`` coordination service), so it may run in a
    background thread while training steps run.
    """

    kinds: dict[str, str]
    arrays: Any  # {"save_counter": ..., "items": {name: tree of host arrays}}
    positions: dict[str, Any]  # this process's iterator positions, by item name

    def write(self, path: str | os.PathLike[str]) -> str:
        """Writes the directory ``path`` (replacing one there) atomically: under a
        temporary name, flushed to disk, then renamed. Every process of a job calls it.

        Returns:
            The absolute path written.
        """
        final = os.path.abspath(os.fspath(path))
        _refuse_foreign(final)
        tmp = f"{final}.tmp"
        # Each step ends with every process meeting the others; a step that fails in one
        # process fails in all of them there (`_files.together`), so none waits for it.
        with _files.together("prepared"):
            if _files.is_primary():
                os.makedirs(os.path.dirname(final), exist_ok=True)
                for stale in _leftovers(final):
                    _files.remove_tree(stale)
        _storage.write_saveable(tmp, self.arrays)  # every process returns once it is there
        try:
            self._finish(tmp, final)
        except Exception:
            if _files.is_primary():
                with contextlib.suppress(OSError):  # the error to raise is the first one
                    _files.remove_tree(tmp)  # nothing half-written is left behind
            raise
        return final

    def _finish(self, tmp: str, final: str) -> None:
        """Adds the small files to the written arrays ``tmp``, then publishes it."""
        me = jax.process_index()
        with _files.together("written"):
            if self.positions:
                body = {"format": _ITERATOR_FORMAT, "process": me, "iterators": self.positions}
                _files.write_json(os.path.join(tmp, iterator_file(me)), body, durable=False)
            if _files.is_primary():
                meta = {
                    "format": _FORMAT,
                    "version": 1,
                    "items": self.kinds,
                    "num_processes": jax.process_count(),
                }
                _files.write_json(os.path.join(tmp, META), meta, durable=False)
        with _files.together("published"):
            if _files.is_primary():
                _files.publish(tmp, final)


def _refuse_foreign(final: str) -> None:
    """Raises ``FileExistsError`` if ``final`` exists and is not a checkpoint jaxdist wrote
    (or an empty directory): a write replaces what is there, and must never take a user's
    files with it."""
    if not os.path.lexists(final):
        return
    if os.path.isdir(final) and not os.path.islink(final):
        names = sorted(os.listdir(final))
        if not names or META in names or _storage.MANIFEST in names:
            return
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        what = f"a directory of other files ({shown})"
    else:
        what = "a file" if not os.path.islink(final) else "a symbolic link"
    raise FileExistsError(
        f"jaxdist.checkpoint: {final} exists and is not a checkpoint jaxdist wrote: it is "
        f"{what}. Writing there would replace it, so nothing was written. Write the "
        "checkpoint to a new path (or an empty directory), or move that one away."
    )


def _leftovers(final: str) -> list[str]:
    """Temporary and half-deleted directories an interrupted write of ``final`` left."""
    parent, base = os.path.split(final)
    if not os.path.isdir(parent):
        return []
    return [
        os.path.join(parent, n)
        for n in os.listdir(parent)
        if n.startswith(f"{base}.tmp") or n == f"{base}.deleted"
    ]


def _iterator_state(where: str, name: str, item: Any) -> Any:
    state = item.get_state()
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{where}: item {name!r} ({type(item).__name__}) returned a state from "
            f"get_state() that is not JSON-serializable ({e}); a checkpoint stores iterator "
            "positions as JSON. Give the checkpoint an iterator whose state is JSON (dicts, "
            "lists, strings, numbers), or keep this one out of it."
        ) from None
    return state


def _read_meta(where: str, path: str) -> dict[str, Any]:
    file = os.path.join(path, META)
    try:
        meta = _files.read_json(where, file, "the checkpoint's metadata")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{where}: {path} has no {META}: it was not written by "
            "jaxdist.checkpoint.Checkpoint (for a directory written by "
            "jaxdist.checkpoint.save, use jaxdist.checkpoint.restore)."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"{where}: {file} is not a jaxdist checkpoint's metadata.")
    return meta


def _check_items(where: str, path: str, saved: dict[str, str], kinds: dict[str, str]) -> None:
    missing = sorted(set(kinds) - set(saved))
    extra = sorted(set(saved) - set(kinds))
    if missing or extra:
        raise ValueError(
            f"{where}: the checkpoint in {path} holds the items {sorted(saved)}, but this "
            f"Checkpoint has {sorted(kinds)} (missing from the checkpoint: {missing or 'none'}; "
            f"not in this Checkpoint: {extra or 'none'}). Give the Checkpoint the items, with "
            "the names, that were saved."
        )
    for name, kind in kinds.items():
        if saved[name] != kind:
            raise ValueError(
                f"{where}: item {name!r} was saved as {saved[name]!r} but is now {kind!r} "
                f"(kinds: 'nnx' for Flax NNX objects, 'iterator' for objects with "
                f"get_state/set_state, 'pytree' for the rest). Restore into an object of the "
                "kind that was saved."
            )


def _read_positions(where: str, path: str, saved_processes: int) -> dict[str, Any]:
    me, count = jax.process_index(), jax.process_count()
    if saved_processes != count:
        raise ValueError(
            f"{where}: the checkpoint in {path} holds the iterator positions of "
            f"{saved_processes} processes, but this job has {count}: each process's "
            "position belongs to the data that process reads. Restore with the same number "
            "of processes, or leave the iterators out of the Checkpoint (and start their "
            "data afresh)."
        )
    body = _files.read_json(where, os.path.join(path, iterator_file(me)), "iterator positions")
    if not isinstance(body, dict) or body.get("format") != _ITERATOR_FORMAT:
        raise ValueError(f"{where}: {iterator_file(me)} in {path} is not an iterator record.")
    return dict(body["iterators"])
