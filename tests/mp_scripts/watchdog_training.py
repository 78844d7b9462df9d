"""A training loop in which one process stalls inside step 20 (tests/strategies/test_watchdog.py).

Usage: watchdog_training.py VICTIM STALL_SECONDS STEPS [TIMEOUT_SECONDS|- [EXIT_CODE]]
    VICTIM stalls (sleeps) STALL_SECONDS before its step 20, as a hung data loader or
    a slow host would; TIMEOUT_SECONDS is ``CommunicationOptions(timeout_seconds=...)``
    (without it, or ``-``, the default applies: the launcher's ``--collective-timeout``,
    ``JAXDIST_COLLECTIVE_TIMEOUT``, or the strategy's own); with EXIT_CODE, VICTIM then
    calls ``sys.exit(EXIT_CODE)`` instead of training on.

Prints ``STALLING <wall-clock time>`` when the stall starts and ``DONE <w>`` at the end,
where ``w`` is the result of STEPS all-reduce steps (``w <- w + sum of replica ids + 1``).
"""

from __future__ import annotations

import sys
import time


def main(
    victim: int, stall: float, steps: int, timeout: float | None, exit_code: int | None
) -> None:
    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    options = jd.experimental.CommunicationOptions(timeout_seconds=timeout)
    strategy = jd.MultiWorkerMirroredStrategy(communication_options=options)
    import jax.numpy as jnp

    @strategy.function
    def step(ctx: jd.ReplicaContext, w: jax.Array) -> jax.Array:
        return w + ctx.all_reduce("sum", (ctx.replica_id_in_sync_group + 1).astype(jnp.float32))

    w = jnp.float32(0.0)
    for i in range(steps):
        if jax.process_index() == victim and i == 20:
            print(f"STALLING {time.time()!r}", flush=True)
            time.sleep(stall)
            if exit_code is not None:
                print(f"EXITING {time.time()!r}", flush=True)
                sys.exit(exit_code)
        w = step(w)
    print(f"DONE {float(w)!r}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    timeout = float(args[3]) if len(args) > 3 and args[3] != "-" else None
    main(
        int(args[0]), float(args[1]), int(args[2]), timeout, int(args[4]) if len(args) > 4 else None
    )
