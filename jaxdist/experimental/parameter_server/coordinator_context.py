"""Which worker runs the current closure (TF's
``tf.distribute.coordinator.experimental_get_current_worker_index``), and which strategy a
pickled `ParameterServerStrategy` is in this process (the coordinator's, or a worker's view).

A worker actor sets its task index in a context variable for the length of each closure it
runs (the scheduled function, and the ``dataset_fn`` and the iterator steps of a per-worker
dataset). A worker task runs in its own process and compiles each function there, so an
index read while a function is traced is that worker's for every later call of the compiled
function.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = [
    "dispatch",
    "experimental_get_current_worker_index",
    "register_strategy",
    "set_worker_view",
    "strategy_for",
]

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


# Where a pickled ParameterServerStrategy resolves (its variables carry it): in the
# coordinator's process, the strategy itself (by its id); in a worker's, that worker's view
# of it (`ParameterServerStrategy` in worker mode, set when the worker starts).
_STRATEGIES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_WORKER_VIEW: list[Any] = []


def register_strategy(uid: int, strategy: Any) -> None:
    """Called by `ParameterServerStrategy` in the coordinator's process."""
    _STRATEGIES[uid] = strategy


def set_worker_view(view: Any) -> None:
    """Called by a worker actor when it starts: its view of every strategy."""
    _WORKER_VIEW[:] = [view]


def strategy_for(uid: int) -> Any:
    """The strategy with id ``uid`` in this process, else this worker's view, else None."""
    found = _STRATEGIES.get(uid)
    if found is not None:
        return found
    return _WORKER_VIEW[0] if _WORKER_VIEW else None
