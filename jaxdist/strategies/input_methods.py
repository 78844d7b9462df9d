"""A strategy's input methods: datasets of global batches, per-input-pipeline datasets and
TF 1.x's in-memory rows. `jaxdist.Strategy` inherits them; each method's ``self`` is
typed as the `StrategyLike` protocol, all that the input layer asks of a strategy."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from jaxdist._protocols import StrategyLike
from jaxdist.data import NumpyRows
from jaxdist.input.distribute import distribute_dataset, distribute_from_function

__all__ = ["DatasetMethods"]


class DatasetMethods:
    """The dataset methods of `jaxdist.Strategy` (one concept: distributed input)."""

    def experimental_distribute_dataset(
        self: StrategyLike, dataset: Any, options: Any = None
    ) -> Any:
        """Splits a dataset of *global* batches across the replicas.

        ``dataset`` is any iterable of pytrees of arrays (a list, a generator,
        `jaxdist.data.from_arrays(...)`, a grain dataset or loader) or a
        ``tf.data.Dataset``. Each global batch of ``B`` rows becomes a pytree of
        `PerReplica` leaves of shape ``(N, B/N, ...)`` placed on the devices in a
        background thread. A last, smaller batch is padded to the same shape and
        carries valid-row counts (see `PerReplica`), unless
        ``InputOptions(partial_batches="drop")``.

        Returns:
            A re-iterable `DistributedDataset`.
        """
        return distribute_dataset(self, dataset, options)

    def distribute_datasets_from_function(
        self: StrategyLike, dataset_fn: Callable[[Any], Any], options: Any = None
    ) -> Any:
        """Calls ``dataset_fn(InputContext)`` once per input pipeline (one per process, or one
        per replica with ``InputReplicationMode.PER_REPLICA``); the returned iterable yields
        *per-replica* batches, which feed this process's replicas in turn.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> def dataset_fn(ctx):
            ...     bs = ctx.get_per_replica_batch_size(4)
            ...     return jd.data.from_arrays(np.arange(8.0), batch_size=bs)
            >>> [b.array.shape for b in s.distribute_datasets_from_function(dataset_fn)]
            [(1, 4), (1, 4)]
        """
        return distribute_from_function(self, dataset_fn, options)

    def experimental_distribute_datasets_from_function(
        self: StrategyLike, dataset_fn: Callable[[Any], Any], options: Any = None
    ) -> Any:
        """Deprecated alias of `distribute_datasets_from_function` (TF's old name)."""
        warnings.warn(
            f"{type(self).__name__}.experimental_distribute_datasets_from_function is deprecated "
            "(as in TF); call distribute_datasets_from_function.",
            DeprecationWarning,
            stacklevel=2,
        )
        return distribute_from_function(self, dataset_fn, options)

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> Any:
        """TF 1.x's in-memory dataset of rows: batch it, then distribute it.

        ``strategy.experimental_make_numpy_dataset((x, y)).batch(64)`` is
        ``jd.data.from_arrays(x, y, batch_size=64)``, a dataset of global batches
        for `experimental_distribute_dataset`.
        """
        return NumpyRows(numpy_input)
