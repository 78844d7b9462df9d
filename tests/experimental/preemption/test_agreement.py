"""The agreement of several processes on the call to save at, in one process: two handlers
over a shared in-memory key-value store, each in its own thread, in lock step. A planted
off-by-one in the agreement was caught before only by a slow two-process test, as a hang."""

from __future__ import annotations

import threading
from pathlib import Path

import jax.numpy as jnp
import pytest

import jaxdist as jd
from jaxdist.experimental.preemption.agreement import KeyValueAgreement

pytest.importorskip("orbax.checkpoint")


class _Store:
    """The three calls of the ``jax.distributed`` client the agreement makes."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self._changed:
            return [(k, v) for k, v in self._values.items() if k.startswith(prefix)]

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
            return self._values[key]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("noticed_after", [1, 5])
def test_two_processes_agree_on_one_call_and_save_at_its_end(
    tmp_path: Path, noticed_after: int
) -> None:
    store, barrier = _Store(), threading.Barrier(2, timeout=20)
    handlers, ckpts, exits, errors = [], [], [[], []], []
    for p in range(2):
        ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(()))
        config = jd.experimental.TerminationConfig(
            termination_watcher_fn=lambda: False,
            exit_fn=lambda p=p: exits[p].append(handlers[p].total_run_calls),
        )
        handler = jd.experimental.PreemptionCheckpointHandler(None, ckpt, tmp_path / str(p), config)
        agreement = KeyValueAgreement(store, p, 2, timeout_s=10)  # as process p of 2
        agreement._handler = 0  # the keys of each process's first handler, as in a real job
        handler._agreement = agreement
        handlers.append(handler)
        ckpts.append(ckpt)

    def process(p: int) -> None:
        def step() -> None:
            ckpts[p].w = ckpts[p].w + 1.0

        try:
            for _ in range(30):
                barrier.wait()  # the processes' steps run in lock step, as collectives make them
                handlers[p].run(step)
                if p == 1 and handlers[p].total_run_calls == noticed_after:
                    handlers[p]._notice("SIGTERM")  # process 1 alone is told
                if exits[p]:
                    return
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    # Both saved once, after the same call: the notice's call, one more for the others to
    # publish, and the call after the largest count (2 or 3 calls after the notice).
    assert len(exits[0]) == len(exits[1]) == 1 and exits[0] == exits[1], exits
    assert noticed_after + 2 <= exits[0][0] <= noticed_after + 3, exits
    for p in range(2):
        fresh = jd.checkpoint.Checkpoint(w=jnp.zeros(()), total_run_calls=0)
        jd.checkpoint.CheckpointManager(fresh, tmp_path / str(p)).restore_or_initialize()
        assert int(fresh.total_run_calls) == exits[0][0] and float(fresh.w) == exits[0][0]
