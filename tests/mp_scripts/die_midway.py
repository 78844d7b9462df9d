"""Multi-process training in which one process fails at step 20
(tests/strategies/test_multi_worker.py).

Usage: die_midway.py VICTIM HOW [TIMEOUT_SECONDS]
    VICTIM: the process that fails (0 hosts JAX's coordination service).
    HOW: ``exit`` ends it at once (``os._exit(7)``, as a crash or SIGKILL would);
    ``stall`` keeps it alive but away from the collectives for 120 s (a hang).
    TIMEOUT_SECONDS: ``CommunicationOptions(timeout_seconds=...)`` of every process.

Prints ``FAILING <how> <wall-clock time>`` just before the victim fails, so the
test can time how long the other process takes to end.
"""

from __future__ import annotations

import os
import sys
import time


def main(victim: int, how: str, timeout: float | None) -> None:
    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    options = jd.experimental.CommunicationOptions(timeout_seconds=timeout)
    strategy = jd.MultiWorkerMirroredStrategy(communication_options=options)
    import jax.numpy as jnp

    step = strategy.function(lambda ctx, x: ctx.all_reduce("sum", x * 2.0))
    for i in range(100_000):
        if jax.process_index() == victim and i == 20:
            print(f"FAILING {how} {time.time()!r}", flush=True)
            if how == "exit":
                os._exit(7)
            time.sleep(120)
            os._exit(8)
        step(jnp.float32(i))
    sys.exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else None)
