"""The collective watchdog of a multi-process strategy (private; `MultiWorkerMirroredStrategy`).

With ``CommunicationOptions(timeout_seconds=T)`` in a job of several
processes, the strategy counts the programs it dispatches in this process
(its *steps*: every ``strategy.run`` / ``strategy.function`` call, from 0)
and a daemon thread watches them:

- every ``poll`` seconds it checks whether the last dispatched step's outputs
  are ready, and publishes this process's step count in `jax.distributed`'s
  key-value store (``jaxdist/watchdog/<strategy>/<process id>``);
- when a step has been in flight for ``T`` seconds without any step
  completing, it reads the other processes' counts, prints one line naming
  the step and the processes that have not reached it (those whose count
  shows they never dispatched it), e.g.::

      jaxdist: MultiWorkerMirroredStrategy: step 20 did not complete within 10 s
      (CommunicationOptions(timeout_seconds=10)): process 1 did not arrive (its last
      step: 19); ending process 0 with exit code 1.

  and ends this process with exit code 1. The launcher (or `jax.distributed`'s
  heartbeat) then ends the others.

A step counts as in flight from its dispatch until its outputs are ready,
so compiling a step never counts, and waiting for a slower peer does only
up to ``T``: a stall shorter than ``T`` passes. A step whose own compute
takes longer than ``T`` also ends the job (the line then says every process
arrived): ``T`` must exceed the longest step, as TF documents for its
timeout. Steps are numbered in the order each process dispatches them, which
is the same in every process of an SPMD program.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["Watchdog"]

_PREFIX = "jaxdist/watchdog"
_strategies = itertools.count()  # strategies are created in the same order in every process


def _an_array(outputs: Any) -> Any:
    """One output array of a step (all of a program's outputs become ready together)."""
    array = getattr(outputs, "array", None)  # a Mirrored / PerReplica
    if isinstance(array, jax.Array):
        return array
    for leaf in jax.tree.leaves(outputs):
        if isinstance(leaf, jax.Array):
            return leaf
    return None


def _ready(array: Any) -> bool:
    try:
        return bool(array.is_ready())
    except RuntimeError:  # deleted (donated to a later step): it was computed
        return True


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


class Watchdog:
    """Ends this process when a step of the strategy does not complete within ``timeout``."""

    def __init__(
        self,
        timeout: float,
        client: Any,
        process_id: int,
        num_processes: int,
        *,
        where: str = "MultiWorkerMirroredStrategy",
        poll: float | None = None,
        say: Callable[[str], None] = _say,
        exit_now: Callable[[int], Any] = os._exit,
    ) -> None:
        self.timeout = timeout
        self._client, self._me, self._n = client, process_id, num_processes
        self._where, self._say, self._exit = where, say, exit_now
        self._poll = poll if poll is not None else min(1.0, timeout / 10)
        self._prefix = f"{_PREFIX}/{next(_strategies)}/"
        self._lock = threading.Lock()
        self._dispatched = 0  # steps dispatched so far
        self._in_flight: Any = None  # an output of the last step, until it is ready
        self._since = time.monotonic()  # when the oldest step in flight started counting
        self._published = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxdist-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # before jax.distributed's shutdown (registered earlier)

    @property
    def steps(self) -> int:
        """Steps dispatched so far in this process."""
        return self._dispatched

    def wrap(self, caller: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``caller`` that counts its calls as steps and hands their outputs to the watch."""

        def watched(args: Any, kwargs: Any) -> Any:
            out = caller(args, kwargs)
            self.dispatched(out)
            return out

        return watched

    def dispatched(self, outputs: Any) -> None:
        """Records one dispatched step and its outputs."""
        array = _an_array(outputs)
        with self._lock:
            self._dispatched += 1
            if self._in_flight is None or _ready(self._in_flight):  # nothing else pending
                self._since = time.monotonic()
            if array is not None:
                self._in_flight = array

    def stop(self) -> None:
        """Stops watching (at exit: before `jax.distributed` shuts down)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            with self._lock:
                array, steps, since = self._in_flight, self._dispatched, self._since
            if array is not None and _ready(array):
                with self._lock:
                    if self._in_flight is array:
                        self._in_flight = None
                    else:  # a later step was dispatched meanwhile: it counts from now
                        self._since = time.monotonic()
                array = None
            self._publish(steps)
            if array is not None and time.monotonic() - since >= self.timeout:
                self._fire(steps - 1)
                return

    def _publish(self, steps: int) -> None:
        if steps == self._published or self._stop.is_set():
            return
        with contextlib.suppress(Exception):  # the store is best effort; the watch goes on
            self._client.key_value_set(f"{self._prefix}{self._me}", str(steps), True)
            self._published = steps

    def _peers(self) -> dict[int, int] | None:
        """Every other process's published step count (``None``: the store did not answer)."""
        try:
            entries = self._client.key_value_dir_get(self._prefix)
        except Exception:  # the line is still worth printing without them
            return None
        counts = {i: 0 for i in range(self._n) if i != self._me}
        for key, value in entries:
            with contextlib.suppress(ValueError):
                process = int(str(key).rsplit("/", 1)[-1])
                if process in counts:
                    counts[process] = int(value)
        return counts

    def _fire(self, step: int) -> None:
        peers = self._peers()
        if peers is None:
            who = "the other processes' steps are unknown (the key-value store did not answer)"
        else:
            late = {p: c for p, c in sorted(peers.items()) if c <= step}
            if not late:
                who = "every process arrived (the step itself ran longer than that)"
            else:
                names = ", ".join(
                    f"{p} (its last step: {c - 1 if c else 'none'})" for p, c in late.items()
                )
                who = f"process{'es' if len(late) > 1 else ''} {names} did not arrive"
        options = f"CommunicationOptions(timeout_seconds={self.timeout:g})"
        self._say(
            f"jaxdist: {self._where}: step {step} did not complete within {self.timeout:g} s "
            f"({options}): {who}; ending process {self._me} with exit code 1."
        )
        self._exit(1)
