"""A MultiWorkerMirroredStrategy training loop started by jaxdist's launcher
(tests/launch/test_launch.py).

Prints ``STARTED <pid>`` once the strategy is up, ``STEP <i>`` every 5 steps,
and at the end ``DONE <restart count> <w>`` where ``w`` is the trained weight.
Each step all-reduces the per-replica gradient of ``(w * x - 1)^2 / 2`` with
``x = replica id + 1``, so the expected ``w`` is easy to compute in NumPy.

Usage: launched_training.py STEPS [--fail-first-start] [--exit-first-start] [--spawn-helper]
    --fail-first-start: process 1 raises at step 5 of the first attempt
    (``JAXDIST_RESTART_COUNT == 0``); the uncaught exception ends it with code 1.
    --exit-first-start: process 1 prints ``EXITING <wall-clock time>`` and calls
    ``sys.exit(3)`` at step 5 of the first attempt.
    --spawn-helper: first start a helper process that sleeps (as a data loader
    worker would) and print ``HELPER <pid>``; it must not outlive the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def main(steps: int, fail_first_start: bool, exit_first_start: bool, spawn_helper: bool) -> None:
    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import jax.numpy as jnp

    restart = int(os.environ.get("JAXDIST_RESTART_COUNT", "0"))
    if spawn_helper:
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"HELPER {helper.pid}", flush=True)
    print(f"STARTED {os.getpid()}", flush=True)

    @strategy.function
    def step(ctx: jd.ReplicaContext, w: jax.Array) -> jax.Array:
        x = (ctx.replica_id_in_sync_group + 1).astype(jnp.float32)
        grad = (w * x - 1.0) * x
        return w - 0.01 * ctx.all_reduce("mean", grad)

    w = jnp.float32(0.0)
    for i in range(steps):
        if fail_first_start and restart == 0 and jax.process_index() == 1 and i == 5:
            raise RuntimeError("failing on purpose")
        if exit_first_start and restart == 0 and jax.process_index() == 1 and i == 5:
            print(f"EXITING {time.time()!r}", flush=True)
            sys.exit(3)
        w = step(w)
        if i % 5 == 0:
            print(f"STEP {i}", flush=True)
    print(f"DONE {restart} {float(w)!r}", flush=True)


if __name__ == "__main__":
    flags = sys.argv[2:]
    main(
        int(sys.argv[1]),
        "--fail-first-start" in flags,
        "--exit-first-start" in flags,
        "--spawn-helper" in flags,
    )
