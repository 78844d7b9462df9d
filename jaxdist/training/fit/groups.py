"""`jaxdist.fit` with ``steps_per_execution``: k steps per compiled call, every step logged
.

`fit`'s loop calls ``step(*state, batch)`` once per batch and logs each step
(callbacks, the progress bar, the epoch metrics weighted by each batch's rows).
`GroupFeed` keeps that loop as it is:

- the training data is read through a `Lookahead` iterator;
- when the loop calls the step with a batch, `GroupFeed` takes up to ``k - 1``
  more batches from the data (never past ``fit``'s ``steps=`` limit), runs
  them all in one grouped call of the train step, and queues every step's
  output; the `Lookahead` hands the loop the batches taken ahead, and the
  loop's next calls with them return the queued outputs without running
  anything.

So callbacks and the progress bar count steps, not calls, and each step's
metrics are its own. The state is updated a group at a time: a callback
called after a step inside a group sees the state after the whole group
(``loop.mid_group`` is True there). A stop requested inside a group
(``stop_training``, Ctrl-C, SIGTERM) takes effect at the group's end, after
its remaining steps are logged (they are done), so that the step count, the
state and the data position agree wherever training stops; checkpoints and
the preemption handler's agreement are at group ends too.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from jaxdist.training.fit.callbacks import FitLoop
from jaxdist.training.step.train_step import TrainStep

__all__ = ["GroupFeed", "Lookahead"]


class Lookahead:
    """An iterator over the training data that can be read ahead of the loop (private)."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it: Any = it
        self._ahead: collections.deque[tuple[Any, Any]] = collections.deque()

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self._ahead:
            return self._ahead.popleft()[0]
        return next(self._it)

    def take(self) -> Any:
        """The next batch from the data, queued for the loop too (StopIteration at the end)."""
        batch = next(self._it)
        state = self._it.get_state() if hasattr(self._it, "get_state") else None
        self._ahead.append((batch, state))
        return batch

    def get_state(self) -> Any:
        """The data position after the last batch the loop received."""
        if self._ahead:
            raise RuntimeError(
                "jaxdist.fit: the data position is asked for inside a group of "
                "steps_per_execution steps; checkpoints are written between groups only."
            )
        return self._it.get_state()

    def set_state(self, state: Any) -> None:
        self._ahead.clear()
        self._it.set_state(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class _Data:
    """The distributed training data, iterated through a `Lookahead` the feed reads."""

    def __init__(self, data: Any, feed: GroupFeed) -> None:
        self._data = data
        self._feed = feed

    def __iter__(self) -> Lookahead:
        it = Lookahead(iter(self._data))
        self._feed.data = it
        self._feed.queued.clear()
        return it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)


class GroupFeed:
    """``feed(*state, batch)``: the output of the step over ``batch``, run in groups of
    ``k`` steps by the grouped train step ``step`` (private)."""

    def __init__(self, step: TrainStep, loop: FitLoop) -> None:
        self.step = step
        self.loop = loop
        self.data: Lookahead | None = None
        self.queued: collections.deque[tuple[Any, Any]] = collections.deque()  # (batch, out)

    @property
    def mid_group(self) -> bool:
        """Whether steps of the current group are still to be handed to the loop."""
        return bool(self.queued)

    def dataset(self, data: Any) -> _Data:
        return _Data(data, self)

    def __call__(self, *args: Any) -> Any:
        *state, batch = args
        if self.queued and self.queued[0][0] is batch:
            return self.queued.popleft()[1]
        self.queued.clear()
        assert self.data is not None
        k = self.step.steps_per_execution
        loop = self.loop
        if loop.steps is not None:
            k = max(1, min(k, loop.steps - loop.step))
        batches = [batch]
        for _ in range(k - 1):
            try:
                batches.append(self.data.take())
            except StopIteration:
                break
        outs = self.step.each_step(*state, iter(batches))
        self.queued.extend(zip(batches[1:], outs[1:], strict=True))
        return outs[0]
