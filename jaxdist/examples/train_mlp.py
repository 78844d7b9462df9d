"""Data-parallel training of a small MLP with `MirroredStrategy` on synthetic data.

Run with ``make demo`` or ``python -m jaxdist.examples.train_mlp``. Without an
accelerator it simulates 8 CPU devices.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxdist as jd


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros((n_out,))}
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 10), axis=-1))


def train_step(
    ctx: jd.ReplicaContext, params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array
) -> tuple[list[dict[str, jax.Array]], jax.Array]:
    """One SGD step on this replica's share of the batch; gradients averaged across replicas."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # this replica's gradient
    grads = ctx.all_reduce(jd.ReduceOp.MEAN, grads)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params, ctx.all_reduce("mean", loss)


def main(steps: int = 60, global_batch: int = 256) -> float:
    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    print(
        f"jaxdist {jd.__version__}: {type(strategy).__name__} with {n} replicas on "
        f"{jax.devices()[0].platform}"
    )
    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(32, 10)).astype(np.float32)
    params = init_mlp(jax.random.key(0), (32, 64, 10))
    step = strategy.function(train_step)
    start = time.perf_counter()
    loss = float("nan")
    for i in range(steps):
        x = rng.normal(size=(global_batch, 32)).astype(np.float32)
        y = np.argmax(x @ teacher, axis=1)
        # Replica r gets rows [r * B / n, (r + 1) * B / n) of the global batch.
        xs = jd.PerReplica(x.reshape(n, global_batch // n, -1))
        ys = jd.PerReplica(y.reshape(n, global_batch // n))
        params, loss_m = step(params, xs, ys)
        if i % 10 == 0 or i == steps - 1:
            loss = float(loss_m.array)
            print(f"step {i:3d}  loss {loss:.4f}")
    print(f"{steps} steps in {time.perf_counter() - start:.2f}s")
    return loss


if __name__ == "__main__":
    # Simulate 8 devices when only the CPU is there (must precede the first device query).
    jax.config.update("jax_num_cpu_devices", 8)
    main()
