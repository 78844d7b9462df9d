"""One data-parallel SGD step of an MLP 784-1024-1024-10, global batch 512, 8 replicas.

Compares strategy.run (per-replica gradients, ctx.all_reduce MEAN) with the
hand-written jax.jit(jax.shard_map(...)) + pmean step and with jax.jit over
NamedSharding inputs, in one process. Target: throughput ratio >= 0.97 vs
the shard_map baseline.
"""

from __future__ import annotations

import _harness
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

SIZES = (784, 1024, 1024, 10)
BATCH, LR = 512, 0.01


def init(key: jax.Array) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) * np.sqrt(2 / a), "b": jnp.zeros((b,))}
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]


def loss_fn(params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 10), axis=-1))


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def main(cross_device_ops: jd.CrossDeviceOps | None = None) -> None:
    strategy = jd.MirroredStrategy(cross_device_ops=cross_device_ops)
    n, mesh, axis = strategy.num_replicas_in_sync, strategy.mesh, strategy.axis_name
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=(BATCH,)).astype(np.int32)
    params = init(jax.random.key(0))
    data = NamedSharding(mesh, P(axis))
    rep = NamedSharding(mesh, P())
    xg, yg = jax.device_put(x, data), jax.device_put(y, data)
    params_rep = jax.device_put(params, rep)

    # 1. hand-written shard_map + pmean (params cast to varying: per-replica gradients).
    def local_step(params, x, y):
        p = jax.lax.pcast(params, axis, to="varying")
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        g = jax.lax.pmean(g, axis)
        return sgd(params, g), jax.lax.pmean(loss, axis)

    hand = jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=(P(), P())
        ),
        donate_argnums=0,
    )

    # 2. jax.jit with NamedSharding inputs (the partitioner decides the collectives).
    @jax.jit
    def jit_step(params, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        return sgd(params, g), loss

    # 3. jaxdist.
    def replica_step(ctx, params, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        g = ctx.all_reduce(jd.ReduceOp.MEAN, g)
        return sgd(params, g), ctx.all_reduce("mean", loss)

    xs = jd.PerReplica(xg.reshape(n, BATCH // n, 784))
    ys = jd.PerReplica(yg.reshape(n, BATCH // n))
    state = {"hand": params_rep, "jit": params_rep, "jd": params_rep}
    opts = jd.RunOptions(donate_args=False)

    def run_hand():
        state["hand"], loss = hand(state["hand"], xg, yg)
        loss.block_until_ready()

    def run_jit():
        state["jit"], loss = jit_step(state["jit"], xg, yg)
        loss.block_until_ready()

    def run_jd():
        state["jd"], loss = strategy.run(replica_step, args=(state["jd"], xs, ys), options=opts)
        loss.array.block_until_ready()

    state["hand"] = jax.tree.map(jnp.copy, params_rep)
    times = _harness.compare({"shard_map": run_hand, "jit": run_jit, "jaxdist": run_jd}, calls=20)
    base = times["shard_map"]
    print(_harness.describe_machine())
    for name, t in times.items():
        print(f"{name:10s} {1 / t:7.2f} steps/s   throughput ratio vs shard_map {base / t:.3f}")

    # Same numbers as the single-device step on the global batch (rtol 1e-4).
    ref_params, _ = jax.jit(jit_step)(params, x, y)
    got, _ = strategy.run(replica_step, args=(params, xs, ys))
    got0 = strategy.experimental_local_results(got)[0]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got0, ref_params
    )


if __name__ == "__main__":
    import sys

    _harness.setup_devices(8)
    main(jd.NcclAllReduce(num_packs=int(sys.argv[1])) if len(sys.argv) > 1 else None)
