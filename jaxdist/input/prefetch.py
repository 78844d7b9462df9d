"""The prefetch thread of a distributed iterator.

For a general source (a Python generator, grain, tf.data), a background thread
runs the source and splits its batches on the host, so a slow source overlaps
the training step. It hands host batches to the consumer through
`queue.SimpleQueue`s (C-level queues): one for batches, one for the *credits*
that bound how far it runs ahead. `jaxdist.input.dataset` uses it.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from jaxdist.input.batching import HostBatch

__all__ = ["END", "EXIT_TIMEOUT_S", "HOST_QUEUE", "Failure", "HostThread", "Signal", "stop_all"]

END = object()
WAKE = 0  # a credit that only wakes a prefetch thread (to see its stop flag)

# At interpreter exit, prefetch threads get this long, all together, to stop: a thread
# still inside JAX when the runtime shuts down (a source that makes or reads back jax
# arrays) can abort the process, but one blocked in the user's source (a socket, a queue)
# may never return, and is left behind.
EXIT_TIMEOUT_S = 0.5

# A general source's thread queues up to this many host batches (or the buffer size if
# larger), refilled half at a time.
HOST_QUEUE = 4

# Live prefetch threads, with their stop flags and credit queues.
LIVE: weakref.WeakKeyDictionary[threading.Thread, Signal] = weakref.WeakKeyDictionary()


class Signal:
    """Tells a prefetch thread to stop, waking it if it waits for a credit."""

    __slots__ = ("credits", "stop")

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.credits: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def __call__(self) -> None:
        self.stop.set()
        self.credits.put(WAKE)


@atexit.register
def stop_all(timeout: float = EXIT_TIMEOUT_S) -> None:
    """Signals every prefetch thread first, then waits for all of them together, at most
    ``timeout`` seconds in all (threads stuck in user code are abandoned)."""
    live = list(LIVE.items())
    for _, signal in live:
        signal()
    deadline = time.monotonic() + timeout
    for thread, _ in live:
        thread.join(max(0.0, deadline - time.monotonic()))


class Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class HostThread:
    """Runs a source in a background thread and hands its host batches over.

    The thread may queue ``depth`` batches beyond those the consumer has
    taken (and holds one more in the making). The consumer returns the
    credits for taken batches in bulk, ``refill`` at a time (or all before it
    waits), so the thread wakes once per ``refill`` batches and makes them in a
    burst: waking it for every batch costs two GIL hand-offs per batch, about a
    third of the throughput on a 2-core machine.
    """

    def __init__(self, host: Iterator[HostBatch], depth: int, signal: Signal) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.signal = signal
        self.signal.credits.put(depth)
        self._refill = max(1, depth // 2)
        self._owed = 0
        thread = threading.Thread(
            target=fill,
            args=(host, self.items, self.signal),
            name="jaxdist-input-prefetch",
            daemon=True,
        )
        LIVE[thread] = self.signal
        thread.start()

    def get(self, block: bool) -> Any:
        """The next host batch, `END` or a `Failure`; ``queue.Empty`` if ``block`` is
        false and none is ready."""
        if block and self._owed:  # the thread may be waiting for these
            self.signal.credits.put(self._owed)
            self._owed = 0
        item = self.items.get(block)
        if item is not END and not isinstance(item, Failure):
            self._owed += 1
            if self._owed >= self._refill:
                self.signal.credits.put(self._owed)
                self._owed = 0
        return item


def fill(host: Iterator[HostBatch], out: queue.SimpleQueue[Any], signal: Signal) -> None:
    """The prefetch thread's loop (it never touches the iterator, so that can be collected,
    which stops the thread)."""
    stop, credits = signal.stop, signal.credits
    allowed = 0
    last: Any = END
    try:
        for item in host:
            while not allowed:
                credit = credits.get()
                if stop.is_set():
                    return
                allowed += credit
            if stop.is_set():
                return
            allowed -= 1
            out.put(item)
    except BaseException as e:  # handed to the consumer, which re-raises it
        last = Failure(e)
    if not stop.is_set():
        out.put(last)
