"""The digits demo's CNN: `jd.train_step` (and `jd.fit`) vs a hand-written step, in one process.

The network, optimizer and batch size of ``jaxdist.examples.digits``
(conv 32, conv 64, max-pool, dense 128, dense 10; adamw; global batch 64 over
8 replicas). Both sides run the same program: per-replica gradients of the
sum of per-example losses over the global batch, all-reduced (sum), one adamw
update, parameters and optimizer state kept as one replicated copy and
donated, the loss all-reduced and the per-example hits returned per replica.

- ``steps``: one training step per call, every call waited on, over the same
  placed batches (the distributed dataset's, fed to both sides): the hand-written
  ``jax.jit(jax.shard_map(...))`` vs ``jd.train_step``.
- ``epochs``: one epoch per call from the host arrays, input placement and
  metric reading included: a hand-written loop (``jax.device_put`` of each
  batch, the hand-written step, its loss read back every step) vs ``jd.fit``
  (distributed dataset, padded last batch, row-weighted epoch metrics).

Usage: python benchmarks/digits.py
"""

from __future__ import annotations

import math

import _harness
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist.examples import digits

BATCH = 64
STEPS_PER_CALL = 10


def _tx() -> optax.GradientTransformation:
    return optax.adamw(1e-3, weight_decay=1e-4)


def _hand_step(strategy: jd.Strategy, graphdef: nnx.GraphDef):
    mesh, axis = strategy.mesh, strategy.axis_name
    tx = _tx()

    def body(params, opt_state, x, y):
        x, y = x[0], y[0]  # this replica's block of the (replicas, rows, ...) batch
        global_batch = x.shape[0] * jax.lax.axis_size(axis)

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(x)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jnp.sum(per_example) / global_batch, logits

        varying = jax.lax.pcast(params, axis, to="varying")
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(varying)
        grads = jax.lax.psum(grads, axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
        loss = jax.lax.psum(loss, axis)
        return optax.apply_updates(params, updates), opt_state, loss, correct[None]

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P(), P(axis), P(axis)),
            out_specs=(P(), P(), P(), P(axis)),
        ),
        donate_argnums=(0, 1),
    )


def candidates(strategy: jd.Strategy) -> tuple[dict, dict, int, int]:
    n, mesh, axis = strategy.num_replicas_in_sync, strategy.mesh, strategy.axis_name
    x_train, y_train, _, _ = digits.load_digits()
    full = len(x_train) // BATCH * BATCH
    dist = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(x_train[:full], y_train[:full], batch_size=BATCH)
    )
    batches = list(dist)
    rep = NamedSharding(mesh, P())

    # 1. hand-written shard_map step over the dataset's placed batches.
    graphdef, params = nnx.split(digits.CNN(nnx.Rngs(0)), nnx.Param)
    hand = _hand_step(strategy, graphdef)
    hand_state = list(jax.device_put((params, _tx().init(params)), rep))
    cursor = [0]

    def run_hand() -> None:
        for _ in range(STEPS_PER_CALL):
            x, y = batches[cursor[0] % len(batches)]
            cursor[0] += 1
            p, o, loss, _ = hand(*hand_state, x.array, y.array)
            hand_state[:] = [p, o]
            loss.block_until_ready()

    # 2. jd.train_step (the demo's own step) over the same batches.
    with strategy.scope():
        model = digits.CNN(nnx.Rngs(0))
        opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    step, _ = digits.build_steps(strategy)
    jd_cursor = [0]

    def run_jd() -> None:
        for _ in range(STEPS_PER_CALL):
            batch = batches[jd_cursor[0] % len(batches)]
            jd_cursor[0] += 1
            jax.block_until_ready(step(model, opt, batch)["loss"])

    # 3. whole epochs from host arrays: a hand-written loop vs jd.fit.
    data_sharding = NamedSharding(mesh, P(axis))
    b = BATCH // n

    def hand_epoch() -> None:
        for i in range(0, full, BATCH):
            x = x_train[i : i + BATCH].reshape(n, b, 8, 8, 1)
            y = y_train[i : i + BATCH].reshape(n, b)
            xg, yg = jax.device_put((x, y), data_sharding)
            p, o, loss, _ = hand(*hand_state, xg, yg)
            hand_state[:] = [p, o]
            float(loss)

    source = jd.data.from_arrays(x_train[:full], y_train[:full], batch_size=BATCH)

    def fit_epoch() -> None:
        jd.fit(step, model, opt, data=source, progress=False, verbose=False)

    return (
        {"shard_map": run_hand, "jd.train_step": run_jd},
        {"hand-written loop": hand_epoch, "jd.fit": fit_epoch},
        BATCH * STEPS_PER_CALL,
        full,
    )


def main() -> None:
    strategy = jd.MirroredStrategy()
    steps, epochs, step_rows, epoch_rows = candidates(strategy)
    step_times = _harness.compare(steps, calls=3)
    epoch_times = _harness.compare(epochs, calls=1)
    print(_harness.describe_machine())
    print(
        f"digits CNN, adamw, global batch {BATCH}, {strategy.num_replicas_in_sync} replicas; "
        f"{epoch_rows // BATCH} steps per epoch"
    )
    for title, times, rows, base in (
        ("per step, same placed batches", step_times, step_rows, "shard_map"),
        ("per epoch, from host arrays", epoch_times, epoch_rows, "hand-written loop"),
    ):
        print(f"{title}:")
        for name, t in times.items():
            ratio = times[base] / t
            print(f"  {name:18s} {rows / t:10,.0f} examples/s   throughput ratio {ratio:.3f}")
    assert math.isfinite(step_times["jd.train_step"])


if __name__ == "__main__":
    _harness.setup_devices(8)
    main()
