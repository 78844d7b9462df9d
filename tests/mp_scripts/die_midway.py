"""Multi-process training in which process 1 dies at step 20 (tests/test_multi_process.py)."""

from __future__ import annotations

import os
import sys


def main() -> None:
    import jax  # noqa: I001 - the strategy must start jax.distributed first
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import jax.numpy as jnp

    step = strategy.function(lambda ctx, x: ctx.all_reduce("sum", x * 2.0))
    for i in range(100_000):
        if jax.process_index() == 1 and i == 20:
            print("process 1: dying now", flush=True)
            os._exit(7)
        step(jnp.float32(i))
    sys.exit(0)


if __name__ == "__main__":
    main()
