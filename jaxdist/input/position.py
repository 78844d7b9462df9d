"""Where a distributed iterator is in its data, and how to start reading there again.

An iterator's *state* (`DistributedIterator.get_state`) is a small JSON-able
dict: the dataset epoch it reads, how many batches it has returned to the
caller (batches prefetched but not yet returned are not counted), the epoch
of each source that draws a new order per epoch (a shuffled
`jaxdist.data.ArrayDataset`), and the per-replica batch size the epoch's
first batch fixed (so a resumed epoch pads its last batch as the original
did). `set_state` applies it to an iterator of a new dataset over the same
source (same shuffle seed): the batches it then yields are exactly the unseen
ones, in the same order.

Sources that can *seek* start at the saved batch at no cost:
`jaxdist.data.from_arrays` datasets (their epoch's order is rebuilt from the
seed), lists and tuples of batches. Any other source (a generator,
`jaxdist.data.from_generator`, grain, tf.data) is read from the start of the
epoch and the batches before the saved position are dropped (with a warning):
exact only when the source yields the same batches in the same order as in
the run that saved the state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxdist.data import ArrayDataset

__all__ = [
    "Position",
    "Resumed",
    "describe",
    "fingerprint",
    "make_state",
    "open_source",
    "parse_state",
    "seekable",
]

FORMAT = "jaxdist.DistributedIterator"
VERSION = 1


@dataclasses.dataclass
class Position:
    """Where a producer starts (private): ``skip`` steps into the epoch, each source at its
    ``epochs`` entry (None: the source's next epoch). The producer records the epochs it
    used in ``epochs``."""

    skip: int = 0
    epochs: list[int | None] | None = None


def seekable(source: Any) -> bool:
    """True for sources that can start at any batch of any epoch without reading the others."""
    return isinstance(source, (ArrayDataset, list, tuple))


def open_source(
    source: Any, iterate: Callable[[Any], Iterator[Any]], epoch: int | None, skip: int
) -> tuple[Iterator[Any], int | None]:
    """An iterator over ``source``'s elements from element ``skip`` of the epoch on, and the
    source's epoch it reads (None for a source without epochs).

    A `jaxdist.data.ArrayDataset` reads its epoch ``epoch`` (its next one when None); a
    list or tuple starts at ``skip``; any other source drops its first ``skip`` elements
    (lazily: wherever the iterator is first advanced)."""
    if isinstance(source, ArrayDataset):
        used = source.next_epoch if epoch is None else epoch
        return source.epoch_batches(used, skip), used
    if isinstance(source, (list, tuple)):
        return itertools.islice(source, skip, None), None
    it = iterate(source)
    return (itertools.islice(it, skip, None) if skip else it), None


SAMPLE_ROWS = 64
"""Rows of a `jaxdist.data.ArrayDataset` (spread over it) whose bytes its fingerprint hashes."""


def fingerprint(source: Any) -> dict[str, Any]:
    """What identifies ``source`` and its options in an iterator's state, so that a state is
    not applied to an iterator over other data (another seed, other rows, no shuffling):
    for `jaxdist.data.from_arrays`, its rows, leaves, batch size, shuffling and a hash of
    `SAMPLE_ROWS` rows spread over it; for a list or tuple of batches, their count and a
    hash of the first and last; for any other source, its type (it cannot be looked into
    without reading it)."""
    if isinstance(source, ArrayDataset):
        leaves = source.leaves
        rows = np.unique(np.linspace(0, max(source.num_rows - 1, 0), SAMPLE_ROWS).astype(int))
        digest = hashlib.sha256()
        for leaf in leaves:
            digest.update(np.ascontiguousarray(leaf[rows] if leaf.shape[0] else leaf).tobytes())
        return {
            "kind": "arrays",
            "rows": int(source.num_rows),
            "leaves": [[list(leaf.shape[1:]), str(leaf.dtype)] for leaf in leaves],
            "batch_size": int(source.batch_size),
            "shuffle": bool(source.shuffle),
            "seed": int(source.seed) if source.shuffle else None,
            "drop_remainder": bool(source.drop_remainder),
            "sample_sha256": digest.hexdigest()[:16],
        }
    if isinstance(source, (list, tuple)):
        digest = hashlib.sha256()
        for element in (source[:1], source[-1:]):
            for leaf in jax.tree.leaves(element):
                digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
        return {"kind": "batches", "count": len(source), "sample_sha256": digest.hexdigest()[:16]}
    return {"kind": type(source).__name__}


def describe(print_: dict[str, Any]) -> str:
    """A fingerprint in words."""
    if print_.get("kind") == "arrays":
        order = f"shuffled with seed {print_['seed']}" if print_["shuffle"] else "not shuffled"
        return (
            f"from_arrays({print_['rows']} rows of {print_['leaves']}, batch_size "
            f"{print_['batch_size']}, {order}, drop_remainder={print_['drop_remainder']}, "
            f"rows' hash {print_['sample_sha256']})"
        )
    if print_.get("kind") == "batches":
        return f"a list of {print_['count']} batches (hash {print_['sample_sha256']})"
    return f"a {print_.get('kind')} source"


def make_state(
    epoch: int,
    batches: int,
    source_epochs: list[int | None] | None,
    rows_per_replica: int | None,
    first_rows: int | None,
    sources: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON-able state of an iterator (see the module docstring); ``sources``: the
    sources' `fingerprint`s."""
    return {
        "sources": sources,
        "format": FORMAT,
        "version": VERSION,
        "epoch": epoch,
        "batches": batches,
        "source_epochs": None if source_epochs is None else list(source_epochs),
        "rows_per_replica": rows_per_replica,
        "first_rows": first_rows,
        "process_index": jax.process_index(),
        "num_processes": jax.process_count(),
    }


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A parsed state (private)."""

    epoch: int
    batches: int
    source_epochs: list[int | None] | None
    rows_per_replica: int | None
    first_rows: int | None


def _count(where: str, state: dict[str, Any], key: str, *, optional: bool = False) -> Any:
    value = state.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{where}: state[{key!r}] must be a non-negative int, got {value!r}. Pass a state "
            "that DistributedIterator.get_state returned."
        )
    return value


def parse_state(where: str, state: Any, prints: list[dict[str, Any]]) -> Resumed:
    """Checks a state from `make_state` (possibly read back from JSON) against this process
    and a producer of sources with the `fingerprint`s ``prints``.

    Raises:
        ValueError: not such a state, or one saved by another process, for another
            number of sources, or for other sources or options.
    """
    sources = len(prints)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(
            f"{where}: expected a state returned by DistributedIterator.get_state (a dict with "
            f"format {FORMAT!r}), got {type(state).__name__} {str(state)[:80]}."
        )
    if state.get("version") != VERSION:
        raise ValueError(
            f"{where}: the state has version {state.get('version')!r}; this jaxdist reads "
            f"version {VERSION}."
        )
    me, count = jax.process_index(), jax.process_count()
    saved_by = (state.get("process_index"), state.get("num_processes"))
    if saved_by != (me, count):
        raise ValueError(
            f"{where}: the state was saved by process {saved_by[0]} of {saved_by[1]}, but this "
            f"is process {me} of {count}. Each process restores its own iterator's state "
            "(jaxdist.checkpoint.Checkpoint keeps one per process), in a job of the same size."
        )
    epochs = state.get("source_epochs")
    if epochs is not None:
        ok = isinstance(epochs, list) and all(
            e is None or (isinstance(e, int) and not isinstance(e, bool) and e >= 0) for e in epochs
        )
        if not ok or len(epochs) != sources:
            raise ValueError(
                f"{where}: state['source_epochs'] is {epochs!r}, but this dataset reads "
                f"{sources} source(s): the state belongs to a dataset built differently. "
                "Restore into an iterator of the same kind of dataset over the same sources."
            )
    saved = state.get("sources")
    if saved is not None and saved != prints:  # None: a state from before fingerprints
        mine = "; ".join(map(describe, prints))
        theirs = "; ".join(map(describe, saved)) if isinstance(saved, list) else repr(saved)
        raise ValueError(
            f"{where}: the state was saved by an iterator over {theirs}, but this iterator "
            f"reads {mine}; its position there would yield other batches. Restore into an "
            "iterator over the same data with the same options (batch size, shuffling and "
            "seed), or leave the iterator out of what you restore to start its data afresh."
        )
    return Resumed(
        epoch=_count(where, state, "epoch"),
        batches=_count(where, state, "batches"),
        source_epochs=None if epochs is None else list(epochs),
        rows_per_replica=_count(where, state, "rows_per_replica", optional=True),
        first_rows=_count(where, state, "first_rows", optional=True),
    )
