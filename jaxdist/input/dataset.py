"""`DistributedDataset` and `DistributedIterator`: batches prefetched onto the replicas.

A dataset wraps a *producer*: a function returning a fresh iterator of host
batches ``(leaves, valid_counts)`` already split per replica. Up to
``experimental_per_replica_buffer_size`` batches are placed on the devices
ahead of the consumer, so input work overlaps the training step:

- the iterator itself starts the asynchronous transfers of the next batches
  when it returns one (as ``flax.jax_utils.prefetch_to_device`` does), so
  they reach the devices while the step runs;
- for a general source (a Python generator, grain, tf.data) a background
  thread runs the source and splits its batches on the host, so a slow
  source (decoding, a socket) overlaps the step too; batches already in
  memory (a list or tuple of batches, `jaxdist.data.from_arrays`) need no
  thread. The thread copies each batch out of the source's memory (which the
  source may refill) into recycled host buffers (`jaxdist.input.host_pool`).

The transfers stay on the consumer's thread: issued from a background thread
they ran about 25% slower on a 2-core machine. The thread hands host batches
over through `queue.SimpleQueue`s (C-level queues): one for batches, one for
the *credits* that bound how far it runs ahead. A stalled iterator holds at
most ``buffer`` batches on the devices beyond the one returned, and
``max(HOST_QUEUE, buffer) + 1`` on the host.

Several threads may share one iterator (a lock serializes ``next``): each
batch goes to exactly one of them, and at the end every one of them gets
``StopIteration``.

In a job of several processes that read their own sources, the prefetch thread
also agrees with the other processes whether any of them still has a batch
(`jaxdist.input.agreement`), so that every process ends the epoch on the same
step even when their sources' lengths differ. It agrees on blocks of `BLOCK`
steps, reading (and copying) that many batches ahead, so such an iterator holds
up to `BLOCK` more host batches; such a dataset always has a thread, which
hides the agreement's latency behind the steps.
"""

from __future__ import annotations

import collections
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from jaxdist.errors import OutOfRangeError
from jaxdist.input.agreement import BLOCK, StepSync, agreed
from jaxdist.input.batching import Batcher, HostBatch
from jaxdist.input.group import PlacedGroup, stack_steps
from jaxdist.input.host_pool import HostPool
from jaxdist.input.position import Position, fingerprint, make_state, parse_state
from jaxdist.input.prefetch import END, HOST_QUEUE, Failure, HostThread, Signal

__all__ = ["DistributedDataset", "DistributedIterator", "OptionalValue"]


class OptionalValue:
    """What `DistributedIterator.get_next_as_optional` returns."""

    __slots__ = ("_value",)

    def __init__(self, value: Any = END) -> None:
        self._value = value

    def has_value(self) -> bool:
        return self._value is not END

    def get_value(self) -> Any:
        if self._value is END:
            raise ValueError("OptionalValue.get_value: the iterator was exhausted (no value).")
        return self._value


class Producer(Protocol):
    """Makes an epoch's host batches (private): from ``position`` on, recording there the
    epochs of the ``sources`` it read; ``seekable`` when every source can start anywhere."""

    sources: list[Any]
    seekable: bool

    def __call__(self, batcher: Batcher, position: Position) -> Iterator[HostBatch]: ...


class Epochs:
    """A dataset's count of iterators (epochs) and of iterators moved by ``set_state``,
    shared with its iterators (private)."""

    __slots__ = ("count", "moves")

    def __init__(self) -> None:
        self.count = 0
        self.moves = 0


class DistributedIterator:
    """Yields one distributed batch per step: a pytree with `PerReplica` leaves.

    Each leaf has shape ``(N, b, ...)`` (replica ``r`` owns row ``r``) and
    carries the batch's valid-row counts (``PerReplica.valid``); only a last,
    partial batch has padding.

    `get_state` / `set_state` save and restore the iterator's position (see
    `jaxdist.input.position`): a new iterator over the same source given a
    saved state yields exactly the batches the saved one had not returned.

    Given to ``jd.train_step(..., steps_per_execution=k)``, the iterator
    places full batches k at a time (`jaxdist.input.group.PlacedGroup`: one
    host stack and one transfer per leaf, the next group prefetched); ``next``
    still returns one batch, and positions still count batches.
    """

    def __init__(
        self,
        producer: Producer,
        make_batcher: Callable[[], Batcher],
        *,
        threaded: bool = True,
        sync: StepSync | None = None,
        epoch: int = 0,
        epochs: Epochs | None = None,
        one_shot: bool = False,
    ) -> None:
        self._lock = threading.Lock()  # consumers in several threads take turns
        self._producer = producer
        self._prints: list[dict[str, Any]] | None = None  # the sources' fingerprints
        self._make_batcher = make_batcher
        self._threaded = threaded
        self._sync = sync
        self._epoch = epoch
        self._epochs = epochs if epochs is not None else Epochs()
        self._one_shot = one_shot
        self._returned = 0  # batches of this epoch returned to the caller
        self._thread: HostThread | None = None
        # Batches per `PlacedGroup` read ahead: 1 until a grouped call asks for more.
        self._group = 1
        self._start(Position())

    def _start(self, position: Position, batcher: Batcher | None = None, move: int = 0) -> None:
        """Starts reading the epoch at ``position`` (a fresh batcher unless given); ``move``
        numbers a start moved by `set_state` (its agreement between processes is new)."""
        batcher = batcher if batcher is not None else self._make_batcher()
        self._batcher = batcher
        self._peeked: Any = END
        self._done = False
        self._exhausted = False  # the source has nothing more (or failed)
        self._ahead: collections.deque[Any] = collections.deque()
        self._forming: list[HostBatch] = []  # full host batches of the next group
        self._buffer = batcher.options.experimental_per_replica_buffer_size
        host = self._producer(batcher, position)
        self._position = position  # with the sources' epochs filled in
        self._host: Iterator[HostBatch] | None = None
        self._thread = None
        sync = self._sync
        if self._threaded or sync is not None:
            signal = Signal()
            depth = max(HOST_QUEUE, self._buffer)
            # Host copies in flight: queued, in the making, placed ahead, being transferred
            # (and held by an agreement's block).
            pool = HostPool(per_shape=depth + self._buffer + 4 + (BLOCK if sync else 0))
            # Each batch is copied out of the source's memory as soon as it is made, before
            # the source is asked for the next (which may refill that memory).
            host = map(pool.owned, host)
            if sync is not None:  # processes with their own sources end on the same step
                agreement = sync.epoch(
                    self._epoch, signal.stop, restart=move, first_step=position.skip
                )
                host = agreed(host, batcher, agreement)
            self._thread = HostThread(host, depth, signal)
            weakref.finalize(self, self._thread.signal)
        else:
            self._host = host
            batcher.rows_in_place = not batcher.multi_process

    def __iter__(self) -> DistributedIterator:
        return self

    def _pull(self) -> Any:
        if self._done:
            return END
        self._read_ahead()
        if not self._ahead:
            self._done = True
            return END
        item = self._ahead.popleft()
        if type(item) is Failure:
            self._done = True
            raise item.error
        return item

    def _from_thread(self, block: bool) -> Any:
        """The prefetch thread's next host batch, `END`, a `Failure`, or None if none is
        ready."""
        assert self._thread is not None
        try:
            return self._thread.get(block)
        except queue.Empty:
            return None

    def _read_ahead(self) -> None:
        """Places (starts the transfers of) the batch about to be returned and up to
        ``buffer`` more that are ready, so they reach the devices while the step runs.
        Only the first is waited for. A failure is kept in line and raised when its batch
        is due. After a grouped call (`next_group`), full batches are placed ``_group``
        at a time, as `PlacedGroup`s."""
        ahead, buffer, place, host = self._ahead, self._buffer, self._batcher.place, self._host
        forming, group, is_full = self._forming, self._group, self._batcher.is_full
        item: Any
        while not self._exhausted and len(ahead) <= buffer:
            if host is not None:  # a source read in this thread (in memory)
                try:
                    item = next(host, END)
                except Exception as e:
                    item = Failure(e)
            else:
                item = self._from_thread(block=not ahead)
                if item is None:
                    return
            if item is END or type(item) is Failure:
                self._exhausted = True
                if forming:
                    self._place_group()
                if item is not END:
                    ahead.append(item)
                return
            if group > 1 and is_full(item[1]):
                forming.append(item)
                if len(forming) >= group:
                    self._place_group()
                continue
            if forming:  # a padded batch ends a group, and travels alone
                self._place_group()
            try:
                ahead.append(place(*item))
            except Exception as e:
                ahead.append(Failure(e))
                self._exhausted = True

    def _place_group(self) -> None:
        """Places the full host batches collected for a group together."""
        forming = self._forming
        batcher = self._batcher
        try:
            tree = batcher.place_group(stack_steps(forming))
            group = PlacedGroup(tree, len(forming), batcher.full_valid())
        except Exception as e:
            self._ahead.append(Failure(e))
            self._exhausted = True
        else:
            self._ahead.append(group)
        forming.clear()

    def _split_off(self, group: PlacedGroup, n: int) -> PlacedGroup:
        """The first ``n`` batches of ``group`` (split on the devices), its rest kept next
        in line."""
        head, rest = group.split(n)
        self._ahead.appendleft(rest)
        return head

    def _pull_at_most(self, n: int) -> Any:
        """The next batch or `PlacedGroup` of at most ``n`` batches, or `END`."""
        item = self._pull()
        if type(item) is PlacedGroup and item.count > n:
            item = self._split_off(item, n)
        return item

    def _pull_one(self) -> Any:
        """The next batch alone (split off a group read ahead for grouped calls), or `END`."""
        item = self._pull()
        if type(item) is PlacedGroup:
            item = (self._split_off(item, 1) if item.count > 1 else item).batch()
        return item

    def next_group(self, k: int) -> list[tuple[Any, int]]:
        """Up to ``k`` next batches for a grouped train step, in order: ``(batch, 1)`` for
        a batch placed alone, ``(group, count)`` for a `PlacedGroup`; empty at the end.
        From this call on, batches read ahead are grouped ``k`` at a time (one host copy
        and one transfer per leaf and group); with ``experimental_fetch_to_device=False``
        every batch is returned alone."""
        k_group = k if self._batcher.options.experimental_fetch_to_device else 1
        out: list[tuple[Any, int]] = []
        with self._lock:
            self._group = k_group
            taken = 0
            if self._peeked is not END:
                out.append((self._peeked, 1))
                self._peeked, taken = END, 1
            while taken < k:
                try:
                    item = self._pull_at_most(k - taken)
                except Exception as e:
                    if not out:
                        raise
                    # The batches before a failure run; the failure is raised next call.
                    self._ahead.appendleft(Failure(e))
                    self._done = False
                    break
                if item is END:
                    break
                count = item.count if type(item) is PlacedGroup else 1
                out.append((item, count))
                taken += count
            if self._batcher.pending:
                self._warn()
            self._returned += taken
        return out

    def _warn(self) -> None:
        """Emits the warnings batching found (in the caller's thread, at its line)."""
        pending = self._batcher.pending
        while pending:
            warnings.warn(pending.pop(0), UserWarning, stacklevel=3)

    def __next__(self) -> Any:
        with self._lock:
            if self._peeked is not END:
                item, self._peeked = self._peeked, END
                self._returned += 1
                return item
            item = self._pull_one()
            if self._batcher.pending:
                self._warn()
            if item is END:
                raise StopIteration
            self._returned += 1
        return item

    def get_next(self) -> Any:
        """The next distributed batch.

        Raises:
            jaxdist.errors.OutOfRangeError: at the end, as TF's ``get_next`` (a
                ``StopIteration``; `next` raises a plain one).
        """
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError(
                "DistributedIterator.get_next: the end of the data (use "
                "get_next_as_optional, or a for loop, to stop without an exception)."
            ) from None

    def get_next_as_optional(self) -> OptionalValue:
        """The next batch wrapped in an `OptionalValue` (empty at the end)."""
        try:
            return OptionalValue(next(self))
        except StopIteration:
            return OptionalValue()

    @property
    def element_spec(self) -> Any:
        """The elements' structure as `jax.ShapeDtypeStruct` values with shardings, for compiling a
        step ahead of time (``strategy.function(step).lower(state, it.element_spec)``)."""
        with self._lock:
            if self._peeked is END:
                self._peeked = self._pull_one()
                if self._peeked is END:
                    raise ValueError("DistributedIterator.element_spec: the dataset is empty.")
            return self._batcher.spec(self._peeked)

    # Position ------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """The iterator's position as a small JSON-able dict (grain's name).

        The position is after the batches returned to the caller; batches
        prefetched but not returned are not counted. In a job of several
        processes each process's iterator has its own state.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.MirroredStrategy()
            >>> ds = jd.data.from_arrays(np.arange(32.0), batch_size=8, shuffle=True)
            >>> it = iter(strategy.experimental_distribute_dataset(ds))
            >>> _ = next(it)
            >>> state = it.get_state()
            >>> rest = [strategy.gather(b, axis=0).tolist() for b in it]
            >>> again = iter(strategy.experimental_distribute_dataset(
            ...     jd.data.from_arrays(np.arange(32.0), batch_size=8, shuffle=True)))
            >>> again.set_state(state)
            >>> [strategy.gather(b, axis=0).tolist() for b in again] == rest
            True
        """
        with self._lock:
            batcher = self._batcher
            known = self._returned > 0 and batcher.b is not None
            return make_state(
                epoch=self._epoch,
                batches=self._returned,
                source_epochs=self._position.epochs,
                rows_per_replica=batcher.b if known else None,
                first_rows=batcher.first_rows if known else None,
                sources=self._fingerprints(),
            )

    def _fingerprints(self) -> list[dict[str, Any]]:
        """The sources' fingerprints (`jaxdist.input.position.fingerprint`), taken once."""
        if self._prints is None:
            self._prints = [fingerprint(s) for s in self._producer.sources]
        return self._prints

    def set_state(self, state: dict[str, Any]) -> None:
        """Moves the iterator to a position `get_state` returned (here or in an earlier
        run), so that it yields exactly the batches not returned before, in the same order.

        The state applies to an iterator of a dataset over the same source with
        the same shuffling seed, made the same way (``iter()`` of
        `Strategy.experimental_distribute_dataset` or
        `Strategy.distribute_datasets_from_function`); the dataset's next
        ``iter()`` then starts the epoch after the state's. A
        `jaxdist.data.from_arrays` dataset, a list or a tuple of batches start
        at the position directly. Another source (a generator,
        `jaxdist.data.from_generator`, grain, tf.data) cannot seek: the batches
        before the position are read and dropped, with a ``UserWarning``, which
        is exact only when the source yields the same batches in the same order
        as in the run that saved the state; a generator that already went past
        the position cannot go back (``ValueError``). In a job of several
        processes every process moves its own iterator, at the same step.

        The state carries a fingerprint of the sources and their options
        (`jaxdist.input.position.fingerprint`: for `jaxdist.data.from_arrays`
        its rows, batch size, shuffling, seed and a hash of rows spread over
        it), and a state saved for other data is refused.

        Raises:
            ValueError: ``state`` is not such a state, was saved by another
                process, for another kind of dataset or for other data or
                options (the message names both), or lies behind a one-shot
                source's current position.
        """
        where = "DistributedIterator.set_state"
        resumed = parse_state(where, state, self._fingerprints())
        with self._lock:
            seekable, ahead = self._producer.seekable, self._returned <= resumed.batches
            if not seekable and not ahead and self._one_shot:
                raise ValueError(
                    f"{where}: the state is at batch {resumed.batches} of its epoch, but this "
                    f"iterator has returned {self._returned} batches of a source that can be "
                    "iterated only once (an iterator or generator object), which cannot go "
                    "back. Call set_state on a new iterator over a new source."
                )
            self._epoch = resumed.epoch
            self._epochs.count = max(self._epochs.count, resumed.epoch)
            if not seekable and ahead:  # read on to the position
                drop = resumed.batches - self._returned
                if drop:
                    self._warn_skip(drop)
                self._drop(drop)
                self._returned = resumed.batches
                return
            if not seekable and resumed.batches:  # a new pass over the source
                self._warn_skip(resumed.batches)
            self._stop_thread()
            batcher = self._make_batcher()
            if resumed.rows_per_replica is not None:
                batcher.resume(resumed.rows_per_replica, resumed.first_rows, resumed.batches)
            self._epochs.moves += 1
            position = Position(skip=resumed.batches, epochs=resumed.source_epochs)
            self._start(position, batcher, move=self._epochs.moves)
            self._returned = resumed.batches

    def _warn_skip(self, count: int) -> None:
        kinds = ", ".join(sorted({type(s).__name__ for s in self._producer.sources}))
        warnings.warn(
            f"DistributedIterator.set_state: the dataset's source ({kinds}) cannot seek, so "
            f"the {count} batches before the saved position are read and dropped. Resuming "
            "is exact only if the source yields the same batches in the same order as in "
            "the run that saved the state. Sources that seek: jaxdist.data.from_arrays, "
            "lists and tuples of batches.",
            UserWarning,
            stacklevel=3,
        )

    def _drop(self, count: int) -> None:
        """Drops the next ``count`` batches (host batches where not yet placed)."""
        while count and self._peeked is not END:
            self._peeked, count = END, count - 1
        while count and self._ahead and type(self._ahead[0]) is not Failure:
            head = self._ahead.popleft()
            if type(head) is PlacedGroup:
                if head.count > count:
                    self._ahead.appendleft(head.split(count)[1])
                    return
                count -= head.count
            else:
                count -= 1
        while count and self._forming:
            self._forming.pop(0)
            count -= 1
        while count and not self._exhausted:
            item: Any = self._from_thread(block=True) if self._host is None else None
            if self._host is not None:
                item = next(self._host, END)
            if item is END or type(item) is Failure:
                self._exhausted = True
                if item is not END:
                    self._ahead.append(item)
                return
            count -= 1

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._thread.signal()
            self._thread = None

    def close(self) -> None:
        """Stops the prefetch thread (also done when the iterator is garbage collected); a
        ``next`` waiting in another thread then ends with ``StopIteration``."""
        self._done = True
        if self._thread is not None:
            self._thread.signal()
            self._thread.items.put(END)  # wakes a consumer waiting for the next batch
        with self._lock:
            self._ahead.clear()
            self._forming.clear()
            self._peeked = END


class DistributedDataset:
    """An iterable of distributed batches; each ``iter()`` starts a new epoch.

    A source that can be iterated only once (a generator) gives one epoch: a
    second ``iter()`` raises ``RuntimeError`` rather than silently yielding
    nothing.
    """

    def __init__(
        self,
        producer: Producer,
        make_batcher: Callable[[], Batcher],
        *,
        threaded: bool = True,
        one_shot: str | None = None,
        sync: StepSync | None = None,
    ) -> None:
        self._producer = producer
        self._sync = sync  # processes reading their own sources agree on when they end
        self._make_batcher = make_batcher
        self._threaded = threaded
        self._one_shot = one_shot  # why a second iter() fails, for a one-shot source
        self._epochs = Epochs()  # shared with the iterators (set_state renumbers the epochs)
        self._started: DistributedIterator | None = None  # made by element_spec, not handed out
        self._spec: Any = None

    def __iter__(self) -> DistributedIterator:
        if self._started is not None:
            it, self._started = self._started, None
            return it
        if self._one_shot is not None and self._epochs.count:
            raise RuntimeError(self._one_shot)
        self._epochs.count += 1
        return DistributedIterator(
            self._producer,
            self._make_batcher,
            threaded=self._threaded,
            sync=self._sync,
            epoch=self._epochs.count,
            epochs=self._epochs,
            one_shot=self._one_shot is not None,
        )

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Folds one epoch: ``state = reduce_func(state, element)`` for every distributed
        batch, from ``initial_state`` (TF's ``DistributedDataset.reduce``).

        Example: ``ds.reduce(0.0, lambda total, b: total + strategy.reduce("sum", b,
        axis=0))`` sums every row of the epoch (padding excluded).
        """
        if not callable(reduce_func):
            raise TypeError(
                "DistributedDataset.reduce(initial_state, reduce_func): reduce_func must be "
                f"callable as reduce_func(state, element), got {type(reduce_func).__name__}."
            )
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    @property
    def element_spec(self) -> Any:
        """As `DistributedIterator.element_spec` (reads the first batch; for a one-shot
        source that batch is kept for the next ``iter()``, never lost)."""
        if self._spec is None:
            it = iter(self)
            try:
                self._spec = it.element_spec
            except BaseException:
                it.close()
                raise
            if self._one_shot is not None:
                self._started = it
            else:
                it.close()
        return self._spec
