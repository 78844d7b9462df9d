"""The two ways to distribute input (reached through `Strategy` methods).

`distribute_dataset`: a source of *global* batches (an iterable, a
`jaxdist.data.ArrayDataset`, a grain dataset or loader, a ``tf.data.Dataset``)
is split across replicas. `distribute_from_function`: ``dataset_fn`` builds
one pipeline per process (or per replica) that yields *per-replica* batches;
it is called once, when the dataset is distributed, and every epoch iterates
the pipelines it returned again (so a shuffling source reshuffles).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jaxdist._protocols import StrategyLike
from jaxdist.data import ArrayDataset
from jaxdist.input.agreement import step_sync
from jaxdist.input.batching import Batcher, HostBatch, Layout, Shared, replica_layout
from jaxdist.input.dataset import DistributedDataset
from jaxdist.input.options import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
)
from jaxdist.input.position import Position, open_source, seekable

_REITERABLE = (
    "a list of batches, jaxdist.data.from_arrays(...), or jaxdist.data.from_generator(fn) "
    "with a function fn that returns a new generator for each epoch"
)


class _GlobalBatches:
    """The producer of `distribute_dataset`: the source's global batches, split on the host."""

    def __init__(self, dataset: Any) -> None:
        self.sources = [dataset]
        self.seekable = seekable(dataset)

    def __call__(self, batcher: Batcher, position: Position) -> Iterator[HostBatch]:
        epoch = position.epochs[0] if position.epochs else None
        source, used = open_source(self.sources[0], _iterate, epoch, position.skip)
        position.epochs = [used]
        # Host batches, less those the partial-batch policy drops (None); map and filter
        # iterate in C, with no generator frame per batch.
        return filter(None, map(batcher.from_global, source))


class _PipelineBatches:
    """The producer of `distribute_from_function`: per-replica batches from the pipelines
    ``dataset_fn`` returned, one per local replica (``per_replica``) or one in all, whose
    consecutive elements feed the ``n_local`` replicas in turn."""

    def __init__(self, datasets: list[Any], *, per_replica: bool, n_local: int) -> None:
        self.sources = datasets
        self.seekable = all(seekable(ds) for ds in datasets)
        self.per_replica = per_replica
        self.n_local = n_local

    def __call__(self, batcher: Batcher, position: Position) -> Iterator[HostBatch]:
        per_step = 1 if self.per_replica else self.n_local  # elements of a pipeline per step
        its, used = [], []
        for i, ds in enumerate(self.sources):
            epoch = position.epochs[i] if position.epochs else None
            it, epoch_used = open_source(ds, _iterate, epoch, position.skip * per_step)
            its.append(it)
            used.append(epoch_used)
        position.epochs = used
        return self._steps(batcher, its)

    def _steps(self, batcher: Batcher, its: list[Iterator[Any]]) -> Iterator[HostBatch]:
        n_local = self.n_local
        while True:
            if self.per_replica:
                elements = [next(it, None) for it in its]
            else:  # consecutive elements of the one pipeline feed the replicas in turn
                elements = []
                for _ in range(n_local):
                    e = next(its[0], None)
                    if e is None:
                        break
                    elements.append(e)
                elements += [None] * (n_local - len(elements))
            if all(e is None for e in elements):
                return
            host = batcher.from_per_replica(elements)
            if host is not None:
                yield host


def _check_options(options: Any, where: str, layout: Layout) -> InputOptions:
    if options is None:
        options = InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"{where}: options must be a jaxdist.InputOptions, got {type(options)}.")
    if layout.multi_process and not options.experimental_fetch_to_device:
        raise ValueError(
            f"{where}: InputOptions(experimental_fetch_to_device=False) yields host NumPy "
            f"batches, which cannot hold the replicas of the {layout.num_processes} processes "
            "this strategy spans. Keep experimental_fetch_to_device=True in a multi-process job."
        )
    return options


def _iterate(source: Any) -> Iterator[Any]:
    """Host batches from any supported source (tf.data yields NumPy via as_numpy_iterator)."""
    if hasattr(source, "as_numpy_iterator") and type(source).__module__.startswith("tensorflow"):
        return iter(source.as_numpy_iterator())
    return iter(source)


def _in_memory(source: Any) -> bool:
    """Sources whose next batch costs nothing to make: prefetched without a thread."""
    return isinstance(source, (ArrayDataset, list, tuple))


def _one_shot(source: Any) -> bool:
    """An iterator (a generator, a file, ``map(...)``): it gives exactly one epoch."""
    return isinstance(source, Iterator)


def _check_source(dataset: Any, where: str) -> None:
    if isinstance(dataset, (np.ndarray, jax.Array, dict)) or (
        isinstance(dataset, tuple) and dataset and isinstance(dataset[0], (np.ndarray, jax.Array))
    ):
        raise TypeError(
            f"{where}: got arrays, not a dataset of batches. Wrap them with "
            "jaxdist.data.from_arrays(x, y, batch_size=...) to batch them."
        )
    if not isinstance(dataset, Iterable) and not hasattr(dataset, "as_numpy_iterator"):
        raise TypeError(
            f"{where}: expected an iterable of global batches (a list or generator of pytrees "
            "of arrays, jaxdist.data.from_arrays(...), a grain dataset or DataLoader, or a "
            f"tf.data.Dataset), got {type(dataset).__name__}."
        )


def distribute_dataset(strategy: StrategyLike, dataset: Any, options: Any) -> DistributedDataset:
    where = f"{type(strategy).__name__}.experimental_distribute_dataset"
    layout = replica_layout(strategy)
    options = _check_options(options, where, layout)
    _check_source(dataset, where)
    if options.experimental_auto_shard_policy is AutoShardPolicy.FILE:
        raise ValueError(
            f"{where}: AutoShardPolicy.FILE splits a dataset by its files, which only the "
            "dataset's own reader can do. Use strategy.distribute_datasets_from_function and "
            "pick this process's files with input_context.input_pipeline_id / "
            "num_input_pipelines (for example grain's ShardOptions), or use DATA."
        )
    if options.experimental_replication_mode is not InputReplicationMode.PER_WORKER:
        raise ValueError(
            f"{where}: InputReplicationMode.PER_REPLICA applies to "
            "distribute_datasets_from_function only."
        )

    threaded = not _in_memory(dataset)
    one_shot = None
    if _one_shot(dataset):
        one_shot = (
            f"{where}: the dataset is a {type(dataset).__name__}, an iterator that gives one "
            "epoch, and iter() already started it; another iter() would yield nothing. "
            f"Distribute a source that can be iterated again: {_REITERABLE}."
        )
    shared = Shared(strategy)
    # OFF: each process reads its own source, whose length may differ from the others'.
    per_process = options.experimental_auto_shard_policy is AutoShardPolicy.OFF
    return DistributedDataset(
        _GlobalBatches(dataset),
        lambda: Batcher(strategy, options, where, layout, shared),
        threaded=threaded,
        one_shot=one_shot,
        sync=step_sync(strategy, layout, where) if per_process else None,
    )


def distribute_from_function(
    strategy: StrategyLike, dataset_fn: Callable[[InputContext], Any], options: Any
) -> DistributedDataset:
    where = f"{type(strategy).__name__}.distribute_datasets_from_function"
    layout = replica_layout(strategy)
    options = _check_options(options, where, layout)
    if not callable(dataset_fn):
        raise TypeError(f"{where}: dataset_fn must be callable, got {type(dataset_fn).__name__}.")
    n = layout.n
    per_replica_mode = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    if per_replica_mode:
        contexts = [InputContext(n, r, n) for r in layout.local]
    else:
        contexts = [InputContext(layout.num_processes, layout.process_rank, n)]
    # As in tf.distribute: dataset_fn runs once per input pipeline, here and now; each
    # epoch iterates the datasets it returned again.
    datasets = []
    for ctx in contexts:
        ds = dataset_fn(ctx)
        _check_source(ds, f"{where} (the dataset returned by dataset_fn)")
        datasets.append(ds)
    one_shot = None
    shot = next((ds for ds in datasets if _one_shot(ds)), None)
    if shot is not None:
        one_shot = (
            f"{where}: dataset_fn returned a {type(shot).__name__}, an iterator that gives one "
            "epoch, and iter() already started it; another iter() would yield nothing. Return "
            f"a source that can be iterated again from dataset_fn: {_REITERABLE}."
        )
    shared = Shared(strategy)
    return DistributedDataset(
        _PipelineBatches(datasets, per_replica=per_replica_mode, n_local=len(layout.local)),
        lambda: Batcher(strategy, options, where, layout, shared),
        threaded=not all(_in_memory(ds) for ds in datasets),
        one_shot=one_shot,
        sync=step_sync(strategy, layout, where),  # the pipelines' lengths may differ
    )
