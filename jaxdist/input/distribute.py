"""The two ways to distribute input (private; reached through `Strategy` methods).

`distribute_dataset`: a source of *global* batches (an iterable, a
`jaxdist.data.ArrayDataset`, a grain dataset or loader, a ``tf.data.Dataset``)
is split across replicas. `distribute_from_function`: ``dataset_fn`` builds
one pipeline per process (or per replica) that yields *per-replica* batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxdist.data import ArrayDataset
from jaxdist.input.batching import Batcher
from jaxdist.input.dataset import DistributedDataset
from jaxdist.input.options import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
)

if TYPE_CHECKING:
    from jaxdist.strategy import Strategy


def _check_options(options: Any, where: str) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"{where}: options must be a jaxdist.InputOptions, got {type(options)}.")
    return options


def _iterate(source: Any) -> Iterator[Any]:
    """Host batches from any supported source (tf.data yields NumPy via as_numpy_iterator)."""
    if hasattr(source, "as_numpy_iterator") and type(source).__module__.startswith("tensorflow"):
        return iter(source.as_numpy_iterator())
    return iter(source)


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


def distribute_dataset(strategy: Strategy, dataset: Any, options: Any) -> DistributedDataset:
    where = f"{type(strategy).__name__}.experimental_distribute_dataset"
    options = _check_options(options, where)
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

    def producer(batcher: Batcher) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
        for batch in _iterate(dataset):
            host = batcher.from_global(batch)
            if host is not None:
                yield host

    in_memory = isinstance(dataset, ArrayDataset)
    return DistributedDataset(
        producer, lambda: Batcher(strategy, options, where), threaded=not in_memory
    )


def distribute_from_function(
    strategy: Strategy, dataset_fn: Callable[[InputContext], Any], options: Any
) -> DistributedDataset:
    where = f"{type(strategy).__name__}.distribute_datasets_from_function"
    options = _check_options(options, where)
    if not callable(dataset_fn):
        raise TypeError(f"{where}: dataset_fn must be callable, got {type(dataset_fn).__name__}.")
    n = strategy.num_replicas_in_sync
    per_replica_mode = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA

    def pipelines(batcher: Batcher) -> list[Iterator[Any]]:
        if per_replica_mode:
            contexts = [InputContext(n, r, n) for r in batcher.local]
        else:
            contexts = [InputContext(jax.process_count(), jax.process_index(), n)]
        made = []
        for ctx in contexts:
            ds = dataset_fn(ctx)
            _check_source(ds, f"{where} (the dataset returned by dataset_fn)")
            made.append(_iterate(ds))
        return made

    def producer(batcher: Batcher) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
        its = pipelines(batcher)
        n_local = len(batcher.local)
        while True:
            if per_replica_mode:
                elements = [next(it, None) for it in its]
            else:
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

    return DistributedDataset(producer, lambda: Batcher(strategy, options, where))
