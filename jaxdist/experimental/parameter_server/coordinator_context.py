"""Which worker runs the current closure: TF's
``tf.distribute.coordinator.experimental_get_current_worker_index``.

A worker actor sets its task index in a context variable for the length of each closure it
runs (the scheduled function, and the ``dataset_fn`` and the iterator steps of a per-worker
dataset). A worker task runs in its own process and compiles each function there, so an
index read while a function is traced is that worker's for every later call of the compiled
function.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["dispatch", "experimental_get_current_worker_index"]

_WORKER_INDEX: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "jaxdist_ps_worker_index", default=None
)


def experimental_get_current_worker_index() -> int:
    """The task index of the ``worker`` running the current closure (a Python ``int``).

    Call it inside a function given to `ClusterCoordinator.schedule` or inside a
    ``dataset_fn`` given to `ClusterCoordinator.create_per_worker_dataset`, for example to
    shard data by worker. Raises `RuntimeError` anywhere else.
    """
    index = _WORKER_INDEX.get()
    if index is None:
        raise RuntimeError(
            "experimental_get_current_worker_index(): no worker closure is running here; call "
            "it inside a function passed to ClusterCoordinator.schedule or a dataset_fn "
            "passed to ClusterCoordinator.create_per_worker_dataset (it runs on a worker)."
        )
    return index


@contextlib.contextmanager
def dispatch(worker_index: int) -> Iterator[None]:
    """Makes ``worker_index`` the current worker index inside the block."""
    token = _WORKER_INDEX.set(worker_index)
    try:
        yield
    finally:
        _WORKER_INDEX.reset(token)
