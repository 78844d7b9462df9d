"""The collective watchdog of a multi-process strategy (`MultiWorkerMirroredStrategy`).

Every process of a multi-process `MultiWorkerMirroredStrategy` job runs one
(a one-process job runs none). The strategy counts the programs it
dispatches in this process, its *steps*, numbered from 0: every
``strategy.run`` / ``strategy.function`` / training-step call, and every
cross-replica operation that dispatches a program (``strategy.reduce``,
``strategy.gather``, ``extended.reduce_to`` / ``batch_reduce_to`` /
``update``, reading an ``ON_READ`` variable's aggregate). Steps are numbered
in the order each process dispatches them, which is the same in every
process of an SPMD program. A daemon thread watches them:

- every ``poll`` seconds it checks whether the last dispatched step's outputs
  are ready, and publishes this process's step count and what that step is
  in `jax.distributed`'s key-value store
  (``jaxdist/watchdog/<strategy>/<process id>``);
- every ``log_interval`` seconds that a step stays in flight (default 60 s),
  it prints one line naming the step, what it is, and the processes that
  have not reached it (read from the store), e.g.::

      jaxdist: MultiWorkerMirroredStrategy: process 0 has waited 60 s for step 20
      (step) to complete; not arrived: process 1 (its last step: 19, step); the job
      ends after 1200 s without progress (the default timeout of a multi-process
      job; ...).

- when a step has been in flight for ``timeout`` seconds without any step
  completing, it prints one line naming the step and the processes that have
  not reached it (those whose count shows they never dispatched it)::

      jaxdist: MultiWorkerMirroredStrategy: step 20 did not complete within 10 s
      (CommunicationOptions(timeout_seconds=10)): process 1 (its last step: 19) did
      not arrive; ending process 0 with exit code 1.

  and ends this process with exit code 1. The launcher (or `jax.distributed`'s
  heartbeat) then ends the others.

A step counts as in flight from its dispatch until its outputs are ready,
so compiling a step (which happens before its dispatch) never counts, and
waiting for a slower peer does only up to ``timeout``: a stall shorter than
``timeout`` passes. A step whose own compute takes longer than ``timeout``
also ends the job (the line then says every process arrived): ``timeout``
must exceed the longest step, as TF documents for its timeout. ``timeout``
``None`` turns the ending off and keeps the lines; ``log_interval`` ``None``
turns the lines off.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxdist._jax_compat import is_tracer

__all__ = ["DEFAULT_LOG_INTERVAL", "DEFAULT_TIMEOUT", "Watchdog"]

DEFAULT_TIMEOUT = 1200.0  # 20 min: under XLA's own CPU collective timeout (30 min)
DEFAULT_LOG_INTERVAL = 60.0
_PREFIX = "jaxdist/watchdog"
_strategies = itertools.count()  # strategies are created in the same order in every process


def _an_array(outputs: Any) -> Any:
    """One concrete output array of a step (all of a program's outputs become ready
    together); ``None`` when it has none (e.g. traced inside another program)."""
    array = getattr(outputs, "array", None)  # a Mirrored / PerReplica
    if isinstance(array, jax.Array) and not is_tracer(array):
        return array
    for leaf in jax.tree.leaves(outputs):
        if isinstance(leaf, jax.Array) and not is_tracer(leaf):
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


def _seconds(value: float) -> str:
    return f"{value:g}" if value < 10 else f"{math.floor(value):d}"


class Watchdog:
    """Reports, then ends, this process when a step of the strategy does not complete.

    Args:
        timeout: seconds a step may stay in flight before the process ends
            (``None``: never).
        client: `jax.distributed`'s client (its key-value store).
        process_id: this process.
        num_processes: the job's process count.
        log_interval: seconds between the lines about a step in flight (``None``: none).
        source: where ``timeout`` comes from, for the lines.
        where: the strategy's name, for the lines.
        poll: seconds between checks (default: a tenth of the shortest interval, at
            most 1 s).
        say: prints a line (tests pass a recorder).
        exit_now: ends the process (``os._exit``; tests pass a recorder).
    """

    def __init__(
        self,
        timeout: float | None,
        client: Any,
        process_id: int,
        num_processes: int,
        *,
        log_interval: float | None = None,
        source: str | None = None,
        where: str = "MultiWorkerMirroredStrategy",
        poll: float | None = None,
        say: Callable[[str], None] = _say,
        exit_now: Callable[[int], Any] = os._exit,
    ) -> None:
        self.timeout = timeout or None
        self.log_interval = log_interval or None
        self._source = source or f"CommunicationOptions(timeout_seconds={timeout or 0:g})"
        self._client, self._me, self._n = client, process_id, num_processes
        self._where, self._say, self._exit = where, say, exit_now
        spans = [s for s in (self.timeout, self.log_interval) if s]
        self._poll = poll if poll is not None else min([1.0, *(s / 10 for s in spans)])
        self._prefix = f"{_PREFIX}/{next(_strategies)}/"
        self._lock = threading.Lock()
        self._dispatched = 0  # steps dispatched so far
        self._what = ""  # what the last dispatched step is
        self._in_flight: Any = None  # an output of the last step, until it is ready
        self._since = time.monotonic()  # when the oldest step in flight started counting
        self._logged = (self._since, 0)  # (since, lines printed about that wait)
        self._published = (-1, "")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxdist-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # before jax.distributed's shutdown (registered earlier)

    @property
    def steps(self) -> int:
        """Steps dispatched so far in this process."""
        return self._dispatched

    def wrap(self, caller: Callable[[Any, Any], Any], what: str) -> Callable[[Any, Any], Any]:
        """``caller`` that counts its calls as steps (described as ``what``) and hands
        their outputs to the watch."""

        def watched(args: Any, kwargs: Any) -> Any:
            out = caller(args, kwargs)
            self.dispatched(out, what)
            return out

        return watched

    def dispatched(self, outputs: Any, what: str = "") -> None:
        """Records one dispatched step and its outputs."""
        array = _an_array(outputs)
        with self._lock:
            self._dispatched += 1
            self._what = what
            if self._in_flight is None or _ready(self._in_flight):  # nothing else pending
                self._since = time.monotonic()
            if array is not None:
                self._in_flight = array

    def dispatched_if_any(self, outputs: Any, what: str) -> None:
        """Records a step only when ``outputs`` hold a concrete array (a program ran)."""
        if _an_array(outputs) is not None:
            self.dispatched(outputs, what)

    def stop(self) -> None:
        """Stops watching (at exit: before `jax.distributed` shuts down)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            with self._lock:
                array, since = self._in_flight, self._since
                steps, what = self._dispatched, self._what
            if array is not None and _ready(array):
                with self._lock:
                    if self._in_flight is array:
                        self._in_flight = None
                    else:  # a later step was dispatched meanwhile: it counts from now
                        self._since = time.monotonic()
                array = None
            self._publish(steps, what)
            if array is None:
                continue
            waited = time.monotonic() - since
            if self.timeout is not None and waited >= self.timeout:
                self._fire(steps - 1)
                return
            if self.log_interval is not None:
                logged_since, lines = self._logged
                lines = lines if logged_since == since else 0
                due = math.floor(waited / self.log_interval)
                if due > lines:
                    self._logged = (since, due)
                    self._report(steps - 1, what, waited)

    def _publish(self, steps: int, what: str) -> None:
        if (steps, what) == self._published or self._stop.is_set():
            return
        with contextlib.suppress(Exception):  # the store is best effort; the watch goes on
            self._client.key_value_set(f"{self._prefix}{self._me}", f"{steps}:{what}", True)
            self._published = (steps, what)

    def _peers(self) -> dict[int, tuple[int, str]] | None:
        """Every other process's published step count and what its last step is
        (``None``: the store did not answer)."""
        try:
            entries = self._client.key_value_dir_get(self._prefix)
        except Exception:  # the line is still worth printing without them
            return None
        counts = {i: (0, "") for i in range(self._n) if i != self._me}
        for key, value in entries:
            with contextlib.suppress(ValueError):
                process = int(str(key).rsplit("/", 1)[-1])
                count, _, what = str(value).partition(":")
                if process in counts:
                    counts[process] = (int(count), what)
        return counts

    def _late(self, step: int) -> dict[int, tuple[int, str]] | None:
        """The processes that have not dispatched ``step`` (``None``: unknown)."""
        peers = self._peers()
        if peers is None:
            return None
        return {p: c for p, c in sorted(peers.items()) if c[0] <= step}

    def _report(self, step: int, what: str, waited: float) -> None:
        late = self._late(step)
        if late is None:
            who = "the other processes' steps are unknown (the key-value store did not answer)"
        elif not late:
            who = "every process arrived (the step itself is running that long)"
        else:
            names = ", ".join(
                f"{p} (its last step: {c - 1 if c else 'none'}{', ' + w if c and w else ''})"
                for p, (c, w) in late.items()
            )
            who = f"not arrived: process{'es' if len(late) > 1 else ''} {names}"
        if self.timeout is None:
            end = f"no timeout ends the job ({self._source})"
        else:
            end = f"the job ends after {_seconds(self.timeout)} s without progress ({self._source})"
        self._say(
            f"jaxdist: {self._where}: process {self._me} has waited {_seconds(waited)} s for "
            f"step {step}{f' ({what})' if what else ''} to complete; {who}; {end}."
        )

    def _fire(self, step: int) -> None:
        assert self.timeout is not None
        late = self._late(step)
        if late is None:
            who = "the other processes' steps are unknown (the key-value store did not answer)"
        elif not late:
            who = "every process arrived (the step itself ran longer than that)"
        else:
            names = ", ".join(
                f"{p} (its last step: {c - 1 if c else 'none'})" for p, (c, _) in late.items()
            )
            who = f"process{'es' if len(late) > 1 else ''} {names} did not arrive"
        self._say(
            f"jaxdist: {self._where}: step {step} did not complete within "
            f"{self.timeout:g} s ({self._source}): {who}; ending process {self._me} with exit "
            "code 1."
        )
        self._exit(1)
