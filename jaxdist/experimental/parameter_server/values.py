"""What a scheduled closure returns and takes: `RemoteValue`, `PerWorkerValues`, and the
per-worker datasets of `ClusterCoordinator.create_per_worker_dataset`.

A `RemoteValue` is filled in when its closure finishes; its result is a host copy (NumPy
arrays, parameter-server variable handles), so it outlives the worker that made it. A
`PerWorkerValues` holds one value per worker; as a closure argument it becomes the value of
the worker that runs the closure. A per-worker iterator argument becomes the next element
of that worker's own iterator.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from typing import Any

__all__ = [
    "ClosureCancelledError",
    "WorkerLossError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "RemoteValue",
]

_ids = itertools.count()


class ClosureCancelledError(concurrent.futures.CancelledError):
    """The closure was cancelled (an earlier closure failed) before it ran."""


class WorkerLossError(RuntimeError):
    """A closure's worker died every time it ran, more often than the coordinator retries
    (``MAX_WORKER_LOSSES``); the message names the closure and what happened to each
    worker."""


class RemoteValue:
    """The future result of a closure scheduled with `ClusterCoordinator.schedule`."""

    __slots__ = ("_done", "_error", "_result")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def set_outcome(self, result: Any = None, error: BaseException | None = None) -> None:
        """Fills in the closure's ``result``, or its ``error`` (which `fetch` raises); called
        once by the `ClusterCoordinator` when the closure finishes or is cancelled."""
        self._result, self._error = result, error
        self._done.set()

    def fetch(self) -> Any:
        """Waits for the closure and returns its result (a nested structure of NumPy arrays
        and variable handles), or raises its error (`concurrent.futures.CancelledError`
        when it was cancelled)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def get(self) -> Any:
        """Same as `fetch` (TF's newer name)."""
        return self.fetch()

    def __repr__(self) -> str:
        if not self._done.is_set():
            return "RemoteValue(<pending>)"
        if self._error is not None:
            return f"RemoteValue(<error: {type(self._error).__name__}>)"
        return "RemoteValue(<ready>)"


class PerWorkerValues:
    """One value per worker (TF's ``PerWorkerValues``): a closure argument of this type
    becomes the value of the worker that runs the closure.

    Example:
        >>> from jaxdist.experimental.coordinator import PerWorkerValues
        >>> PerWorkerValues([10, 20, 30]).values
        (10, 20, 30)
    """

    __slots__ = ("_values",)

    def __init__(self, values: Any) -> None:
        values = tuple(values)
        if not values:
            raise ValueError(
                "PerWorkerValues(values=...): expected one value per worker, got none."
            )
        self._values = values

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self._values)} workers)"


class PerWorkerIterator:
    """An iterator per worker; as a closure argument, that worker's next element."""

    __slots__ = ("_dataset", "_id")

    def __init__(self, dataset: PerWorkerDataset) -> None:
        self._dataset = dataset
        self._id = next(_ids)

    @property
    def dataset(self) -> PerWorkerDataset:
        """The per-worker dataset this iterator iterates."""
        return self._dataset

    @property
    def iterator_id(self) -> int:
        """The id a worker keeps its own iterator of this one under (unique in the process)."""
        return self._id

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "PerWorkerIterator: the elements live on the workers. Pass the iterator to "
            "ClusterCoordinator.schedule(fn, args=(iterator,)); fn receives the next element "
            "of the iterator of the worker that runs it."
        )

    def __repr__(self) -> str:
        return f"PerWorkerIterator(id={self._id})"


class PerWorkerDataset:
    """A dataset made on every worker by ``dataset_fn()``; ``iter()`` gives a
    `PerWorkerIterator` (fresh iterators on every worker)."""

    __slots__ = ("_fn_ref", "_num_workers")

    def __init__(self, fn_ref: Any, num_workers: int) -> None:
        self._fn_ref = fn_ref  # an object-store reference to the pickled dataset_fn
        self._num_workers = num_workers

    @property
    def fn_ref(self) -> Any:
        """The Ray object-store reference to the pickled ``dataset_fn`` (workers load it)."""
        return self._fn_ref

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self)
