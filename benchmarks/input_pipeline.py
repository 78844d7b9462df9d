"""Serving global batches to 8 replicas: jaxdist's distributed dataset vs hand-written
``jax.device_put(batch, NamedSharding(mesh, P('data')))``, in one process.

65,536 x 784 float32 rows in batches of 512. Target: batches/s ratio >= 0.95.
Then an MLP step with input from the dataset vs the same step on one batch
already on the devices: prefetch should hide the input cost.
"""

from __future__ import annotations

import time

import _harness
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

ROWS, FEATURES, BATCH = 65_536, 784, 512


def batches_per_second(loop, rounds: int = 5) -> float:
    loop()  # warm up
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        n = loop()
        rates.append(n / (time.perf_counter() - start))
    return float(np.median(rates))


def main() -> None:
    strategy = jd.MirroredStrategy()
    mesh = strategy.mesh
    x = np.random.default_rng(0).normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 10, size=(ROWS,)).astype(np.int32)
    sharding = NamedSharding(mesh, P(strategy.axis_name))

    def hand_loop() -> int:
        last = None
        for i in range(ROWS // BATCH):
            sl = slice(i * BATCH, (i + 1) * BATCH)
            last = (jax.device_put(x[sl], sharding), jax.device_put(y[sl], sharding))
        jax.block_until_ready(last)
        return ROWS // BATCH

    ds = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=BATCH))

    def drain(dataset) -> int:
        count, batch = 0, None
        for count, batch in enumerate(dataset, 1):  # noqa: B007 (the last batch is waited on)
            pass
        jax.block_until_ready(batch)
        return count

    def jaxdist_loop() -> int:
        return drain(ds)

    def generator():
        for i in range(ROWS // BATCH):
            sl = slice(i * BATCH, (i + 1) * BATCH)
            yield x[sl], y[sl]

    def generator_loop() -> int:  # a general Python source: prefetched by a thread
        return drain(strategy.experimental_distribute_dataset(generator()))

    print(_harness.describe_machine())
    base = batches_per_second(hand_loop)
    ours = batches_per_second(jaxdist_loop)
    gen = batches_per_second(generator_loop)
    print(f"hand-written device_put   {base:8.0f} batches/s")
    print(f"distributed dataset       {ours:8.0f} batches/s   ratio {ours / base:.3f}")
    print(f"  from a generator        {gen:8.0f} batches/s   ratio {gen / base:.3f} (thread)")

    # With a training step in the loop.
    import train_step as ts

    params = ts.init(jax.random.key(0))

    def replica_step(ctx, params, batch):
        bx, by = batch
        loss, g = jax.value_and_grad(ts.loss_fn)(params, bx, by)
        return ts.sgd(params, ctx.all_reduce("mean", g)), ctx.all_reduce("mean", loss)

    step = strategy.function(replica_step)
    fixed = next(iter(ds))
    state = {"p": params}

    def steps_fixed(k: int = 32) -> int:
        for _ in range(k):
            state["p"], loss = step(state["p"], fixed)
        loss.array.block_until_ready()
        return k

    def steps_from_dataset(k: int = 32) -> int:
        it = iter(ds)
        for _ in range(k):
            state["p"], loss = step(state["p"], next(it))
        loss.array.block_until_ready()
        it.close()
        return k

    no_input = batches_per_second(steps_fixed)
    with_input = batches_per_second(steps_from_dataset)
    print(f"MLP step, batch already on devices  {1e3 / no_input:7.2f} ms/step")
    print(
        f"MLP step, batch from the dataset    {1e3 / with_input:7.2f} ms/step   "
        f"ratio {no_input / with_input:.3f} of the input-free time"
    )


if __name__ == "__main__":
    _harness.setup_devices(8)
    main()
